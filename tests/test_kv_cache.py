import pytest
import torch

from ddtree.models.kv_cache import KVCache


def make_cache(num_slots=100, dtype=torch.float64):
    per_token = 2 * 2 * 1 * 4 * torch.empty(0, dtype=dtype).element_size()  # layers * (k, v) * heads * head_dim
    return KVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_bytes=num_slots * per_token, dtype=dtype)


def test_byte_accounting_and_admission():
    cache = make_cache(100)
    assert cache.num_slots == 100 and cache.bytes_per_token == 2 * 2 * 4 * 8
    a = cache.allocate(1, 60)
    assert a is not None and a.num_bytes == 60 * cache.bytes_per_token
    assert cache.num_bytes_used == a.num_bytes and cache.num_bytes_free == 40 * cache.bytes_per_token
    assert cache.allocate(2, 41) is None  # does not fit: the scheduler queues it
    assert cache.allocate(2, 40) is not None
    assert cache.allocate(3, 1) is None
    with pytest.raises(ValueError, match="already"):
        cache.allocate(1, 1)
    with pytest.raises(ValueError, match="positive"):
        cache.allocate(9, 0)
    assert cache.free(1) and not cache.free(1)
    assert cache.allocate(3, 60) is not None  # freed range reused
    cache.free(2)
    cache.free(3)
    assert cache.num_bytes_used == 0
    assert cache.allocate(4, 100) is not None  # free ranges merged back into one


def fill_scratch(cache, seq_id, n):
    """Write recognisable values: entry j of the scratch holds j + 100 * committed."""
    base = cache.handle(seq_id).num_committed
    first = cache.reserve_scratch(seq_id, n)
    values = torch.arange(n, dtype=cache.dtype) + 100 * base
    cache.pool[:, :, :, first : first + n] = values.view(1, 1, 1, n, 1)
    return values


def test_commit_moves_kept_entries_contiguously():
    cache = make_cache(100)
    cache.allocate(0, 30)
    cache.allocate(1, 30)
    fill_scratch(cache, 0, 5)
    cache.commit_all(0)
    other = fill_scratch(cache, 1, 4)
    cache.commit_all(1)
    scratch = fill_scratch(cache, 0, 8)  # a verify segment: root + 7 nodes
    cache.commit(0, [0, 2, 5, 6])
    assert cache.num_committed(0) == 9
    k, v = cache.keys_values(0, 1, 9)
    assert k.shape == (1, 9, 4)
    expected = torch.cat([torch.arange(5, dtype=cache.dtype), scratch[[0, 2, 5, 6]]])
    assert torch.equal(k[0, :, 0], expected) and torch.equal(v[0, :, 3], expected)
    k1, _ = cache.keys_values(1, 0, 4)  # the neighbour is untouched
    assert torch.equal(k1[0, :, 0], other)


def test_commit_many_equals_one_commit_per_request_and_checks_all_first():
    """A verify pass's commit for every request in one copy: the same pool and counts as one commit per request
    (regions adjacent, so the moves of neighbours would collide if the copy were not gathered first); a bad keep
    list for any request commits none of them."""
    keeps = {1: [0, 2, 5], 2: [0, 1, 2], 3: [0], 4: [0, 3]}
    caches = [make_cache(100), make_cache(100)]
    for cache in caches:
        for seq_id in keeps:
            cache.allocate(seq_id, 20)
            fill_scratch(cache, seq_id, 3)
            cache.commit_all(seq_id)
            fill_scratch(cache, seq_id, 6)
    for seq_id, keep in keeps.items():
        caches[0].commit(seq_id, keep)
    before = caches[1].pool.clone()
    written = torch.zeros(100, dtype=torch.bool)
    for seq_id in keeps:
        written[caches[1].handle(seq_id).slot_start : caches[1].handle(seq_id).slot_start + 9] = True
    with pytest.raises(ValueError, match="increasing"):
        caches[1].commit_many(list(keeps), [keeps[1], keeps[2], [3, 1], keeps[4]])
    with pytest.raises(ValueError, match="twice"):
        caches[1].commit_many([1, 1], [[0], [0]])
    assert torch.equal(caches[1].pool[..., written, :], before[..., written, :])
    assert all(caches[1].handle(s).num_committed == 3 and caches[1].handle(s).num_scratch == 6 for s in keeps)
    caches[1].commit_many(list(keeps), list(keeps.values()))
    for seq_id in keeps:  # the 9 slots written in each region (the others were never written)
        start = caches[1].handle(seq_id).slot_start
        assert torch.equal(caches[1].pool[..., start : start + 9, :], caches[0].pool[..., start : start + 9, :])
    for seq_id, keep in keeps.items():
        h = caches[1].handle(seq_id)
        assert (h.num_committed, h.num_scratch) == (3 + len(keep), 0)
        expected = torch.tensor(keep, dtype=torch.float64) + 300
        assert torch.equal(caches[1].keys_values(seq_id, 1, h.num_committed)[0][0, 3:, 0], expected)


