"""The two stage objects the engine drives: the target worker and the drafter worker.

They own every tensor (weights, KV caches, logits, hidden features); the engine sends them request ids, token ids
and draft trees, and gets back plain lists. In one process the engine calls them directly; the Ray deployment puts
each on its own actor (deployments/) and the same calls become actor calls. What crosses between them per round is
small: top-K draft log-probs [R, L, K] from the drafter, the trees to the target, accepted token ids back, and the
accepted tokens' hidden features from the target to the drafter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ddtree.accept import accept, accept_on_demand, target_tokens_greedy, target_tokens_sampled
from ddtree.packing import PackedBatch, pack
from ddtree.sampling_params import SamplingParams
from ddtree.tree import DraftTree


class WorkerLostError(RuntimeError):
    """A worker's process is gone: none of its calls will be answered. Worker proxies that run a worker elsewhere
    (deployments/actors.py) raise it. The engine survives losing either worker: without a drafter its requests go on
    without drafts; without a target they wait for a new one and are prefilled again on it (`Engine.attach_target`)."""


def wait_for_device(device: torch.device | str) -> None:
    """Wait for the work queued on a CUDA device. Its kernels run asynchronously: without this, a worker call that
    returns device tensors is timed by its launches, and the budget policy's cost model (refreshed from these
    timings every round) would learn that drafting costs next to nothing."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Completed:
    """A worker call already done, in this process. The engine submits the round's two big calls (draft, verify)
    with `*_async` and reads them with `.result()`, so that the actor proxies (deployments/proxies.py) can run them
    concurrently on two actors; in one process they simply run one after the other, here."""

    def __init__(self, fn, *args) -> None:
        t0 = time.perf_counter()
        self.value = fn(*args)
        self.seconds = time.perf_counter() - t0  # spent inside the worker
        self.wall_seconds = self.seconds  # what the call cost its caller (an actor call adds its hops)

    def result(self):
        return self.value


