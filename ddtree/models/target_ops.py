"""The kernels a target forward runs on, chosen once when the model is built.

Matrix ops (`TargetOps`: the layers' linears, RMSNorm, SiLU-and-mul, the LM head), one meaning and three mechanisms:
    NativeOps    the project's CPU ops (ddtree.kernels): the layer matrices become panels for a GEMM that streams
                 them once per forward; every row is computed the same way whatever else is in the batch
    OneDnnOps    torch on CPUs without them: oneDNN-packed copies for forwards of several rows, where torch's
                 default GEMM (MKL) runs far below both bounds (benchmarks/bench_gemm.py)
    TorchOps     torch's own kernels on the plain [in, out] matrices (GPUs, other dtypes)

Attention (`bind(kv, batch, cos, sin)` once per forward, then one call per layer: (q/k norm,) rotary, the new
tokens' KV write, and attention against each request's region of the KV cache):
    NativeAttention   each request's block in one native call (with NativeOps)
    SdpaAttention     per request, PyTorch SDPA with a dense mask (None: causal)
    FlexAttention     the whole batch at once, a block mask from the ancestor bitmasks (verify batches with trees)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.kernels import NO_TENSOR
from ddtree.models.config import TargetConfig
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import rms_norm
from ddtree.models.target_weights import MATRIX_NAMES, LayerWeights, TargetWeights
from ddtree.packing import PackedBatch

FLEX_RECOMPILE_LIMIT = 64

# (layer index, its weights, qkv [N, q + 2 kv]) -> attention output [N, heads * head_dim]
Attend = Callable[[int, LayerWeights, torch.Tensor], torch.Tensor]


@dataclass
class ForwardBatch:
    """Where each request's packed queries are and what they may see; built once per forward."""

    seq_ids: list[int]
    query_starts: list[int]  # [R + 1]
    num_cached: list[int]  # [R]
    masks: list[torch.Tensor | None]  # per request [n_r, num_cached + n_r] bool; None = causal
    slots: torch.Tensor  # [N] pool slot of every packed token's new KV entry
    packed: PackedBatch | None = None  # set for FlexAttention only


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; `weight` [..., dim] may hold one row per head."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return rms_norm(x, weight, eps)  # Hugging Face's float32 round trip
    if weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel
    return F.rms_norm(x, weight.shape[-1:], None, eps) * weight


# ---- matrix ops --------------------------------------------------------------------------------------------------


