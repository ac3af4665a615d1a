"""Tiny random checkpoints for tests (ours and the engine's): real Hugging Face folders, loadable by transformers.

write_random_target(path, model_type="llama", seed=0, **sizes) -> Path
    config.json + model.safetensors in the transformers layout; weights drawn with a large enough scale that
    logits differ clearly between tokens (argmax ties would make equality tests vacuous).
write_random_dflash(path, target_config, num_layers=1, block_size=4, target_layer_ids=None, seed=0) -> Path
random_draft_tree(num_nodes, max_depth, vocab_size, generator) -> DraftTree
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.models.config import TargetConfig
from ddtree.tree import DraftTree

TINY_SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def write_random_target(
    path: str | Path, model_type: str = "llama", seed: int = 0, tie_word_embeddings: bool = False, **sizes
) -> Path:
    """A random Llama-family checkpoint folder; `sizes` override TINY_SIZES."""
    s = dict(TINY_SIZES, **sizes)
    config = TargetConfig(
        model_type=model_type,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_ids=[2],
        **s,
    )
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def w(*shape, scale=None):
        fan_in = shape[-1]
        return torch.randn(*shape, generator=gen) * (scale if scale is not None else fan_in**-0.5)

    def norm(n):
        return 1.0 + 0.3 * torch.randn(n, generator=gen)

    t = {"model.embed_tokens.weight": w(config.vocab_size, h, scale=1.0), "model.norm.weight": norm(h)}
    if not tie_word_embeddings:
        t["lm_head.weight"] = w(config.vocab_size, h, scale=2.0 * h**-0.5)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = w(config.q_size, h)
        t[p + "self_attn.k_proj.weight"] = w(config.kv_size, h)
        t[p + "self_attn.v_proj.weight"] = w(config.kv_size, h)
        t[p + "self_attn.o_proj.weight"] = w(h, config.q_size)
        if model_type == "qwen2":
            t[p + "self_attn.q_proj.bias"] = 0.5 * torch.randn(config.q_size, generator=gen)
            t[p + "self_attn.k_proj.bias"] = 0.5 * torch.randn(config.kv_size, generator=gen)
            t[p + "self_attn.v_proj.bias"] = 0.5 * torch.randn(config.kv_size, generator=gen)
        if model_type == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(config.head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(config.head_dim)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
    return _write(path, config.to_hf_dict(), t)


def write_random_dflash(
    path: str | Path,
    target_config: TargetConfig,
    num_layers: int = 1,
    block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
) -> Path:
    """A random DFlash drafter matching `target_config`'s hidden size, in the published layout."""
    from ddtree.models.dflash import DFlashConfig, DFlashDraftModel, build_target_layer_ids, save_dflash

    tc = target_config
    config = DFlashConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta,
        vocab_size=tc.vocab_size,
        max_position_embeddings=tc.max_position_embeddings,
        block_size=block_size,
        num_target_layers=tc.num_hidden_layers,
        mask_token_id=tc.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=target_layer_ids or build_target_layer_ids(tc.num_hidden_layers, num_layers),
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    model.reset_parameters(std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.7, 1.3)
    save_dflash(model, config, path, dtype=torch.float32)
    return Path(path)


def _write(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def random_draft_tree(num_nodes: int, max_depth: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """A random prefix-closed tree in a valid pop order (every parent before its children), depths <= max_depth."""
    parents: list[int] = []
    depths: list[int] = []
    for i in range(num_nodes):
        candidates = [-1] + [j for j in range(i) if depths[j] < max_depth]
        parent = candidates[int(torch.randint(len(candidates), (1,), generator=generator))]
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return DraftTree(
        token_ids=torch.randint(0, vocab_size, (num_nodes,), generator=generator),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor(depths, dtype=torch.int64),
        path_logprobs=torch.zeros(num_nodes),
    )
