"""The proxies the Engine calls in place of its workers (`TargetProxy`, `DrafterProxy`: ddtree/contracts.py's
`Target` and `Drafter`): every method is one operation on a worker actor's channel.

Each operation reports the seconds spent inside the worker; the proxies keep the difference from the call's wall
time: the cost of the hops themselves (`HopTimes`, reported as a metric and by benchmarks/bench_serving.py).

A drafter actor that dies closes its channels: the drafter proxy's call raises ChannelClosedError (a
WorkerLostError, which the engine survives), after telling the target to keep every feature from then on
(`DisconnectDrafter`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deployments.channel import ChannelClient, ChannelClosedError
from deployments.worker_ops import (
    WIRE,
    Allocate,
    DisconnectDrafter,
    Draft,
    DrafterOp,
    DraftTopK,
    Free,
    FreeDraft,
    MeasureBatchCost,
    MeasureDraftCost,
    MeasureVerifyCost,
    Prefill,
    Reply,
    SendFeatures,
    TargetOp,
    Verify,
    tensor_from_wire,
    trees_to_wire,
)


@dataclass
class HopTimes:
    """Seconds the proxies spent in worker calls beyond what the workers spent working (summed), split into the
    way there (submission until the worker began) and back (the worker's end until the result was read). The way
    back splits again at the moment the reply began to arrive: before it, the worker encoding and sending it and
    this process waking up ("wait"); after it, reading and decoding it ("read")."""

    seconds: float = 0.0
    num_calls: int = 0
    there_seconds: float = 0.0
    # per operation (Verify, Draft, ...): [calls, seconds there, seconds back, of them seconds waiting] (fixed size:
    # one entry per op type)
    by_op: dict[str, list] = field(default_factory=dict)

    def add(
        self,
        wall_seconds: float,
        inside_seconds: float,
        there_seconds: float = 0.0,
        op: str = "",
        wait_seconds: float = 0.0,
    ) -> None:
        hop, there = max(0.0, wall_seconds - inside_seconds), max(0.0, there_seconds)
        back = max(0.0, hop - there)
        self.seconds += hop
        self.there_seconds += there
        self.num_calls += 1
        entry = self.by_op.setdefault(op, [0, 0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += there
        entry[2] += back
        entry[3] += min(back, max(0.0, wait_seconds))


class PendingCall:
    """A worker call in flight (the engine's draft and verify are submitted so that they can overlap); `.result()`
    waits for it. The hop time booked is the wall time from submission to result minus the time inside the
    worker, so it is an upper bound when the caller reads the result late."""

    def __init__(
        self, channel: ChannelClient, hops: HopTimes, op, convert=None, on_reply=None, books_hops: bool = True
    ) -> None:
        self.hops = hops
        self.books_hops = books_hops  # (an unawaited call books its send where it is sent: `_Unawaited`)
        self.convert = convert  # applied to the worker's result (e.g. numpy arrays back into tensors)
        self.on_reply = on_reply  # called with the Reply (the target proxy reads its feature batch number)
        self.op_name = type(op).__name__
        self.start = time.perf_counter()
        self.channel = channel
        self.ticket = channel.send(op)
        self.seconds = 0.0  # inside the worker, known after result()
        self.wall_seconds = 0.0  # submission to result: the hops included, known after result()
        self._value = None
        self._is_done = False

    def result(self):
        if not self._is_done:
            reply = self.channel.receive(self.ticket)
            self.wall_seconds = time.perf_counter() - self.start
            self.seconds = reply.seconds
            if self.books_hops:
                # (one clock per node: the worker's started_at and the channel's arrival compare with ours)
                wait = self.channel.arrived_at - (reply.started_at + reply.seconds)
                self.hops.add(self.wall_seconds, reply.seconds, reply.started_at - self.start, self.op_name, wait)
            if self.on_reply is not None:
                self.on_reply(reply)
            self._value = reply.result if self.convert is None else self.convert(reply.result)
            self._is_done = True
        return self._value


MAX_UNAWAITED_FREES = 32  # a drafter's frees whose replies wait for a later call's before they are read


class _Unawaited:
    """Calls whose replies the engine does not wait for (frees: they answer nothing it needs), so each costs the
    round only its send. Their replies are read after a later call's reply on the same channel, which they precede
    there: reading them then never waits. A failure one carries is raised there (a channel that closed is raised by
    the later call itself)."""

    def __init__(self, hops: HopTimes) -> None:
        self.hops = hops
        self.calls: list[PendingCall] = []

    def send(self, submit: Callable[[], PendingCall]) -> None:
        t0 = time.perf_counter()
        call = submit()
        sent = time.perf_counter() - t0
        self.hops.add(sent, 0.0, sent, call.op_name)
        self.calls.append(call)

    def settle(self) -> None:
        calls, self.calls = self.calls, []
        for call in calls:
            call.result()


class TargetProxy:
    """Looks like a TargetWorker to the Engine; every method is one call on the target's channel."""

    def __init__(self, actor, info: dict, hops: HopTimes, can_overlap: bool, poll_seconds: float = 0.0) -> None:
        self.actor = actor
        self.channel = ChannelClient(info["channel"], "target worker", poll_seconds, codec=WIRE)
        self.hops = hops
        self.can_overlap = can_overlap  # its calls run on other cores or devices than the drafter's
        self.max_model_len = info["max_model_len"]
        self.max_request_tokens = info["max_request_tokens"]
        self.eos_token_ids = info["eos_token_ids"]
        self.vocab_size = info["vocab_size"]
        self.tokenizer = info["tokenizer"]
        self.keeps_features = info["keeps_features"]
        self.pid = info["pid"]  # the actor's process
        self.num_feature_batches = 0  # the last FeatureBatch the target has sent the drafter
        # Requests that drafted and have not been verified since: their verify sends their new features on to the
        # drafter. Those in `_waiting_in_actor` (fallback rounds) left theirs in the target actor.
        self._drafting: set[str] = set()
        self._waiting_in_actor: set[str] = set()
        # Requests whose features went to the connected drafter: it holds a context cache for them
        self._known_to_drafter: set[str] = set()
        self.drafter_connected = self.keeps_features  # (False between a loss of the drafter and its restart)
        self.kv_bytes_used = 0  # as of the target's last reply
        self._unawaited = _Unawaited(hops)

    def _on_reply(self, reply: Reply) -> None:
        self.num_feature_batches = max(self.num_feature_batches, reply.feature_batch)
        self.kv_bytes_used = reply.kv_bytes_used

    def _after_reply(self, reply: Reply) -> None:
        self._unawaited.settle()  # (replies of calls sent before this one: read first, as they came first)
        self._on_reply(reply)

    def _submit(self, op: TargetOp) -> PendingCall:
        return PendingCall(self.channel, self.hops, op, on_reply=self._after_reply)

    def allocate(self, request_id, capacity, params):
        return self.allocate_many([(request_id, capacity, params)]) == 1

    def allocate_many(self, requests):
        if not requests:
            return 0
        request_ids, capacities, params = (list(column) for column in zip(*requests))
        return self._submit(Allocate(request_ids, capacities, params)).result()

    def prefill(self, request_ids, prompts):
        # (the prompt's features wait in the target actor until the request first drafts: one that decodes plain
        # to its end, as most do under load, costs the drafter nothing)
        if self.keeps_features:
            self._waiting_in_actor.update(request_ids)
        return self._submit(Prefill(list(request_ids), [list(p) for p in prompts])).result()

    def verify(self, request_ids, trees, roots, prompt_ids=(), prompts=()):
        return self.verify_async(request_ids, trees, roots, prompt_ids, prompts).result()

    def verify_async(self, request_ids, trees, roots, prompt_ids=(), prompts=()) -> PendingCall:
        drafting = [r for r in request_ids if r in self._drafting]
        self._drafting.difference_update(request_ids)
        if self.keeps_features:  # (the prompts' features wait in the target actor, as a prefill's do)
            self._waiting_in_actor.update(r for r in request_ids if r not in drafting)
            self._waiting_in_actor.update(prompt_ids)
        op = Verify(list(request_ids), trees_to_wire(trees), list(roots), drafting, list(prompt_ids), list(prompts))
        return self._submit(op)

    def take_features(self, request_ids) -> None:
        """The target sends the drafter what it needs itself (module docstring): here only requests back from
        fallback cost a call, which pushes the features they left in the target actor. They count as drafting
        until their next verify."""
        back = [r for r in request_ids if r in self._waiting_in_actor]
        if back:
            self._submit(SendFeatures(back)).result()
            self._waiting_in_actor.difference_update(back)
        self._drafting.update(request_ids)
        self._known_to_drafter.update(request_ids)
        return None

    def drafter_forgets(self, request_id) -> bool:
        """Whether the connected drafter was sent features of the finished `request_id` (it holds a context to
        drop); it is then no longer counted as holding one."""
        if request_id not in self._known_to_drafter:
            return False
        self._known_to_drafter.discard(request_id)
        return True

    def free(self, request_id):
        """Sent without waiting: the target frees the request's KV as soon as it reads the call, before any later
        call (an admission's allocation included)."""
        self._drafting.discard(request_id)
        self._waiting_in_actor.discard(request_id)
        self._unawaited.send(
            lambda: PendingCall(self.channel, self.hops, Free(request_id), on_reply=self._on_reply, books_hops=False)
        )

    def measure_verify_cost(self, token_counts):
        return self._submit(MeasureVerifyCost(list(token_counts))).result()

    def measure_batch_cost(self, request_counts):
        return self._submit(MeasureBatchCost(list(request_counts))).result()

    def drafter_lost(self) -> None:
        """The drafter actor died: the target keeps every feature from now on (the requests that were drafting lost
        their context with it, and the engine never drafts them again)."""
        if self.drafter_connected:
            self.drafter_connected = False
            self._drafting.clear()
            self._known_to_drafter.clear()
            with contextlib.suppress(ChannelClosedError):  # (a dead target: its own next call says so)
                self._submit(DisconnectDrafter()).result()

    def drafter_attached(self) -> None:
        """A new drafter actor is connected to the target (`TargetActor.connect_drafter`)."""
        self.drafter_connected = True

    def kv_cache_stats(self) -> dict:
        """As of the target's last reply (every reply carries it): no call."""
        return {"bytes_used": self.kv_bytes_used}


class DrafterProxy:
    """Looks like a DrafterWorker to the Engine."""

    def __init__(
        self, actor, info: dict, target: TargetProxy, hops: HopTimes, can_overlap: bool, poll_seconds: float = 0.0
    ) -> None:
        self.actor = actor
        self.channel = ChannelClient(info["channel"], "drafter worker", poll_seconds, codec=WIRE)
        self.target = target  # (the number of the last feature batch it sent the drafter)
        self.hops = hops
        self.block_len = info["block_len"]
        self.pid = info["pid"]  # the actor's process
        self.can_overlap = can_overlap
        self._unawaited = _Unawaited(hops)

    def draft(self, request_ids, roots, features, max_k):
        return self.draft_async(request_ids, roots, features, max_k).result()

    def draft_async(self, request_ids, roots, features, max_k) -> PendingCall:
        # (features: None, from TargetProxy.take_features: the target sends them to the drafter itself)
        op = Draft(list(request_ids), list(roots), max_k, self.target.num_feature_batches)
        return self._submit(op, convert=_draft_from_wire)

    def free(self, request_id):
        """Drop the request's context; no call for a request the drafter never heard of (it never drafted).
        Sent without waiting; where no draft follows for a long while, the replies are read once
        `MAX_UNAWAITED_FREES` have gathered (long answered then, but the last)."""
        if not self.target.drafter_forgets(request_id):
            return None
        if len(self._unawaited.calls) >= MAX_UNAWAITED_FREES:
            self._unawaited.settle()
        op = FreeDraft(request_id, self.target.num_feature_batches)
        self._unawaited.send(lambda: self._submit(op, books_hops=False, settles=False))
        return None

    def measure_draft_cost(self, batch_sizes, max_k):
        return self._submit(MeasureDraftCost(list(batch_sizes), max_k)).result()

    def _submit(self, op: DrafterOp, convert=None, books_hops: bool = True, settles: bool = True) -> PendingCall:
        """A call whose ChannelClosedError (the drafter actor died: the engine then decodes on without it) first
        tells the target to keep the features it would have sent. Its reply settles the frees sent before it."""
        on_reply = (lambda reply: self._unawaited.settle()) if settles else None
        try:
            return _DrafterCall(
                self.channel,
                self.hops,
                op,
                convert=convert,
                on_reply=on_reply,
                books_hops=books_hops,
                on_lost=self.target.drafter_lost,
            )
        except ChannelClosedError:
            self.target.drafter_lost()
            raise


class _DrafterCall(PendingCall):
    def __init__(self, *args, on_lost, **kwargs) -> None:
        self.on_lost = on_lost
        super().__init__(*args, **kwargs)

    def result(self):
        try:
            return super().result()
        except ChannelClosedError:
            self.on_lost()
            raise


def _draft_from_wire(topk: DraftTopK) -> tuple[torch.Tensor, torch.Tensor]:
    return tensor_from_wire(topk.logprobs), tensor_from_wire(topk.token_ids)
