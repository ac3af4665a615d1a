"""The target runner against Hugging Face transformers (oracle) and against its own sequential decoding (float64)."""

import pytest
import torch

from ddtree.models.target import TargetModel, measure_batch_cost_curve, measure_verify_cost_curve
from ddtree.models.testing import random_draft_tree, write_random_target
from ddtree.packing import pack

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
FEATURE_LAYERS = [2, 0]  # unsorted on purpose, and the last layer (Hugging Face normalises that one)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {f: write_random_target(root / f, model_type=f, seed=i) for i, f in enumerate(FAMILIES)}


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def hf_logits_and_features(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in FEATURE_LAYERS], dim=-1)
    return out.logits[0], feats


def random_ids(n, gen, vocab=97):
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_hf(checkpoints, family):
    hf = hf_model(checkpoints[family])
    runner = TargetModel.load(checkpoints[family], feature_layer_ids=FEATURE_LAYERS, max_kv_bytes=2**22)
    gen = torch.Generator().manual_seed(0)
    prompts = [random_ids(n, gen) for n in (5, 17, 9)]
    continuations = [random_ids(4, gen) for _ in prompts]
    for s in range(3):
        assert runner.kv.allocate(s, 64) is not None
    last, feats = runner.prefill([0, 1, 2], prompts, max_chunk_tokens=8)  # several chunks, pieces split
    for r, prompt in enumerate(prompts):
        ref_logits, ref_feats = hf_logits_and_features(hf, prompt)
        torch.testing.assert_close(last[r], ref_logits[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats[r], ref_feats, rtol=1e-4, atol=1e-4)
        assert runner.kv.num_committed(r) == len(prompt)
    for step in range(4):
        logits, feats = runner.decode([0, 1, 2], [c[step] for c in continuations])
        for r, prompt in enumerate(prompts):
            ref_logits, ref_feats = hf_logits_and_features(hf, prompt + continuations[r][: step + 1])
            torch.testing.assert_close(logits[r], ref_logits[-1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(feats[r], ref_feats[-1], rtol=1e-4, atol=1e-4)


def path_tokens(tree, root, node):
    """Tokens from the root to `node` (inclusive), root first."""
    out = []
    while node >= 0:
        out.append(int(tree.token_ids[node]))
        node = int(tree.parents[node])
    return [root] + out[::-1]


def make_verify_case(runner, gen, num_requests=3, vocab=97, scattered=False):
    """Prefilled requests with different committed lengths and one random tree (depth <= 4) each. `scattered`:
    their KV regions lie in the pool in reverse order with free slots between them (requests that left)."""
    prompts = [random_ids(n, gen, vocab) for n in (6, 11, 3, 8)[:num_requests]]
    trees = [random_draft_tree(n, 4, vocab, gen) for n in (7, 0, 12, 5)[:num_requests]]
    roots = [int(t) for t in torch.randint(0, vocab, (num_requests,), generator=gen)]
    seq_ids = [10 + r for r in range(num_requests)]
    for s in reversed(seq_ids) if scattered else seq_ids:
        if scattered:
            runner.kv.allocate(100 + s, 37)
        runner.kv.allocate(s, 64)
    if scattered:
        for s in seq_ids:
            runner.kv.free(100 + s)
    runner.prefill(seq_ids, prompts)
    packed = pack(trees, roots, [len(p) for p in prompts])
    return seq_ids, prompts, trees, roots, packed


@pytest.mark.parametrize("gemm", ["native", "onednn"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_verify_matches_hf_on_every_path(checkpoints, family, gemm):
    hf = hf_model(checkpoints[family])
    runner = TargetModel.load(
        checkpoints[family], feature_layer_ids=FEATURE_LAYERS, max_kv_bytes=2**22, cpu_kernels=gemm == "native"
    )
    # float32 on CPU: forwards of several tokens run on the native panel GEMM, or without it (a machine without a
    # C++ compiler) on the oneDNN-packed weights
    if gemm == "native":
        if not runner.uses_cpu_kernels:
            pytest.skip("the native CPU ops could not be built here (no C++ compiler)")
        assert runner.ops.name == "native"
    else:
        assert runner.ops.name == ("onednn" if torch.backends.mkldnn.is_available() else "torch")
    seq_ids, prompts, trees, roots, packed = make_verify_case(runner, torch.Generator().manual_seed(1))
    logits, feats = runner.verify(seq_ids, packed)
    assert logits.shape == (packed.num_tokens, 97) and feats.shape == (packed.num_tokens, 2 * 64)
    for r in range(len(seq_ids)):
        seg = packed.segment(r)
        for local, row in enumerate(range(seg.start, seg.stop)):
            ids = prompts[r] + path_tokens(trees[r], roots[r], local - 1)
            ref_logits, ref_feats = hf_logits_and_features(hf, ids)
            torch.testing.assert_close(logits[row], ref_logits[-1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(feats[row], ref_feats[-1], rtol=1e-4, atol=1e-4)
    # The hidden states alone, then the LM head on chosen rows (one row, several, all)
    for s in seq_ids:
        runner.commit(s, [])
    hidden, hidden_feats = runner.verify(seq_ids, packed, hidden_only=True)
    assert hidden.shape == (packed.num_tokens, 64) and torch.equal(hidden_feats, feats)
    for rows in ([2], [0, 3, 4], list(range(packed.num_tokens))):
        torch.testing.assert_close(runner.lm_head_logits(hidden[rows]), logits[rows], rtol=1e-5, atol=1e-5)


def sequential_logits(runner, prompt, path, seq_id=99):
    """Logits after each token of `path`, fed one decode step at a time after `prompt`."""
    runner.kv.allocate(seq_id, len(prompt) + len(path) + 1)
    try:
        runner.prefill([seq_id], [prompt])
        return torch.stack([runner.decode([seq_id], [t])[0][0] for t in path])
    finally:
        runner.free(seq_id)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_verify_equals_sequential_decoding_float64(checkpoints, attention):
    runner = TargetModel.load(checkpoints["qwen2"], dtype=torch.float64, max_kv_bytes=2**23, attention=attention)
    seq_ids, prompts, trees, roots, packed = make_verify_case(
        runner, torch.Generator().manual_seed(2), 4, scattered=attention == "flex"
    )
    rows = torch.tensor([0, 3, packed.num_tokens - 1])
    logits, _ = runner.verify(seq_ids, packed)
    for r in range(len(seq_ids)):
        seg = packed.segment(r)
        for local, row in enumerate(range(seg.start, seg.stop)):
            path = path_tokens(trees[r], roots[r], local - 1)
            expected = sequential_logits(runner, prompts[r], path)[-1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-10, atol=1e-10)
    # asking for some rows gives exactly those rows
    for s in seq_ids:
        runner.commit(s, [])
    only, _ = runner.verify(seq_ids, packed, logits_rows=rows)
    torch.testing.assert_close(only, logits[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scattered", [False, True])
def test_flex_matches_sdpa(checkpoints, scattered):
    """FlexAttention reads the KV pool in place: requests' regions in batch order and adjacent, or in reverse
    order with free slots between them."""
    results = []
    for attention in ("sdpa", "flex"):
        runner = TargetModel.load(checkpoints["llama"], feature_layer_ids=[1], max_kv_bytes=2**22, attention=attention)
        seq_ids, _, _, _, packed = make_verify_case(runner, torch.Generator().manual_seed(3), scattered=scattered)
        results.append(runner.verify(seq_ids, packed))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)


def test_commit_then_decoding_continues_as_if_only_the_path_was_fed(checkpoints):
    runner = TargetModel.load(checkpoints["qwen3"], dtype=torch.float64, max_kv_bytes=2**23)
    seq_ids, prompts, trees, roots, packed = make_verify_case(runner, torch.Generator().manual_seed(4))
    runner.verify(seq_ids, packed)
    # request 0: accept the deepest node's path; request 1 (empty tree): only the root; request 2: a leaf path
    kept = {}
    for r, tree in enumerate(trees):
        node = int(torch.argmax(tree.depths)) if tree.num_nodes else -1
        chain = []
        while node >= 0:
            chain.append(node + 1)  # local index in the segment
            node = int(tree.parents[node])
        kept[r] = [0] + chain[::-1]
        runner.commit(seq_ids[r], kept[r])
    next_tokens = [5, 6, 7]
    logits, _ = runner.decode(seq_ids, next_tokens)
    for r in range(len(seq_ids)):
        seg_ids = packed.input_ids[packed.segment(r)].tolist()
        fed = [seg_ids[i] for i in kept[r]]
        assert runner.kv.num_committed(seq_ids[r]) == len(prompts[r]) + len(fed) + 1
        expected = sequential_logits(runner, prompts[r], fed + [next_tokens[r]])[-1]
        torch.testing.assert_close(logits[r], expected, rtol=1e-10, atol=1e-10)


def test_greedy_argmax_matches_hf_float64(checkpoints):
    hf = hf_model(checkpoints["llama"], dtype=torch.float64)
    runner = TargetModel.load(checkpoints["llama"], dtype=torch.float64, max_kv_bytes=2**22)
    prompt = random_ids(7, torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    runner.kv.allocate(0, 32)
    logits, _ = runner.prefill([0], [prompt])
    out = [int(logits[0].argmax())]
    for _ in range(11):
        logits, _ = runner.decode([0], [out[-1]])
        out.append(int(logits[0].argmax()))
    assert out == ref


def test_tied_embeddings_and_errors(tmp_path):
    path = write_random_target(tmp_path / "tied", tie_word_embeddings=True)
    hf = hf_model(path)
    runner = TargetModel.load(path, max_kv_bytes=2**20)
    assert runner.embed_tokens.data_ptr() == runner.lm_head.data_ptr()  # one copy of the shared matrix
    ids = random_ids(6, torch.Generator().manual_seed(6))
    runner.kv.allocate(0, 8)
    last, feats = runner.prefill([0], [ids])
    assert feats[0].shape == (6, 0)
    torch.testing.assert_close(last[0], hf_logits_and_features(hf, ids)[0][-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="exceed"):
        runner.prefill([0], [[1, 2, 3]])  # 6 + 3 > 8 allocated slots
    with pytest.raises(ValueError, match="no KV allocation"):
        runner.decode([5], [1])
    with pytest.raises(ValueError, match="feature layer"):
        TargetModel.load(path, feature_layer_ids=[3])
    with pytest.raises(ValueError, match="attention"):
        TargetModel.load(path, attention="paged")


def test_a_checkpoint_that_does_not_match_its_config_is_refused(tmp_path):
    """Fewer layers, another vocabulary size or stray tensors would otherwise load silently as another model."""
    import json

    from safetensors.torch import load_file, save_file

    path = write_random_target(tmp_path / "m")
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    TargetModel.load(path, max_kv_bytes=2**20)  # as written: loads
    for key, value, match in [
        ("num_hidden_layers", config["num_hidden_layers"] - 1, "does not use"),
        ("vocab_size", config["vocab_size"] + 5, "has shape"),
        ("intermediate_size", config["intermediate_size"] * 2, "has shape"),
    ]:
        config_path.write_text(json.dumps(dict(config, **{key: value})))
        with pytest.raises(ValueError, match=match):
            TargetModel.load(path, max_kv_bytes=2**20)
    config_path.write_text(json.dumps(config))
    weights_file = next(path.glob("*.safetensors"))
    tensors = load_file(str(weights_file))
    save_file(dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}), str(weights_file))
    TargetModel.load(path, max_kv_bytes=2**20)  # old checkpoints' rotary buffers are ignored
    save_file(dict(tensors, **{"model.extra_proj.weight": torch.ones(4, 4)}), str(weights_file))
    with pytest.raises(ValueError, match="model.extra_proj.weight"):
        TargetModel.load(path, max_kv_bytes=2**20)
    save_file(tensors, str(weights_file))
    save_file({"model.norm.weight": torch.ones(config["hidden_size"])}, str(path / "old-copy.safetensors"))
    with pytest.raises(ValueError, match="old-copy.safetensors"):  # a name in two files
        TargetModel.load(path, max_kv_bytes=2**20)


def test_failed_reservation_leaves_every_request_usable(checkpoints):
    """A batched prefill where one prompt exceeds its allocation reserves nothing for the others either."""
    runner = TargetModel.load(checkpoints["llama"], dtype=torch.float64, max_kv_bytes=2**20)
    runner.kv.allocate(1, 16)
    runner.kv.allocate(2, 4)
    with pytest.raises(ValueError, match="exceed"):
        runner.prefill([1, 2], [[1, 2, 3], [4, 5, 6, 7, 8]])
    assert runner.kv.handle(1).num_scratch == 0 and runner.kv.num_committed(1) == 0
    last, _ = runner.prefill([1], [[1, 2, 3]])
    torch.testing.assert_close(last[0], sequential_logits(runner, [1, 2], [3])[-1], rtol=1e-10, atol=1e-10)


def test_decoding_continues_after_the_pool_compacts(checkpoints):
    """Requests finishing out of order leave holes; admitting a request that needs them together moves the live
    requests' KV entries, and their decoding continues exactly."""
    runner = TargetModel.load(checkpoints["qwen3"], dtype=torch.float64, max_kv_bytes=2**23)
    slots = runner.kv.num_slots
    gen = torch.Generator().manual_seed(8)
    prompt = random_ids(9, gen)
    sizes = {0: slots // 4, 1: 32, 2: slots // 4, 3: 32}
    for seq_id, size in sizes.items():
        assert runner.kv.allocate(seq_id, size) is not None
    runner.prefill([1, 3], [prompt, prompt[:5]])
    runner.free(0)
    runner.free(2)
    big = slots - 64 - 8  # fits only in the two holes together (and the tail)
    assert max(length for _, length in runner.kv._free) < big
    assert runner.kv.allocate(7, big) is not None
    assert runner.kv.handle(1).slot_start == 0
    logits, _ = runner.decode([1, 3], [11, 12])
    runner.free(7)  # room for the references
    torch.testing.assert_close(
        logits[0], sequential_logits(runner, prompt, [11], seq_id=99)[-1], rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(
        logits[1], sequential_logits(runner, prompt[:5], [12], seq_id=99)[-1], rtol=1e-10, atol=1e-10
    )


def test_verify_cost_curve(checkpoints):
    runner = TargetModel.load(checkpoints["llama"], max_kv_bytes=2**22)
    curve = measure_verify_cost_curve(runner, [1, 4, 16], num_context_tokens=8, num_repeats=1)
    assert [n for n, _ in curve] == [1, 4, 16]
    assert all(s > 0 for _, s in curve)
    assert runner.kv.num_bytes_used == 0  # its scratch request is freed


def test_batch_cost_curve(checkpoints):
    runner = TargetModel.load(checkpoints["llama"], max_kv_bytes=2**22)
    curve = measure_batch_cost_curve(runner, [2, 4, 8], num_context_tokens=8, num_repeats=1)
    assert [r for r, _ in curve] == [2, 4, 8] and all(s > 0 for _, s in curve)
    assert runner.kv.num_bytes_used == 0  # its scratch requests are freed
    # counts past what the free cache holds are left out
    assert runner.kv.allocate(5, runner.kv.num_slots - 3 * 9) is not None  # room for 3 requests of 8 + 1 tokens
    assert [r for r, _ in measure_batch_cost_curve(runner, [2, 4], num_context_tokens=8, num_repeats=1)] == [2]
    assert runner.kv.num_bytes_used == runner.kv.bytes_for(runner.kv.num_slots - 3 * 9)


def test_bfloat16_runs_close_to_float32(checkpoints):
    gen = torch.Generator().manual_seed(7)
    prompt = random_ids(12, gen)
    tree = random_draft_tree(6, 3, 97, gen)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = TargetModel.load(checkpoints["qwen3"], dtype=dtype, feature_layer_ids=[1], max_kv_bytes=2**22)
        runner.kv.allocate(0, 32)
        last, _ = runner.prefill([0], [prompt])
        logits, feats = runner.verify([0], pack([tree], [int(last[0].argmax())], [len(prompt)]))
        assert logits.dtype == feats.dtype == dtype
        results[dtype] = logits.float()
    ref, low = results[torch.float32], results[torch.bfloat16]
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_packed_and_plain_weights_agree(checkpoints):
    """The oneDNN-packed path (several tokens, or one token with several threads) and the plain matrices give the
    same prefill, decode and verify logits within float32 rounding."""
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs = []
            for is_packed in (True, False):
                runner = TargetModel.load(
                    checkpoints["qwen2"],
                    feature_layer_ids=FEATURE_LAYERS,
                    max_kv_bytes=2**22,
                    pack_gemm_weights=is_packed,
                    cpu_kernels=False,
                )
                assert (runner.ops.name == "onednn") == (is_packed and torch.backends.mkldnn.is_available())
                seq_ids, prompts, trees, roots, packed = make_verify_case(runner, torch.Generator().manual_seed(3))
                verify_logits, _ = runner.verify(seq_ids, packed)
                runner.kv.allocate(50, 32)
                prefill_logits, _ = runner.prefill([50], [[5, 9, 13, 2]])
                decode_logits, _ = runner.decode([50], [7])
                outs.append((verify_logits, prefill_logits, decode_logits))
            for a, b in zip(*outs):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_hf(tmp_path, rope_scaling):
    import json

    path = write_random_target(tmp_path / "scaled", model_type="llama", seed=7)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = rope_scaling
    config["rope_theta"] = 500000.0  # long wavelengths: the llama3 rule rescales some, blends others
    (path / "config.json").write_text(json.dumps(config))
    hf = hf_model(path, dtype=torch.float64)
    runner = TargetModel.load(path, dtype=torch.float64, feature_layer_ids=FEATURE_LAYERS, max_kv_bytes=2**22)
    ids = random_ids(120, torch.Generator().manual_seed(1))  # past original_max_position_embeddings
    runner.kv.allocate(0, 128)
    last, feats = runner.prefill([0], [ids])
    ref_logits, ref_feats = hf_logits_and_features(hf, ids)
    # Hugging Face computes the inverse frequencies in float32 (we keep float64): ~1e-6 apart
    torch.testing.assert_close(last[0], ref_logits[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats[0], ref_feats, rtol=1e-5, atol=1e-5)
    unscaled = write_random_target(tmp_path / "plain", model_type="llama", seed=7)
    (unscaled / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))  # the same but for scaling
    plain = TargetModel.load(unscaled, dtype=torch.float64, max_kv_bytes=2**22)
    plain.kv.allocate(0, 128)
    # the scaling matters far beyond that tolerance
    assert (plain.prefill([0], [ids])[0][0] - last[0]).abs().max() > 1e-2
