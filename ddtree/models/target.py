"""The target runner: a lean Llama-family forward over packed batches of many requests.

Every call is one forward over the packed tokens of several requests: linear layers run on all packed tokens at
once (weights fused and stored [in, out]: ddtree.models.target_weights), attention runs per request against its
region of the KV cache, or for the whole batch at once with FlexAttention (verify batches with trees). The kernels
are chosen once, at construction (ddtree.models.target_ops): the native CPU ops, oneDNN or torch for the matrices;
native, SDPA or Flex for attention. Logits are computed only for the rows asked for; hidden features of
`feature_layer_ids` (Hugging Face's hidden_states[i + 1], concatenated along the feature dim; the last layer's is
after the final norm, as in Hugging Face) for every row.

Public API (engine side):
    TargetModel.load(source="default", device="cpu", dtype=torch.float32, feature_layer_ids=(),
                     max_kv_bytes=2**30, attention="sdpa", cache_dir=None) -> TargetModel
        source: a Hugging Face folder (config.json + safetensors), a .gguf file, a hub id, or "default" (the
        embedded SmolLM2-135M-Instruct, converted once, see ddtree.models.default).
    runner.kv.allocate(seq_id, max_tokens) -> KVHandle | None       None = does not fit now (queue the request)
    runner.prefill(seq_ids, token_id_lists) -> (last_logits [R, V], features: list of [n_i, F])    commits
    runner.decode(seq_ids, token_ids) -> (logits [R, V], features [R, F])                          commits
    runner.verify(seq_ids, packed, logits_rows=None) -> (logits [M, V], features [N, F])   KV in scratch slots
    runner.verify(seq_ids, packed, hidden_only=True) -> (hidden [N, H], features)
        runner.lm_head_logits(hidden[rows]) -> [M, V]
    runner.commit(seq_id, keep_local_indices)        keep root + accepted path (local indices in the segment)
    runner.free(seq_id) -> bool
    runner.embed(token_ids [n]) -> [n, H];  runner.project_logits(hidden [n, H]) -> [n, V]  (for the drafter)
    runner.head() -> TargetHead      only the embedding and LM head, for a drafter living elsewhere
    runner.tokenizer                                 from the same source (loaded on first use)
    measure_verify_cost_curve(runner, token_counts) -> list[(num_tokens, seconds)]
    measure_batch_cost_curve(runner, request_counts) -> list[(num_requests, seconds)]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.models.config import TargetConfig
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import Rotary
from ddtree.models.target_ops import (
    FlexAttention,
    ForwardBatch,
    NativeAttention,
    NativeOps,
    OneDnnOps,
    SdpaAttention,
    TargetOps,
    TorchOps,
)
from ddtree.models.target_weights import (
    TargetHead,
    feature_bytes_per_token,
    kv_budget_bytes_per_token,
    load_target_weights,
)
from ddtree.packing import PackedBatch

__all__ = [
    "TargetHead",
    "TargetModel",
    "kv_budget_bytes_per_token",
    "measure_batch_cost_curve",
    "measure_verify_cost_curve",
]

ATTENTION_BACKENDS = ("sdpa", "flex")
DEFAULT_MAX_PREFILL_TOKENS = 512


class TargetModel:
    def __init__(
        self,
        config: TargetConfig,
        tensors: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        feature_layer_ids=(),
        max_kv_bytes: int = 2**30,
        attention: str = "sdpa",
        source_path: Path | None = None,
        pack_gemm_weights: bool = True,
        cpu_kernels: bool = True,
        kernel_weight_dtype: torch.dtype = torch.float32,
    ):
        """Build from Hugging Face-named tensors ([out, in] as in transformers).

        `cpu_kernels` (CPU, float32): the project's native ops (ddtree/kernels/cpu_ops.cpp, built on first use) run
        every forward (`NativeOps`, `NativeAttention`). Every op computes a row the same way whatever else is in
        the batch, so a tree node's logits are bit-identical to those of decoding its path token by token.
        Without them (a CPU without AVX2, no C++ compiler, DDTREE_CPU_KERNELS=0) torch's kernels run; results
        differ by float32 rounding only. `kernel_weight_dtype` bfloat16 (with the native ops): the matrices are
        stored as bf16 panels (the LM head too) while activations, norms, attention, the KV cache and the features
        stay `dtype` (float32): half the bytes a decode step reads (benchmarks/bench_runtime.py
        --kernel-weight-dtype bfloat16). Without the native ops it is ignored (see `kernel_weight_dtype` after
        construction).

        `pack_gemm_weights` (CPU, float32, only without the native ops): oneDNN-packed copies of the matrices for
        forwards of several tokens (`OneDnnOps`), 2x faster than torch's default GEMM there."""
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention = attention
        self.source_path = source_path
        self.feature_layer_ids = [int(i) for i in feature_layer_ids]
        for i in self.feature_layer_ids:
            if not 0 <= i < config.num_hidden_layers:
                raise ValueError(
                    f"feature layer id {i} out of range for this target's {config.num_hidden_layers} "
                    f"layers (a drafter's target_layer_ids name layers of the target it was made for: "
                    f"is the drafter made for another target?)"
                )
        self.feature_dim = len(self.feature_layer_ids) * config.hidden_size
        native = None  # the native CPU ops module (ddtree.kernels)
        if cpu_kernels and self.device.type == "cpu" and dtype == torch.float32:
            from ddtree.kernels import PANEL_DTYPES, cpu_ops

            if kernel_weight_dtype not in PANEL_DTYPES:
                raise ValueError(f"kernel_weight_dtype must be float32 or bfloat16, got {kernel_weight_dtype}")
            native = cpu_ops()
        # the dtype of the panels the native ops read (float32 without them: the plain matrices are `dtype`)
        self.kernel_weight_dtype = kernel_weight_dtype if native is not None else torch.float32
        self.weights = load_target_weights(config, tensors, self.device, dtype, fuse_as_view=native is not None)
        self.ops: TargetOps
        if native is not None:
            self.ops = NativeOps(config, self.weights, native, self.kernel_weight_dtype)
        elif pack_gemm_weights and self.device.type == "cpu" and dtype == torch.float32 and OneDnnOps.available():
            self.ops = OneDnnOps(config, self.weights)
        else:
            self.ops = TorchOps(config, self.weights)
        # attention for every batch; FlexAttention only for verify batches with trees (attention="flex")
        self.batch_attention = NativeAttention(config, native) if native is not None else SdpaAttention(config)
        self.tree_attention = FlexAttention(config, self.device) if attention == "flex" else None
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        self.kv = self._new_kv_cache(max_kv_bytes)
        self._tokenizer = None

    # ---- construction -----------------------------------------------------------------------------------------
    def _new_kv_cache(self, max_bytes: int) -> KVCache:
        # `max_bytes` covers each token's KV entries and its features (kept until the drafter takes them)
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            max_bytes,
            self.device,
            self.dtype,
            max_tokens_per_request=cfg.sliding_window,
            extra_bytes_per_token=feature_bytes_per_token(cfg, self.dtype, len(self.feature_layer_ids)),
            zero_fill=self.attention == "flex",
        )

    def resize_kv_cache(self, max_bytes: int) -> None:
        """A KV cache of `max_bytes` in place of the current one, which must hold no request (sizing it once the
        weights are loaded: `ddtree.loaders.load_target_worker` on a GPU)."""
        if self.kv.num_bytes_used:
            raise ValueError("the KV cache holds requests: it can only be resized empty")
        self.kv = self._new_kv_cache(max_bytes)  # built first: a failure keeps the old one

    @classmethod
    def load(
        cls,
        source: str | Path = "default",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        feature_layer_ids=(),
        max_kv_bytes: int = 2**30,
        attention: str = "sdpa",
        cache_dir: str | Path | None = None,
        pack_gemm_weights: bool = True,
        cpu_kernels: bool = True,
        kernel_weight_dtype: torch.dtype = torch.float32,
    ) -> TargetModel:
        """`cache_dir`: where the default model's converted copy lives (see ddtree.models.default)."""
        from ddtree.models.loader import read_checkpoint, resolve_source

        if str(source) == "default":
            from ddtree.models.default import default_target_dir

            path = default_target_dir(cache_dir)
        else:
            path = resolve_source(source)
        config, tensors = read_checkpoint(path)
        return cls(
            config,
            tensors,
            device,
            dtype,
            feature_layer_ids,
            max_kv_bytes,
            attention,
            source_path=path,
            pack_gemm_weights=pack_gemm_weights,
            cpu_kernels=cpu_kernels,
            kernel_weight_dtype=kernel_weight_dtype,
        )

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether this runner's forwards run on the native CPU ops (ddtree.kernels)."""
        return isinstance(self.ops, NativeOps)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes a forward must read at least once (every weight matrix and norm)."""
        return self.ops.weight_bytes()

    @property
    def lm_head(self) -> torch.Tensor:
        return self.weights.lm_head  # [H, V]

    @property
    def embed_tokens(self) -> torch.Tensor:
        return self.weights.embed_tokens  # [V, H]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.source_path is None:
                raise ValueError("this model was built from tensors; it has no tokenizer")
            from ddtree.models.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.source_path)
        return self._tokenizer

    # ---- shared embedding and head (the drafter uses them) ----------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[...] int64 -> [..., H]."""
        return F.embedding(token_ids, self.embed_tokens)

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] already-normed hidden states -> [..., V] logits (the LM head only)."""
        return hidden @ self.lm_head

    def head(self) -> TargetHead:
        """The embedding and LM head (shared tensors, no copy) for a drafter."""
        return TargetHead(self.config, list(self.feature_layer_ids), self.embed_tokens, self.lm_head)

    # ---- public operations ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, seq_ids: list[int], token_id_lists: list[list[int]], max_chunk_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Append prompts to the requests' caches (committed) in chunks of at most `max_chunk_tokens` packed
        tokens; returns the logits of each prompt's last token [R, V] and its features [n_i, F]."""
        if len(seq_ids) != len(token_id_lists) or not seq_ids:
            raise ValueError("prefill needs one non-empty token list per request")
        if any(len(ids) == 0 for ids in token_id_lists):
            raise ValueError("prefill got an empty prompt")
        if max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be positive")
        for s in seq_ids:
            h = self.kv.handle(s)
            if h.num_scratch:
                raise ValueError(f"request {s} has uncommitted verify entries; commit first")
        last_logits: list[torch.Tensor | None] = [None] * len(seq_ids)
        features: list[list[torch.Tensor]] = [[] for _ in seq_ids]
        # Greedy packing of prompt pieces into forwards of <= max_chunk_tokens tokens.
        pending = [(r, 0) for r in range(len(seq_ids))]
        while pending:
            pieces, budget = [], max_chunk_tokens
            while pending and budget > 0:
                r, start = pending.pop(0)
                end = min(len(token_id_lists[r]), start + budget)
                pieces.append((r, start, end))
                budget -= end - start
                if end < len(token_id_lists[r]):
                    pending.insert(0, (r, end))
            ids = [t for r, s, e in pieces for t in token_id_lists[r][s:e]]
            lens = [e - s for _, s, e in pieces]
            rows = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(pieces))], device=self.device)
            logits, feats = self._run_causal([seq_ids[r] for r, _, _ in pieces], ids, lens, rows)
            offset = 0
            for i, (r, s, e) in enumerate(pieces):
                features[r].append(feats[offset : offset + e - s])
                offset += e - s
                if e == len(token_id_lists[r]):
                    last_logits[r] = logits[i]
        return torch.stack(last_logits), [torch.cat(f) for f in features]

    @torch.inference_mode()
    def decode(self, seq_ids: list[int], token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request, appended and committed; logits [R, V] and features [R, F]."""
        if len(seq_ids) != len(token_ids) or not seq_ids:
            raise ValueError("decode needs one token per request")
        rows = torch.arange(len(seq_ids), device=self.device)
        return self._run_causal(seq_ids, list(token_ids), [1] * len(seq_ids), rows)

    @torch.inference_mode()
    def verify(
        self,
        seq_ids: list[int],
        packed: PackedBatch,
        logits_rows: torch.Tensor | None = None,
        hidden_only: bool = False,
        num_prompts: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over a packed batch of trees. KV entries go to scratch slots after each request's committed
        entries (call `commit` next). Returns logits [M, V] for `logits_rows` (all N rows if None) and features
        [N, F] for every packed token; `hidden_only`: the final-normed hidden states [N, H] instead of logits, for
        `lm_head_logits` of the rows a caller turns out to need. The last `num_prompts` segments are prompts, each
        packed as one chain (`DraftTree.chain`): their attention is causal, and the caller commits them whole."""
        if len(seq_ids) != packed.num_requests:
            raise ValueError(f"{len(seq_ids)} seq_ids for a batch of {packed.num_requests} requests")
        for r, s in enumerate(seq_ids):
            h = self.kv.handle(s)
            if packed.num_cached[r] != h.num_committed:
                raise ValueError(
                    f"request {s}: batch packed with {packed.num_cached[r]} cached tokens, cache holds "
                    f"{h.num_committed}"
                )
        lens = [packed.segment_len(r) for r in range(packed.num_requests)]
        slots = self._reserve(seq_ids, lens)
        is_root_only = all(n == 1 for n in lens)
        # A dense mask per tree only (flex reads `packed` instead): a root alone sees its whole cache and itself, and
        # a prompt is causal, which is what no mask means. In a loaded batch most requests verify their root alone
        # beside a few trees, and each mask is built on the host and runs the masked kernel path on every layer.
        num_trees = packed.num_requests - num_prompts
        masks = [
            None if self.attention == "flex" or r >= num_trees or n == 1 else packed.dense_mask(r).to(self.device)
            for r, n in enumerate(lens)
        ]
        batch = ForwardBatch(
            list(seq_ids),
            list(packed.query_starts),
            list(packed.num_cached),
            masks,
            slots,
            packed if (self.attention == "flex" and not is_root_only) else None,
        )
        if hidden_only:
            logits_rows = None
        elif logits_rows is None:
            logits_rows = torch.arange(packed.num_tokens, device=self.device)
        return self._forward(
            packed.input_ids.to(self.device),
            packed.position_ids.to(self.device),
            batch,
            None if logits_rows is None else logits_rows.to(self.device),
        )

    def commit(self, seq_id: int, keep_local_indices) -> None:
        """After verify: keep the given segment entries (root + accepted path), contiguous; drop the rest."""
        self.kv.commit(seq_id, keep_local_indices)

    def commit_many(self, seq_ids: list[int], keep_local_indices: list) -> None:
        """`commit` for every request of a verify pass, in one copy of the moved entries."""
        self.kv.commit_many(seq_ids, keep_local_indices)

    def free(self, seq_id: int) -> bool:
        return self.kv.free(seq_id)

    # ---- internals --------------------------------------------------------------------------------------------
    def _reserve(self, seq_ids: list[int], lens: list[int]) -> torch.Tensor:
        """[N] pool slots for the new tokens of each request, right after its committed entries."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a request appears twice in one batch")
        before = [self.kv.handle(s).num_scratch for s in seq_ids]
        starts = []
        try:
            for s, n in zip(seq_ids, lens):
                starts.append(self.kv.reserve_scratch(s, n))
        except ValueError:  # all or nothing: the requests reserved before the one that does not fit are untouched
            for s, num_scratch in zip(seq_ids, before):
                self.kv.handle(s).num_scratch = num_scratch
            raise
        return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(self.device)

    def _run_causal(self, seq_ids, token_ids: list[int], lens: list[int], logits_rows: torch.Tensor):
        """Causal segments appended to each request's committed entries, then committed."""
        num_cached = [self.kv.num_committed(s) for s in seq_ids]
        slots = self._reserve(seq_ids, lens)
        query_starts = [0]
        for n in lens:
            query_starts.append(query_starts[-1] + n)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(num_cached, lens)]).to(self.device)
        batch = ForwardBatch(list(seq_ids), query_starts, num_cached, [None] * len(seq_ids), slots)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        try:
            out = self._forward(ids, positions, batch, logits_rows)
        except BaseException:
            for s in seq_ids:
                self.kv.commit(s, [])  # half-written entries never count as context
            raise
        for s in seq_ids:
            self.kv.commit_all(s)
        return out

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, logits_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [M, V] of `logits_rows`, or the final-normed hidden states [N, H] of all rows if None;
        features [N, F])."""
        # Few, large ops per layer: at one decode token every op costs microseconds of overhead, and the weight
        # reads (the bandwidth bound) are all the time a decode step should take.
        ops, weights, num_tokens = self.ops, self.weights, input_ids.numel()
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [N, head_dim]
        attention = self.tree_attention if batch.packed is not None else self.batch_attention
        attend = attention.bind(self.kv, batch, cos, sin)
        h = self.embed(input_ids)  # [N, H]
        features: dict[int, torch.Tensor] = {}
        for layer, lw in enumerate(weights.layers):
            qkv = ops.linear(ops.norm(h, lw.attn_norm), layer, "w_qkv", lw.b_qkv)  # [N, q + 2 kv]
            h = ops.linear(attend(layer, lw, qkv), layer, "w_o", lw.b_o, residual=h)
            gate_up = ops.linear(ops.norm(h, lw.mlp_norm), layer, "w_gate_up")  # [N, 2 * intermediate]
            h = ops.linear(ops.silu_and_mul(gate_up), layer, "w_down", residual=h)
            if layer in self.feature_layer_ids:  # Hugging Face's last hidden state is after the final norm
                features[layer] = ops.norm(h, weights.final_norm) if layer == len(weights.layers) - 1 else h
        if self.feature_layer_ids:
            feats = torch.cat([features[i] for i in self.feature_layer_ids], dim=-1)  # [N, F]
        else:
            feats = torch.empty(num_tokens, 0, device=self.device, dtype=self.dtype)
        hidden = ops.norm(h if logits_rows is None else h.index_select(0, logits_rows), weights.final_norm)  # [M, H]
        if logits_rows is None:  # the caller projects the rows it needs (`lm_head_logits`)
            return hidden, feats
        return ops.lm_head(hidden, num_tokens), feats

    @torch.inference_mode()
    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] final-normed hidden states (`verify(..., hidden_only=True)`) -> [M, V] logits."""
        return self.ops.lm_head(hidden.contiguous(), hidden.shape[0])


