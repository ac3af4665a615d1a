"""The decoding engine: continuous batching of DDTree rounds over a target worker and a drafter worker.

One round (`Engine.step`; docs/engine.md), each stage a method that fills in the round's `RoundBatch`:

    admit               waiting requests that fit in KV memory join; their prompts go into this round's verify pass
                        (their first token comes from it), or into a prefill pass of their own when nothing else
                        runs or they are longer than `max_folded_prompt_tokens`
    schedule            which running requests draft this round, each with its budget, and which decode plain
    draft               ONE drafter forward for all drafting requests: top-K log-probs for positions 1..L, then
                        the trees: the top-B prefixes of each request, all requests at once; in auto mode each
                        request's n-gram proposal (ddtree.ngram) merged in, or as the whole tree of a plain
                        request; then the global node allocation
    verify              ONE target forward over every request's packed tree (a root-only tree when plain) and
                        the admitted prompts, target tokens, acceptance walk, KV compaction: all inside the
                        target worker
    update budgets      cost curves and each request's acceptance, before the commit (finished requests leave)
    commit + emit       stops applied, text decoded, outputs made; finished requests leave
    update guard        the round's tokens per second, for the closed loop (ddtree.guard)

Two request groups in flight (ddtree.pipeline) build their phases from the same stages.

The engine holds plain data (ids, lists, ints) and talks to its two workers through a handful of methods, so that the
Ray deployment can place the same workers on separate actors (deployments/) without changing this file.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ddtree.budget import BudgetConfig, BudgetPolicy, RoundPlan, closed_batch_drafters
from ddtree.config import EngineConfig
from ddtree.contracts import Drafter, Pending, Target
from ddtree.cost import CostModel, batch_cost_counts, verify_cost_counts
from ddtree.detokenizer import OutputState
from ddtree.guard import POLICY, ThroughputGuard
from ddtree.ngram import NgramIndex
from ddtree.outputs import RequestOutput, RequestStats, TokenLogprobs
from ddtree.pipeline import Pipeline
from ddtree.proposal import drafted_trees, kept_tree, proposed_trees
from ddtree.recovery import WorkerRecovery
from ddtree.request import OutputWriter, PromptTooLongError, Request, validated
from ddtree.round import RoundBatch, RoundEntry
from ddtree.sampling_params import SamplingParams
from ddtree.scheduler import EngineFullError, Scheduler
from ddtree.workers import RawLogprobs, WorkerLostError

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineFullError", "PromptTooLongError", "RoundTimings"]


@dataclass
class RoundTimings:
    """Seconds spent in each stage, summed over the engine's life (see `Engine.timings`)."""

    prefill: float = 0.0
    draft: float = 0.0
    tree: float = 0.0
    verify: float = 0.0  # target forward
    accept: float = 0.0  # target tokens, walk and KV compaction
    emit: float = 0.0
    num_rounds: int = 0  # verify passes
    num_draft_calls: int = 0  # drafter forwards
    num_prefill_calls: int = 0  # target prefill passes (admissions and restores)
    num_prompts_in_verify: int = 0  # admitted prompts taken in by a round's verify pass (no prefill pass of their own)
    num_pipelined_phases: int = 0  # steps run with two request groups in flight (pipeline=True or "auto")
    num_plain_rounds: int = 0  # rounds the guard ran as plain decoding (no draft, no n-gram chain)
    num_speculative_request_rounds: int = 0
    num_autoregressive_request_rounds: int = 0
    num_ngram_tokens: int = 0  # accepted from the n-gram chains of requests in fallback

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# RoundTimings' stages, in round order: the seconds fields that add up to a sequential round's work
ROUND_STAGES = ("prefill", "draft", "tree", "verify", "accept", "emit")