def test_commit_validation_and_overflow():
    cache = make_cache(100)
    cache.allocate(0, 10)
    cache.reserve_scratch(0, 4)
    for bad in ([1, 1], [2, 1], [4], [-1, 0]):
        with pytest.raises(ValueError, match="increasing"):
            cache.commit(0, bad)
    cache.commit(0, [])  # drop everything: nothing committed
    assert cache.num_committed(0) == 0
    cache.reserve_scratch(0, 10)
    cache.commit_all(0)
    with pytest.raises(ValueError, match="exceed"):
        cache.reserve_scratch(0, 1)
    with pytest.raises(ValueError, match="no KV allocation"):
        cache.num_committed(5)


def test_window_limit_and_tiny_budget():
    with pytest.raises(ValueError, match="holds no token"):
        KVCache(2, 1, 4, max_bytes=10)
    cache = KVCache(2, 1, 4, max_bytes=10**6, max_tokens_per_request=16)
    with pytest.raises(ValueError, match="exactly"):
        cache.allocate(0, 17)
    assert cache.max_request_tokens == 16  # the window, not the pool
    small = KVCache(2, 1, 4, max_bytes=small_bytes(10))
    assert small.max_request_tokens == small.num_slots == 10  # the pool, when no window
    assert small.allocate(0, 10) is not None and small.allocate(1, 1) is None


def small_bytes(num_tokens: int) -> int:
    return num_tokens * 2 * 2 * 1 * 4 * 4  # layers x (k, v) x kv_heads x head_dim x float32 bytes


@pytest.mark.parametrize("chunk", [256, 2, 5])  # regions moved in one copy, or in chunks overlapping their target
def test_holes_too_small_are_compacted_and_entries_kept(chunk, monkeypatch):
    """Requests of different sizes finishing out of order leave free slots split into holes: a request that fits
    in all free slots is still admitted (the live regions slide together, their entries with them)."""
    monkeypatch.setattr("ddtree.models.kv_cache.COMPACT_CHUNK_TOKENS", chunk)
    cache = make_cache(1000)
    for seq_id, size in enumerate([300, 100, 300, 100, 200]):
        assert cache.allocate(seq_id, size) is not None
    kept = {}
    for seq_id in (1, 3, 4):
        kept[seq_id] = fill_scratch(cache, seq_id, 7)
        cache.commit_all(seq_id)
    fill_scratch(cache, 4, 3)  # uncommitted scratch moves too
    cache.free(0)
    cache.free(2)  # 600 slots free, in two holes of 300
    assert cache.num_bytes_free == 600 * cache.bytes_per_token
    assert cache.allocate(9, 601) is None  # more than is free: queued, nothing moved
    assert [cache.handle(s).slot_start for s in (1, 3, 4)] == [300, 700, 800]
    handle = cache.allocate(9, 500)
    assert handle is not None and handle.slot_start == 400
    assert [cache.handle(s).slot_start for s in (1, 3, 4)] == [0, 100, 200]
    for seq_id, values in kept.items():
        k, v = cache.keys_values(seq_id, 1, 7)
        assert torch.equal(k[0, :, 0], values) and torch.equal(v[0, :, 3], values)
    assert cache.handle(4).num_scratch == 3
    first = cache.handle(4).slot_start + 7
    assert torch.equal(cache.pool[0, 0, 0, first : first + 3, 0], torch.arange(3, dtype=cache.dtype) + 700)
    assert cache.allocate(10, 100) is not None and cache.allocate(11, 1) is None  # exactly full