def measure_verify_cost_curve(
    runner: TargetModel,
    token_counts: list[int],
    num_context_tokens: int = 128,
    num_repeats: int = 3,
    seq_id: int = -1,
) -> list[tuple[int, float]]:
    """Seconds of one verify forward for each packed token count (a chain tree of that many tokens after
    `num_context_tokens` cached ones), the minimum over `num_repeats` runs. Uses and frees KV slots of `seq_id`."""
    from ddtree.packing import pack
    from ddtree.tree import DraftTree

    if not token_counts or min(token_counts) < 1:
        raise ValueError("token_counts must be positive")
    max_count = max(token_counts)
    if runner.kv.allocate(seq_id, num_context_tokens + max_count) is None:
        raise ValueError("not enough free KV cache to measure the verify cost curve")
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = runner.config.vocab_size
        context = torch.randint(0, vocab, (num_context_tokens,), generator=gen).tolist()
        if num_context_tokens:
            runner.prefill([seq_id], [context])
        curve = []
        for n in token_counts:
            num_nodes = n - 1
            tree = DraftTree(
                token_ids=torch.randint(0, vocab, (num_nodes,), generator=gen),
                parents=torch.arange(num_nodes) - 1,
                depths=torch.arange(1, num_nodes + 1),
                path_logprobs=torch.zeros(num_nodes),
            )
            # on the runner's device, as the engine packs (FlexAttention's mask reads the packed tensors on the GPU)
            packed = pack([tree.to(runner.device)], [1], [runner.kv.num_committed(seq_id)], device=runner.device)
            curve.append((n, _fastest_verify(runner, [seq_id], packed, num_repeats)))
        return curve
    finally:
        runner.free(seq_id)