class TorchOps:
    """torch's kernels on the plain matrices."""

    name = "torch"

    def __init__(self, config: TargetConfig, weights: TargetWeights) -> None:
        self.config, self.weights = config, weights

    def linear(self, x, layer: int, name: str, bias=None, residual=None) -> torch.Tensor:
        """The layer's matrix `name` applied to x [N, in] (+ bias, + residual [N, out]) -> [N, out]."""
        w = getattr(self.weights.layers[layer], name)  # [in, out]
        if residual is not None:
            out = torch.addmm(residual, x, w)  # the residual fused into the GEMM
            return out if bias is None else out + bias
        return x @ w if bias is None else torch.addmm(bias, x, w)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch_rms_norm(x, weight, self.config.rms_norm_eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = self.config.intermediate_size
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def lm_head(self, hidden: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[M, H] final-normed hidden states of a forward of `num_tokens` tokens -> [M, V] logits."""
        return hidden @ self.weights.lm_head

    def weight_bytes(self) -> int:
        """Bytes a forward must read at least once (every weight matrix and norm)."""
        return self.weights.num_bytes()


class OneDnnOps(TorchOps):
    """oneDNN-packed copies of the layer matrices and the LM head beside the plain ones (a second copy of the
    weights). One row on one thread keeps the plain matrices: MKL's GEMV streams them faster there, and does not
    parallelise (benchmarks/bench_gemm.py)."""

    name = "onednn"

    def __init__(self, config: TargetConfig, weights: TargetWeights) -> None:
        super().__init__(config, weights)

        def pack(w_in_out: torch.Tensor) -> torch.Tensor:  # [in, out] (x @ W) -> packed [out, in] (nn.Linear)
            return torch.ops.mkldnn._reorder_linear_weight(w_in_out.t().contiguous())

        self.packed_layers = [{n: pack(getattr(lw, n)) for n in MATRIX_NAMES} for lw in weights.layers]
        self.packed_lm_head = pack(weights.lm_head)

    @staticmethod
    def available() -> bool:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )

    @staticmethod
    def _uses_packed(num_rows: int) -> bool:
        return num_rows > 1 or torch.get_num_threads() > 1

    def linear(self, x, layer: int, name: str, bias=None, residual=None) -> torch.Tensor:
        if not self._uses_packed(x.shape[0]):
            return super().linear(x, layer, name, bias, residual)
        out = _onednn_linear(x, self.packed_layers[layer][name], bias)
        return out if residual is None else residual + out

    def lm_head(self, hidden: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if self._uses_packed(max(hidden.shape[0], num_tokens)):  # (as the forward's layers ran)
            return _onednn_linear(hidden, self.packed_lm_head)
        return super().lm_head(hidden, num_tokens)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ a oneDNN-packed [out, in] weight (+ bias) -> [N, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class PanelLayerWeights:
    """A layer's matrices packed for the native CPU GEMM (`NativeOps.pack`), by name, with their output widths."""

    panels: dict[str, torch.Tensor]
    widths: dict[str, int]


class NativeOps:
    """The native CPU ops. The layer matrices move into panels (their plain copies are dropped); the LM head keeps
    its plain matrix (the embedding, shared with drafters) and gains a panel copy. `weight_dtype` float32: split
    panels on AMX tiles where the CPU and the OS offer them (`ddtree.kernels.split_panels_pay`: each weight to 16
    significant bits, every product exact, float32 sums), else float32 panels; bfloat16: bf16 panels, every product
    on bf16-rounded inputs with float32 sums (bf16 dot products)."""

    name = "native"

    def __init__(self, config: TargetConfig, weights: TargetWeights, ops, weight_dtype: torch.dtype) -> None:
        from ddtree.kernels import pack_panels, pack_split_panels, split_panels_pay

        self.config, self.weights, self.ops, self.weight_dtype = config, weights, ops, weight_dtype
        self.uses_split_panels = weight_dtype == torch.float32 and split_panels_pay()
        bytes_per_weight = 4 if weight_dtype == torch.float32 else 2  # split panels: two bf16 values a weight

        def pack(w: torch.Tensor) -> torch.Tensor:  # [in, out]
            self._panel_bytes += w.numel() * bytes_per_weight
            return pack_split_panels(w) if self.uses_split_panels else pack_panels(w, weight_dtype)

        self._panel_bytes = 0  # the packed matrices' weights, not their zero padding
        self.panel_layers: list[PanelLayerWeights] = []
        for lw in weights.layers:
            matrices = {n: getattr(lw, n) for n in MATRIX_NAMES}  # [in, out]
            self.panel_layers.append(
                PanelLayerWeights(
                    {n: pack(w) for n, w in matrices.items()}, {n: w.shape[1] for n, w in matrices.items()}
                )
            )
            for n in MATRIX_NAMES:
                setattr(lw, n, None)
        self.panel_lm_head = pack(weights.lm_head)

    def linear(self, x, layer: int, name: str, bias=None, residual=None) -> torch.Tensor:
        pl = self.panel_layers[layer]
        return self.ops.panel_linear(
            x.contiguous(),
            pl.panels[name],
            pl.widths[name],
            NO_TENSOR if bias is None else bias.contiguous(),
            NO_TENSOR if residual is None else residual.contiguous(),
        )

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x.contiguous(), weight, self.config.rms_norm_eps)  # 1-D weights only here

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)

    def lm_head(self, hidden: torch.Tensor, num_tokens: int) -> torch.Tensor:
        # every row count on the panels: a row's logits do not depend on the others
        return self.ops.panel_linear(hidden, self.panel_lm_head, self.config.vocab_size, NO_TENSOR, NO_TENSOR)

    def weight_bytes(self) -> int:
        """The plain tensors and the panels' weights (not their zero padding); the LM head counts as its panels."""
        lm_head = self.weights.lm_head
        return self.weights.num_bytes() + self._panel_bytes - lm_head.numel() * lm_head.element_size()


TargetOps = TorchOps | OneDnnOps | NativeOps


# ---- attention ---------------------------------------------------------------------------------------------------


