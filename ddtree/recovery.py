"""Losing a worker and taking a new one, without losing a request.

A worker that dies (its calls raise `WorkerLostError`) costs no accepted request. A lost drafter leaves the engine
decoding plain until another is attached. A lost target stops the rounds until another is attached; then every
running request is prefilled again from its prompt and committed tokens and goes on where it was. The Serve app
(deployments/) detects the loss, restarts the actor and attaches it; offline, nothing restarts a worker.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ddtree.workers import WorkerLostError

if TYPE_CHECKING:
    from ddtree.contracts import Drafter, Target
    from ddtree.outputs import RequestOutput

logger = logging.getLogger("ddtree.engine")


class WorkerRecovery:
    """The engine's part in a worker's loss and replacement (mixed into `Engine`, whose scheduler, requests,
    workers and pipeline it reads)."""

    def _init_recovery(self) -> None:
        # A lost drafter (its worker raised WorkerLostError): every round is plain decoding (n-gram chains included)
        # until `attach_drafter` gives a new one. Requests that ran when it was lost never draft again: their
        # context went with it (those admitted later have all their features in the target worker).
        self.drafter_lost: str | None = None
        self.num_drafter_losses = 0
        self._without_draft_context: set[str] = set()
        # A lost target (a target call raised WorkerLostError): no round runs until `attach_target` gives a new
        # one. Nothing a round did is lost with it: tokens are committed only from a verify result in hand. Each
        # running request is then prefilled again on the new target from its prompt and committed tokens (its
        # next root is the last committed token, as before), and goes on where it was.
        self.target_lost: str | None = None
        self.num_target_losses = 0
        self._to_restore: list[str] = []  # running requests with no KV on the current target yet

    @property
    def _can_draft(self) -> bool:
        return self.drafter is not None and self.drafter_lost is None

    def attach_drafter(self, drafter: Drafter) -> None:
        """Speculation resumes with `drafter` (a restarted worker) after a loss; the cost model is kept."""
        if self.config.speculation == "off":
            raise ValueError("speculation='off' has no drafter to attach")
        self.drafter, self.drafter_lost = drafter, None

    def lose_drafter(self, error: BaseException) -> None:
        """The drafter's worker is gone: decode on without it (see `drafter_lost`)."""
        if self.drafter_lost is None:
            logger.error("the drafter is lost (%s); decoding on without drafts until a drafter is attached", error)
            self.num_drafter_losses += 1
        self.drafter_lost = str(error) or type(error).__name__
        self._without_draft_context.update(self.scheduler.running)
        self.pipeline.in_flight = None  # (drafted already, but its requests' context is gone too: they decode plain)

    def lose_target(self, error: BaseException) -> None:
        """The target's worker is gone: no round runs until `attach_target` (see `target_lost`)."""
        if self.target_lost is None:
            logger.error("the target is lost (%s); %d requests wait for a new one", error, len(self.requests))
            self.num_target_losses += 1
        self.target_lost = str(error) or type(error).__name__
        self.pipeline.in_flight = None  # (its trees were drafted for a verify on the lost target: drafted again)

    def attach_target(self, target: Target, drafter: Drafter | None = None) -> None:
        """A new target worker (a restarted one, same model) after `lose_target`, and with it a new drafter where
        the old one's contexts went too. The next step prefills every running request again (`_restore`)."""
        if self.target_lost is None:
            raise ValueError("attach_target: the target is not lost")
        old = self.target
        if (target.vocab_size, list(target.eos_token_ids)) != (old.vocab_size, list(old.eos_token_ids)):
            raise ValueError("attach_target: the new target's vocabulary or EOS tokens differ from the lost one's")
        if target.max_request_tokens < old.max_request_tokens:
            raise ValueError(
                f"attach_target: the new target holds {target.max_request_tokens} tokens per request, "
                f"fewer than the lost one ({old.max_request_tokens})"
            )
        self.target, self.target_lost = target, None
        self._to_restore = list(self.scheduler.running)  # (none of them has KV on the new target)
        if drafter is not None:
            self.attach_drafter(drafter)
        elif self._can_draft:  # the drafter stays: its contexts of these requests are rebuilt from the prefill
            for rid in self._to_restore:
                try:
                    self.drafter.free(rid)
                except WorkerLostError as exc:
                    self.lose_drafter(exc)
                    break
        # every restored request's drafter context is rebuilt from its new prefill's features
        self._without_draft_context.difference_update(self._to_restore)

    def _restore(self, outputs: list[RequestOutput]) -> None:
        """Prefill the running requests again on a new target: prompt + committed tokens but the last, which is
        the next round's root (so the KV cache is what the lost target held). A request with no committed token
        (its first prefill was lost) gets its first token from this prefill, as at admission."""
        restore = self._to_restore
        for rid in restore:
            req = self.requests[rid]
            if not self.target.allocate(rid, self._kv_capacity(req), req.output.params):
                raise RuntimeError(
                    f"the new target has no room for request {rid!r} ({self._kv_capacity(req)} "
                    f"tokens), which the lost one held"
                )
        t0 = time.perf_counter()
        sequences = [self.requests[r].prompt_token_ids + self.requests[r].output.token_ids[:-1] for r in restore]
        prefilled = self.target.prefill(restore, sequences)
        self.timings.prefill += time.perf_counter() - t0
        self.timings.num_prefill_calls += 1
        self._to_restore = []
        for rid, token, logprobs in zip(restore, prefilled.token_ids, prefilled.logprobs):
            req = self.requests[rid]
            if req.root_token_id is None:
                self._first_token(req, token, logprobs, outputs)