class Engine(WorkerRecovery):
    def __init__(
        self,
        config: EngineConfig,
        target: Target,
        drafter: Drafter | None,
        tokenizer,
        cost: CostModel | None = None,
        detokenize: bool = True,
    ) -> None:
        """`detokenize=False` leaves the text of an output that needs no engine decision on it (no stop strings, no
        log-probabilities) to the consumer (`RequestOutput.text_pending`, `ddtree.detokenizer.TextDecoder`), off the
        round's path: a served engine's streams decode it on their own thread."""
        if config.speculation != "off" and drafter is None:
            raise ValueError(f"speculation={config.speculation!r} needs a drafter")
        self.config = config
        self.target = target
        self.drafter = drafter if config.speculation != "off" else None
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.writer = OutputWriter(tokenizer)
        self.eos_token_ids = frozenset(target.eos_token_ids)
        self.block_len = drafter.block_len if self.drafter is not None else 0
        fixed_budget, is_auto = self._size_budgets(config)
        self.max_model_len = self._context_window(config.max_model_len, target)
        budget_config = BudgetConfig(
            fixed_budget=fixed_budget,
            max_budget=max(1, self.max_budget),
            allow_fallback=config.allow_fallback,
            max_probe_overhead=config.max_probe_overhead,
            speculation_margin=config.speculation_margin,
        )
        self.budget = BudgetPolicy(budget_config, cost if cost is not None else self.measure_cost_model())
        self.scheduler = Scheduler(config.max_num_seqs, config.max_waiting)
        # the closed loop over the budget policy (auto mode only: a fixed budget or dflash is the user's choice)
        self.guard = ThroughputGuard(config.max_explore_share) if is_auto and config.max_explore_share > 0 else None
        self._is_auto = is_auto
        self._closed_batch = False  # this step's: see `step`
        # requests that ran in the guard's plain rounds since they last drafted: the drafter is behind on them
        self._drafter_behind: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.timings = RoundTimings()
        self._ids = itertools.count()
        self.pipeline = Pipeline(self)  # two request groups in flight (config.pipeline)
        self._init_recovery()

    def _size_budgets(self, config: EngineConfig) -> tuple[int | None, bool]:
        """Sets `max_budget` (nodes drafted per request), `ngram_tokens` and `max_verified_nodes`; returns the fixed
        budget (None: adaptive) and whether the mode is auto (adaptive ddtree: n-gram chains and the guard)."""
        fixed_budget = config.fixed_budget
        if config.speculation == "dflash":  # the DFlash baseline verifies its whole argmax chain
            fixed_budget = min(fixed_budget or self.block_len, self.block_len)
        self.max_budget = (fixed_budget or config.max_budget) if self.drafter is not None else 0
        is_auto = self.drafter is not None and config.speculation == "ddtree" and fixed_budget is None
        self.ngram_tokens = config.ngram_tokens if is_auto else 0
        # Nodes one request may verify beyond its root (drafted and n-gram): its verify scratch in the KV cache
        self.max_verified_nodes = self.max_budget + self.ngram_tokens
        return fixed_budget, is_auto

    def _context_window(self, requested: int | None, target: Target) -> int:
        """The model's window, capped by `requested` and by what one request can reserve in the KV cache (its
        prompt, every new token and one verify pass's scratch: `_kv_capacity`), so that every request
        accepted here can be admitted once the cache is free instead of waiting forever."""
        window = min(requested or target.max_model_len, target.max_model_len)
        fits = target.max_request_tokens - 1 - self.max_verified_nodes
        if fits < 2:
            raise ValueError(
                f"the KV cache holds {target.max_request_tokens} tokens per request, too few for a verify pass of "
                f"{1 + self.max_verified_nodes} tokens: give it more bytes (kv_cache_bytes) or lower max_budget"
            )
        if fits < window:
            logger.warning(
                "context window capped at %d tokens (was %d): that is what one request can reserve "
                "in the KV cache (kv_cache_bytes, or the model's sliding window)",
                fits,
                window,
            )
        return min(window, fits)

    # ----------------------------------------------------------------------------------------------------------
    # Requests in and out

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; raises ValueError (bad input), PromptTooLongError or EngineFullError, having recorded
        nothing."""
        prompt_token_ids, params = self.validate(prompt, params)
        if request_id is None:  # the next free automatic id (a caller may have chosen "req-N" itself)
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        output = OutputState(params, self.eos_token_ids, max_new_tokens=max_new)
        self.scheduler.add(request_id)
        self.requests[request_id] = Request(
            request_id,
            prompt_token_ids,
            output,
            RequestStats(arrival_time=time.perf_counter()),
            decodes_text=self.detokenize or bool(params.stop) or params.logprobs is not None,
        )
        return request_id

    def validate(self, prompt: str | list[int], params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params, or a clear error."""
        return validated(prompt, params, self.tokenizer, self.target.vocab_size, self.max_model_len)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.output.finish_reason = "abort"
        return self._finish(req, new_text="", new_token_ids=[])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ----------------------------------------------------------------------------------------------------------
    # The round

    def step(self, closed_batch: bool = False) -> list[RequestOutput]:
        """One round; the outputs of every request that committed tokens or finished in it. With the target lost,
        nothing runs (the caller waits for `attach_target`).

        `closed_batch`: the caller adds no request before those in the engine finish (`LLM.generate`). Then, with
        nothing waiting, auto mode drafts only for the requests that may set the batch's end
        (`ddtree.budget.closed_batch_drafters`)."""
        self._closed_batch = closed_batch
        outputs: list[RequestOutput] = []
        self._expire_waiting(outputs)
        if self.target_lost is not None:
            return outputs
        try:
            if self._to_restore:
                self._restore(outputs)
            overlap = self.pipeline.choose()
            if overlap or self.pipeline.in_flight is not None:  # (a group still in flight is verified first)
                self.pipeline.step(outputs, overlap)
                return outputs
            admitted = self._admit()
            running = self._ready_requests(busy=set())
            in_verify = self._prompts_in_verify(admitted, running)
            if admitted and not in_verify:
                self._prefill(admitted, outputs)  # a pass of their own: they join this round's verify next
                running = self._ready_requests(busy=set())
            if running:
                batch = self._schedule(running, in_verify)  # which requests draft, each with its budget
                self._draft(batch)  # draft, build trees (n-gram chains merged, global node allocation)
                self._verify(batch)  # ONE target pass: target tokens, acceptance walk, KV compaction, prompts
                self._update_budgets(batch)  # cost curves, per-request acceptance (before commit: some finish)
                self._commit(batch, outputs)  # tokens committed and emitted; finished requests leave
                self._update_guard(batch)  # the round's tokens per second, for the throughput guard
        except WorkerLostError as exc:  # the target's (the drafter's are handled where its calls are read)
            self.lose_target(exc)
        return outputs  # (what was committed before a loss included: a stream must not miss it)

    def _expire_waiting(self, outputs: list[RequestOutput]) -> None:
        """Requests waiting for admission past `max_queue_seconds` leave (oldest first: the queue is in arrival
        order)."""
        if self.config.max_queue_seconds is None:
            return
        now = time.perf_counter()
        while self.scheduler.waiting:
            req = self.requests[self.scheduler.waiting[0]]
            if now - req.stats.arrival_time <= self.config.max_queue_seconds:
                return
            req.output.finish_reason = "queue_timeout"
            outputs.append(self._finish(req, new_text="", new_token_ids=[]))

    def _ready_requests(self, busy: set[str]) -> list[str]:
        """Running requests whose next root token is known and that are not waiting for a verify."""
        return [
            rid for rid in self.scheduler.running if rid not in busy and self.requests[rid].root_token_id is not None
        ]

    def _kv_capacity(self, req: Request) -> int:
        """The KV entries a request reserves: its prompt, every new token, and one verify pass's scratch."""
        return len(req.prompt_token_ids) + req.output.max_new_tokens + 1 + self.max_verified_nodes

    def _admit(self) -> list[str]:
        """Waiting requests that fit join (their KV reserved), in arrival order; nothing of theirs computed yet."""

        def allocate(request_ids: list[str]) -> int:
            requests = [self.requests[r] for r in request_ids]
            return self.target.allocate_many([(r.request_id, self._kv_capacity(r), r.output.params) for r in requests])

        return self.scheduler.admit(allocate)

    def _prompts_in_verify(self, admitted: list[str], running: list[str]) -> list[str]:
        """The admitted requests whose prompts join the round's verify pass: all of them where a round runs anyway
        and their prompts sum to at most `max_folded_prompt_tokens`, else none (one prefill pass takes them all)."""
        if not admitted or not running:
            return []
        num_tokens = sum(len(self.requests[r].prompt_token_ids) for r in admitted)
        return admitted if num_tokens <= self.config.max_folded_prompt_tokens else []

    def _admit_and_prefill(self, outputs: list[RequestOutput]) -> None:
        """Admit, and prefill the admitted in a pass of their own (two groups in flight: each pass is planned
        without them)."""
        self._prefill(self._admit(), outputs)

    def _prefill(self, admitted: list[str], outputs: list[RequestOutput]) -> None:
        if not admitted:
            return
        t0 = time.perf_counter()
        prefilled = self.target.prefill(admitted, [self.requests[r].prompt_token_ids for r in admitted])
        self.timings.prefill += time.perf_counter() - t0
        self.timings.num_prefill_calls += 1
        for rid, token, logprobs in zip(admitted, prefilled.token_ids, prefilled.logprobs):
            self._first_token(self.requests[rid], token, logprobs, outputs)

    def _first_token(
        self, req: Request, token: int, logprobs: RawLogprobs | None, outputs: list[RequestOutput]
    ) -> None:
        """A prefilled request's first token: from here on the budget policy plans it."""
        self.budget.add(req.request_id)
        if self.ngram_tokens:
            req.ngrams = NgramIndex(req.prompt_token_ids)
        req.stats.first_token_time = time.perf_counter()
        out = self._append_tokens(req, [token], logprobs)
        if out is not None:
            outputs.append(out)

    def _plan(self, running: list[str]) -> RoundPlan:
        if not self._can_draft:
            return RoundPlan([], list(running), [])
        # A request with one token left gets it from the verify's root alone: a draft could add nothing. One whose
        # drafter context was lost with a drafter has nothing to draft from.
        last = {r for r in running if self.requests[r].tokens_left <= 1 or r in self._without_draft_context}
        if self._closed_batch and self._is_auto and not self.scheduler.waiting:
            # (over every running request: those in flight in the other pipelined group set the end too)
            tokens_left = {r: self.requests[r].tokens_left for r in self.scheduler.running}
            last.update(set(running) - closed_batch_drafters(tokens_left))
        if not last:
            return self.budget.plan(running)
        plan = self.budget.plan([r for r in running if r not in last])
        return RoundPlan(
            plan.speculative_ids, plan.autoregressive_ids + [r for r in running if r in last], plan.max_budgets
        )

    def _schedule(self, running: list[str], prompt_ids: list[str]) -> RoundBatch:
        """The round's batch: the budget policy's plan, or plain decoding where the throughput guard explores it;
        `prompt_ids`' prompts join its verify pass."""
        started_at = time.perf_counter()
        arm = self.guard.choose(len(running)) if self.guard is not None else POLICY
        roots = {rid: self.requests[rid].root_token_id for rid in running}
        prompts = {"prompt_ids": list(prompt_ids), "prompts": [self.requests[r].prompt_token_ids for r in prompt_ids]}
        if arm == POLICY:
            plan = self._plan(running)
            resumes = not self._drafter_behind.isdisjoint(plan.speculative_ids)
            self._drafter_behind.difference_update(plan.speculative_ids)
            return RoundBatch.from_plan(
                plan, roots, arm=arm, started_at=started_at, resumes_drafting=resumes, **prompts
            )
        self._drafter_behind.update(running)
        self.timings.num_plain_rounds += 1
        batch = RoundBatch.from_plan(RoundPlan([], list(running), []), roots, arm=arm, started_at=started_at, **prompts)
        batch.close()  # plain decoding, as speculation "off" does: no draft, no n-gram chain
        return batch

    def _draft(self, batch: RoundBatch) -> None:
        """Draft and build the batch's trees. A drafter lost on the way (nothing of the round is committed yet)
        leaves the round to plain decoding, n-gram chains included."""
        try:
            topk = self._collect_draft(batch, self._submit_draft(batch))
        except WorkerLostError as exc:
            self.lose_drafter(exc)
            batch.entries = [RoundEntry(e.request_id, e.root_token_id) for e in batch.entries]
            topk = None
        self._build_trees(batch, topk)

    def _submit_draft(self, batch: RoundBatch) -> Pending | None:
        """Start the drafter forward for the batch's drafting entries (None when there are none)."""
        drafting = batch.drafting
        if not drafting:
            return None
        request_ids = [e.request_id for e in drafting]
        # Target features of tokens committed since each request last drafted (several rounds after a fallback):
        # they go from the target worker to the drafter worker; the drafter extends its context cache with them.
        features = self.target.take_features(request_ids)
        return self.drafter.draft_async(request_ids, [e.root_token_id for e in drafting], features, self.max_budget)

    def _collect_draft(self, batch: RoundBatch, pending: Pending | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drafter's top-K log-probs and token ids ([R, L, K] each, rows in the order of `batch.drafting`)."""
        if pending is None:
            return None
        topk = pending.result()
        self.timings.draft += pending.seconds
        self.timings.num_draft_calls += 1
        batch.draft_seconds, batch.num_drafting = self._observed_seconds(pending), len(batch.drafting)
        return topk

    def _build_trees(self, batch: RoundBatch, topk: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The open entries' trees: drafted ones from the top-K (each with its n-gram chain merged in, in auto
        mode), and plain ones' n-gram chains as trees of their own, all cut to the round's global node allocation
        (`BudgetPolicy.allocate_round`), in which the closed entries take their place. Every entry is closed after."""
        plan = batch.open_plan()
        if not plan.speculative_ids and not (self.ngram_tokens and plan.autoregressive_ids):
            batch.close()
            return
        t0 = time.perf_counter()
        proposed, trees = [], []
        if topk is not None:
            max_depths = [self.requests[rid].tokens_left - 1 for rid in plan.speculative_ids]
            trees = drafted_trees(*topk, plan.max_budgets, max_depths, chain=self.config.speculation == "dflash")
            proposed, trees = proposed_trees(trees, with_tokens=bool(self.ngram_tokens))  # host trees
        entries = {e.request_id: e for e in batch.entries}
        chains: dict[str, list[int]] = {}
        if self.ngram_tokens:
            for rid in plan.speculative_ids + plan.autoregressive_ids:
                chains[rid] = self.requests[rid].ngrams.propose(
                    min(self.ngram_tokens, self.requests[rid].tokens_left - 1)
                )
                entries[rid].chain = chains[rid] or None
        allocation = self.budget.allocate_round(plan, proposed, chains, batch.closed_load())
        for i, (rid, tree, n) in enumerate(zip(allocation.request_ids, allocation.trees, allocation.counts)):
            is_drafted = i < allocation.num_drafted
            if not is_drafted and not n:  # a plain entry with no node kept: the root alone
                continue
            # On the host: the target worker packs the round's trees there and uploads the batch once
            kept = kept_tree(tree, trees[i] if is_drafted else None, n)
            entries[rid].tree, entries[rid].predicted = kept, sum(tree.values[:n])
        batch.close()
        self.timings.tree += time.perf_counter() - t0

    def _verify(self, batch: RoundBatch) -> None:
        self._collect_verify(batch, self._submit_verify(batch))

    def _submit_verify(self, batch: RoundBatch) -> Pending:
        roots = [e.root_token_id for e in batch.entries]
        trees = [e.tree for e in batch.entries]
        if not batch.prompt_ids:
            return self.target.verify_async(batch.request_ids, trees, roots)
        return self.target.verify_async(batch.request_ids, trees, roots, batch.prompt_ids, batch.prompts)

    def _collect_verify(self, batch: RoundBatch, pending: Pending) -> None:
        result = pending.result()
        batch.record(result, self._observed_seconds(pending))
        self.timings.num_prompts_in_verify += len(batch.prompt_ids)
        self.timings.verify += result.forward_seconds
        self.timings.accept += result.accept_seconds
        self.timings.num_rounds += 1
        num_drafting = len(batch.drafting)
        self.timings.num_speculative_request_rounds += num_drafting
        self.timings.num_autoregressive_request_rounds += len(batch.entries) - num_drafting

    def _observed_seconds(self, pending: Pending) -> float:
        """What a draft or verify call cost the round, for the cost model: its wall time (an actor call's hops, and
        for a draft the features' transfer, are part of what drafting costs a round; the start-up curves measure
        inside the workers only), except when two groups are in flight, where the calls overlap and a result may be
        read late: then the time inside the worker."""
        return pending.seconds if self.pipeline.is_active else pending.wall_seconds

    def _update_budgets(self, batch: RoundBatch) -> None:
        """What the round teaches the budget policy: the cost curves, each drafting request's acceptance (drafting's
        gain is what it accepted beyond its n-gram chain alone), and the chains' values."""
        cost = self.budget.cost
        if batch.draft_seconds is not None and not batch.resumes_drafting:  # (a switch's catch-up is no draft cost)
            cost.observe_draft(batch.num_drafting, batch.draft_seconds)
        cost.observe_verify(batch.num_verified_tokens, batch.verify_seconds, batch.num_verified_requests)
        for e in batch.entries:
            without_draft = self.budget.observe_proposal(e.chain, e.accepted + [e.bonus], e.request_id)
            stats = self.requests[e.request_id].stats
            if e.drafts:
                self.budget.observe(e.request_id, e.predicted, len(e.accepted), e.tree.num_nodes, without_draft)
                stats.budgets.append(e.tree.num_nodes)
                stats.num_speculative_rounds += 1
            else:
                stats.num_autoregressive_rounds += 1

    def _commit(self, batch: RoundBatch, outputs: list[RequestOutput]) -> None:
        """Commit each entry's accepted tokens and bonus token. Its statistics count what the round committed:
        tokens accepted past a stop are discarded, and not counted either (the budget policy learned from the
        whole verify result)."""
        t0 = time.perf_counter()
        for e in batch.entries:
            req = self.requests[e.request_id]
            num_before = len(req.output.token_ids)
            out = self._append_tokens(req, e.accepted + [e.bonus], e.logprobs)
            num_committed = max(0, len(req.output.token_ids) - num_before)
            if e.drafts:
                req.stats.acceptance_lengths.append(num_committed)
            else:  # an n-gram chain's tokens, if it verified one
                num_ngram = min(len(e.accepted), num_committed)
                req.stats.num_ngram_tokens += num_ngram
                self.timings.num_ngram_tokens += num_ngram
            if out is not None:
                outputs.append(out)
        for rid, token, logprobs in zip(batch.prompt_ids, batch.first_token_ids, batch.first_logprobs):
            self._first_token(self.requests[rid], token, logprobs, outputs)
        self.timings.emit += time.perf_counter() - t0

    def _update_guard(self, batch: RoundBatch) -> None:
        """The throughput guard's measurement: tokens the round's verify answered (past a stop included) over the
        round's time, for the arm it ran. Not while a worker is lost: those rounds measure the loss. A round that
        switches arms (`resumes_drafting`) counts in the time spent but is not measured: its catch-up draft is a
        cost of switching, not of the arm. A round that took in admitted prompts is measured net of them (less what
        the cost model prices their tokens at in its verify pass): the prompts are work of neither arm, while what
        speculating costs beside them is the arm's."""
        if self.guard is None or self.drafter_lost is not None or self.target_lost is not None:
            return
        num_tokens = sum(1 + len(e.accepted) for e in batch.entries)
        seconds = time.perf_counter() - batch.started_at
        if batch.prompts:
            seconds -= self.budget.cost.verify_seconds_of_part(
                batch.num_verified_tokens,
                sum(map(len, batch.prompts)),
                batch.num_verified_requests,
                len(batch.prompts),
            )
        self.guard.observe(
            len(batch.entries),
            batch.arm,
            num_tokens,
            seconds,
            measured=not batch.resumes_drafting,
            speculated=batch.speculates,
            plain_seconds=self.budget.cost.verify_seconds(len(batch.entries), len(batch.entries)),
        )

    def _append_tokens(
        self, req: Request, tokens: list[int], logprobs: RawLogprobs | None = None
    ) -> RequestOutput | None:
        """Commit tokens to a request; its output when it has something new, or finished."""
        new = self.writer.commit(req, tokens, logprobs)
        if req.output.finish_reason is not None:
            return self._finish(req, new.new_text, new.token_ids, new.logprobs)
        if not new.token_ids:
            return None
        return req.to_output(new.new_text, new.token_ids, new.logprobs, finished=False)

    def _finish(
        self, req: Request, new_text: str, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None = None
    ) -> RequestOutput:
        rid = req.request_id
        self.pipeline.drop(rid)
        was_admitted = rid in self.scheduler.running  # (a waiting request holds nothing in the workers)
        self.scheduler.remove(rid)
        self.budget.remove(rid)
        if rid in self._to_restore:  # (no KV on the new target yet)
            self._to_restore.remove(rid)
        elif was_admitted and self.target_lost is None:  # (a lost target's KV went with it)
            try:
                self.target.free(rid)
            except WorkerLostError as exc:  # the request is finished all the same
                self.lose_target(exc)
        self._without_draft_context.discard(rid)
        self._drafter_behind.discard(rid)
        if was_admitted and self._can_draft:
            try:
                self.drafter.free(rid)
            except WorkerLostError as exc:
                self.lose_drafter(exc)
        req.stats.finish_time = time.perf_counter()
        del self.requests[rid]
        return req.to_output(new_text, new_token_ids, new_logprobs, finished=True)

    # ----------------------------------------------------------------------------------------------------------
    # Cost model

    def measure_cost_model(self, token_counts: Iterable[int] | None = None) -> CostModel:
        """Time the verify pass over packed token counts (one request) and over batches of one-token requests, and
        the drafter over batch sizes (start-up profile)."""
        cap = max(1, self.max_budget)
        max_tokens = max(self.config.max_num_seqs * (1 + cap), 1)
        counts = sorted(set(token_counts or verify_cost_counts(max_tokens)) | {1})
        counts = [n for n in counts if n <= max_tokens] or [1]
        verify_points = self.target.measure_verify_cost(counts)
        request_counts = batch_cost_counts(self.config.max_num_seqs)
        batch_points = self.target.measure_batch_cost(request_counts) if request_counts else []
        draft_points = self.drafter.measure_draft_cost([1, 4, 16], cap) if self.drafter is not None else [(1, 1e-3)]
        return CostModel(verify_points, draft_points, batch_points or None)
