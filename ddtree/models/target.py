"""The target runner: a lean Llama-family forward over packed batches of many requests.

Every call is one forward over the packed tokens of several requests: linear layers run on all packed tokens at
once (weights stored [in, out], fused q/k/v and gate/up, `x @ W`), attention runs per request against its region
of the KV cache (PyTorch SDPA with a dense mask) or for the whole batch at once (FlexAttention with a block mask
from the ancestor bitmasks; used for verify batches with trees, while prefill and root-only steps use SDPA on both
backends). Logits are computed only for the rows asked for; hidden features of `feature_layer_ids` (Hugging
Face's hidden_states[i + 1], concatenated along the feature dim; the last layer's is after the final norm, as in
Hugging Face) for every row. On CPU, prefer one torch thread on a shared machine (docs/runtime_benchmark.md).

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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.kernels import NO_TENSOR
from ddtree.models.config import TargetConfig
from ddtree.models.kv_cache import KVCache, kv_bytes_per_token
from ddtree.models.layers import Rotary, rms_norm
from ddtree.packing import PackedBatch

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("sdpa", "flex")
DEFAULT_MAX_PREFILL_TOKENS = 512


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    w_qkv: torch.Tensor | None  # [H, q_size + 2 * kv_size]
    b_qkv: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm repeated per q head, then k_norm (Qwen3)
    w_o: torch.Tensor | None  # [q_size, H]
    b_o: torch.Tensor | None  # [H]
    mlp_norm: torch.Tensor  # [H]
    w_gate_up: torch.Tensor | None  # [H, 2 * intermediate]
    w_down: torch.Tensor | None  # [intermediate, H]
    # w_qkv, w_o, w_gate_up, w_down are None when the native CPU ops hold them as panels (PanelLayerWeights).


def feature_bytes_per_token(config: TargetConfig, dtype: torch.dtype, num_feature_layers: int) -> int:
    """The features a token keeps for the drafter (hidden states of `num_feature_layers` layers)."""
    return num_feature_layers * config.hidden_size * torch.empty(0, dtype=dtype).element_size()


def kv_budget_bytes_per_token(config: TargetConfig, dtype: torch.dtype, num_feature_layers: int) -> int:
    """What one reserved token takes from a runner's `max_kv_bytes`: its K and V in every layer, and its features."""
    return kv_bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype
    ) + feature_bytes_per_token(config, dtype, num_feature_layers)


@dataclass
class PanelLayerWeights:
    """A layer's matrices as [P, K, 32] panels for the native CPU GEMM (`ddtree.kernels.pack_panels`), with their
    output widths."""

    w_qkv: torch.Tensor
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    widths: dict[str, int]


@dataclass
class PackedLayerWeights:
    """oneDNN-packed copies of a layer's matrices, used for forwards of more than one token on CPUs (see
    `TargetModel.pack_gemm_weights`): opaque tensors for `torch.ops.mkldnn._linear_pointwise`."""

    w_qkv: torch.Tensor
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


@dataclass
class _Batch:
    """Where each request's packed queries are and what they may see; built once per forward."""

    seq_ids: list[int]
    query_starts: list[int]  # [R + 1]
    num_cached: list[int]  # [R]
    masks: list[torch.Tensor | None]  # per request [n_r, num_cached + n_r] bool; None = causal
    slots: torch.Tensor  # [N] pool slot of every packed token's new KV entry
    packed: PackedBatch | None = None  # for the flex backend


