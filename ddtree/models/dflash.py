"""The DFlash block-diffusion drafter, in the published checkpoint layout (z-lab/dflash `DFlashDraftModel`).

A few Qwen3-style decoder layers of the target's hidden size, with no embedding and no LM head of their own (the
target's `embed_tokens` and `lm_head` are used, frozen). Conditioning: the target's hidden states of
`target_layer_ids` (hidden_states[i + 1], concatenated along the feature dim) are projected by `fc` then
`hidden_norm`; in every layer, keys and values are concat(proj(context), proj(block)) with k_norm and rotary
embedding applied to both, queries come from the block only. The projected context is the same input for every
layer (it is not transformed by the layers), so its per-layer K/V can be cached across drafts.

Block input: position 0 holds the last committed token, positions 1..L `mask_token_id`; the output at block
position k predicts the token at position k (no shift). Block positions continue the target's positions.

Public API:
    DFlashConfig.from_dict(d) / .to_dict()               config.json layout (architectures ["DFlashDraftModel"])
    DFlashDraftModel(config)                              nn.Module, weights named as in the checkpoints
      .project_context(target_features [B, C, F]) -> [B, C, H]
      .context_kv(context [B, C, H], context_positions [B, C]) -> per layer (k, v) [B, C, kv_heads, head_dim]
      .forward(block_hidden [B, S, H], context [B, C, H], block_positions [B, S], context_positions [B, C],
               attention_mask [B, S, C + S] bool or None) -> [B, S, H] (after the final norm)
      .forward_with_context_kv(block_hidden, context_kv, block_positions, attention_mask) -> [B, S, H]
      .forward_with_attention(block_hidden, block_positions, attends: one per layer) -> [B, S, H]
    attend_with_context(context_k, context_v, attention_mask) -> a layer's attention function (BlockAttention:
        (q [B, S, heads, head_dim], block k, v [B, S, kv_heads, head_dim]) -> [B, S, heads, head_dim])
    save_dflash(model, config, path, dtype=torch.bfloat16)   config.json + model.safetensors
    load_dflash(path, device="cpu", dtype=torch.float32) -> (config, model)
    build_target_layer_ids(num_target_layers, num_draft_layers) -> list[int]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.config import check_sizes_and_activation, read_rope
from ddtree.models.layers import RMSNorm, Rotary, apply_rope

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
# dflash_config keys of newer reference drafters that change the draft, with the value that changes nothing
DFLASH_NEUTRAL_SCALINGS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference default: one layer -> [T // 2]; else evenly spread over 1..T-3."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise ValueError("num_target_layers and num_draft_layers must be positive")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    num_target_layers: int | None
    mask_token_id: int
    target_layer_ids: list[int]
    rope_scaling: dict | None = None
    extra: dict = field(default_factory=dict)  # other config.json keys (bos/eos ids...), written back unchanged

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor plus at least one mask), got {self.block_size}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} out of range for {self.num_target_layers} layers"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a token id of the target's vocabulary "
                f"(0..{self.vocab_size - 1})"
            )

    @property
    def num_target_features(self) -> int:
        """Input width of `fc`: one target hidden state per target layer id."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        """Parse a DFlash config.json (both the transformers 4.x and 5.x rope layouts)."""
        archs = d.get("architectures") or []
        if archs and ARCHITECTURE not in archs:
            raise ValueError(f"not a DFlash drafter config: architectures={archs}")
        if d.get("attention_bias", False):
            raise ValueError("DFlash drafters with attention_bias are not supported")
        if "sliding_attention" in (d.get("layer_types") or []) and d.get("use_sliding_window", False):
            raise ValueError("DFlash drafters with sliding-window layers are not supported")
        check_sizes_and_activation(d, "the drafter's config.json")
        dflash = d.get("dflash_config") or {}
        if "mask_token_id" not in dflash:
            raise ValueError("config.json lacks dflash_config.mask_token_id")
        # Newer DFlash drafters may scale the block's input embeddings or the draft logits: not implemented here, so
        # such a drafter is refused rather than drafted with the wrong scaling.
        scalings = {
            key: dflash[key]
            for key, neutral in DFLASH_NEUTRAL_SCALINGS.items()
            if dflash.get(key) not in (None, neutral)
        }
        if scalings:
            raise ValueError(f"DFlash drafters with {scalings} in dflash_config are not supported")
        num_layers = int(d["num_hidden_layers"])
        num_target_layers = d.get("num_target_layers")
        target_layer_ids = dflash.get("target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ValueError("config.json needs dflash_config.target_layer_ids or num_target_layers")
            target_layer_ids = build_target_layer_ids(int(num_target_layers), num_layers)
        rope_theta, rope_scaling = read_rope(d)
        known = {
            "architectures",
            "model_type",
            "attention_bias",
            "attention_dropout",
            "block_size",
            "dflash_config",
            "head_dim",
            "hidden_act",
            "hidden_size",
            "intermediate_size",
            "layer_types",
            "max_position_embeddings",
            "max_window_layers",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "num_target_layers",
            "rms_norm_eps",
            "rope_scaling",
            "rope_theta",
            "rope_parameters",
            "sliding_window",
            "use_sliding_window",
            "vocab_size",
            "dtype",
            "torch_dtype",
            "tie_word_embeddings",
            "use_cache",
            "initializer_range",
            "auto_map",
            "transformers_version",
        }
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            vocab_size=int(d["vocab_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            block_size=int(d.get("block_size", dflash.get("block_size", 16))),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in target_layer_ids],
            rope_scaling=rope_scaling,
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """The config.json layout of the published DFlash checkpoints (a Qwen3 config plus the DFlash keys)."""
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            # as the published checkpoints: transformers' AutoModel (trust_remote_code) builds the drafter from their
            # modeling file dflash.py, placed next to this config, instead of silently building a plain Qwen3Model
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": str(dtype).removeprefix("torch."),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": self.rope_scaling,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        d.update(self.extra)
        return d


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, T, kv_heads, head_dim], k normed and rotated (what a KV cache holds)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H], already input-normed
        cos: torch.Tensor,  # [B, S, head_dim] at the block positions
        sin: torch.Tensor,
        attend: BlockAttention,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)), cos, sin)
        block_k, block_v = self.project_kv(x, cos, sin)
        out = attend(q, block_k, block_v)  # [B, S, heads, head_dim]
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))


# The block's attention over its context and itself: (q [B, S, heads, head_dim], the block's own k and v [B, S,
# kv_heads, head_dim]) -> [B, S, heads, head_dim]. Where the context's keys and values live is the caller's: given
# per layer (`attend_with_context`, training and the generic forward), or a serving cache read in place.
BlockAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend_with_context(
    context_k: torch.Tensor,  # [B, C, kv_heads, head_dim]
    context_v: torch.Tensor,  # [B, C, kv_heads, head_dim]
    attention_mask: torch.Tensor | None,  # [B, S, C + S] bool, True = may attend; None = all
) -> BlockAttention:
    """Attention over the given context keys/values followed by the block's own (one SDPA call, masked)."""

    def attend(q: torch.Tensor, block_k: torch.Tensor, block_v: torch.Tensor) -> torch.Tensor:
        k = torch.cat([context_k, block_k], dim=1).transpose(1, 2)  # [B, kv_heads, C + S, head_dim]
        v = torch.cat([context_v, block_v], dim=1).transpose(1, 2)
        mask = None if attention_mask is None else attention_mask.unsqueeze(1)  # [B, 1, S, C + S]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[1]
        )  # [B, heads, S, head_dim]
        return out.transpose(1, 2)

    return attend


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, attend: BlockAttention):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.num_target_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Not a buffer: the checkpoint holds no rotary tables.
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Hugging Face's initialisation for training from scratch: N(0, std) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[B, C, len(target_layer_ids) * hidden] target hidden states -> [B, C, hidden] drafter context."""
        if target_features.shape[-1] != self.config.num_target_features:
            raise ValueError(
                f"target features have width {target_features.shape[-1]}, expected {self.config.num_target_features}"
            )
        return self.hidden_norm(self.fc(target_features))

    def context_kv(
        self, context: torch.Tensor, context_positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [B, C, kv_heads, head_dim] of the projected context at its positions."""
        cos, sin = self.rotary.cos_sin(context_positions, context.dtype)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def forward_with_context_kv(
        self,
        block_hidden: torch.Tensor,  # [B, S, H]
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [B, C, kv_heads, head_dim]
        block_positions: torch.Tensor,  # [B, S]
        attention_mask: torch.Tensor | None = None,  # [B, S, C + S] bool
    ) -> torch.Tensor:
        """[B, S, H] final-normed block states, keys/values of the context given per layer."""
        if len(context_kv) != len(self.layers):
            raise ValueError(f"context_kv has {len(context_kv)} layers, model has {len(self.layers)}")
        return self.forward_with_attention(
            block_hidden, block_positions, [attend_with_context(k, v, attention_mask) for k, v in context_kv]
        )

    def forward_with_attention(
        self, block_hidden: torch.Tensor, block_positions: torch.Tensor, attends: list[BlockAttention]
    ) -> torch.Tensor:
        """[B, S, H] final-normed block states, each layer's attention over its context given as a function."""
        cos, sin = self.rotary.cos_sin(block_positions, block_hidden.dtype)
        h = block_hidden
        for layer, attend in zip(self.layers, attends, strict=True):
            h = layer(h, cos, sin, attend)
        return self.norm(h)

    def forward(
        self,
        block_hidden: torch.Tensor,  # [B, S, H] target embeddings of the block tokens
        context: torch.Tensor,  # [B, C, H] projected context (project_context)
        block_positions: torch.Tensor,  # [B, S]
        context_positions: torch.Tensor,  # [B, C]
        attention_mask: torch.Tensor | None = None,  # [B, S, C + S] bool, True = may attend; None = all
    ) -> torch.Tensor:
        """[B, S, H] after the final norm; apply the target's lm_head for logits.

        For training, S may hold several blocks of one sequence with a mask that lets each block see its own
        tokens and the context strictly before its anchor.
        """
        b, s, _ = block_hidden.shape
        c = context.shape[1]
        if attention_mask is not None and tuple(attention_mask.shape) != (b, s, c + s):
            raise ValueError(f"attention_mask must have shape {(b, s, c + s)}, got {tuple(attention_mask.shape)}")
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError("attention_mask must be a bool tensor (True = may attend)")
        return self.forward_with_context_kv(
            block_hidden, self.context_kv(context, context_positions), block_positions, attention_mask
        )


def expected_weight_names(config: DFlashConfig) -> list[str]:
    """Exactly the tensor names of a DFlash checkpoint for this config."""
    names = ["norm.weight", "fc.weight", "hidden_norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        names += [p + f"self_attn.{n}_norm.weight" for n in ("q", "k")]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def save_dflash(
    model: DFlashDraftModel, config: DFlashConfig, path: str | Path, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write config.json and model.safetensors in the published layout."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(config.to_dict(dtype), indent=2) + "\n")


def load_dflash(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[DFlashConfig, DFlashDraftModel]:
    """Read a DFlash checkpoint folder (config.json + model.safetensors or sharded safetensors)."""
    from ddtree.models.loader import read_weight_files, safetensors_files

    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise ValueError(f"{path} has no {CONFIG_NAME}: not a DFlash checkpoint folder")
    config = DFlashConfig.from_dict(json.loads((path / CONFIG_NAME).read_text()))
    files = safetensors_files(path)  # those the index names when there is one
    # Some exports keep the wrapper prefix; the tensors are the same.
    state = read_weight_files(files, rename=lambda name: name.removeprefix("model."))
    expected = set(expected_weight_names(config))
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"DFlash checkpoint {path} does not match its config: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}"
        )
    model = DFlashDraftModel(config)
    model.load_state_dict(state)
    return config, model.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------------------------------------------
# Draft vocabulary (optional, next to the checkpoint)
#
# The drafter shares the target's LM head, and on a CPU that head is most of a draft's cost: for SmolLM2 it is a
# [576, 49152] matrix (113 MB in float32) read for every drafted position. A drafter only learns to predict the
# tokens it saw as labels in training, so computing its logits over those tokens alone loses (almost) nothing and
# makes the head several times cheaper (the frequency-ranked draft vocabulary of FR-Spec / EAGLE-3's draft vocab).
# It is a serving-time choice, not part of the DFlash layout: `draft_vocab.json` holds the target token ids in
# decreasing training frequency, with where they came from; a folder without it drafts over the full vocabulary.

DRAFT_VOCAB_NAME = "draft_vocab.json"


def save_draft_vocab(path: str | Path, token_ids: list[int], **provenance) -> Path:
    """Write `draft_vocab.json` into a drafter folder; `token_ids` must be distinct non-negative ints."""
    token_ids = [int(t) for t in token_ids]
    if not token_ids or len(set(token_ids)) != len(token_ids) or min(token_ids) < 0:
        raise ValueError("a draft vocabulary needs distinct non-negative token ids")
    out = Path(path) / DRAFT_VOCAB_NAME
    out.write_text(json.dumps({"num_tokens": len(token_ids), **provenance, "token_ids": token_ids}) + "\n")
    return out


def load_draft_vocab(path: str | Path, vocab_size: int) -> list[int] | None:
    """The draft vocabulary of a drafter folder (None when it has none), checked against the target's vocab."""
    file = Path(path) / DRAFT_VOCAB_NAME
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    token_ids = data.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError(f"{file} has no 'token_ids' list")
    if len(set(token_ids)) != len(token_ids) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"{file}: token ids must be distinct integers in [0, {vocab_size})")
    return token_ids


def draft_vocab_from_counts(counts: dict[int, int], max_size: int, required: tuple[int, ...] = ()) -> list[int]:
    """The `max_size` most frequent tokens (ties by id), plus `required` ones (e.g. EOS) if they are missing."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:max_size]
    chosen = set(ranked)
    return ranked + [t for t in required if t not in chosen]
