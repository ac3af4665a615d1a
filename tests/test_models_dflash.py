import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    build_target_layer_ids,
    load_dflash,
    save_dflash,
)


def tiny_config(**overrides) -> DFlashConfig:
    kw = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=64,
        max_position_embeddings=256,
        block_size=4,
        num_target_layers=6,
        mask_token_id=63,
        target_layer_ids=[1, 3, 4],
    )
    kw.update(overrides)
    return DFlashConfig(**kw)


def make_model(config: DFlashConfig, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).to(torch.float64)
    with torch.no_grad():  # non-trivial norm scales so that a wrong norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


EXPECTED_KEYS_2_LAYERS = {
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    *[
        f"layers.{i}.{name}"
        for i in range(2)
        for name in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
    ],
}


def test_checkpoint_layout_and_roundtrip(tmp_path):
    config = tiny_config()
    model = make_model(config)
    save_dflash(model, config, tmp_path, dtype=torch.float32)

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == EXPECTED_KEYS_2_LAYERS
    assert weights["fc.weight"].shape == (32, 3 * 32)
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    assert weights["layers.0.self_attn.q_norm.weight"].shape == (8,)

    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 3, 4]}
    assert raw["block_size"] == 4 and raw["num_target_layers"] == 6 and raw["head_dim"] == 8

    config2, model2 = load_dflash(tmp_path, dtype=torch.float64)
    assert config2 == config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[name], tensor.to(torch.float32).to(torch.float64))


def test_load_rejects_wrong_keys(tmp_path):
    config = tiny_config()
    save_dflash(make_model(config), config, tmp_path, dtype=torch.float32)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros(64, 32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected"):
        load_dflash(tmp_path)


def test_load_refuses_a_tensor_in_two_files_and_follows_the_index(tmp_path):
    """A stale copy next to the weights would otherwise win or lose by file-name order."""
    import json

    config = tiny_config()
    save_dflash(make_model(config), config, tmp_path, dtype=torch.float32)
    weights = load_file(str(tmp_path / "model.safetensors"))
    name = next(iter(weights))
    save_file({name: torch.zeros_like(weights[name])}, str(tmp_path / "model_best.safetensors"))
    with pytest.raises(ValueError, match="model_best.safetensors"):
        load_dflash(tmp_path)
    # with an index, only the files it names are read
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model.safetensors" for n in weights}})
    )
    _, model = load_dflash(tmp_path)
    assert torch.equal(model.state_dict()[name.removeprefix("model.")], weights[name])


def test_published_config_parses():
    # Trimmed from the Qwen3-4B DFlash drafter's config.json (transformers 4.x layout).
    published = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": 40960,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "vocab_size": 151936,
    }
    config = DFlashConfig.from_dict(published)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.num_target_features == 5 * 2560
    assert config.mask_token_id == 151669 and config.block_size == 16 and config.rope_theta == 1e6
    again = config.to_dict()
    assert again["bos_token_id"] == 151643  # unknown keys survive a round trip
    assert DFlashConfig.from_dict(again) == config
    # transformers 5.x rope layout, block size inside dflash_config
    v5 = {k: v for k, v in published.items() if k not in ("rope_theta", "rope_scaling", "block_size")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000}
    v5["dflash_config"] = dict(published["dflash_config"], block_size=8)
    config5 = DFlashConfig.from_dict(v5)
    assert config5.rope_theta == 1e6 and config5.rope_scaling is None and config5.block_size == 8
    # a null rope_theta beside rope_parameters (transformers 5 writes both keys)
    assert DFlashConfig.from_dict({**v5, "rope_theta": None}).rope_theta == 1e6


def test_build_target_layer_ids_matches_reference_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(30, 3) == [1, 14, 27]