class NativeAttention:
    """Each request's attention block (rotary, KV write, attention; Qwen3's q/k norms included) in one native call,
    faster than SDPA and the torch ops around it at every size measured (1-256 new tokens over 0-2048 cached:
    docs/runtime_benchmark.md)."""

    def __init__(self, config: TargetConfig, ops) -> None:
        self.config, self.ops = config, ops

    def bind(self, kv: KVCache, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> Attend:
        cfg = self.config

        def attend(layer: int, lw: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
            outs = []
            for r, seq_id in enumerate(batch.seq_ids):
                q0, q1 = batch.query_starts[r], batch.query_starts[r + 1]
                k, v = kv.keys_values(seq_id, layer, batch.num_cached[r] + q1 - q0)  # new entries last
                mask = batch.masks[r]
                outs.append(
                    self.ops.attention_block(
                        qkv[q0:q1],
                        cos[q0:q1],
                        sin[q0:q1],
                        k,
                        v,
                        NO_TENSOR if mask is None else mask.contiguous(),
                        cfg.num_attention_heads,
                        NO_TENSOR if lw.qk_norm is None else lw.qk_norm,
                        cfg.rms_norm_eps,
                    )
                )
            return outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, heads * head_dim]

        return attend


class _TorchAttention:
    """torch ops for the q/k norm, rotary and KV write (q and k heads roped together), then `_attention`."""

    def __init__(self, config: TargetConfig) -> None:
        self.config = config

    def bind(self, kv: KVCache, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> Attend:
        cfg = self.config
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size, half = cfg.q_size, cfg.kv_size, hd // 2
        cos = cos.unsqueeze(1)  # [N, 1, head_dim], broadcast over heads
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).unsqueeze(1)  # rotate-half's sign folded
        attention = self._attention(kv, batch)

        def attend(layer: int, lw: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
            num_tokens = qkv.shape[0]
            qk = qkv[:, : q_size + kv_size].view(num_tokens, nh + nkv, hd)
            if lw.qk_norm is not None:  # [nh + nkv, head_dim] weights: q_norm rows then k_norm rows
                qk = torch_rms_norm(qk, lw.qk_norm, cfg.rms_norm_eps)
            swapped = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)
            qk = torch.addcmul(qk * cos, swapped, sin_signed)  # [N, nh + nkv, head_dim]
            pool = kv.pool[layer]  # [2, kv_heads, slots, head_dim]
            pool[0][:, batch.slots] = qk[:, nh:].transpose(0, 1)
            pool[1][:, batch.slots] = qkv[:, q_size + kv_size :].view(num_tokens, nkv, hd).transpose(0, 1)
            return attention(layer, qk[:, :nh])  # [N, heads * head_dim]

        return attend

    def _attention(self, kv: KVCache, batch: ForwardBatch) -> Callable[[int, torch.Tensor], torch.Tensor]:
        raise NotImplementedError


class SdpaAttention(_TorchAttention):
    def _attention(self, kv: KVCache, batch: ForwardBatch) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Per request: its queries against its cached + new entries, dense mask (None = causal)."""
        gqa = self.config.num_attention_heads != self.config.num_key_value_heads

        def attention(layer: int, q: torch.Tensor) -> torch.Tensor:
            num_tokens, nh, hd = q.shape
            out = torch.empty(num_tokens, nh, hd, device=q.device, dtype=q.dtype)
            for r, seq_id in enumerate(batch.seq_ids):
                q0, q1 = batch.query_starts[r], batch.query_starts[r + 1]
                n, num_cached = q1 - q0, batch.num_cached[r]
                k, v = kv.keys_values(seq_id, layer, num_cached + n)  # [kv_heads, T, head_dim]
                # 4-D inputs: the 3-D form takes SDPA's slow math path with GQA
                qr = q[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
                mask = batch.masks[r]
                is_causal = mask is None and n > 1
                if is_causal and num_cached > 0:
                    mask, is_causal = causal_mask(n, num_cached, q.device), False
                o = F.scaled_dot_product_attention(
                    qr, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=is_causal, enable_gqa=gqa
                )  # [1, heads, n, head_dim]
                out[q0:q1] = o[0].transpose(0, 1)
            return out.view(num_tokens, nh * hd)

        return attention


class FlexAttention(_TorchAttention):
    """FlexAttention over the KV pool in place: keys are the pool's slots from the batch's first region to the end of
    its last one, each request's entries read where they lie (no per-layer copy of every request's context), with
    a block mask built once per forward that lists only the blocks of the batch's regions. Compiled on a GPU (a
    fused kernel); eager elsewhere, where it materialises the scores over the span (tests only)."""

    def __init__(self, config: TargetConfig, device: torch.device) -> None:
        super().__init__(config)
        self.device = device
        self._flex = None

    def _kernel(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

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
        return self._flex

    def _attention(self, kv: KVCache, batch: ForwardBatch) -> Callable[[int, torch.Tensor], torch.Tensor]:
        packed = batch.packed
        regions = [kv.handle(s).slot_start for s in batch.seq_ids]
        first = min(regions)
        end = max(o + packed.num_keys(r) for r, o in enumerate(regions))
        block_mask = packed.flex_block_mask(kv_offsets=[o - first for o in regions], num_keys=end - first)
        flex = self._kernel()
        gqa = self.config.num_attention_heads != self.config.num_key_value_heads

        def attention(layer: int, q: torch.Tensor) -> torch.Tensor:
            num_tokens, nh, hd = q.shape
            pool = kv.pool[layer, :, :, first:end].unsqueeze(1)  # [2, 1, kv_heads, end - first, head_dim]
            o = flex(q.transpose(0, 1).unsqueeze(0), pool[0], pool[1], block_mask=block_mask, enable_gqa=gqa)
            return o[0].transpose(0, 1).reshape(num_tokens, nh * hd)

        return attention


def causal_mask(n: int, num_cached: int, device) -> torch.Tensor:
    """[n, num_cached + n] bool: query i sees every cached entry and new tokens 0..i."""
    cols = torch.arange(num_cached + n, device=device)
    rows = torch.arange(n, device=device).unsqueeze(1) + num_cached
    return cols.unsqueeze(0) <= rows
