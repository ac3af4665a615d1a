"""The decoding engine: continuous batching of DDTree rounds over a target worker and a drafter worker.

One round (`Engine.step`; docs/engine.md):

    admit + prefill     waiting requests that fit in KV memory join; their first token comes from the prefill
    plan                which running requests draft this round (speculative) and which decode without a draft
    draft               ONE drafter forward for all speculative requests: top-K log-probs for positions 1..L
    build trees         the top-B prefixes of each request, all requests at once; in auto mode each request's
                        n-gram proposal (ddtree.ngram) merged in, or as the whole tree of a request in fallback;
                        then the global node allocation
    verify              ONE target forward over every request's packed tree (a root-only tree when autoregressive),
                        target tokens, acceptance walk, KV compaction: all inside the target worker
    observe + emit      budgets learn from the accepted lengths; stops are applied; finished requests leave

The engine holds plain data (ids, lists, ints) and talks to its two workers through a handful of methods, so that the
Ray deployment can place the same workers on separate actors (deployments/) without changing this file.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from ddtree.budget import BudgetConfig, BudgetPolicy, CostModel, ProposedTree, RoundPlan
from ddtree.config import EngineConfig
from ddtree.detokenizer import Detokenizer, OutputState
from ddtree.guard import POLICY, ThroughputGuard
from ddtree.ngram import NgramIndex
from ddtree.outputs import RequestOutput, RequestStats, TokenLogprobs
from ddtree.sampling_params import SamplingParams
from ddtree.scheduler import EngineFullError, Scheduler
from ddtree.tree import DraftTree, build_round_trees, chain_trees_from_topk
from ddtree.workers import DrafterWorker, RawLogprobs, TargetWorker, VerifyResult, WorkerLostError

logger = logging.getLogger(__name__)

PIPELINE_ENTER_SPEEDUP = 1.08  # pipeline="auto" enters when two groups are predicted this much faster than one

__all__ = ["Engine", "EngineConfig", "EngineFullError", "PromptTooLongError", "RoundTimings"]


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within the model's context window (HTTP 400/413)."""


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids: with the tokenizer's own special tokens (BOS for Llama/Mistral), as Hugging Face
    and vLLM encode a prompt."""
    return tokenizer.encode(text, add_special_tokens=True)


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
    num_pipelined_phases: int = 0  # steps run with two request groups in flight (pipeline=True or "auto")
    num_plain_rounds: int = 0  # rounds the guard ran as plain decoding (no draft, no n-gram chain)
    num_speculative_request_rounds: int = 0
    num_autoregressive_request_rounds: int = 0
    num_ngram_tokens: int = 0  # accepted from the n-gram chains of requests in fallback

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    output: OutputState
    stats: RequestStats
    root_token_id: int | None = None  # last committed token, not yet in the KV cache
    num_text_tokens_emitted: int = 0
    ngrams: NgramIndex | None = None  # prompt + committed tokens (auto mode with ngram_tokens > 0)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per committed token (SamplingParams.logprobs)
    text_started: bool = False  # a committed token decoded to something (special tokens do not): logprobs' bytes


@dataclass
class _DraftedTrees:
    trees: list[DraftTree] = field(default_factory=list)  # per speculative request
    predicted: list[float] = field(default_factory=list)  # S(b) of the kept nodes, uncalibrated
    # n-gram chains proposed this round, per request id (whether or not the allocation kept their nodes); requests
    # in fallback whose chain was kept verify it as their tree (ngram_trees)
    proposals: dict[str, list[int]] = field(default_factory=dict)
    ngram_trees: dict[str, DraftTree] = field(default_factory=dict)


@dataclass
class _DraftedGroup:
    """Pipelined mode: speculative requests whose trees were drafted last phase and wait for their verify."""

    plan: RoundPlan  # speculative_ids and max_budgets (no autoregressive ids)
    drafted: _DraftedTrees


def _without(group: _DraftedGroup, request_ids: set[str]) -> _DraftedGroup | None:
    """The group minus some requests (aborted while in flight); None when nothing is left."""
    if request_ids.isdisjoint(group.plan.speculative_ids):
        return group
    keep = [i for i, rid in enumerate(group.plan.speculative_ids) if rid not in request_ids]
    if not keep:
        return None
    plan = RoundPlan([group.plan.speculative_ids[i] for i in keep], [], [group.plan.max_budgets[i] for i in keep])
    drafted = _DraftedTrees(
        [group.drafted.trees[i] for i in keep],
        [group.drafted.predicted[i] for i in keep],
        {r: c for r, c in group.drafted.proposals.items() if r not in request_ids},
    )
    return _DraftedGroup(plan, drafted)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        target: TargetWorker,
        drafter: DrafterWorker | None,
        tokenizer,
        cost: CostModel | None = None,
    ) -> None:
        if config.speculation != "off" and drafter is None:
            raise ValueError(f"speculation={config.speculation!r} needs a drafter")
        self.config = config
        self.target = target
        self.drafter = drafter if config.speculation != "off" else None
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        # A token's text for log-probabilities (up to 21 per generated token): decoded once per token id.
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: self.detokenizer.decode([token_id]))
        self._token_bytes = functools.lru_cache(maxsize=1 << 16)(self.detokenizer.token_bytes)
        self.eos_token_ids = frozenset(target.eos_token_ids)
        self.block_len = drafter.block_len if self.drafter is not None else 0
        fixed_budget = config.fixed_budget
        if config.speculation == "dflash":  # the DFlash baseline verifies its whole argmax chain
            fixed_budget = min(fixed_budget or self.block_len, self.block_len)
        self.max_budget = (fixed_budget or config.max_budget) if self.drafter is not None else 0
        is_auto = self.drafter is not None and config.speculation == "ddtree" and fixed_budget is None
        self.ngram_tokens = config.ngram_tokens if is_auto else 0
        self.max_tree_nodes = self.max_budget + self.ngram_tokens  # a verify pass's scratch entries beyond the root
        self.max_model_len = self._context_window(config.max_model_len, target)
        if cost is None:
            cost = self.measure_cost_model()
        self.budget = BudgetPolicy(
            BudgetConfig(
                fixed_budget=fixed_budget,
                max_budget=max(1, self.max_budget),
                allow_fallback=config.allow_fallback,
                max_probe_overhead=config.max_probe_overhead,
            ),
            cost,
        )
        self.scheduler = Scheduler(config.max_num_seqs, config.max_waiting)
        # the closed loop over the budget policy (auto mode only: a fixed budget or dflash is the user's choice)
        self.guard = ThroughputGuard(config.max_explore_share) if is_auto and config.max_explore_share > 0 else None
        self.requests: dict[str, _Request] = {}
        self.timings = RoundTimings()
        self._ids = itertools.count()
        self._drafted_group: _DraftedGroup | None = None  # pipelined mode: drafted, waiting for its verify
        self._is_pipelining = False  # the last step's choice (pipeline="auto" hysteresis)
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

    def attach_drafter(self, drafter: DrafterWorker) -> None:
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
        self._drafted_group = None  # (drafted already, but its requests' context is gone too: they decode plain)

    def lose_target(self, error: BaseException) -> None:
        """The target's worker is gone: no round runs until `attach_target` (see `target_lost`)."""
        if self.target_lost is None:
            logger.error("the target is lost (%s); %d requests wait for a new one", error, len(self.requests))
            self.num_target_losses += 1
        self.target_lost = str(error) or type(error).__name__
        self._drafted_group = None  # (its trees were drafted for a verify on the lost target: drafted again)

    def attach_target(self, target: TargetWorker, drafter: DrafterWorker | None = None) -> None:
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
        self._to_restore = []
        for rid, token, logprobs in zip(restore, prefilled.token_ids, prefilled.logprobs):
            req = self.requests[rid]
            if req.root_token_id is None:
                self._first_token(req, token, logprobs, outputs)

    def _context_window(self, requested: int | None, target: TargetWorker) -> int:
        """The model's window, capped by `requested` and by what one request can reserve in the KV cache (its
        prompt, every new token and one verify pass's scratch: `_kv_capacity`), so that every request
        accepted here can be admitted once the cache is free instead of waiting forever."""
        window = min(requested or target.max_model_len, target.max_model_len)
        fits = target.max_request_tokens - 1 - self.max_tree_nodes
        if fits < 2:
            raise ValueError(
                f"the KV cache holds {target.max_request_tokens} tokens per request, too few for a verify pass of "
                f"{1 + self.max_tree_nodes} tokens: give it more bytes (kv_cache_bytes) or lower max_budget"
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
        self.requests[request_id] = _Request(
            request_id, prompt_token_ids, output, RequestStats(arrival_time=time.perf_counter())
        )
        return request_id

    def validate(self, prompt: str | list[int], params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params, or a clear error."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        # A copy, validated again: fields may have been set after construction (or unpickled, which skips
        # __post_init__), and a bad value found in the middle of a round would fail every request in it.
        params = replace(params)
        if isinstance(prompt, str):
            prompt_token_ids = encode_prompt(self.tokenizer, prompt)
        elif isinstance(prompt, (list, tuple)):
            prompt_token_ids = list(prompt)
            vocab = self.target.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt_token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise ValueError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context window is {self.max_model_len}"
            )
        return prompt_token_ids, params

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

    def step(self) -> list[RequestOutput]:
        """One round; the outputs of every request that committed tokens or finished in it. With the target lost,
        nothing runs (the caller waits for `attach_target`)."""
        outputs: list[RequestOutput] = []
        self._expire_waiting(outputs)
        if self.target_lost is not None:
            return outputs
        try:
            if self._to_restore:
                self._restore(outputs)
            is_pipelining = self._is_pipelining = self._should_pipeline()
            if is_pipelining or self._drafted_group is not None:  # (a group still in flight is verified first)
                self._pipelined_step(outputs, is_pipelining)
            else:
                self._sequential_step(outputs)
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

    def _sequential_step(self, outputs: list[RequestOutput]) -> None:
        self._admit_and_prefill(outputs)
        running = self._ready_requests(busy=set())
        if not running:
            return
        t0 = time.perf_counter()
        arm = self.guard.choose(len(running)) if self.guard is not None else POLICY
        if arm == POLICY:
            plan = self._plan(running)
            try:
                drafted = self._collect_draft(plan, self._submit_draft(plan), plan.autoregressive_ids)
            except WorkerLostError as exc:  # (raised before anything of the round was committed)
                self.lose_drafter(exc)
                plan = RoundPlan([], list(running), [])
                drafted = self._collect_draft(plan, None, plan.autoregressive_ids)
        else:  # plain decoding, as speculation "off" does
            plan, drafted = RoundPlan([], list(running), []), _DraftedTrees()
            self.timings.num_plain_rounds += 1
        result = self._collect_verify(plan, self._submit_verify(plan, drafted))
        self._observe(plan, drafted, result)
        self._emit(plan, result, outputs)
        if self.guard is not None and self.drafter_lost is None and self.target_lost is None:
            num_tokens = sum(1 + len(a) for a in result.accepted_token_ids)  # (tokens past a stop included)
            self.guard.observe(len(running), arm, num_tokens, time.perf_counter() - t0)

    def _should_pipeline(self) -> bool:
        """pipeline=True: always; "auto": while the cost model predicts two groups faster than one, with a margin
        to enter (it ignores the actor hops and the second verify pass's fixed costs: in benchmarks/bench_pipeline.py
        runs its predictions were 0-7% above the measured ratio), staying while above 1x, and only when the workers
        can work at the same time (`can_overlap`: actors on cores or devices of their own)."""
        if not self._can_draft or self.config.pipeline is False:
            return False
        if self.config.pipeline is True:
            return True
        if not (self.target.can_overlap and self.drafter.can_overlap):
            return False
        threshold = 1.0 if self._is_pipelining else PIPELINE_ENTER_SPEEDUP
        return self.budget.pipeline_speedup(self.scheduler.running) > threshold

    def _pipelined_step(self, outputs: list[RequestOutput], is_pipelining: bool = True) -> None:
        """One phase with two request groups in flight: the target verifies the trees drafted in the previous phase
        while the drafter drafts the requests that phase verified (their new roots are known).

        Requests planned autoregressive need no draft, so they join the current verify pass at once. The drafting
        group is capped at half of all speculating requests (the rest decode one token this phase instead), so the
        two groups stay balanced as requests join and leave. With one speculating request the phases alternate
        draft / verify, which is the sequential round. In one process (`Completed` calls) the phases run one after
        the other; with the workers on two actors (deployments/) the draft and the verify run concurrently."""
        self._admit_and_prefill(outputs)
        self.timings.num_pipelined_phases += int(is_pipelining)
        in_verify, self._drafted_group = self._drafted_group, None  # (`_finish` took aborted requests out of it)
        busy = set(in_verify.plan.speculative_ids) if in_verify is not None else set()
        ready = self._ready_requests(busy)
        plan = self._plan(ready) if ready else RoundPlan([], [], [])
        # Leaving pipelined mode (auto), nothing drafts while the last group in flight is verified.
        max_drafting = (len(plan.speculative_ids) + len(busy) + 1) // 2 if is_pipelining else 0
        if len(plan.speculative_ids) > max_drafting:
            plan = RoundPlan(
                plan.speculative_ids[:max_drafting],
                plan.autoregressive_ids + plan.speculative_ids[max_drafting:],
                plan.max_budgets[:max_drafting],
            )
        verify_plan = RoundPlan(
            in_verify.plan.speculative_ids if in_verify is not None else [],
            plan.autoregressive_ids,
            in_verify.plan.max_budgets if in_verify is not None else [],
        )
        verify_drafted = in_verify.drafted if in_verify is not None else _DraftedTrees()
        # Submission order matters on actors: the drafting requests' features are taken from the target before
        # the verify is queued behind them (inside _submit_draft), so the draft does not wait for the verify.
        try:
            pending_draft = self._submit_draft(plan)
        except WorkerLostError as exc:
            self.lose_drafter(exc)  # (the drafting group sits this phase out; it decodes plain from the next)
            pending_draft, plan = None, RoundPlan([], plan.autoregressive_ids, [])
        if self.ngram_tokens and plan.autoregressive_ids:
            # Requests decoding without a draft verify their n-gram chains, allocated in the context of the verify
            # pass they join: the trees drafted last phase are in it already.
            trees = verify_drafted.trees  # each commits its root's token and its expected nodes (uncalibrated)
            num_packed = len(trees) + sum(t.num_nodes for t in trees)
            expected = len(trees) + sum(verify_drafted.predicted)
            chained = self._collect_draft(
                RoundPlan([], plan.autoregressive_ids, []), None, plan.autoregressive_ids, packed=(num_packed, expected)
            )
            verify_drafted.proposals.update(chained.proposals)
            verify_drafted.ngram_trees.update(chained.ngram_trees)
        pending_verify = None
        if verify_plan.speculative_ids or verify_plan.autoregressive_ids:
            pending_verify = self._submit_verify(verify_plan, verify_drafted)
        if plan.speculative_ids:  # the next group's trees are built while the target verifies
            # (priced with this phase's one-token requests standing in for those of the pass they will join,
            # which are planned only then)
            try:
                drafted = self._collect_draft(plan, pending_draft)
                self._drafted_group = _DraftedGroup(RoundPlan(plan.speculative_ids, [], plan.max_budgets), drafted)
            except WorkerLostError as exc:
                self.lose_drafter(exc)
        if pending_verify is not None:
            result = self._collect_verify(verify_plan, pending_verify)
            self._observe(verify_plan, verify_drafted, result)
            self._emit(verify_plan, result, outputs)

    def _ready_requests(self, busy: set[str]) -> list[str]:
        """Running requests whose next root token is known and that are not waiting for a verify."""
        return [
            rid for rid in self.scheduler.running if rid not in busy and self.requests[rid].root_token_id is not None
        ]

    def _kv_capacity(self, req: _Request) -> int:
        """The KV entries a request reserves: its prompt, every new token, and one verify pass's scratch."""
        return len(req.prompt_token_ids) + req.output.max_new_tokens + 1 + self.max_tree_nodes

    def _admit_and_prefill(self, outputs: list[RequestOutput]) -> None:
        def try_allocate(rid: str) -> bool:
            req = self.requests[rid]
            return self.target.allocate(rid, self._kv_capacity(req), req.output.params)

        admitted = self.scheduler.admit(try_allocate)
        if not admitted:
            return
        t0 = time.perf_counter()
        prefilled = self.target.prefill(admitted, [self.requests[r].prompt_token_ids for r in admitted])
        self.timings.prefill += time.perf_counter() - t0
        for rid, token, logprobs in zip(admitted, prefilled.token_ids, prefilled.logprobs):
            self._first_token(self.requests[rid], token, logprobs, outputs)

    def _first_token(
        self, req: _Request, token: int, logprobs: RawLogprobs | None, outputs: list[RequestOutput]
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
        last = {r for r in running if self._tokens_left(r) <= 1 or r in self._without_draft_context}
        if not last:
            return self.budget.plan(running)
        plan = self.budget.plan([r for r in running if r not in last])
        return RoundPlan(
            plan.speculative_ids, plan.autoregressive_ids + [r for r in running if r in last], plan.max_budgets
        )

    def _tokens_left(self, rid: str) -> int:
        output = self.requests[rid].output
        return output.max_new_tokens - len(output.token_ids)

    def _submit_draft(self, plan: RoundPlan):
        """Start the drafter forward for the plan's speculative requests (None when there are none)."""
        if not plan.speculative_ids:
            return None
        roots = [self.requests[r].root_token_id for r in plan.speculative_ids]
        # Target features of tokens committed since each request last drafted (several rounds after a fallback):
        # they go from the target worker to the drafter worker; the drafter extends its context cache with them.
        features = self.target.take_features(plan.speculative_ids)
        return self.drafter.draft_async(plan.speculative_ids, roots, features, self.max_budget)

    def _collect_draft(
        self, plan: RoundPlan, pending, ngram_candidates: list[str] = (), packed: tuple[int, float] = (0, 0.0)
    ) -> _DraftedTrees:
        """The drafter's top-K as trees (each with its request's n-gram chain merged in, in auto mode), and the
        n-gram chains of `ngram_candidates` (requests decoding without a draft this round) as trees of their own,
        all cut to the round's global node allocation (`BudgetPolicy.allocate_round`; `packed`: what trees
        allocated before put into the same verify pass)."""
        drafted = _DraftedTrees()
        trees: list[DraftTree] = []
        proposed: list[ProposedTree] = []
        t1 = time.perf_counter()
        if pending is not None:
            topk_logprobs, topk_token_ids = pending.result()
            self.timings.draft += pending.seconds
            self.timings.num_draft_calls += 1
            self.budget.cost.observe_draft(len(plan.speculative_ids), self._observed_seconds(pending))
            t1 = time.perf_counter()
            # A round commits at most (accepted nodes + 1) tokens: nodes deeper than a request's tokens left - 1
            # would be verified for nothing (its last rounds), and their share of the allocation go to no one.
            max_depths = [self._tokens_left(r) - 1 for r in plan.speculative_ids]
            if self.config.speculation == "dflash":
                lengths = [min(b, d) for b, d in zip(plan.max_budgets, max_depths)]
                trees = chain_trees_from_topk(topk_logprobs, topk_token_ids, lengths)
            else:
                trees = _build_depth_capped_trees(topk_logprobs, topk_token_ids, plan.max_budgets, max_depths)
            proposed, trees = self._proposed_trees(trees)  # the trees now on the host, as the policy reads them
        chains: dict[str, list[int]] = {}
        if self.ngram_tokens:
            for rid in list(plan.speculative_ids) + list(ngram_candidates):
                chains[rid] = self.requests[rid].ngrams.propose(min(self.ngram_tokens, self._tokens_left(rid) - 1))
            drafted.proposals = {rid: chain for rid, chain in chains.items() if chain}
        allocation = self.budget.allocate_round(plan, proposed, chains, packed)
        if not allocation.request_ids:
            return drafted
        for i, (rid, tree, n) in enumerate(zip(allocation.request_ids, allocation.trees, allocation.counts)):
            # On the host: the target worker packs the round's trees there and uploads the batch once
            if tree.is_rebuilt:  # a chain merged into a drafted tree, or a chain alone: new tensors
                kept = _truncate(self._tree_tensors(tree), n)
            else:
                kept = _truncate(trees[i], n)
            if i < allocation.num_drafted:
                drafted.trees.append(kept)
                drafted.predicted.append(sum(tree.values[:n]))
            elif kept.num_nodes:
                drafted.ngram_trees[rid] = kept
        self.timings.tree += time.perf_counter() - t1
        return drafted

    def _proposed_trees(self, trees: list[DraftTree]) -> tuple[list[ProposedTree], list[DraftTree]]:
        """The trees as plain lists for the budget policy (node probabilities and, to merge n-gram chains, tokens and
        parents; token ids are exact in float64), and as host tensors (on a GPU, views of one copy: one device read
        per round for both)."""
        logprobs = torch.cat([t.path_logprobs for t in trees])
        if logprobs.device.type == "cpu":  # host trees already: only the lists the policy reads
            fields = ("token_ids", "parents") if self.ngram_tokens else ()
            columns = [logprobs.exp().double()] + [torch.cat([getattr(t, f) for t in trees]).double() for f in fields]
            return self._as_proposed(trees, torch.stack(columns).tolist()), trees
        host = torch.stack(
            [logprobs.exp().double(), logprobs.double()]
            + [torch.cat([getattr(t, f) for t in trees]).double() for f in ("token_ids", "parents", "depths")]
        ).cpu()  # [5, nodes]
        ids = host[2:].long()
        path_logprobs = host[1].to(logprobs.dtype)
        host_trees, start = [], 0
        for t in trees:
            end = start + t.num_nodes
            host_trees.append(
                DraftTree(ids[0, start:end], ids[1, start:end], ids[2, start:end], path_logprobs[start:end])
            )
            start = end
        return self._as_proposed(trees, (host[[0, 2, 3]] if self.ngram_tokens else host[:1]).tolist()), host_trees

    def _as_proposed(self, trees: list[DraftTree], columns: list[list[float]]) -> list[ProposedTree]:
        """Per tree, its slice of the columns (probabilities; with n-gram chains, tokens and parents too)."""
        proposed, start = [], 0
        for t in trees:
            end = start + t.num_nodes
            if self.ngram_tokens:
                proposed.append(
                    ProposedTree(
                        columns[0][start:end],
                        [int(x) for x in columns[1][start:end]],
                        [int(x) for x in columns[2][start:end]],
                    )
                )
            else:
                proposed.append(ProposedTree(columns[0][start:end]))
            start = end
        return proposed

    @staticmethod
    def _tree_tensors(tree: ProposedTree) -> DraftTree:
        """A tree the policy rebuilt (a chain merged in) as host tensors."""
        return DraftTree(
            torch.tensor(tree.token_ids, dtype=torch.int64),
            torch.tensor(tree.parents, dtype=torch.int64),
            torch.tensor(tree.depths, dtype=torch.int64),
            torch.tensor(tree.values, dtype=torch.float32).log(),
        )

    def _submit_verify(self, plan: RoundPlan, drafted: _DraftedTrees):
        request_ids = plan.speculative_ids + plan.autoregressive_ids
        trees = drafted.trees + [drafted.ngram_trees.get(r) for r in plan.autoregressive_ids]
        roots = [self.requests[r].root_token_id for r in request_ids]
        return self.target.verify_async(request_ids, trees, roots)

    def _collect_verify(self, plan: RoundPlan, pending) -> VerifyResult:
        result = pending.result()
        self.timings.verify += result.forward_seconds
        self.timings.accept += result.accept_seconds
        self.timings.num_rounds += 1
        self.timings.num_speculative_request_rounds += len(plan.speculative_ids)
        self.timings.num_autoregressive_request_rounds += len(plan.autoregressive_ids)
        self.budget.cost.observe_verify(result.num_tokens, self._observed_seconds(pending))
        return result

    def _observed_seconds(self, pending) -> float:
        """What a draft or verify call cost the round, for the cost model: its wall time (an actor call's hops, and
        for a draft the features' transfer, are part of what drafting costs a round; the start-up curves measure
        inside the workers only), except when two groups are in flight, where the calls overlap and a result may be
        read late: then the time inside the worker."""
        return pending.seconds if self._is_pipelining else pending.wall_seconds

    def _observe(self, plan: RoundPlan, drafted: _DraftedTrees, result: VerifyResult) -> None:
        for i, rid in enumerate(plan.speculative_ids):
            accepted = result.accepted_token_ids[i]
            # what the request's chain alone would have accepted: drafting's gain is the rest
            without_draft = self.budget.observe_proposal(
                drafted.proposals.get(rid), accepted + [result.bonus_token_ids[i]]
            )
            self.budget.observe(rid, drafted.predicted[i], len(accepted), drafted.trees[i].num_nodes, without_draft)
            stats = self.requests[rid].stats
            stats.budgets.append(drafted.trees[i].num_nodes)
            stats.num_speculative_rounds += 1
        num_speculative = len(plan.speculative_ids)
        for j, rid in enumerate(plan.autoregressive_ids):
            self.requests[rid].stats.num_autoregressive_rounds += 1
            accepted = result.accepted_token_ids[num_speculative + j]
            self.budget.observe_proposal(
                drafted.proposals.get(rid), accepted + [result.bonus_token_ids[num_speculative + j]]
            )

    def _emit(self, plan: RoundPlan, result: VerifyResult, outputs: list[RequestOutput]) -> None:
        """Commit each request's accepted tokens and bonus token. Its statistics count what the round committed:
        tokens accepted past a stop are discarded, and not counted either (the budget policy learned from the
        whole verify result in `_observe`)."""
        t0 = time.perf_counter()
        num_speculative = len(plan.speculative_ids)
        for i, rid in enumerate(plan.speculative_ids + plan.autoregressive_ids):
            req = self.requests[rid]
            tokens = result.accepted_token_ids[i] + [result.bonus_token_ids[i]]
            num_before = len(req.output.token_ids)
            out = self._append_tokens(req, tokens, result.logprobs[i])
            num_committed = max(0, len(req.output.token_ids) - num_before)
            if i < num_speculative:
                req.stats.acceptance_lengths.append(num_committed)
            else:  # an n-gram chain's tokens, if it verified one
                num_ngram = min(len(result.accepted_token_ids[i]), num_committed)
                req.stats.num_ngram_tokens += num_ngram
                self.timings.num_ngram_tokens += num_ngram
            if out is not None:
                outputs.append(out)
        self.timings.emit += time.perf_counter() - t0

    def _append_tokens(
        self, req: _Request, tokens: list[int], logprobs: RawLogprobs | None = None
    ) -> RequestOutput | None:
        kept = self.detokenizer.append(req.output, tokens)
        if req.ngrams is not None:
            req.ngrams.extend(kept)
        req.root_token_id = kept[-1] if kept else req.root_token_id
        new_logprobs = None
        if req.output.params.logprobs is not None:
            new_logprobs = self._token_logprobs(kept, logprobs, at_text_start=not req.text_started)
            req.logprobs.extend(new_logprobs)
            req.text_started = req.text_started or any(lp.token_bytes for lp in new_logprobs)
        new_text = self.detokenizer.take_new_text(req.output)
        if req.output.finish_reason is not None:
            return self._finish(req, new_text, kept, new_logprobs)
        if not kept:
            return None
        return self._output(req, new_text, kept, new_logprobs, finished=False)

    def _token_logprobs(self, kept: list[int], raw: RawLogprobs | None, at_text_start: bool) -> list[TokenLogprobs]:
        """The worker's numbers for the kept tokens, with each token's text and bytes (`at_text_start`: the output
        has no text before them)."""
        if raw is None or len(raw.chosen) < len(kept):
            raise RuntimeError("the target worker returned no log-probabilities for a request that asked for them")
        text = self._token_text

        def to_bytes(token_id: int, at_start: bool) -> bytes:
            raw_bytes = self._token_bytes(token_id)
            if at_start:
                # The spaces a decode drops at the start of a text (SentencePiece: the first word's one) are not in
                # the output's text either: the bytes join into the text as decoded.
                own = text(token_id)
                drop = (len(raw_bytes) - len(raw_bytes.lstrip(b" "))) - (len(own) - len(own.lstrip(" ")))
                if drop > 0:
                    return raw_bytes[drop:]
            return raw_bytes

        out = []
        for k, token_id in enumerate(kept):
            token_bytes = to_bytes(token_id, at_text_start)
            out.append(
                TokenLogprobs(
                    token_id,
                    text(token_id),
                    raw.chosen[k],
                    [(t, text(t), v) for t, v in zip(raw.top_ids[k], raw.top_values[k])],
                    token_bytes,
                    [to_bytes(t, at_text_start) for t in raw.top_ids[k]],
                )
            )
            at_text_start = at_text_start and not token_bytes
        return out

    def _finish(
        self, req: _Request, new_text: str, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None = None
    ) -> RequestOutput:
        rid = req.request_id
        if self._drafted_group is not None:
            # Aborted while its tree waits for a verify: drop the tree now, before the id can be reused.
            self._drafted_group = _without(self._drafted_group, {rid})
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
        if was_admitted and self._can_draft:
            try:
                self.drafter.free(rid)
            except WorkerLostError as exc:
                self.lose_drafter(exc)
        req.stats.finish_time = time.perf_counter()
        del self.requests[rid]
        return self._output(req, new_text, new_token_ids, new_logprobs, finished=True)

    @staticmethod
    def _output(
        req: _Request, new_text: str, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None, finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text=req.output.text if finished else req.output.text[: req.output.num_text_emitted],
            token_ids=list(req.output.token_ids),
            new_text=new_text,
            new_token_ids=list(new_token_ids),
            finished=finished,
            finish_reason=req.output.finish_reason,
            stats=req.stats,
            logprobs=None if req.output.params.logprobs is None else list(req.logprobs),
            new_logprobs=None if req.output.params.logprobs is None else list(new_logprobs or []),
        )

    # ----------------------------------------------------------------------------------------------------------
    # Cost model

    def measure_cost_model(self, token_counts: Iterable[int] | None = None) -> CostModel:
        """Time the verify pass over packed token counts and the drafter over batch sizes (start-up profile)."""
        cap = max(1, self.max_budget)
        counts = sorted(set(token_counts or [1, 2, 4, 8, 16, 32, 64, 128, 256]) | {1})
        counts = [n for n in counts if n <= max(self.config.max_num_seqs * (1 + cap), 1)] or [1]
        verify_points = self.target.measure_verify_cost(counts)
        draft_points = self.drafter.measure_draft_cost([1, 4, 16], cap) if self.drafter is not None else [(1, 1e-3)]
        return CostModel(verify_points, draft_points)


def _build_depth_capped_trees(
    values: torch.Tensor, token_ids: torch.Tensor, budgets: list[int], max_depths: list[int]
) -> list[DraftTree]:
    """`build_round_trees`, each request's tree holding only nodes of depth <= its max depth: the positions past it
    get log-probability -inf, so their nodes pop after every finite one (best-first) and are cut off the end."""
    capped = [r for r, d in enumerate(max_depths) if d < values.shape[1]]
    if not capped:
        return build_round_trees(values, token_ids, budgets)
    values = values.clone()
    for r in capped:
        values[r, max(max_depths[r], 0) :] = float("-inf")
    trees = build_round_trees(values, token_ids, budgets)
    for r in capped:
        trees[r] = _truncate(trees[r], int(torch.isfinite(trees[r].path_logprobs).sum()))
    return trees


def _truncate(tree: DraftTree, num_nodes: int) -> DraftTree:
    """The first `num_nodes` nodes in pop order: still a tree (parents precede children)."""
    if num_nodes >= tree.num_nodes:
        return tree
    return DraftTree(
        tree.token_ids[:num_nodes],
        tree.parents[:num_nodes],
        tree.depths[:num_nodes],
        tree.path_logprobs[:num_nodes],
    )