def naive_reference(model: DFlashDraftModel, target_features, block_hidden, block_pos, ctx_pos, mask):
    """An independent, loop-based rendering of the DFlash forward (one sequence, float64)."""
    cfg = model.config
    sd = {k: v for k, v in model.state_dict().items()}
    eps = cfg.rms_norm_eps

    def norm(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [T, heads, d]
        d = x.shape[-1]
        out = torch.empty_like(x)
        for t in range(x.shape[0]):
            for i in range(d // 2):
                theta = pos[t].item() * cfg.rope_theta ** (-2 * i / d)
                c, s = torch.cos(torch.tensor(theta, dtype=x.dtype)), torch.sin(torch.tensor(theta, dtype=x.dtype))
                a, b = x[t, :, i], x[t, :, i + d // 2]
                out[t, :, i] = a * c - b * s
                out[t, :, i + d // 2] = b * c + a * s
        return out

    ctx = norm(target_features @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    h = block_hidden
    s, c = h.shape[0], ctx.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    all_pos = torch.cat([ctx_pos, block_pos])
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = norm((x @ sd[p + "self_attn.q_proj.weight"].T).view(s, nh, hd), sd[p + "self_attn.q_norm.weight"])
        kv_in = torch.cat([ctx, x])
        k = norm((kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(c + s, nkv, hd), sd[p + "self_attn.k_norm.weight"])
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(c + s, nkv, hd)
        q, k = rope(q, block_pos), rope(k, all_pos)
        out = torch.zeros(s, nh, hd, dtype=h.dtype)
        for head in range(nh):
            kvh = head // (nh // nkv)
            scores = q[:, head] @ k[:, kvh].T / hd**0.5  # [S, C + S]
            scores = scores.masked_fill(~mask, float("-inf"))
            out[:, head] = torch.softmax(scores, -1) @ v[:, kvh]
        h = h + out.reshape(s, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        x = norm(h, sd[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ sd[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    return norm(h, sd["norm.weight"])


def test_forward_matches_naive_reference():
    config = tiny_config()
    model = make_model(config)
    torch.manual_seed(1)
    c, s = 7, 4
    feats = torch.randn(1, c, config.num_target_features, dtype=torch.float64)
    block = torch.randn(1, s, config.hidden_size, dtype=torch.float64)
    ctx_pos = torch.arange(c).unsqueeze(0)
    block_pos = torch.arange(c, c + s).unsqueeze(0)
    mask = torch.rand(1, s, c + s) < 0.7
    mask[..., c:] = True  # block bidirectional
    with torch.no_grad():
        out = model(block, model.project_context(feats), block_pos, ctx_pos, mask)
        out_all = model(block, model.project_context(feats), block_pos, ctx_pos, None)
    ref = naive_reference(model, feats[0], block[0], block_pos[0], ctx_pos[0], mask[0])
    ref_all = naive_reference(
        model, feats[0], block[0], block_pos[0], ctx_pos[0], torch.ones(s, c + s, dtype=torch.bool)
    )
    torch.testing.assert_close(out[0], ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out_all[0], ref_all, rtol=1e-10, atol=1e-10)


def test_concatenated_training_blocks_equal_separate_blocks():
    """Several blocks in one forward, each seeing context strictly before its anchor, equal one forward per block."""
    config = tiny_config()
    model = make_model(config)
    torch.manual_seed(2)
    seq_len, bs = 12, config.block_size
    feats = torch.randn(1, seq_len, config.num_target_features, dtype=torch.float64)
    anchors = [3, 7, 9]
    blocks = torch.randn(1, len(anchors) * bs, config.hidden_size, dtype=torch.float64)
    block_pos = torch.tensor([[a + j for a in anchors for j in range(bs)]])
    ctx_pos = torch.arange(seq_len).unsqueeze(0)
    s = blocks.shape[1]
    mask = torch.zeros(1, s, seq_len + s, dtype=torch.bool)
    for b, a in enumerate(anchors):
        rows = slice(b * bs, (b + 1) * bs)
        mask[0, rows, :a] = True
        mask[0, rows, seq_len + b * bs : seq_len + (b + 1) * bs] = True
    with torch.no_grad():
        context = model.project_context(feats)
        together = model(blocks, context, block_pos, ctx_pos, mask)
        for b, a in enumerate(anchors):
            rows = slice(b * bs, (b + 1) * bs)
            alone = model(blocks[:, rows], context[:, :a], block_pos[:, rows], ctx_pos[:, :a], None)
            torch.testing.assert_close(together[:, rows], alone, rtol=1e-10, atol=1e-10)


def test_block_is_bidirectional_and_sees_context():
    config = tiny_config()
    model = make_model(config)
    torch.manual_seed(3)
    context = model.project_context(torch.randn(1, 5, config.num_target_features, dtype=torch.float64))
    block = torch.randn(1, 4, config.hidden_size, dtype=torch.float64)
    pos_b, pos_c = torch.arange(5, 9).unsqueeze(0), torch.arange(5).unsqueeze(0)
    with torch.no_grad():
        base = model(block, context, pos_b, pos_c)
        later = block.clone()
        later[0, 3] += 1.0
        assert not torch.allclose(model(later, context, pos_b, pos_c)[0, 0], base[0, 0])  # pos 0 sees pos 3
        ctx2 = context.clone()
        ctx2[0, 0] += 1.0
        assert not torch.allclose(model(block, ctx2, pos_b, pos_c)[0, 3], base[0, 3])


def test_bad_inputs_raise():
    config = tiny_config()
    model = make_model(config)
    with pytest.raises(ValueError, match="width"):
        model.project_context(torch.zeros(1, 2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        model(
            torch.zeros(1, 4, 32, dtype=torch.float64),
            torch.zeros(1, 2, 32, dtype=torch.float64),
            torch.zeros(1, 4, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long),
            torch.ones(1, 4, 4, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict(
            {
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "vocab_size": 8,
                "dflash_config": {},
            }
        )
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        DFlashConfig.from_dict(
            {
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "vocab_size": 8,
                "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0]},
            }
        )
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        DFlashConfig.from_dict(
            {
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "hidden_act": "gelu",
                "num_attention_heads": 1,
                "vocab_size": 8,
                "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0]},
            }
        )


def test_a_drafter_grown_by_layers_computes_what_it_grew_from():
    from ddtree.training.train import grow_drafter

    small = make_model(tiny_config(num_hidden_layers=2), seed=0)
    grown = make_model(tiny_config(num_hidden_layers=4, block_size=8), seed=5)
    grow_drafter(grown, small, "small")
    torch.manual_seed(2)
    c, s = 6, 4
    feats = torch.randn(1, c, small.config.num_target_features, dtype=torch.float64)
    block = torch.randn(1, s, small.config.hidden_size, dtype=torch.float64)
    args = (torch.arange(c, c + s).unsqueeze(0), torch.arange(c).unsqueeze(0), None)
    with torch.no_grad():
        expected = small(block, small.project_context(feats), *args)
        got = grown(block, grown.project_context(feats), *args)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert grown.layers[3].mlp.gate_proj.weight.abs().sum() > 0  # the new layers still learn (only outputs are 0)
    with pytest.raises(ValueError, match="more than"):
        grow_drafter(make_model(tiny_config(num_hidden_layers=1)), small, "small")
    with pytest.raises(ValueError, match="does not match the drafter being trained: intermediate_size"):
        grow_drafter(make_model(tiny_config(num_hidden_layers=4, intermediate_size=64)), small, "small")


def test_a_drafter_grown_by_target_layers_computes_what_it_grew_from():
    """Conditioned on more target layers (init's among them, in another order of the features), the grown drafter's
    context is init's on init's layers whatever the new layers hold, and it learns from them (fc's new columns get
    a gradient)."""
    from ddtree.training.train import grow_drafter

    small = make_model(tiny_config(target_layer_ids=[1, 3, 4]), seed=0)
    grown = make_model(tiny_config(target_layer_ids=[0, 1, 2, 3, 4, 5], num_hidden_layers=3), seed=5)
    grow_drafter(grown, small, "small")
    torch.manual_seed(2)
    c, s, h = 6, 4, small.config.hidden_size
    per_layer = torch.randn(1, c, 6, h, dtype=torch.float64)  # the target's hidden states at layers 0..5
    small_feats = per_layer[:, :, [1, 3, 4]].flatten(2)
    grown_feats = per_layer.flatten(2)
    block = torch.randn(1, s, h, dtype=torch.float64)
    args = (torch.arange(c, c + s).unsqueeze(0), torch.arange(c).unsqueeze(0), None)
    with torch.no_grad():
        expected = small(block, small.project_context(small_feats), *args)
        got = grown(block, grown.project_context(grown_feats), *args)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)  # (fc sums more terms, zeros among them)
    grown.train()
    grown(block, grown.project_context(grown_feats), *args).square().sum().backward()
    new_columns = torch.cat([grown.fc.weight.grad[:, j * h : (j + 1) * h] for j in (0, 2, 5)], dim=1)
    assert new_columns.abs().sum() > 0
    with pytest.raises(ValueError, match="must condition on all of them"):
        grow_drafter(make_model(tiny_config(target_layer_ids=[0, 1, 3])), small, "small")
    with pytest.raises(ValueError, match=r"being trained: dflash_config \{'mask_token_id': 63\} there"):
        grow_drafter(make_model(tiny_config(target_layer_ids=[1, 2, 3, 4], mask_token_id=5)), small, "small")