def test_extra_bytes_per_token_are_counted_in_the_budget():
    """Memory the runner keeps per token outside the pool (features waiting for the drafter) comes out of the same
    budget: fewer slots, and each reservation costs the sum."""
    kv_only = make_cache(100)
    per_token = kv_only.bytes_per_token
    cache = KVCache(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        max_bytes=100 * per_token,
        dtype=torch.float64,
        extra_bytes_per_token=per_token,
    )  # features as large as the KV entries
    assert cache.kv_bytes_per_token == per_token and cache.bytes_per_token == 2 * per_token
    assert cache.num_slots == 50 and cache.pool.shape[3] == 50
    assert cache.allocate(0, 50).num_bytes == 100 * per_token and cache.allocate(1, 1) is None


def test_the_runner_counts_its_features_in_the_kv_budget(tmp_path):
    from ddtree.models.target import TargetModel
    from ddtree.models.testing import write_random_target

    path = write_random_target(tmp_path / "t")
    plain = TargetModel.load(path, max_kv_bytes=2**20)
    with_features = TargetModel.load(path, max_kv_bytes=2**20, feature_layer_ids=[0, 1])
    feature_bytes = with_features.feature_dim * 4
    assert with_features.kv.bytes_per_token == plain.kv.bytes_per_token + feature_bytes
    assert with_features.kv.num_slots == 2**20 // (plain.kv.bytes_per_token + feature_bytes)


@pytest.mark.parametrize("chunk", [256, 4, 7])
def test_compaction_by_less_than_a_region_keeps_its_entries(chunk, monkeypatch):
    """A region moving down by fewer slots than it holds: source and target overlap."""
    monkeypatch.setattr("ddtree.models.kv_cache.COMPACT_CHUNK_TOKENS", chunk)
    cache = make_cache(100)
    cache.allocate(0, 5)
    cache.allocate(1, 60)
    values = fill_scratch(cache, 1, 30)
    cache.commit_all(1)
    cache.free(0)  # 5 slots at the start, 35 at the end: 40 free, no hole of 40
    assert cache.allocate(2, 40) is not None and cache.handle(1).slot_start == 0
    k, v = cache.keys_values(1, 0, 30)
    assert torch.equal(k[0, :, 0], values) and torch.equal(v[0, :, 2], values)


def test_the_runner_resizes_its_empty_kv_cache(tmp_path):
    """A GPU target's cache is sized once its weights are loaded (`load_target_worker`): resized in place while
    empty, refused while it holds a request."""
    from ddtree.models.target import TargetModel
    from ddtree.models.testing import write_random_target

    runner = TargetModel.load(write_random_target(tmp_path / "t"), max_kv_bytes=2**16)
    per_token = runner.kv.bytes_per_token
    assert runner.kv.num_slots == 2**16 // per_token
    runner.resize_kv_cache(2**20)
    assert runner.kv.num_slots == 2**20 // per_token and runner.kv.bytes_per_token == per_token
    runner.kv.allocate(1, 8)
    with pytest.raises(ValueError, match="resized empty"):
        runner.resize_kv_cache(2**18)
    assert runner.kv.num_slots == 2**20 // per_token and 1 in runner.kv


def test_a_failed_resize_keeps_the_kv_cache(tmp_path):
    from ddtree.models.target import TargetModel
    from ddtree.models.testing import write_random_target

    runner = TargetModel.load(write_random_target(tmp_path / "t"), max_kv_bytes=2**16)
    before = runner.kv
    with pytest.raises(ValueError, match="holds no token"):
        runner.resize_kv_cache(8)
    assert runner.kv is before
