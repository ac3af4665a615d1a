"""Two request groups in flight: the target verifies one group's trees while the drafter drafts the other's.

`Engine.step` runs one round at a time: draft, then verify. Where the two workers can work at the same time (actors
on cores or devices of their own, deployments/), a phase of this pipeline overlaps them instead: the target
verifies the trees drafted in the previous phase while the drafter drafts the requests that phase verified (their
new roots are known). Each phase is built from the engine's own stages (`_submit_draft`, `_build_trees`,
`_submit_verify`, `_collect_verify`, `_update_budgets`, `_commit`), in a different order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddtree.budget import RoundPlan
from ddtree.round import RoundBatch, RoundEntry
from ddtree.workers import WorkerLostError

if TYPE_CHECKING:
    from ddtree.contracts import Pending
    from ddtree.engine import Engine
    from ddtree.outputs import RequestOutput

PIPELINE_ENTER_SPEEDUP = 1.08  # pipeline="auto" enters when two groups are predicted this much faster than one


class Pipeline:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.in_flight: RoundBatch | None = None  # drafted last phase, waiting for its verify (closed entries)
        self.is_active = False  # the last step's choice (pipeline="auto" hysteresis)

    def choose(self) -> bool:
        """Whether this step overlaps two groups. pipeline=True: always; "auto": while the cost model predicts two
        groups faster than one, with a margin to enter (it ignores the actor hops and the second verify pass's fixed
        costs: benchmarks/bench_pipeline.py compares its predictions with the measured ratio), staying while above
        1x, and only when the workers can work at the same time (`can_overlap`)."""
        self.is_active = self._should_overlap()
        return self.is_active

    def _should_overlap(self) -> bool:
        engine, setting = self.engine, self.engine.config.pipeline
        if not engine._can_draft or setting is False:
            return False
        if setting is True:
            return True
        if not (engine.target.can_overlap and engine.drafter.can_overlap):
            return False
        threshold = 1.0 if self.is_active else PIPELINE_ENTER_SPEEDUP
        return engine.budget.pipeline_speedup(engine.scheduler.running) > threshold

    def drop(self, request_id: str) -> None:
        """A request left while its tree waits for a verify: the tree goes now, before the id can be reused."""
        if self.in_flight is not None:
            self.in_flight = self.in_flight.without({request_id})

    def step(self, outputs: list[RequestOutput], overlap: bool) -> None:
        """One phase. Requests planned plain need no draft, so they join the current verify pass at once. The
        drafting group is capped at half of all speculating requests (the rest decode plain this phase), so the two
        groups stay balanced as requests join and leave. With one speculating request the phases alternate draft /
        verify, which is the sequential round. `overlap` False (leaving, in auto mode): nothing drafts while the
        group in flight is verified. In one process (`Completed` calls) the draft and the verify run one after the
        other; on two actors they run at the same time."""
        engine = self.engine
        engine._admit_and_prefill(outputs)
        engine.timings.num_pipelined_phases += int(overlap)
        in_verify, self.in_flight = self.in_flight, None  # (requests that finished meanwhile were dropped from it)
        drafting, plain = self._split(in_verify, overlap)
        verify = RoundBatch(in_verify.entries + plain if in_verify is not None else plain)
        if in_verify is not None:  # (its drafter call is observed with the verify that uses its trees)
            verify.draft_seconds, verify.num_drafting = in_verify.draft_seconds, in_verify.num_drafting
        # Submission order matters on actors: the drafting requests' features are taken from the target before
        # the verify is queued behind them (inside _submit_draft), so the draft does not wait for the verify.
        try:
            pending_draft = engine._submit_draft(drafting)
        except WorkerLostError as exc:  # the drafting group sits this phase out; it decodes plain from the next
            engine.lose_drafter(exc)
            pending_draft = None
        if engine.ngram_tokens and plain:
            # Plain requests verify their n-gram chains, allocated in the pass they join: the group drafted last
            # phase is in it already (closed entries).
            engine._build_trees(verify, None)
        pending_verify = engine._submit_verify(verify) if verify.entries else None
        if pending_draft is not None:  # the next group's trees are built while the target verifies
            self._build_next_group(drafting, plain, pending_draft)
        if pending_verify is not None:
            engine._collect_verify(verify, pending_verify)
            engine._update_budgets(verify)
            engine._commit(verify, outputs)

    def _split(self, in_verify: RoundBatch | None, overlap: bool) -> tuple[RoundBatch, list[RoundEntry]]:
        """This phase's drafting group and its plain entries, from the requests not in flight."""
        engine = self.engine
        busy = set(in_verify.request_ids) if in_verify is not None else set()
        ready = engine._ready_requests(busy)
        plan = engine._plan(ready) if ready else RoundPlan([], [], [])
        max_drafting = (len(plan.speculative_ids) + len(busy) + 1) // 2 if overlap else 0
        roots = {rid: engine.requests[rid].root_token_id for rid in ready}
        drafting = RoundBatch.from_plan(
            RoundPlan(plan.speculative_ids[:max_drafting], [], plan.max_budgets[:max_drafting]), roots
        )
        rest = plan.autoregressive_ids + plan.speculative_ids[max_drafting:]
        return drafting, [RoundEntry(rid, roots[rid]) for rid in rest]

    def _build_next_group(self, drafting: RoundBatch, plain: list[RoundEntry], pending: Pending) -> None:
        """The drafting group's trees, priced with this phase's plain requests (root only) standing in for those of
        the pass the group will join, which are planned only then."""
        engine = self.engine
        try:
            topk = engine._collect_draft(drafting, pending)
        except WorkerLostError as exc:
            engine.lose_drafter(exc)
            return
        stand_ins = [RoundEntry(e.request_id, e.root_token_id, is_open=False) for e in plain]
        engine._build_trees(RoundBatch(drafting.entries + stand_ins), topk)
        self.in_flight = drafting
