"""The serving-time drafter (cached context, batched draft) against the generic DFlash forward on the full context."""

import pytest
import torch

from ddtree.drafter import DFlashDrafter
from ddtree.models.target import TargetModel
from ddtree.models.testing import write_random_dflash, write_random_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target_dir = write_random_target(root / "target", model_type="qwen3", num_hidden_layers=4)
    target = TargetModel.load(target_dir, dtype=torch.float64, feature_layer_ids=[1, 2], max_kv_bytes=2**22)
    drafter_dir = write_random_dflash(
        root / "drafter", target.config, num_layers=2, block_size=5, target_layer_ids=[1, 2]
    )
    return target, drafter_dir


def reference_logprobs(drafter, features, last_token, start_position):
    """Generic forward over the whole context at once: log-probs [L, V] at block positions 1..L."""
    cfg = drafter.config
    model = drafter.model
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id)
    ids[0, 0] = last_token
    n = features.shape[0]
    with torch.no_grad():
        h = model(
            drafter.target.embed(ids),
            model.project_context(features.unsqueeze(0)),
            torch.arange(start_position, start_position + cfg.block_size).unsqueeze(0),
            torch.arange(n).unsqueeze(0),
        )
        return torch.log_softmax(drafter.target.project_logits(h[0, 1:]), dim=-1)


@pytest.mark.parametrize("in_place", [True, False])
def test_draft_equals_generic_forward_on_full_context(pair, in_place):
    """Both attention mechanisms: per request over its cache in place (CPUs), one padded batch (GPUs)."""
    target, drafter_dir = pair
    drafter = DFlashDrafter.load(drafter_dir, target)
    drafter.attends_in_place = in_place
    assert drafter.block_len == 4
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 3, 14]
    features = [torch.randn(n, 2 * 64, generator=gen, dtype=torch.float64) for n in lengths]
    for r, f in enumerate(features):  # in pieces, as after prefill and then verifies
        drafter.add_context(f"req{r}", f[:2])
        drafter.add_context(f"req{r}", f[2:])
    seq_ids, last = ["req0", "req1", "req2"], [5, 17, 42]
    values, indices = drafter.draft(seq_ids, last, max_k=6)
    assert values.shape == indices.shape == (3, 4, 6)
    for r, f in enumerate(features):
        ref = reference_logprobs(drafter, f, last[r], lengths[r])
        top = torch.topk(ref, 6, dim=-1)
        torch.testing.assert_close(values[r], top.values.float(), rtol=1e-6, atol=1e-6)
        assert torch.equal(indices[r], top.indices)
        alone_v, alone_i = drafter.draft([seq_ids[r]], [last[r]], max_k=6)  # the unpadded path
        torch.testing.assert_close(alone_v[0], values[r], rtol=1e-6, atol=1e-6)
        assert torch.equal(alone_i[0], indices[r])


def test_context_from_target_prefill_and_free(pair):
    target, drafter_dir = pair
    drafter = DFlashDrafter.load(drafter_dir, target)
    target.kv.allocate(7, 32)
    try:
        prompt = [3, 9, 27, 81 % 97, 50, 60]
        last_logits, feats = target.prefill([7], [prompt])
        drafter.add_context(7, feats[0])
        assert drafter.context_len(7) == len(prompt)
        root = int(last_logits[0].argmax())
        values, indices = drafter.draft([7], [root], max_k=3)
        ref = torch.topk(reference_logprobs(drafter, feats[0], root, len(prompt)), 3, dim=-1)
        assert torch.equal(indices[0], ref.indices)
        # explicit positions: continuing at 6, 7 is the same as the default
        extra = torch.randn(2, 128, dtype=torch.float64)
        drafter.add_context(7, extra, positions=torch.tensor([6, 7]))
        after_v, _ = drafter.draft([7], [root], max_k=3)
        ref2 = torch.topk(reference_logprobs(drafter, torch.cat([feats[0], extra]), root, 8), 3, dim=-1)
        torch.testing.assert_close(after_v[0], ref2.values.float(), rtol=1e-6, atol=1e-6)
        assert drafter.num_cache_bytes > 0
        assert drafter.free(7) and not drafter.free(7)
        with pytest.raises(ValueError, match="no drafter context"):
            drafter.draft([7], [root], max_k=3)
    finally:
        target.free(7)