@dataclass
class TargetHead:
    """What the DFlash drafter uses of the target: its config, the feature layers it is fed, the token embedding
    and the LM head (no layers, no KV cache). A drafter on its own actor or GPU holds only these two matrices."""

    config: TargetConfig
    feature_layer_ids: list[int]
    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [H, V]

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    def to(self, device: torch.device | str) -> TargetHead:
        lm_head = self.lm_head.to(device)
        is_tied = self.embed_tokens.data_ptr() == self.lm_head.data_ptr()
        embed = lm_head.t() if is_tied else self.embed_tokens.to(device)  # tied: keep one copy
        return TargetHead(self.config, list(self.feature_layer_ids), embed, lm_head)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_tokens)  # [..., H]

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head  # [..., V]


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
        every forward: the layer matrices are stored once, as panels for a GEMM that streams the weights once per
        forward at the memory's read rate for 1-8 rows (a decode step, a small tree's verify) and stays near the
        compute bound above; the LM head is a panel copy of the embedding matrix; RMSNorm, SiLU-and-mul and each
        request's attention block are native too. Every op computes a row the same way whatever else is in the
        batch, so a tree node's logits are bit-identical to those of decoding its path token by token.
        Without them (a CPU without AVX2, no C++ compiler, DDTREE_CPU_KERNELS=0) torch's kernels run; results
        differ by float32 rounding only. `kernel_weight_dtype` bfloat16 (with the native ops): the matrices are
        stored as bf16 panels (the LM head too) and every product takes bf16-rounded inputs and weights with float32
        sums (bf16 dot products), while activations, norms, attention, the KV cache and the features stay `dtype`
        (float32): half the bytes a decode step reads (benchmarks/bench_runtime.py --kernel-weight-dtype bfloat16).
        Without the native ops it is ignored (see `kernel_weight_dtype` after construction).

        `pack_gemm_weights` (CPU, float32, only without the native ops): also keep oneDNN-packed copies of the layer
        matrices and the LM head for forwards of several tokens. torch's default CPU GEMM (MKL) runs far below both
        the bandwidth and the compute bound for 2-64 rows (benchmarks/bench_gemm.py); oneDNN's packed kernels are 2x
        faster there. Costs a second copy of the weights; one-token decode on one thread keeps the plain matrices
        (MKL's GEMV is the faster there)."""
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
        self._cpu_ops = None  # the native CPU ops (ddtree.kernels)
        if cpu_kernels and self.device.type == "cpu" and dtype == torch.float32:
            from ddtree.kernels import PANEL_DTYPES, cpu_ops

            if kernel_weight_dtype not in PANEL_DTYPES:
                raise ValueError(f"kernel_weight_dtype must be float32 or bfloat16, got {kernel_weight_dtype}")
            self._cpu_ops = cpu_ops()
        # the dtype of the panels the native ops read (float32 without them: the plain matrices are `dtype`)
        self.kernel_weight_dtype = kernel_weight_dtype if self._cpu_ops is not None else torch.float32
        self._load_weights(tensors)
        self.panel_layers: list[PanelLayerWeights] | None = None
        self.panel_lm_head: torch.Tensor | None = None
        self.packed_layers: list[PackedLayerWeights] | None = None
        self.packed_lm_head: torch.Tensor | None = None
        if self._cpu_ops is not None:
            self._make_panels()
        elif pack_gemm_weights and self.device.type == "cpu" and dtype == torch.float32 and _has_onednn_linear():
            self._pack_gemm_weights()
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        self.kv = self._new_kv_cache(max_kv_bytes)
        self._tokenizer = None
        self._flex = None

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

    def _make_panels(self) -> None:
        """The layer matrices move into panels (the plain copies are dropped); the LM head keeps its plain matrix
        (the embedding, shared with drafters) and gains a panel copy."""
        from ddtree.kernels import pack_panels

        names = ("w_qkv", "w_o", "w_gate_up", "w_down")
        self.panel_layers = []
        for lw in self.layers:
            matrices = {name: getattr(lw, name) for name in names}  # [in, out]
            self.panel_layers.append(
                PanelLayerWeights(
                    **{n: pack_panels(w, self.kernel_weight_dtype) for n, w in matrices.items()},
                    widths={n: w.shape[1] for n, w in matrices.items()},
                )
            )
            for name in names:
                setattr(lw, name, None)
        self.panel_lm_head = pack_panels(self.lm_head, self.kernel_weight_dtype)

    def _pack_gemm_weights(self) -> None:
        def pack(w_in_out: torch.Tensor) -> torch.Tensor:  # [in, out] (x @ W) -> packed [out, in] (nn.Linear)
            return torch.ops.mkldnn._reorder_linear_weight(w_in_out.t().contiguous())

        self.packed_layers = [
            PackedLayerWeights(pack(lw.w_qkv), pack(lw.w_o), pack(lw.w_gate_up), pack(lw.w_down)) for lw in self.layers
        ]
        self.packed_lm_head = pack(self.lm_head)

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

    def _load_weights(self, t: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        shapes = {  # per layer, what the config says each tensor is
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (cfg.q_size, hidden),
            "self_attn.q_proj.bias": (cfg.q_size,),
            "self_attn.k_proj.weight": (cfg.kv_size, hidden),
            "self_attn.k_proj.bias": (cfg.kv_size,),
            "self_attn.v_proj.weight": (cfg.kv_size, hidden),
            "self_attn.v_proj.bias": (cfg.kv_size,),
            "self_attn.o_proj.weight": (hidden, cfg.q_size),
            "self_attn.o_proj.bias": (hidden,),
            "self_attn.q_norm.weight": (cfg.head_dim,),
            "self_attn.k_norm.weight": (cfg.head_dim,),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "model.norm.weight": (hidden,),
            "model.embed_tokens.weight": (cfg.vocab_size, hidden),
            "lm_head.weight": (cfg.vocab_size, hidden),
        }
        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            if name not in t:
                raise ValueError(f"checkpoint lacks tensor {name}")
            expected = shapes[name.split(".", 3)[-1] if name.startswith("model.layers.") else name]
            if tuple(t[name].shape) != expected:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(t[name].shape)}, the config says "
                    f"{expected}: the checkpoint does not match its config.json"
                )
            used.add(name)
            return t[name].to(device=self.device, dtype=self.dtype)

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in t else None

        def in_out(*out_in: torch.Tensor) -> torch.Tensor:
            """[in, sum(out)] for `x @ W`, from [out_i, in] matrices fused along out, stored as `_is_stored_out_in`
            says (as the transposed view of a contiguous [out, in] matrix, or contiguous itself). With the native ops
            always the view (no copy): the layer matrices then become panels."""
            fused = torch.cat(out_in, dim=0) if len(out_in) > 1 else out_in[0]
            if self._cpu_ops is not None or _is_stored_out_in(fused.shape[0], fused.shape[1], self.dtype):
                return fused.contiguous().t()
            return fused.t().contiguous()

        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (get(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v"))
            biases = [opt(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
            if any(b is not None for b in biases) and not all(b is not None for b in biases):
                raise ValueError(f"layer {i}: q/k/v biases must be all present or all absent")
            self.layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    w_qkv=in_out(q, k, v),  # one GEMM for q, k and v
                    b_qkv=torch.cat(biases) if biases[0] is not None else None,
                    qk_norm=self._qk_norm(t, get, p) if cfg.has_qk_norm else None,
                    w_o=in_out(get(p + "self_attn.o_proj.weight")),
                    b_o=opt(p + "self_attn.o_proj.bias"),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    w_gate_up=in_out(get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")),
                    w_down=in_out(get(p + "mlp.down_proj.weight")),
                )
            )
        self.final_norm = get("model.norm.weight")
        stored_head = t.get("lm_head.weight")
        head_is_embedding = stored_head is None or (  # compared as stored: a cast may round two equal copies apart
            cfg.tie_word_embeddings
            and "model.embed_tokens.weight" in t
            and torch.equal(stored_head, t["model.embed_tokens.weight"])
        )
        if stored_head is None and not cfg.tie_word_embeddings:
            logger.warning(
                "config.json says tie_word_embeddings false but the checkpoint has no lm_head.weight: the "
                "embedding serves as the LM head"
            )
        elif not head_is_embedding and cfg.tie_word_embeddings:
            logger.warning(
                "config.json says tie_word_embeddings but the checkpoint's lm_head.weight differs from its "
                "embedding: the stored head is used, as transformers does"
            )
        if head_is_embedding:
            self.lm_head = in_out(get("model.embed_tokens.weight"))  # [H, V]
            self.embed_tokens = self.lm_head.t()  # [V, H] view: one copy of the shared matrix
            used.add("lm_head.weight")  # a tied checkpoint may store the copy too
        else:
            self.lm_head = in_out(get("lm_head.weight"))  # [H, V]
            self.embed_tokens = get("model.embed_tokens.weight")  # [V, H]
        # Anything else would be silently ignored: more layers than the config says, other modules. (Rotary
        # frequency buffers that older checkpoints store are recomputed from the config.)
        unused = sorted(n for n in t if n not in used and not n.endswith("rotary_emb.inv_freq"))
        if unused:
            raise ValueError(
                f"checkpoint has {len(unused)} tensor(s) that a {cfg.model_type} model with this config "
                f"does not use, e.g. {unused[:3]}: the checkpoint does not match its config.json"
            )

    def _qk_norm(self, t: dict[str, torch.Tensor], get, prefix: str) -> torch.Tensor:
        cfg = self.config
        names = [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
        if any(n not in t for n in names):
            raise ValueError(f"a qwen3 checkpoint needs {names[0]} and {names[1]}")
        q_norm, k_norm = (get(n) for n in names)
        return torch.cat([q_norm.expand(cfg.num_attention_heads, -1), k_norm.expand(cfg.num_key_value_heads, -1)])

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether this runner's forwards run on the native CPU ops (ddtree.kernels)."""
        return self._cpu_ops is not None

    @property
    def num_weight_bytes(self) -> int:
        """Bytes a forward must read at least once (every weight matrix and norm)."""
        tensors = [self.final_norm, self.lm_head]
        if self.embed_tokens.data_ptr() != self.lm_head.data_ptr():
            tensors.append(self.embed_tokens)
        for lw in self.layers:
            tensors += [x for x in vars(lw).values() if x is not None]
        num_bytes = sum(x.numel() * x.element_size() for x in tensors)
        for pl in self.panel_layers or []:  # the matrices' own bytes, not the panels' zero padding
            num_bytes += sum(
                in_features * w * getattr(pl, n).element_size()
                for n, w in pl.widths.items()
                for in_features in [self._panel_in_features(getattr(pl, n))]
            )
        if self.panel_lm_head is not None:  # the LM head reads its panels, not the embedding matrix
            num_bytes -= self.lm_head.numel() * self.lm_head.element_size()
            num_bytes += self.lm_head.numel() * self.panel_lm_head.element_size()
        return num_bytes

    def _panel_in_features(self, panels: torch.Tensor) -> int:
        """A panel tensor's input count: its rows (float32), twice its rows of pairs (bfloat16)."""
        return panels.shape[1] * (2 if panels.dtype == torch.bfloat16 else 1)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over a packed batch of trees. KV entries go to scratch slots after each request's committed
        entries (call `commit` next). Returns logits [M, V] for `logits_rows` (all N rows if None) and features
        [N, F] for every packed token; `hidden_only`: the final-normed hidden states [N, H] instead of logits, for
        `lm_head_logits` of the rows a caller turns out to need."""
        if len(seq_ids) != packed.num_requests:
            raise ValueError(f"{len(seq_ids)} seq_ids for a batch of {packed.num_requests} requests")
        for r, s in enumerate(seq_ids):
            h = self.kv.handle(s)
            if packed.num_cached[r] != h.num_committed:
                raise ValueError(
                    f"request {s}: batch packed with {packed.num_cached[r]} cached tokens, cache holds "
                    f"{h.num_committed}"
                )
        slots = self._reserve(seq_ids, [packed.segment_len(r) for r in range(packed.num_requests)])
        is_root_only = all(packed.segment_len(r) == 1 for r in range(packed.num_requests))
        if is_root_only or self.attention == "flex":
            masks = [None] * packed.num_requests  # root-only segments see everything; flex uses `packed`
        else:
            masks = [packed.dense_mask(r).to(self.device) for r in range(packed.num_requests)]
        batch = _Batch(
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
        batch = _Batch(list(seq_ids), query_starts, num_cached, [None] * len(seq_ids), slots)
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
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: _Batch, logits_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [M, V] of `logits_rows`, or the final-normed hidden states [N, H] of all rows if None;
        features [N, F])."""
        # Few, large ops per layer: at one decode token every op costs microseconds of overhead, and the weight
        # reads (the bandwidth bound) are all the time a decode step should take.
        cfg = self.config
        num_tokens = input_ids.numel()
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = cfg.q_size, cfg.kv_size
        half = hd // 2
        h = self.embed(input_ids)  # [N, H]
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [N, head_dim]
        ops = self._cpu_ops
        if ops is not None:
            linear, norm = self._panel_linear, self._native_norm
        else:
            # One token on one thread: MKL's GEMV streams the weights faster than the packed kernel (which wins from
            # two rows, or with more threads: the GEMV does not parallelise here); benchmarks/bench_gemm.py.
            use_packed = self.packed_layers is not None and (num_tokens > 1 or torch.get_num_threads() > 1)
            linear, norm = (self._packed_linear if use_packed else self._plain_linear), self._norm
        # Each request's attention block (rotary, KV write, attention) in one native call, faster than SDPA and the
        # torch ops around it at every size measured (1-256 new tokens over 0-2048 cached: docs/runtime_benchmark.md),
        # Qwen3's q/k norms included; Flex: torch ops.
        native_attention = ops is not None and batch.packed is None
        if not native_attention:
            cos = cos.unsqueeze(1)  # [N, 1, head_dim], broadcast over heads
            sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).unsqueeze(1)  # rotate-half's sign folded
            attend = self._flex_attention_fn(batch) if batch.packed is not None else self._sdpa_attention
        features: list[torch.Tensor] = []
        last_layer = cfg.num_hidden_layers - 1
        for layer, lw in enumerate(self.layers):
            x = norm(h, lw.attn_norm)
            qkv = linear(x, layer, "w_qkv", lw.b_qkv)  # [N, q + 2 kv]
            if native_attention:
                attn = self._native_attention(layer, qkv, cos, sin, batch)  # [N, heads * head_dim]
            else:
                qk = qkv[:, : q_size + kv_size].view(num_tokens, nh + nkv, hd)  # q and k heads roped together
                if lw.qk_norm is not None:
                    qk = self._norm(qk, lw.qk_norm)  # [nh + nkv, head_dim] weights: q_norm rows then k_norm rows
                swapped = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)
                qk = torch.addcmul(qk * cos, swapped, sin_signed)  # [N, nh + nkv, head_dim]
                pool = self.kv.pool[layer]  # [2, kv_heads, slots, head_dim]
                pool[0][:, batch.slots] = qk[:, nh:].transpose(0, 1)
                pool[1][:, batch.slots] = qkv[:, q_size + kv_size :].view(num_tokens, nkv, hd).transpose(0, 1)
                attn = attend(layer, qk[:, :nh], batch)  # [N, heads * head_dim]
            h = linear(attn, layer, "w_o", lw.b_o, residual=h)
            gate_up = linear(norm(h, lw.mlp_norm), layer, "w_gate_up")  # [N, 2 * intermediate]
            if ops is not None:
                act = ops.silu_and_mul(gate_up)
            else:
                act = F.silu(gate_up[:, : cfg.intermediate_size]) * gate_up[:, cfg.intermediate_size :]
            h = linear(act, layer, "w_down", residual=h)
            if layer in self.feature_layer_ids:
                # Hugging Face's last hidden state is after the final norm.
                features.append(norm(h, self.final_norm) if layer == last_layer else h)
        feats = self._order_features(features, num_tokens)
        hidden = norm(h if logits_rows is None else h.index_select(0, logits_rows), self.final_norm)  # [M, H]
        if logits_rows is None:  # the caller projects the rows it needs (`lm_head_logits`)
            return hidden, feats
        return self._lm_head(hidden, prefer_packed=linear == self._packed_linear), feats

    @torch.inference_mode()
    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] final-normed hidden states (`verify(..., hidden_only=True)`) -> [M, V] logits."""
        return self._lm_head(hidden.contiguous(), prefer_packed=torch.get_num_threads() > 1)

    def _lm_head(self, hidden: torch.Tensor, prefer_packed: bool) -> torch.Tensor:
        """The fastest LM head kernel for M rows (`prefer_packed`: oneDNN even for one row, as the layers used)."""
        ops = self._cpu_ops
        if ops is not None:  # every row count on the panels: a row's logits do not depend on the others
            return ops.panel_linear(hidden, self.panel_lm_head, self.config.vocab_size, NO_TENSOR, NO_TENSOR)
        if self.packed_lm_head is not None and (hidden.shape[0] > 1 or prefer_packed):
            return _packed_linear(hidden, self.packed_lm_head)  # [M, V]
        return self.project_logits(hidden)

    # The layer's matrix `name` applied to x [N, in] (+ bias, + residual [N, out]): one meaning, three mechanisms
    # (torch on the plain matrices, oneDNN on packed copies, the native panel GEMM).
    def _plain_linear(self, x, layer: int, name: str, bias=None, residual=None) -> torch.Tensor:
        w = getattr(self.layers[layer], name)  # [in, out]
        if residual is not None:
            out = torch.addmm(residual, x, w)  # the residual fused into the GEMM
            return out if bias is None else out + bias
        return x @ w if bias is None else torch.addmm(bias, x, w)

    def _packed_linear(self, x, layer: int, name: str, bias=None, residual=None) -> torch.Tensor:
        out = _packed_linear(x, getattr(self.packed_layers[layer], name), bias)
        return out if residual is None else residual + out

    def _panel_linear(self, x, layer: int, name: str, bias=None, residual=None) -> torch.Tensor:
        pl = self.panel_layers[layer]
        return self._cpu_ops.panel_linear(
            x.contiguous(),
            getattr(pl, name),
            pl.widths[name],
            NO_TENSOR if bias is None else bias.contiguous(),
            NO_TENSOR if residual is None else residual.contiguous(),
        )

    def _native_attention(
        self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: _Batch
    ) -> torch.Tensor:
        """Per request: (q/k norm,) rotary, KV write and attention of its new tokens (its mask, or causal) in one
        native call."""
        qk_norm = self.layers[layer].qk_norm
        outs = []
        for r, seq_id in enumerate(batch.seq_ids):
            q0, q1 = batch.query_starts[r], batch.query_starts[r + 1]
            k, v = self.kv.keys_values(seq_id, layer, batch.num_cached[r] + q1 - q0)  # new entries last
            mask = batch.masks[r]
            outs.append(
                self._cpu_ops.attention_block(
                    qkv[q0:q1],
                    cos[q0:q1],
                    sin[q0:q1],
                    k,
                    v,
                    NO_TENSOR if mask is None else mask.contiguous(),
                    self.config.num_attention_heads,
                    NO_TENSOR if qk_norm is None else qk_norm,
                    self.config.rms_norm_eps,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _native_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._cpu_ops.rms_norm(x.contiguous(), weight, self.config.rms_norm_eps)  # 1-D weights only here

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim; `weight` [..., dim] may hold one row per head."""
        eps = self.config.rms_norm_eps
        if self.dtype in (torch.float16, torch.bfloat16):
            return rms_norm(x, weight, eps)  # Hugging Face's float32 round trip
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight

    def _order_features(self, collected: list[torch.Tensor], num_tokens: int) -> torch.Tensor:
        """Collected in layer order -> concatenated in feature_layer_ids order [N, F]."""
        if not self.feature_layer_ids:
            return torch.empty(num_tokens, 0, device=self.device, dtype=self.dtype)
        in_layer_order = sorted(set(self.feature_layer_ids))
        by_layer = dict(zip(in_layer_order, collected))
        return torch.cat([by_layer[i] for i in self.feature_layer_ids], dim=-1)

    def _sdpa_attention(self, layer: int, q: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Per request: its queries against its cached + new entries, dense mask (None = causal)."""
        num_tokens, nh, hd = q.shape
        gqa = nh != self.config.num_key_value_heads
        out = torch.empty(num_tokens, nh, hd, device=q.device, dtype=q.dtype)
        for r, seq_id in enumerate(batch.seq_ids):
            q0, q1 = batch.query_starts[r], batch.query_starts[r + 1]
            n, num_cached = q1 - q0, batch.num_cached[r]
            k, v = self.kv.keys_values(seq_id, layer, num_cached + n)  # [kv_heads, T, head_dim]
            # 4-D inputs: the 3-D form takes SDPA's slow math path with GQA
            qr = q[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            mask = batch.masks[r]
            is_causal = mask is None and n > 1
            if is_causal and num_cached > 0:
                mask, is_causal = _causal_mask(n, num_cached, q.device), False
            o = F.scaled_dot_product_attention(
                qr, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=is_causal, enable_gqa=gqa
            )  # [1, heads, n, head_dim]
            out[q0:q1] = o[0].transpose(0, 1)
        return out.view(num_tokens, nh * hd)

    def _flex_attention_fn(self, batch: _Batch):
        """FlexAttention over the KV pool in place: keys are the pool's slots from the batch's first region to the
        end of its last one, each request's entries read where they lie (no per-layer copy of every request's
        context), with a block mask built once per forward that lists only the blocks of the batch's regions."""
        from torch.nn.attention.flex_attention import flex_attention

        packed = batch.packed
        regions = [self.kv.handle(s).slot_start for s in batch.seq_ids]
        # The keys: the pool's slots from the first region to the end of the last one, a view
        first = min(regions)
        end = max(o + packed.num_keys(r) for r, o in enumerate(regions))
        block_mask = packed.flex_block_mask(kv_offsets=[o - first for o in regions], num_keys=end - first)
        if self._flex is None:
            # Compiled on GPU (fused kernel); eager elsewhere (materialises the scores over the span: tests only).
            if self.device.type == "cuda":
                # Batches differ in which sizes are 1 or happen to be equal (requests, query blocks, bit words), and
                # dynamo compiles a variant for each such pattern (4 over 40 varied batches in a CPU check:
                # benchmarks/check_flex_recompiles.py). Past its limit (8) it would run flex_attention eagerly,
                # materialising every score of the batch: a variant more costs one compile, that costs memory.
                import torch._dynamo as dynamo

                # `recompile_limit` in newer torch, `cache_size_limit` in older
                name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
                setattr(dynamo.config, name, max(getattr(dynamo.config, name), FLEX_RECOMPILE_LIMIT))
                self._flex = torch.compile(flex_attention, dynamic=True)
            else:
                self._flex = flex_attention
        flex = self._flex
        gqa = self.config.num_attention_heads != self.config.num_key_value_heads

        def attend(layer: int, q: torch.Tensor, b: _Batch) -> torch.Tensor:
            num_tokens, nh, hd = q.shape
            pool = self.kv.pool[layer, :, :, first:end].unsqueeze(1)  # [2, 1, kv_heads, end - first, head_dim]
            o = flex(q.transpose(0, 1).unsqueeze(0), pool[0], pool[1], block_mask=block_mask, enable_gqa=gqa)
            return o[0].transpose(0, 1).reshape(num_tokens, nh * hd)

        return attend


FLEX_RECOMPILE_LIMIT = 64


def _is_stored_out_in(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Weight storage for MKL/oneDNN at one row (a decode step streams every weight once): float32 `x @ W` reads
    W faster stored [in, out] when out > in (q/k/v, gate/up, the LM head), and stored [out, in] when out <= in
    (o_proj, down_proj); at 16-32 rows the two are on par. In bfloat16 the [out, in] storage is the faster one for
    every shape (docs/runtime_benchmark.md)."""
    if dtype in (torch.float16, torch.bfloat16):
        return True
    return out_features <= in_features


def _causal_mask(n: int, num_cached: int, device) -> torch.Tensor:
    """[n, num_cached + n] bool: query i sees every cached entry and new tokens 0..i."""
    cols = torch.arange(num_cached + n, device=device)
    rows = torch.arange(n, device=device).unsqueeze(1) + num_cached
    return cols.unsqueeze(0) <= rows


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
            best = float("inf")
            for _ in range(num_repeats):
                start = time.perf_counter()
                runner.verify([seq_id], packed)
                if runner.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
                runner.commit(seq_id, [])
            curve.append((n, best))
        return curve
    finally:
        runner.free(seq_id)


def _has_onednn_linear() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ a oneDNN-packed [out, in] weight (+ bias) -> [N, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
