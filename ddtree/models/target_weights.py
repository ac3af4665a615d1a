"""The target's weights as the forward reads them, read from Hugging Face-named tensors and checked against the
config.

    load_target_weights(config, tensors, device, dtype, fuse_as_view) -> TargetWeights
        every layer's matrices fused (q/k/v into one, gate/up into one) and stored [in, out] for `x @ W`; the
        checkpoint's tensors must be exactly those the config describes (a missing, misshapen or unused tensor is
        a ValueError naming it)
    TargetHead       the embedding and the LM head only: what a drafter uses of its target
    feature_bytes_per_token, kv_budget_bytes_per_token    what one token reserves of a runner's `max_kv_bytes`
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.models.config import TargetConfig
from ddtree.models.kv_cache import kv_bytes_per_token

logger = logging.getLogger(__name__)

MATRIX_NAMES = ("w_qkv", "w_o", "w_gate_up", "w_down")


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
    # The four matrices are None once the native CPU ops hold them as panels (ddtree.models.target_ops).


@dataclass
class TargetWeights:
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [H, V]
    embed_tokens: torch.Tensor  # [V, H]; a view of lm_head when the checkpoint ties them (one copy)

    def num_bytes(self) -> int:
        """Bytes of every tensor held (the shared embedding once)."""
        tensors = [self.final_norm, self.lm_head]
        if self.embed_tokens.data_ptr() != self.lm_head.data_ptr():
            tensors.append(self.embed_tokens)
        for lw in self.layers:
            tensors += [x for x in vars(lw).values() if x is not None]
        return sum(x.numel() * x.element_size() for x in tensors)


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


def feature_bytes_per_token(config: TargetConfig, dtype: torch.dtype, num_feature_layers: int) -> int:
    """The features a token keeps for the drafter (hidden states of `num_feature_layers` layers)."""
    return num_feature_layers * config.hidden_size * torch.empty(0, dtype=dtype).element_size()


def kv_budget_bytes_per_token(config: TargetConfig, dtype: torch.dtype, num_feature_layers: int) -> int:
    """What one reserved token takes from a runner's `max_kv_bytes`: its K and V in every layer, and its features."""
    return kv_bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype
    ) + feature_bytes_per_token(config, dtype, num_feature_layers)


def _expected_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Per layer (names after `model.layers.N.`) and for the whole model, what the config says each tensor is."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
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


class _Reader:
    """Takes the checkpoint's tensors by name, each checked against its expected shape and cast to the model's
    device and dtype, and records which were taken."""

    def __init__(self, cfg: TargetConfig, tensors: dict[str, torch.Tensor], device, dtype, fuse_as_view: bool):
        self.tensors, self.device, self.dtype, self.fuse_as_view = tensors, device, dtype, fuse_as_view
        self.shapes = _expected_shapes(cfg)
        self.used: set[str] = set()

    def get(self, name: str) -> torch.Tensor:
        t = self.tensors
        if name not in t:
            raise ValueError(f"checkpoint lacks tensor {name}")
        expected = self.shapes[name.split(".", 3)[-1] if name.startswith("model.layers.") else name]
        if tuple(t[name].shape) != expected:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(t[name].shape)}, the config says "
                f"{expected}: the checkpoint does not match its config.json"
            )
        self.used.add(name)
        return t[name].to(device=self.device, dtype=self.dtype)

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.tensors else None

    def in_out(self, *out_in: torch.Tensor) -> torch.Tensor:
        """[in, sum(out)] for `x @ W`, from [out_i, in] matrices fused along out, stored as `_is_stored_out_in`
        says (as the transposed view of a contiguous [out, in] matrix, or contiguous itself); with `fuse_as_view`
        always the view (no copy: the native ops turn the layer matrices into panels)."""
        fused = torch.cat(out_in, dim=0) if len(out_in) > 1 else out_in[0]
        if self.fuse_as_view or _is_stored_out_in(fused.shape[0], fused.shape[1], self.dtype):
            return fused.contiguous().t()
        return fused.t().contiguous()


