"""The two stage objects the engine drives: the target worker and the drafter worker.

They own every tensor (weights, KV caches, logits, hidden features); the engine sends them request ids, token ids
and draft trees, and gets back plain lists. In one process the engine calls them directly; the Ray deployment puts
each on its own actor (deployments/) and the same calls become actor calls. What crosses between them per round is
small: top-K draft log-probs [R, L, K] from the drafter, the trees to the target, accepted token ids back, and the
accepted tokens' hidden features from the target to the drafter.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.accept import accept, accept_on_demand, target_tokens_greedy, target_tokens_sampled
from ddtree.models.dflash import DFlashConfig
from ddtree.packing import pack
from ddtree.sampling_params import SamplingParams
from ddtree.tree import DraftTree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DEFAULT_KV_CACHE_BYTES = 1 << 30  # on a CPU; on a GPU, GPU_KV_CACHE_FRACTION of the memory free after the weights
GPU_KV_CACHE_FRACTION = 0.5
KV_PLACEHOLDER_BYTES = 1 << 26  # a GPU target's cache until it is sized: one token of any model (65B bf16: 2.7 MB)
DEFAULT_DRAFTER_DIR = Path(__file__).parent / "assets" / "drafter" / "smollm2-135m-dflash"


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
    with `*_async` and reads them with `.result()`, so that the actor proxies (deployments/actors.py) can run them
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


# From this many packed tokens a verify runs the LM head only on the rows its acceptance walk reaches (each pass an
# LM head call and a host sync; `TargetWorker._accept_on_demand`), below it on all rows at once. CPU: one LM head
# call costs about the same up to ~8 rows (the weights' read) and grows per row beyond: docs/runtime_benchmark.md.
# GPU: a GPU's LM head is flat to far more rows, so a high bound.
LM_HEAD_ON_DEMAND_MIN_TOKENS = {False: 16, True: 1024}  # by "is on a GPU"

LOGPROB_ROWS_PER_CHUNK = 512  # rows of [rows, vocab] float32 log-softmax held at once (a GPU's vocab: 150k x 4 B)


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[list[int]],
                 ks: list[int | None]) -> list[RawLogprobs | None]:
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
        index = torch.tensor(flat_rows[start : start + LOGPROB_ROWS_PER_CHUNK], dtype=torch.long,
                             device=logits.device)
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
        out[r] = RawLogprobs(chosen[start:end], [ids[:k] for ids in top_ids[start:end]],
                             [values[:k] for values in top_values[start:end]])
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
        # Sampling noise is keyed by (seed, position) (ddtree.accept): a seeded request's text depends on its seed
        # only, never on the trees or the batch. Unseeded requests draw their seed from torch's global generator.
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._seeds[request_id] = seed
        self._pending_features[request_id] = []
        return True

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
        seq_index = torch.arange(len(request_ids), device=last_logits.device)
        last_positions = torch.tensor([len(p) - 1 for p in prompts], device=last_logits.device)
        tokens = self._target_tokens(request_ids, last_logits, seq_index, last_positions)
        ks = [self._params[rid].logprobs for rid in request_ids]
        logprobs = raw_logprobs(last_logits, tokens, [[r] for r in range(len(request_ids))], ks)
        return PrefillResult(tokens.tolist(), logprobs)

    def verify(self, request_ids: list[str], trees: list[DraftTree | None], root_token_ids: list[int]) -> VerifyResult:
        """One forward over every request's packed tree (None: root only, an autoregressive step), then the
        acceptance walk and the KV compaction."""
        t0 = time.perf_counter()
        seq_ids = [self._seq_ids[r] for r in request_ids]
        device = self.model.device
        # Packed on the host (the engine's trees are there; its sizes are then known without a device read) and
        # uploaded in one go
        trees = [t.to("cpu") if t is not None else DraftTree.empty() for t in trees]
        num_cached = [self.model.kv.num_committed(s) for s in seq_ids]
        packed = pack(trees, root_token_ids, num_cached, device="cpu").to(device)
        on_demand = packed.num_tokens >= self.lm_head_on_demand_min_tokens
        out, features = self.model.verify(seq_ids, packed, hidden_only=on_demand)  # [N, H] or [N, V]; [N, F]
        wait_for_device(device)  # the forward's time, not its launches' (the walk's sync would add it to accept)
        t1 = time.perf_counter()
        if on_demand:
            result, logits, tokens, logit_rows = self._accept_on_demand(request_ids, packed, out)
        else:
            logits = out
            tokens = self._target_tokens(request_ids, logits, packed.seq_index, packed.position_ids)
            result = accept(packed, tokens)  # the round's one host sync
            logit_rows = result.accepted_packed
        # Each request keeps the root and its accepted nodes (they produced the committed tokens): KV entries and
        # features, for all requests at once
        kept = result.accepted_packed
        self.model.commit_many(seq_ids, [[p - packed.query_starts[r] for p in k] for r, k in enumerate(kept)])
        if self.keep_features:
            # one upload of every request's rows, then a gather each: each request's own tensor (a view of one
            # gather for all would keep the whole round alive while a request rests in fallback for many rounds,
            # outside the KV budget that counts each token's features once)
            rows = torch.tensor([p for k in kept for p in k], dtype=torch.int64).to(features.device)
            for rid, own_rows in zip(request_ids, rows.split([len(k) for k in kept])):
                self._pending_features[rid].append(features.index_select(0, own_rows))
        logprobs = raw_logprobs(logits, tokens, logit_rows, [self._params[rid].logprobs for rid in request_ids])
        t2 = time.perf_counter()
        return VerifyResult(result.accepted_token_ids, result.bonus_token_ids, packed.num_tokens, t1 - t0, t2 - t1,
                            logprobs)

    def _accept_on_demand(self, request_ids: list[str], packed, hidden: torch.Tensor):
        """The walk with the LM head run only on the rows it reaches (`accept_on_demand`): (result, logits [M, V] of
        the rows asked, the target's tokens there [M], each request's accepted rows as indices into them)."""
        asked_logits, asked_tokens = [], []

        def target_tokens_of(rows: list[int]) -> list[int]:
            index = torch.tensor(rows, device=hidden.device)
            logits = self.model.lm_head_logits(hidden.index_select(0, index))
            tokens = self._target_tokens(request_ids, logits, packed.seq_index.index_select(0, index),
                                         packed.position_ids.index_select(0, index))
            asked_logits.append(logits)
            asked_tokens.append(tokens)
            return tokens.tolist()

        result, asked = accept_on_demand(packed, target_tokens_of)
        row_of = {p: i for i, p in enumerate(asked)}
        logit_rows = [[row_of[p] for p in path] for path in result.accepted_packed]
        return result, torch.cat(asked_logits), torch.cat(asked_tokens), logit_rows

    def verify_async(self, request_ids: list[str], trees: list[DraftTree | None], root_token_ids: list[int]
                     ) -> Completed:
        return Completed(self.verify, request_ids, trees, root_token_ids)

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

    def draft_async(self, request_ids: list[str], root_token_ids: list[int], new_features: list[torch.Tensor],
                    max_k: int) -> Completed:
        return Completed(self.draft, request_ids, root_token_ids, new_features, max_k)

    def free(self, request_id: str) -> None:
        if request_id in self._known:
            self._known.discard(request_id)
            self.drafter.free(request_id)

    def measure_draft_cost(self, batch_sizes: list[int], max_k: int) -> list[tuple[int, float]]:
        return self.drafter.measure_draft_cost(batch_sizes, max_k)


def resolve_device(device: str | torch.device, what: str = "device") -> torch.device:
    """The torch device named (cpu, cuda, cuda:N), or a ValueError saying why it cannot be used here, before anything
    loads: a model meant for a GPU never loads for minutes only to fail, nor silently runs on the CPU. `what`: how
    the messages name the setting (a CLI's `--device`)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what} {device!r} is not a torch device (use cpu, cuda or cuda:N)") from e
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"{what} {device!r}: DDTree runs on cpu or cuda only")
    if not torch.cuda.is_available():
        raise ValueError(f"{what} {device!r}: CUDA is not available here (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__} sees no GPU, or is a CPU-only build)")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def compute_and_kernel_dtypes(dtype: torch.dtype, device: str | torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype a model computes and caches in, the native CPU kernels' weight dtype) for the `dtype` asked for.

    On a CPU whose native kernels have AVX-512 bf16 dot products (`ddtree.kernels.bf16_panels_pay`), bfloat16 means
    bf16 weights on them: each matrix product takes bf16-rounded inputs and weights with float32 sums, while
    activations, norms, attention, the KV cache and the features stay float32. That reads half the weight bytes of
    float32: a decode step 1.85x faster here, a 32-token verify 1.49x (docs/runtime_benchmark.md); torch's own
    bfloat16 CPU kernels are slower than float32 at one row. Elsewhere (a GPU, a CPU without those dot products,
    where bf16 panels run slower than float32 ones, no compiler) the model computes in `dtype` itself."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        from ddtree.kernels import bf16_panels_pay

        if bf16_panels_pay():
            return torch.float32, torch.bfloat16
    return dtype, torch.float32


def resolve_drafter_path(model: str | None, drafter: str | None) -> Path:
    """The drafter folder: the shipped one for the embedded default target, else the one given."""
    if drafter is None:
        if model is not None:
            raise ValueError("a custom target model needs its own drafter (drafter=...), or speculation='off'")
        path = DEFAULT_DRAFTER_DIR
    else:
        path = Path(drafter)
    if not (path / "config.json").is_file():
        raise ValueError(f"drafter {str(path)!r} is not a DFlash checkpoint folder (no config.json)")
    return path


def load_target_worker(
    model: str | None,
    drafter_path: Path | None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    kv_cache_bytes: int | None = None,
    attention: str = "auto",
) -> TargetWorker:
    """The target (model None: the embedded default), producing the features `drafter_path`'s drafter reads."""
    from ddtree.models.target import TargetModel

    feature_layer_ids: list[int] = []
    if drafter_path is not None:
        config = DFlashConfig.from_dict(json.loads((Path(drafter_path) / "config.json").read_text()))
        feature_layer_ids = config.target_layer_ids
    is_cuda = torch.device(device).type == "cuda"
    if attention == "auto":
        attention = "flex" if is_cuda else "sdpa"
    sized_after_loading = kv_cache_bytes is None and is_cuda
    compute_dtype, kernel_weight_dtype = compute_and_kernel_dtypes(resolve_dtype(dtype, device), device)
    target_model = TargetModel.load(
        model if model is not None else "default",
        device=device,
        dtype=compute_dtype,
        kernel_weight_dtype=kernel_weight_dtype,
        feature_layer_ids=feature_layer_ids,
        max_kv_bytes=KV_PLACEHOLDER_BYTES if sized_after_loading else kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
        attention=attention,
    )
    if sized_after_loading:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # memory the loading's temporaries left in torch's cache counts as free
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
        target_model.resize_kv_cache(gpu_kv_cache_bytes(free_bytes + target_model.kv.max_bytes))
    return TargetWorker(target_model, keep_features=drafter_path is not None)


def gpu_kv_cache_bytes(free_bytes: int) -> int:
    """The KV cache a GPU target gets without `kv_cache_bytes`: a share of the device memory free once its weights
    are loaded, the rest left to the drafter's weights and contexts (when it shares the GPU) and to the activations
    of verify passes (logits of up to ~1000 rows x the vocabulary)."""
    return int(free_bytes * GPU_KV_CACHE_FRACTION)


def load_drafter_worker(
    drafter_path: Path, head, *, device: str = "cpu", dtype: str | torch.dtype | None = None
) -> DrafterWorker:
    """The drafter, with the target's `TargetHead` (embedding + LM head; `TargetModel.head()`)."""
    from ddtree.drafter import DFlashDrafter

    head = head.to(device)
    compute_dtype, _ = compute_and_kernel_dtypes(resolve_dtype(dtype, device), device)  # its panels: its own choice
    return DrafterWorker(DFlashDrafter.load(drafter_path, head, device=device, dtype=compute_dtype))


def build_workers(
    model: str | None = None,
    drafter: str | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    need_drafter: bool = True,
    kv_cache_bytes: int | None = None,
    attention: str = "auto",
) -> tuple[TargetWorker, DrafterWorker | None, object]:
    """Both workers in this process (sharing the target's embedding and LM head), and the tokenizer.

    model None: the embedded default SmolLM2-135M-Instruct; drafter None: the drafter shipped for it."""
    device = str(resolve_device(device))
    drafter_path = resolve_drafter_path(model, drafter) if need_drafter else None
    target = load_target_worker(
        model, drafter_path, device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes, attention=attention
    )
    drafter_worker = None
    if drafter_path is not None:
        drafter_worker = load_drafter_worker(drafter_path, target.model.head(), device=device, dtype=dtype)
    return target, drafter_worker, target.model.tokenizer