def test_contexts_of_several_requests_in_one_projection(pair):
    """`add_contexts` (one projection for every request's new tokens) gives each request the context that
    `add_context` one request at a time gives, including a request new to the drafter, an empty extension and
    explicit positions; a bad request in the batch leaves every context as it was."""
    target, drafter_dir = pair
    one_by_one, batched = DFlashDrafter.load(drafter_dir, target), DFlashDrafter.load(drafter_dir, target)
    gen = torch.Generator().manual_seed(4)
    for d in (one_by_one, batched):
        d.add_context("a", torch.randn(5, 128, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    for step in range(3):
        feats = [torch.randn(n, 128, generator=gen, dtype=torch.float64) for n in (2, 0, 3, 70)]
        ids = ["a", "b", "c", "d"]  # "b" empty, then new; "d" crosses its capacity
        positions = [None, None, torch.arange(10 * step, 10 * step + 3), None]
        for seq_id, f, p in zip(ids, feats, positions):
            one_by_one.add_context(seq_id, f, p)
        batched.add_contexts(ids, feats, positions)
    for seq_id in ("a", "b", "c", "d"):
        assert batched.context_len(seq_id) == one_by_one.context_len(seq_id)
        assert batched._get(seq_id).next_position == one_by_one._get(seq_id).next_position
    v1, i1 = one_by_one.draft(["a", "c", "d"], [1, 2, 3], max_k=4)
    v2, i2 = batched.draft(["a", "c", "d"], [1, 2, 3], max_k=4)
    torch.testing.assert_close(v2, v1, rtol=1e-12, atol=1e-12)
    assert torch.equal(i1, i2)
    lengths = {s: batched.context_len(s) for s in ("a", "c")}
    for bad in ([torch.zeros(2, 128, dtype=torch.float64), torch.zeros(2, 7, dtype=torch.float64)],):
        with pytest.raises(ValueError, match="features must be"):
            batched.add_contexts(["a", "e"], bad)
    with pytest.raises(ValueError, match="twice"):
        batched.add_contexts(["a", "a"], [torch.zeros(1, 128, dtype=torch.float64)] * 2)
    batched.add_contexts(["a", "f"], [torch.zeros(0, 0), torch.zeros(0, 128)])  # no rows (the actors' empty pick)
    assert batched.context_len("f") == 0 and batched.context_len("a") == lengths["a"]
    batched.free("f")
    with pytest.raises(ValueError, match="positions"):
        batched.add_contexts(["a", "c"], [torch.zeros(1, 128, dtype=torch.float64)] * 2, [None, [1, 2]])
    assert {s: batched.context_len(s) for s in ("a", "c")} == lengths
    assert "e" not in batched._contexts


def test_context_capacity_grows(pair):
    target, drafter_dir = pair
    drafter = DFlashDrafter.load(drafter_dir, target)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(150, 128, generator=gen, dtype=torch.float64)
    for i in range(0, 150, 10):  # crosses the initial capacity several times
        drafter.add_context("r", feats[i : i + 10])
    values, indices = drafter.draft(["r"], [4], max_k=2)
    ref = torch.topk(reference_logprobs(drafter, feats, 4, 150), 2, dim=-1)
    torch.testing.assert_close(values[0], ref.values.float(), rtol=1e-6, atol=1e-6)


def test_mismatched_target_layers_rejected(pair, tmp_path):
    target, _ = pair
    other = write_random_dflash(tmp_path / "d", target.config, num_layers=1, target_layer_ids=[0, 3])
    with pytest.raises(ValueError, match="feature_layer_ids"):
        DFlashDrafter.load(other, target)
    drafter = DFlashDrafter.load(write_random_dflash(tmp_path / "e", target.config, target_layer_ids=[1, 2]), target)
    with pytest.raises(ValueError, match="features must be"):
        drafter.add_context("x", torch.zeros(3, 5, dtype=torch.float64))


def _edit_config(folder, edit) -> None:
    import json

    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_a_drafter_made_for_another_target_is_refused(pair, tmp_path):
    """Another vocabulary, another target depth, or scalings of newer reference drafters that are not implemented:
    refused when loading (a drafter for another target would draft nothing the target accepts, without a word)."""
    target, _ = pair
    cases = {
        "vocabulary size 5000 != target vocabulary size": lambda c: {**c, "vocab_size": 5000},
        "made for a target of 36 layers": lambda c: {**c, "num_target_layers": 36},
        "'output_multiplier': 0.5": lambda c: {**c, "dflash_config": {**c["dflash_config"], "output_multiplier": 0.5}},
    }
    for i, (message, edit) in enumerate(cases.items()):
        folder = write_random_dflash(tmp_path / str(i), target.config, target_layer_ids=[1, 2])
        _edit_config(folder, edit)
        with pytest.raises(ValueError, match=message):
            DFlashDrafter.load(folder, target)
    neutral = write_random_dflash(tmp_path / "neutral", target.config, target_layer_ids=[1, 2])
    _edit_config(neutral, lambda c: {**c, "dflash_config": {**c["dflash_config"], "input_embedding_scale": 1.0}})
    DFlashDrafter.load(neutral, target)


def test_measure_draft_cost(pair):
    target, drafter_dir = pair
    drafter = DFlashDrafter.load(drafter_dir, target)
    curve = drafter.measure_draft_cost([1, 3], max_k=4, num_context_tokens=8, num_repeats=1)
    assert [b for b, _ in curve] == [1, 3] and all(s > 0 for _, s in curve)
    assert drafter.num_cache_bytes == 0


def test_drafter_on_the_target_head_alone(pair):
    """A drafter on its own actor holds only the target's embedding and LM head; its drafts are the same."""
    target, drafter_dir = pair
    head = target.head()
    assert head.embed_tokens.data_ptr() == target.embed_tokens.data_ptr()  # shared, not copied
    feats = torch.randn(5, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    results = []
    for t in (target, head):
        drafter = DFlashDrafter.load(drafter_dir, t)
        drafter.add_context("r", feats)
        results.append(drafter.draft(["r"], [11], max_k=4))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    assert torch.equal(results[0][1], results[1][1])


def test_draft_vocabulary_restricts_the_head(pair, tmp_path):
    """With draft_vocab.json the drafter proposes only those tokens, with the log-softmax over them: its top-k is
    the full distribution's restricted and renormalised; without the file (or use_draft_vocab=False) the full one."""
    import shutil

    from ddtree.models.dflash import DRAFT_VOCAB_NAME, draft_vocab_from_counts, load_dflash, save_draft_vocab

    target, drafter_dir = pair
    folder = tmp_path / "with_vocab"
    shutil.copytree(drafter_dir, folder)
    vocab = draft_vocab_from_counts({7: 3, 3: 9, 40: 9, 11: 1, 90: 2}, max_size=4, required=(1,))
    assert vocab == [3, 40, 7, 90, 1]  # by frequency, ties by id, required ones appended
    save_draft_vocab(folder, vocab, source="test")
    feats = torch.randn(6, 128, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    full = DFlashDrafter.load(folder, target, use_draft_vocab=False)
    restricted = DFlashDrafter.load(folder, target)
    assert full.draft_token_ids is None and restricted.draft_token_ids.tolist() == vocab
    for d in (full, restricted):
        d.add_context("r", feats)
    full_values, full_ids = full.draft(["r"], [11], max_k=target.config.vocab_size)
    values, ids = restricted.draft(["r"], [11], max_k=8)
    assert ids.shape == (1, 4, 5)  # max_k is capped by the draft vocabulary's size
    for pos in range(4):
        in_vocab = [(v, t) for v, t in zip(full_values[0, pos].tolist(), full_ids[0, pos].tolist()) if t in vocab]
        assert ids[0, pos].tolist() == [t for _, t in in_vocab]  # same order as the full distribution
        expected = torch.tensor([v for v, _ in in_vocab], dtype=torch.float64)
        torch.testing.assert_close(
            values[0, pos].double(), expected - torch.logsumexp(expected, 0), rtol=1e-6, atol=1e-6
        )
    config, model = load_dflash(drafter_dir, dtype=torch.float64)
    with pytest.raises(ValueError, match="distinct"):
        DFlashDrafter(config, model, target, torch.device("cpu"), torch.float64, draft_token_ids=[3, 3])
    (folder / DRAFT_VOCAB_NAME).write_text('{"token_ids": [1, 1]}')
    with pytest.raises(ValueError, match="distinct"):
        DFlashDrafter.load(folder, target)
    with pytest.raises(ValueError, match="distinct"):
        save_draft_vocab(folder, [2, 2])