@dataclass
class RawLogprobs:
    """Log-probabilities at a request's committed tokens (plain lists): the token's own, and the ids and values of
    the k most likely tokens (k = its SamplingParams.logprobs), most likely first."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


@dataclass
class PrefillResult:
    token_ids: list[int]  # per request: its first generated token
    logprobs: list[RawLogprobs | None]  # per request: at that token (None: not asked)


@dataclass
class VerifyResult:
    accepted_token_ids: list[list[int]]  # per request: tokens of the accepted tree nodes (bonus excluded)
    bonus_token_ids: list[int]  # per request: the target's own token after the accepted path
    num_tokens: int  # packed tokens verified
    forward_seconds: float
    accept_seconds: float  # target tokens, the walk and the KV compaction
    logprobs: list[RawLogprobs | None]  # per request: at its accepted tokens and the bonus token (None: not asked)
    prefilled: PrefillResult | None = None  # the prompts the pass took in (`TargetWorker.verify(prompts=)`)


# From this many packed tokens a verify runs the LM head only on the rows its acceptance walk reaches (each pass an
# LM head call and a host sync; `TargetWorker._accept_on_demand`), below it on all rows at once. CPU: one LM head
# call costs about the same up to ~8 rows (the weights' read) and grows per row beyond: docs/runtime_benchmark.md.
# GPU: a GPU's LM head is flat to far more rows, so a high bound.
LM_HEAD_ON_DEMAND_MIN_TOKENS = {False: 16, True: 1024}  # by "is on a GPU"

LOGPROB_ROWS_PER_CHUNK = 512  # rows of [rows, vocab] float32 log-softmax held at once (a GPU's vocab: 150k x 4 B)


def raw_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[list[int]], ks: list[int | None]
) -> list[RawLogprobs | None]:
    """Per request r asking for log-probabilities (ks[r] not None): the log-softmax of `logits` [N, V] at its
    `rows[r]` (those that produced its committed tokens) at `token_ids` [N], and the top ks[r] of each row (float32;
    float64 logits stay float64); None for the others. The asking requests' rows are computed together, in chunks of
    LOGPROB_ROWS_PER_CHUNK, with one read-back per list and chunk."""
    asking = [r for r, k in enumerate(ks) if k is not None]
    flat_rows = [i for r in asking for i in rows[r]]
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    max_k = min(max((ks[r] for r in asking), default=0), logits.shape[-1])
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for start in range(0, len(flat_rows), LOGPROB_ROWS_PER_CHUNK):
        index = torch.tensor(flat_rows[start : start + LOGPROB_ROWS_PER_CHUNK], dtype=torch.long, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, index).to(dtype), dim=-1)
        chosen += logp.gather(1, token_ids.index_select(0, index)[:, None]).squeeze(1).tolist()
        if max_k > 0:
            top = logp.topk(max_k, dim=-1)
            top_ids += top.indices.tolist()
            top_values += top.values.tolist()
        else:
            top_ids += [[] for _ in range(index.numel())]
            top_values += [[] for _ in range(index.numel())]
    out: list[RawLogprobs | None] = [None] * len(ks)
    start = 0
    for r in asking:
        end, k = start + len(rows[r]), ks[r]
        out[r] = RawLogprobs(
            chosen[start:end], [ids[:k] for ids in top_ids[start:end]], [values[:k] for values in top_values[start:end]]
        )
        start = end
    return out


def _tokenizer_eos_id(model) -> int | None:
    if model.source_path is None:  # built from tensors: no tokenizer
        return None
    try:
        tokenizer = model.tokenizer
    except (OSError, ValueError):  # a checkpoint folder without tokenizer files
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if isinstance(eos, int) else None


class TargetWorker:
    """The target model, its KV cache, per-request sampling state, and features waiting for the drafter."""

    can_overlap = False  # in the engine's process: its calls cannot run while the drafter's do

    def __init__(self, model, keep_features: bool) -> None:
        self.model = model
        self.keep_features = keep_features and model.feature_dim > 0
        self.max_model_len = int(model.config.max_position_embeddings)
        self.max_request_tokens = int(model.kv.max_request_tokens)  # one request's largest KV reservation
        self.eos_token_ids = list(model.config.eos_token_ids)
        tokenizer_eos = _tokenizer_eos_id(model)
        if tokenizer_eos is not None and tokenizer_eos not in self.eos_token_ids:
            self.eos_token_ids.append(tokenizer_eos)  # as Hugging Face and vLLM stop at the tokenizer's EOS too
        self.vocab_size = int(model.config.vocab_size)
        self.lm_head_on_demand_min_tokens = LM_HEAD_ON_DEMAND_MIN_TOKENS[model.device.type == "cuda"]
        self.model_dir = str(model.source_path) if model.source_path is not None else None
        self._seq_ids: dict[str, int] = {}
        self._next_seq_id = 0
        self._params: dict[str, SamplingParams] = {}
        self._seeds: dict[str, int] = {}
        self._pending_features: dict[str, list[torch.Tensor]] = {}

    @property
    def num_kv_bytes_used(self) -> int:
        return self.model.kv.num_bytes_used

    def allocate(self, request_id: str, max_tokens: int, params: SamplingParams) -> bool:
        """Reserve the request's KV region; False when it does not fit now (the request keeps waiting)."""
        seq_id = self._next_seq_id
        if self.model.kv.allocate(seq_id, max_tokens) is None:
            return False
        self._next_seq_id += 1
        self._seq_ids[request_id] = seq_id
        self._params[request_id] = params
        # A sample's random number is keyed by (seed, position) (ddtree.accept): a seeded request's text depends on its
        # seed only, never on the trees or the batch. Unseeded requests draw their seed from torch's global generator.
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._seeds[request_id] = seed
        self._pending_features[request_id] = []
        return True

    def allocate_many(self, requests: list[tuple[str, int, SamplingParams]]) -> int:
        for i, (request_id, max_tokens, params) in enumerate(requests):
            if not self.allocate(request_id, max_tokens, params):
                return i
        return len(requests)

    def seq_id(self, request_id: str) -> int:
        """The request's sequence id in the model's KV cache (`model.kv.handle(seq_id)`)."""
        return self._seq_ids[request_id]

    def prefill(self, request_ids: list[str], prompts: list[list[int]]) -> PrefillResult:
        """Prompts into the KV cache; returns each request's first generated token (and its log-probabilities,
        where asked)."""
        seq_ids = [self._seq_ids[r] for r in request_ids]
        last_logits, features = self.model.prefill(seq_ids, prompts)  # [R, V], list of [n_i, F]
        if self.keep_features:
            for rid, f in zip(request_ids, features):
                self._pending_features[rid].append(f)  # each its own tensor (the prefill concatenates its pieces)
        return self._first_tokens(request_ids, prompts, last_logits)

    def _first_tokens(
        self, request_ids: list[str], prompts: list[list[int]], last_logits: torch.Tensor
    ) -> PrefillResult:
        """Each prompt's first generated token from the logits at its last token [R, V] (and its log-probs)."""
        seq_index = torch.arange(len(request_ids), device=last_logits.device)
        last_positions = torch.tensor([len(p) - 1 for p in prompts], device=last_logits.device)
        tokens = self._target_tokens(request_ids, last_logits, seq_index, last_positions)
        ks = [self._params[rid].logprobs for rid in request_ids]
        logprobs = raw_logprobs(last_logits, tokens, [[r] for r in range(len(request_ids))], ks)
        return PrefillResult(tokens.tolist(), logprobs)

    def verify(
        self,
        request_ids: list[str],
        trees: list[DraftTree | None],
        root_token_ids: list[int],
        prompt_ids: list[str] = (),
        prompts: list[list[int]] = (),
    ) -> VerifyResult:
        """One forward over every request's packed tree (None: root only, an autoregressive step), then the
        acceptance walk and the KV compaction: pack -> forward -> accept -> commit.

        `prompts` (of the newly admitted `prompt_ids`, nothing in their KV yet) join the same forward, each as one
        causal segment that is kept whole, so that admitting requests costs no pass of its own (a pass reads every
        weight; on a CPU that is a decode step's cost). Their first tokens come back in `VerifyResult.prefilled`."""
        if len(prompt_ids) != len(prompts) or any(not p for p in prompts):
            raise ValueError("verify needs one non-empty prompt per prompt id")
        if not request_ids:
            raise ValueError("verify needs at least one request to verify (a prompt alone is a prefill)")
        t0 = time.perf_counter()
        num_trees = len(request_ids)
        all_ids = list(request_ids) + list(prompt_ids)  # the trees' requests, then the prompts'
        seq_ids = [self._seq_ids[r] for r in all_ids]
        packed = self._pack(
            seq_ids,
            list(trees) + [DraftTree.chain(p[1:]) for p in prompts],
            list(root_token_ids) + [p[0] for p in prompts],
        )
        in_trees = packed.head(num_trees) if prompts else packed
        on_demand = in_trees.num_tokens >= self.lm_head_on_demand_min_tokens
        prompt_rows = [(packed.query_starts[r], packed.query_starts[r + 1]) for r in range(num_trees, len(seq_ids))]
        last_rows = [end - 1 for _, end in prompt_rows]
        logits_rows = None
        if prompts and not on_demand:  # every tree row, then each prompt's last row
            logits_rows = torch.tensor(list(range(in_trees.num_tokens)) + last_rows)
        out, features = self.model.verify(
            seq_ids, packed, logits_rows, hidden_only=on_demand, num_prompts=len(prompts)
        )  # [N, H] or [M, V]; [N, F]
        wait_for_device(self.model.device)  # the forward's time, not its launches' (the walk's sync would add it)
        t1 = time.perf_counter()
        if on_demand:  # (the prompts' last rows go with the walk's first LM head call: one read of the head)
            result, logits, tokens, logit_rows, last_logits = self._accept_on_demand(
                request_ids, in_trees, out, last_rows
            )
        else:
            last_logits, out = out[in_trees.num_tokens :], out[: in_trees.num_tokens]
            result, logits, tokens, logit_rows = self._accept(request_ids, in_trees, out)
        prefilled = self._first_tokens(list(prompt_ids), list(prompts), last_logits) if prompts else None
        kept = result.accepted_packed + [list(range(start, end)) for start, end in prompt_rows]  # prompts: whole
        self._commit(all_ids, seq_ids, packed, kept, features)
        logprobs = raw_logprobs(logits, tokens, logit_rows, [self._params[rid].logprobs for rid in request_ids])
        t2 = time.perf_counter()
        return VerifyResult(
            result.accepted_token_ids,
            result.bonus_token_ids,
            packed.num_tokens,
            t1 - t0,
            t2 - t1,
            logprobs,
            prefilled,
        )

    def _pack(self, seq_ids: list[int], trees: list[DraftTree | None], root_token_ids: list[int]) -> PackedBatch:
        """The round's trees as one verify batch: packed on the host (the engine's trees are there, and its sizes are
        then known without a device read) and uploaded in one go."""
        trees = [t.to("cpu") if t is not None else DraftTree.empty() for t in trees]
        num_cached = [self.model.kv.num_committed(s) for s in seq_ids]
        return pack(trees, root_token_ids, num_cached, device="cpu").to(self.model.device)

    def _accept(self, request_ids: list[str], packed: PackedBatch, logits: torch.Tensor):
        """The target's tokens at every row of `logits` and the walk: (result, those logits, the tokens, each
        request's accepted rows as indices into them)."""
        tokens = self._target_tokens(request_ids, logits, packed.seq_index, packed.position_ids)
        result = accept(packed, tokens)  # the round's one host sync
        return result, logits, tokens, result.accepted_packed

    def _commit(
        self,
        request_ids: list[str],
        seq_ids: list[int],
        packed: PackedBatch,
        kept: list[list[int]],
        features: torch.Tensor,
    ) -> None:
        """Each request keeps the root and its accepted nodes (`kept`: packed rows; they produced the committed
        tokens): KV entries and features, for all requests at once."""
        self.model.commit_many(seq_ids, [[p - packed.query_starts[r] for p in k] for r, k in enumerate(kept)])
        if self.keep_features:
            # one upload of every request's rows, then a gather each: each request's own tensor (a view of one
            # gather for all would keep the whole round alive while a request rests in fallback for many rounds,
            # outside the KV budget that counts each token's features once)
            rows = torch.tensor([p for k in kept for p in k], dtype=torch.int64).to(features.device)
            for rid, own_rows in zip(request_ids, rows.split([len(k) for k in kept])):
                self._pending_features[rid].append(features.index_select(0, own_rows))

    def _accept_on_demand(self, request_ids: list[str], packed, hidden: torch.Tensor, extra_rows: list[int]):
        """The walk with the LM head run only on the rows it reaches (`accept_on_demand`): (result, logits [M, V] of
        the rows asked, the target's tokens there [M], each request's accepted rows as indices into them, and the
        logits of `extra_rows` [E, V], which the first LM head call projects with the walk's first rows)."""
        asked_logits, asked_tokens, extra = [], [], []

        def target_tokens_of(rows: list[int]) -> list[int]:
            with_extra = rows + (extra_rows if not asked_logits else [])
            index = torch.tensor(with_extra, device=hidden.device)
            logits = self.model.lm_head_logits(hidden.index_select(0, index))
            if not asked_logits:
                extra.append(logits[len(rows) :])
                logits, index = logits[: len(rows)], index[: len(rows)]
            tokens = self._target_tokens(
                request_ids, logits, packed.seq_index.index_select(0, index), packed.position_ids.index_select(0, index)
            )
            asked_logits.append(logits)
            asked_tokens.append(tokens)
            return tokens.tolist()

        result, asked = accept_on_demand(packed, target_tokens_of)
        row_of = {p: i for i, p in enumerate(asked)}
        logit_rows = [[row_of[p] for p in path] for path in result.accepted_packed]
        return result, torch.cat(asked_logits), torch.cat(asked_tokens), logit_rows, extra[0]

    def verify_async(
        self,
        request_ids: list[str],
        trees: list[DraftTree | None],
        root_token_ids: list[int],
        prompt_ids: list[str] = (),
        prompts: list[list[int]] = (),
    ) -> Completed:
        return Completed(self.verify, request_ids, trees, root_token_ids, prompt_ids, prompts)

    def take_features(self, request_ids: list[str]) -> list[torch.Tensor]:
        """Features [n_i, F] of every token committed since the request's last draft (the drafter's new context)."""
        out = []
        for rid in request_ids:
            pending = self._pending_features[rid]
            out.append(pending[0] if len(pending) == 1 else torch.cat(pending))
            self._pending_features[rid] = []
        return out

    def num_new_features(self, request_id: str) -> int:
        return sum(f.shape[0] for f in self._pending_features.get(request_id, ()))

    def free(self, request_id: str) -> None:
        seq_id = self._seq_ids.pop(request_id, None)
        if seq_id is not None:
            self.model.free(seq_id)
        for d in (self._params, self._seeds, self._pending_features):
            d.pop(request_id, None)

    def measure_verify_cost(self, token_counts: list[int]) -> list[tuple[int, float]]:
        from ddtree.models.target import measure_verify_cost_curve

        # One untimed pass first: the first forwards pay one-off costs (allocations, kernel selection) that would
        # otherwise land on the curve's first points.
        measure_verify_cost_curve(self.model, [1, max(token_counts)], num_repeats=1)
        return measure_verify_cost_curve(self.model, token_counts)

    def measure_batch_cost(self, request_counts: list[int]) -> list[tuple[int, float]]:
        from ddtree.models.target import measure_batch_cost_curve

        return measure_batch_cost_curve(self.model, request_counts)

    def _target_tokens(
        self, request_ids: list[str], logits: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        params = [self._params[r] for r in request_ids]
        if all(p.is_greedy for p in params):
            return target_tokens_greedy(logits)
        return target_tokens_sampled(
            logits,
            seq_index,
            positions,
            [p.temperature for p in params],
            [p.top_p for p in params],
            [p.top_k for p in params],
            [self._seeds[r] for r in request_ids],
        )


class DrafterWorker:
    """The DFlash drafter and its per-request context caches."""

    can_overlap = False

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.block_len = int(drafter.block_len)
        self._known: set[str] = set()

    def add_contexts(self, request_ids: list[str], new_features: list[torch.Tensor]) -> None:
        """Extend each request's context cache with its new target features [n_i, F] (n_i may be 0)."""
        for rid in request_ids:
            if rid not in self._known:
                self.drafter.add_request(rid)
                self._known.add(rid)
        self.drafter.add_contexts(request_ids, new_features)

    def draft(
        self,
        request_ids: list[str],
        root_token_ids: list[int],
        new_features: list[torch.Tensor] | None,
        max_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend each request's context with `new_features` (None: already extended, `add_contexts`), then ONE
        forward for all of them: (top-K log-probs [R, L, K], token ids [R, L, K]) for block positions 1..L."""
        if new_features is not None:
            self.add_contexts(request_ids, new_features)
        out = self.drafter.draft(request_ids, root_token_ids, max_k)
        wait_for_device(self.drafter.device)  # the call's time is the drafter's, not its kernel launches'
        return out

    def draft_async(
        self, request_ids: list[str], root_token_ids: list[int], new_features: list[torch.Tensor], max_k: int
    ) -> Completed:
        return Completed(self.draft, request_ids, root_token_ids, new_features, max_k)

    def free(self, request_id: str) -> None:
        if request_id in self._known:
            self._known.discard(request_id)
            self.drafter.free(request_id)

    def measure_draft_cost(self, batch_sizes: list[int], max_k: int) -> list[tuple[int, float]]:
        return self.drafter.measure_draft_cost(batch_sizes, max_k)
