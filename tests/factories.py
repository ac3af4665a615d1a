"""Tiny random checkpoints on disk, in the formats real ones use: a Hugging Face Llama/Qwen3 folder (with a real
character-level tokenizer) and a DFlash drafter folder. Deterministic for a given seed."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_tokenizer import make_char_tokenizer


def make_tiny_target(
    path: Path,
    model_type: str = "llama",
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 64,
    logit_scale: float = 1.0,
    max_position_embeddings: int = 512,
) -> Path:
    """A random tiny causal LM saved with save_pretrained + the char tokenizer. `logit_scale` sharpens the output
    distribution (a larger value makes greedy decoding more repetitive and easier to draft)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = make_char_tokenizer()
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_drafter(
    path: Path,
    target_dir: Path,
    seed: int = 1,
    block_size: int = 8,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
) -> Path:
    """A random DFlash drafter for the tiny target at `target_dir`, in the published checkpoint layout."""
    import json

    from ddtree.models.config import TargetConfig
    from ddtree.models.testing import write_random_dflash

    config = TargetConfig.from_hf_dict(json.loads((target_dir / "config.json").read_text()))
    return write_random_dflash(
        path,
        config,
        num_layers=num_layers,
        block_size=block_size,
        target_layer_ids=target_layer_ids or [0, config.num_hidden_layers - 1],
        mask_token_id=0,  # <unk>: never produced by the char tokenizer
        seed=seed,
    )


def decode_in_random_rounds(tokenizer, tokens: list[int], max_round: int, rng):
    """Feed `tokens` to a Detokenizer in rounds of 1..max_round tokens, as accepted trees deliver them; returns the
    final OutputState and the text each round released."""
    from ddtree.detokenizer import Detokenizer, OutputState
    from ddtree.sampling_params import SamplingParams

    detok = Detokenizer(tokenizer)
    state = OutputState(SamplingParams(max_tokens=len(tokens)), frozenset(), max_new_tokens=len(tokens))
    pieces, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, max_round)
        detok.append(state, tokens[i : i + n])
        pieces.append(Detokenizer.take_new_text(state))
        i += n
    return state, pieces