def measure_batch_cost_curve(
    runner: TargetModel,
    request_counts: list[int],
    num_context_tokens: int = 128,
    num_repeats: int = 3,
) -> list[tuple[int, float]]:
    """Seconds of one verify forward over the roots of R requests (one token each, after `num_context_tokens`
    cached ones each) for each R in `request_counts`, the minimum over `num_repeats` runs: beside
    `measure_verify_cost_curve`'s one request of R tokens, what a request costs a pass beyond its tokens (each
    request's attention reads its own cache, in a call of its own on CPU kernels). Uses and frees KV slots of the
    sequence ids -1, -2, ..., -max(request_counts); counts beyond what the free KV cache holds are left out."""
    from ddtree.packing import pack
    from ddtree.tree import DraftTree

    if not request_counts or min(request_counts) < 1:
        raise ValueError("request_counts must be positive")
    seq_ids: list[int] = []
    try:
        for i in range(max(request_counts)):
            if runner.kv.allocate(-1 - i, num_context_tokens + 1) is None:
                break
            seq_ids.append(-1 - i)
        gen = torch.Generator().manual_seed(0)
        vocab = runner.config.vocab_size
        if num_context_tokens and seq_ids:
            runner.prefill(seq_ids, torch.randint(0, vocab, (len(seq_ids), num_context_tokens), generator=gen).tolist())
        curve = []
        for r in sorted(set(request_counts)):
            if r > len(seq_ids):
                break
            ids = seq_ids[:r]
            roots = torch.randint(0, vocab, (r,), generator=gen).tolist()
            trees = [DraftTree.empty(runner.device) for _ in ids]
            packed = pack(trees, roots, [runner.kv.num_committed(s) for s in ids], device=runner.device)
            curve.append((r, _fastest_verify(runner, ids, packed, num_repeats)))
        return curve
    finally:
        for s in seq_ids:
            runner.free(s)


def _fastest_verify(runner: TargetModel, seq_ids: list[int], packed: PackedBatch, num_repeats: int) -> float:
    """The least seconds of `num_repeats` verify forwards of `packed` (synchronised on a GPU), each one's entries
    dropped after it, so that every run starts from the same cache."""
    best = float("inf")
    for _ in range(num_repeats):
        start = time.perf_counter()
        runner.verify(seq_ids, packed)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        runner.commit_many(seq_ids, [[] for _ in seq_ids])
    return best
