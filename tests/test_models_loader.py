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


def write_gguf(path, hf_dir, arch, extra=None, with_feed_forward_length=True):
    import gguf
    from safetensors.torch import load_file

    cfg = TargetConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text()))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    if with_feed_forward_length:
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
    if extra is not None:
        extra(writer)
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


def test_gguf_rope_scaling_and_end_tokens(tmp_path):
    import gguf

    hf_dir = write_random_target(tmp_path / "hf", model_type="llama")

    def linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
        writer.add_eot_token_id(7)  # Llama 3's <|eot_id|>: generation must stop there too

    write_gguf(tmp_path / "linear.gguf", hf_dir, "llama", linear)
    cfg, _ = read_checkpoint(tmp_path / "linear.gguf")
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfg.eos_token_ids == [2, 7]

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32768)

    write_gguf(tmp_path / "yarn.gguf", hf_dir, "llama", yarn)
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        read_checkpoint(tmp_path / "yarn.gguf")

    write_gguf(tmp_path / "incomplete.gguf", hf_dir, "llama", with_feed_forward_length=False)
    with pytest.raises(ValueError, match="lacks llama.feed_forward_length"):
        read_checkpoint(tmp_path / "incomplete.gguf")


def _config(hf_dir):
    return json.loads((hf_dir / "config.json").read_text())


def test_unsupported_checkpoints_fail_before_loading(tmp_path):
    hf_dir = write_random_target(tmp_path / "hf", model_type="qwen2")
    config = _config(hf_dir)
    with pytest.raises(ValueError, match="quantized checkpoints \\(fp8\\)"):
        TargetConfig.from_hf_dict({**config, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        TargetConfig.from_hf_dict({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh' is not supported"):
        TargetConfig.from_hf_dict({**config, "hidden_act": "gelu_pytorch_tanh"})  # (Gemma's: not a Llama MLP)
    assert TargetConfig.from_hf_dict({**config, "hidden_act": "swish"}) == TargetConfig.from_hf_dict(config)
    incomplete = {k: v for k, v in config.items() if k not in ("intermediate_size", "vocab_size")}
    with pytest.raises(ValueError, match="lacks vocab_size, intermediate_size"):
        TargetConfig.from_hf_dict(incomplete)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(4, 4, dtype=torch.int32)
    save_file(tensors, str(hf_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="not floating point"):
        read_checkpoint(hf_dir)


def test_sharded_folder_reads_the_files_its_index_names(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_dir = write_random_target(tmp_path / "hf", model_type="qwen2")
    original = load_file(str(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors").unlink()
    names = sorted(original)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: original[k] for k in keys}, str(hf_dir / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # Mistral's repos also hold the weights in their own format; a stale extra file must not be merged in either
    save_file({"junk": torch.zeros(3)}, str(hf_dir / "consolidated.safetensors"))
    save_file({"lm_head.weight": torch.zeros(2)}, str(hf_dir / "stale.safetensors"))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    cfg, read = read_checkpoint(hf_dir)
    assert set(read) == set(original) and all(torch.equal(read[k], original[k]) for k in original)
    assert cfg.eos_token_ids[0] == _config(hf_dir)["eos_token_id"] and 5 in cfg.eos_token_ids
    assert len(set(cfg.eos_token_ids)) == len(cfg.eos_token_ids)
    (hf_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        read_checkpoint(hf_dir)


def test_mistral_without_a_sliding_window_key_has_transformers_default_window(tmp_path):
    """transformers' MistralConfig gives a config.json without `sliding_window` a 4096-token window (null: none);
    a Mistral config the project writes says null rather than leaving the key out."""
    config = _config(write_random_target(tmp_path / "m", model_type="mistral"))
    assert "sliding_window" in config and config["sliding_window"] is None
    assert TargetConfig.from_hf_dict(config).sliding_window is None
    no_key = {k: v for k, v in config.items() if k != "sliding_window"}
    assert TargetConfig.from_hf_dict(no_key).sliding_window == 4096
    assert TargetConfig.from_hf_dict({**no_key, "model_type": "llama"}).sliding_window is None


def test_a_tied_config_with_a_different_stored_head_uses_that_head(tmp_path):
    """As transformers does (it warns and does not tie): a fine-tune that trained the head but kept the config tied
    must give the stored head's logits, not the embedding's."""
    hf_dir = write_random_target(tmp_path / "hf", model_type="llama")  # untied, its own random lm_head
    prompt = [3, 1, 4, 1, 5]

    def logits():
        model = TargetModel.load(hf_dir, dtype=torch.float64)
        model.kv.allocate(0, 16)
        return model.prefill([0], [prompt])[0]

    untied = logits()
    (hf_dir / "config.json").write_text(json.dumps({**_config(hf_dir), "tie_word_embeddings": True}))
    assert torch.equal(logits(), untied)


def test_a_tied_checkpoint_storing_both_copies_shares_one_matrix_in_any_dtype(tmp_path, caplog):
    """Equal copies as stored are tied whatever the load dtype (a cast to bfloat16 must not make them "differ":
    a second vocabulary x hidden matrix and a false warning)."""
    import logging

    from safetensors.torch import load_file, save_file

    hf_dir = write_random_target(tmp_path / "hf", model_type="llama", tie_word_embeddings=True)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(hf_dir / "model.safetensors"))
    for dtype in (torch.float32, torch.bfloat16):
        with caplog.at_level(logging.WARNING, logger="ddtree.models.target_weights"):
            model = TargetModel.load(hf_dir, dtype=dtype)
        assert model.lm_head.untyped_storage().data_ptr() == model.embed_tokens.untyped_storage().data_ptr()
        assert "differs" not in caplog.text
