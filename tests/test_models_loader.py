"""Checkpoint readers: GGUF files written the way llama.cpp writes them read back as the original tensors."""

import json

import numpy as np
import pytest
import torch

from ddtree.models.config import TargetConfig
from ddtree.models.loader import GGUF_TO_HF, read_checkpoint
from ddtree.models.target import TargetModel
from ddtree.models.testing import write_random_target

HF_TO_GGUF = {v: k for k, v in GGUF_TO_HF.items()}


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's convert script: rows of each head regrouped from halves to interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(path, hf_dir, arch):
    import gguf
    from safetensors.torch import load_file

    cfg = TargetConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text()))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "lm_head" or parts[1] in ("embed_tokens", "norm"):
            base = "lm_head" if parts[0] == "lm_head" else f"model.{parts[1]}"
            gname = f"{HF_TO_GGUF[base]}.{parts[-1]}"
        else:
            layer, module = parts[2], ".".join(parts[3:-1])
            gname = f"blk.{layer}.{HF_TO_GGUF[module]}.{parts[-1]}"
        if arch == "llama" and module_is(name, "q_proj"):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif arch == "llama" and module_is(name, "k_proj"):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        writer.add_tensor(gname, np.ascontiguousarray(t.numpy().astype(np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return cfg, tensors


def module_is(name, module):
    return f".{module}." in name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_reads_back_the_original_tensors(tmp_path, arch):
    hf_dir = write_random_target(tmp_path / "hf", model_type=arch)
    cfg, original = write_gguf(tmp_path / "m.gguf", hf_dir, arch)
    read_cfg, read = read_checkpoint(tmp_path / "m.gguf")
    assert read_cfg.model_type == arch and read_cfg.num_key_value_heads == cfg.num_key_value_heads
    assert read_cfg.head_dim == cfg.head_dim and read_cfg.vocab_size == cfg.vocab_size
    assert not read_cfg.tie_word_embeddings  # the file has an output.weight
    assert set(read) == set(original)
    for name, t in original.items():
        assert torch.equal(read[name], t.float()), name
    # and the runner built from the GGUF equals the one built from the folder
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    outs = []
    for source in (hf_dir, tmp_path / "m.gguf"):
        runner = TargetModel.load(source, dtype=torch.float64, max_kv_bytes=2**20)
        runner.kv.allocate(0, 16)
        outs.append(runner.prefill([0], [ids])[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)


def test_unknown_sources_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TargetModel.load(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        TargetModel.load(tmp_path)