def load_target_weights(
    cfg: TargetConfig, tensors: dict[str, torch.Tensor], device, dtype: torch.dtype, fuse_as_view: bool
) -> TargetWeights:
    """The weights from Hugging Face-named tensors ([out, in] as in transformers), checked against `cfg`."""
    read = _Reader(cfg, tensors, device, dtype, fuse_as_view)
    layers = [_layer_weights(cfg, read, i) for i in range(cfg.num_hidden_layers)]
    final_norm = read.get("model.norm.weight")
    stored_head = tensors.get("lm_head.weight")
    head_is_embedding = stored_head is None or (  # compared as stored: a cast may round two equal copies apart
        cfg.tie_word_embeddings
        and "model.embed_tokens.weight" in tensors
        and torch.equal(stored_head, tensors["model.embed_tokens.weight"])
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
        lm_head = read.in_out(read.get("model.embed_tokens.weight"))  # [H, V]
        embed_tokens = lm_head.t()  # [V, H] view: one copy of the shared matrix
        read.used.add("lm_head.weight")  # a tied checkpoint may store the copy too
    else:
        lm_head = read.in_out(read.get("lm_head.weight"))  # [H, V]
        embed_tokens = read.get("model.embed_tokens.weight")  # [V, H]
    # Anything else would be silently ignored: more layers than the config says, other modules. (Rotary frequency
    # buffers that older checkpoints store are recomputed from the config.)
    unused = sorted(n for n in tensors if n not in read.used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(
            f"checkpoint has {len(unused)} tensor(s) that a {cfg.model_type} model with this config "
            f"does not use, e.g. {unused[:3]}: the checkpoint does not match its config.json"
        )
    return TargetWeights(layers, final_norm, lm_head, embed_tokens)


def _layer_weights(cfg: TargetConfig, read: _Reader, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    q, k, v = (read.get(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v"))
    biases = [read.opt(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        raise ValueError(f"layer {i}: q/k/v biases must be all present or all absent")
    return LayerWeights(
        attn_norm=read.get(p + "input_layernorm.weight"),
        w_qkv=read.in_out(q, k, v),  # one GEMM for q, k and v
        b_qkv=torch.cat(biases) if biases[0] is not None else None,
        qk_norm=_qk_norm(cfg, read, p) if cfg.has_qk_norm else None,
        w_o=read.in_out(read.get(p + "self_attn.o_proj.weight")),
        b_o=read.opt(p + "self_attn.o_proj.bias"),
        mlp_norm=read.get(p + "post_attention_layernorm.weight"),
        w_gate_up=read.in_out(read.get(p + "mlp.gate_proj.weight"), read.get(p + "mlp.up_proj.weight")),
        w_down=read.in_out(read.get(p + "mlp.down_proj.weight")),
    )


def _qk_norm(cfg: TargetConfig, read: _Reader, prefix: str) -> torch.Tensor:
    names = [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
    if any(n not in read.tensors for n in names):
        raise ValueError(f"a qwen3 checkpoint needs {names[0]} and {names[1]}")
    q_norm, k_norm = (read.get(n) for n in names)
    return torch.cat([q_norm.expand(cfg.num_attention_heads, -1), k_norm.expand(cfg.num_key_value_heads, -1)])


def _is_stored_out_in(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Weight storage for MKL/oneDNN at one row (a decode step streams every weight once): float32 `x @ W` reads
    W faster stored [in, out] when out > in (q/k/v, gate/up, the LM head), and stored [out, in] when out <= in
    (o_proj, down_proj); at 16-32 rows the two are on par. In bfloat16 the [out, in] storage is the faster one for
    every shape (docs/runtime_benchmark.md)."""
    if dtype in (torch.float16, torch.bfloat16):
        return True
    return out_features <= in_features
