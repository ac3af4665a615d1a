"""Packing draft trees into one verify batch: ids, positions, and masks against hand-drawn trees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask, flex_attention

from ddtree.packing import pack
from ddtree.tree import DraftTree, build_tree


def tree_of(tokens: list[int], parents: list[int]) -> DraftTree:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return DraftTree(
        token_ids=torch.tensor(tokens),
        parents=torch.tensor(parents),
        depths=torch.tensor(depths),
        path_logprobs=-torch.arange(len(tokens), dtype=torch.float32),
    )


#   root ─┬─ n0(10) ─┬─ n2(12) ── n4(14)
#         │          └─ n3(13)
#         └─ n1(11) ─── n5(15)
DEPTH3 = tree_of([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 2, 1])
# Segment offsets: 0 = root, 1 + i = node i. Row: may the token see column (ancestor or itself)?
DEPTH3_MASK = torch.tensor(
    [
        # r  n0 n1 n2 n3 n4 n5
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # n0
        [1, 0, 1, 0, 0, 0, 0],  # n1
        [1, 1, 0, 1, 0, 0, 0],  # n2
        [1, 1, 0, 0, 1, 0, 0],  # n3
        [1, 1, 0, 1, 0, 1, 0],  # n4
        [1, 0, 1, 0, 0, 0, 1],  # n5
    ],
    dtype=torch.bool,
)


def ancestor_mask_by_walking(tree: DraftTree) -> torch.Tensor:
    n = tree.num_nodes + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    parents = tree.parents.tolist()
    for i in range(n):
        mask[i, 0] = True
        node = i - 1
        while node >= 0:
            mask[i, node + 1] = True
            node = parents[node]
    return mask


def test_hand_drawn_depth3_tree_and_two_other_requests() -> None:
    chain = tree_of([20, 21], [-1, 0])
    packed = pack([DEPTH3, DraftTree.empty(), chain], root_token_ids=[7, 8, 9], num_cached=[5, 3, 0])

    assert packed.query_starts == [0, 7, 8, 11]
    assert packed.num_tokens == 11 and packed.num_requests == 3
    assert packed.input_ids.tolist() == [7, 10, 11, 12, 13, 14, 15, 8, 9, 20, 21]
    assert packed.depths.tolist() == [0, 1, 1, 2, 2, 3, 2, 0, 0, 1, 2]
    assert packed.position_ids.tolist() == [5, 6, 6, 7, 7, 8, 7, 3, 0, 1, 2]
    assert packed.seq_index.tolist() == [0] * 7 + [1] + [2] * 3
    assert packed.node_index.tolist() == [-1, 0, 1, 2, 3, 4, 5, -1, -1, 0, 1]
    assert packed.local_parents.tolist() == [-1, 0, 0, 1, 1, 3, 2, -1, -1, 0, 1]

    assert torch.equal(packed.tree_mask(0), DEPTH3_MASK)
    assert torch.equal(packed.tree_mask(1), torch.ones(1, 1, dtype=torch.bool))
    assert torch.equal(packed.tree_mask(2), torch.tril(torch.ones(3, 3, dtype=torch.bool)))

    # Dense SDPA masks: all cached entries, then the tree mask.
    assert torch.equal(packed.dense_mask(0), torch.cat([torch.ones(7, 5, dtype=torch.bool), DEPTH3_MASK], 1))
    assert torch.equal(packed.dense_mask(1), torch.ones(1, 4, dtype=torch.bool))  # autoregressive: sees all
    assert torch.equal(packed.dense_mask(2), torch.tril(torch.ones(3, 3, dtype=torch.bool)))  # nothing cached

    # FlexAttention: queries = packed tokens, keys = per request (cached entries, segment tokens).
    assert packed.kv_starts() == [0, 12, 16, 19]
    flex = create_mask(packed.flex_mask_mod(), 1, 1, packed.num_tokens, packed.kv_starts()[-1], device="cpu")[0, 0]
    expected = torch.block_diag(*[packed.dense_mask(r) for r in range(packed.num_requests)])
    assert torch.equal(flex, expected)


def test_trees_beyond_one_bit_word() -> None:
    """Segments longer than 64 tokens use several words per row, including the sign bit of each word."""
    g = torch.Generator().manual_seed(0)
    trees = [build_tree(torch.log_softmax(torch.randn(6, 30, generator=g), -1), budget) for budget in (200, 63, 64, 1)]
    packed = pack(trees, root_token_ids=[1, 2, 3, 4], num_cached=[0, 17, 4, 9])
    assert packed.ancestor_bits.shape == (packed.num_tokens, 4)
    for r, tree in enumerate(trees):
        assert torch.equal(packed.tree_mask(r), ancestor_mask_by_walking(tree))
        seg = packed.segment(r)
        assert torch.equal(packed.input_ids[seg][1:], tree.token_ids)
        assert torch.equal(packed.position_ids[seg], packed.num_cached[r] + packed.depths[seg])
    flex = create_mask(packed.flex_mask_mod(), 1, 1, packed.num_tokens, packed.kv_starts()[-1], device="cpu")[0, 0]
    assert torch.equal(flex, torch.block_diag(*[packed.dense_mask(r) for r in range(packed.num_requests)]))


def test_only_autoregressive_requests() -> None:
    packed = pack([DraftTree.empty(), DraftTree.empty()], root_token_ids=[5, 6], num_cached=[2, 0])
    assert packed.input_ids.tolist() == [5, 6]
    assert packed.position_ids.tolist() == [2, 0]
    assert packed.local_parents.tolist() == [-1, -1]
    assert torch.equal(packed.dense_mask(0), torch.ones(1, 3, dtype=torch.bool))


def test_bad_batches_are_rejected() -> None:
    import pytest

    with pytest.raises(ValueError):
        pack([], [], [])
    with pytest.raises(ValueError):
        pack([DEPTH3], [1, 2], [0])


def mask_from_blocks(block_mask, num_queries: int, num_keys: int) -> torch.Tensor:
    """[Q, K] bool: what FlexAttention computes with this BlockMask: partial blocks through the mask_mod, full
    blocks whole, unlisted blocks not at all."""
    size = block_mask.BLOCK_SIZE[0]
    q = torch.arange(num_queries)
    k = torch.arange(num_keys)
    by_mod = block_mask.mask_mod(0, 0, q[:, None], k[None, :])
    out = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for qb in range(block_mask.kv_num_blocks.shape[-1]):
        rows = slice(qb * size, (qb + 1) * size)
        for counts, indices, is_full in (
            (block_mask.kv_num_blocks, block_mask.kv_indices, False),
            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True),
        ):
            for kb in indices[0, 0, qb, : int(counts[0, 0, qb])].tolist():
                cols = slice(kb * size, (kb + 1) * size)
                out[rows, cols] = True if is_full else by_mod[rows, cols]
    return out


def test_flex_block_mask_from_the_layout_is_the_exact_mask() -> None:
    """The BlockMask built from host integers gives FlexAttention exactly the ancestor mask: no visible key in an
    unlisted block, full blocks all visible; small blocks so that query blocks hold one or many requests."""
    g = torch.Generator().manual_seed(5)
    num_full = 0
    for case in range(12):
        num_requests = 1 + case % 5
        trees = [
            build_tree(
                torch.log_softmax(torch.randn(5, 20, generator=g), -1), int(torch.randint(0, 40, (1,), generator=g))
            )
            for _ in range(num_requests)
        ]
        num_cached = torch.randint(0, 70, (num_requests,), generator=g).tolist()
        packed = pack(trees, list(range(num_requests)), num_cached)
        compact = torch.block_diag(*[packed.dense_mask(r) for r in range(num_requests)])
        # the compact layout, and a pool's: regions in shuffled order with free slots between and after them
        lens = [c + packed.segment_len(r) for r, c in enumerate(num_cached)]
        gaps = torch.randint(0, 20, (num_requests + 1,), generator=g).tolist()
        offsets, end = [0] * num_requests, 0
        for r, gap in zip(torch.randperm(num_requests, generator=g).tolist(), gaps):
            offsets[r], end = end + gap, end + gap + lens[r]
        num_keys = end + gaps[-1]
        pooled = torch.zeros(packed.num_tokens, num_keys, dtype=torch.bool)
        for r in range(num_requests):
            pooled[packed.segment(r), offsets[r] : offsets[r] + lens[r]] = packed.dense_mask(r)
        for layout, expected in (({}, compact), ({"kv_offsets": offsets, "num_keys": num_keys}, pooled)):
            for block_size in (8, 16, 128):
                block_mask = packed.flex_block_mask(block_size, **layout)
                got = mask_from_blocks(block_mask, *expected.shape)
                assert torch.equal(got, expected), (case, block_size, layout)
                num_full += int(block_mask.full_kv_num_blocks.sum())
    assert num_full > 0  # the cases exercise full blocks too


def test_flex_key_layout_is_checked() -> None:
    packed = pack([DraftTree.empty(), DraftTree.empty()], [1, 2], [3, 4])  # key ranges of 4 and 5
    assert packed.key_layout() == ([0, 4], 9)
    assert packed.key_layout([10, 0], 20) == ([10, 0], 20)
    for offsets, num_keys in (([0], 20), ([0, 3], 20), ([4, 0], 20), ([0, 16], 20), ([-1, 10], 20)):
        with pytest.raises(ValueError):
            packed.key_layout(offsets, num_keys)


def test_flex_block_mask_skips_other_requests_blocks() -> None:
    """Sparsity: one request per query block sees only its own key blocks."""
    trees = [DraftTree.empty()] * 3
    packed = pack(trees, [1, 2, 3], [40, 40, 40])
    block_mask = packed.flex_block_mask(1)  # one query per block
    counts = (block_mask.kv_num_blocks + block_mask.full_kv_num_blocks)[0, 0].tolist()
    assert counts == [41, 41, 41]
    assert block_mask.full_kv_num_blocks[0, 0].tolist() == [40, 40, 40]


def test_compiled_flex_attention_with_the_layout_block_mask_equals_sdpa() -> None:
    """The fused kernel (torch.compile, as the runner uses on GPUs; here its CPU form) reads only the listed blocks:
    with the layout's BlockMask it equals SDPA with the dense masks, query blocks of one request (full blocks) and of
    several alike."""
    g = torch.Generator().manual_seed(6)
    trees = [build_tree(torch.log_softmax(torch.randn(6, 30, generator=g), -1), b) for b in (200, 0, 17, 9, 5)]
    packed = pack(trees, [1, 2, 3, 4, 5], [300, 5, 129, 0, 260])  # two query blocks: inductor's CPU template
    # fails to compile for a single one (torch 2.13)
    num_keys = packed.kv_starts()[-1]
    q = torch.randn(1, 4, packed.num_tokens, 64, generator=g)
    k = torch.randn(1, 2, num_keys, 64, generator=g)
    v = torch.randn(1, 2, num_keys, 64, generator=g)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.block_diag(*[packed.dense_mask(r) for r in range(5)]), enable_gqa=True
    )
    block_mask = packed.flex_block_mask()  # 128, the runner's (a fresh compile at 16 trips an inductor CPU bug)
    assert int(block_mask.full_kv_num_blocks.sum()) > 0 and int(block_mask.kv_num_blocks.sum()) > 0
    flex = torch.compile(flex_attention, dynamic=False)  # dynamic shapes trip an inductor CPU codegen bug
    torch.testing.assert_close(flex(q, k, v, block_mask=block_mask, enable_gqa=True), expected, rtol=1e-5, atol=1e-5)

    # The runner's form: keys and values a strided view of a pool [2, kv_heads, slots, head_dim] whose regions lie
    # in reverse order with zeroed free slots between them
    kv_starts, offsets, end = packed.kv_starts(), [0] * 5, 50
    pool = torch.zeros(2, 2, 1500, 64)
    for r in reversed(range(5)):
        offsets[r] = end
        pool[0, :, end : end + kv_starts[r + 1] - kv_starts[r]] = k[0, :, kv_starts[r] : kv_starts[r + 1]]
        pool[1, :, end : end + kv_starts[r + 1] - kv_starts[r]] = v[0, :, kv_starts[r] : kv_starts[r + 1]]
        end += kv_starts[r + 1] - kv_starts[r] + 7
    view = pool[:, :, 50:end].unsqueeze(1)  # [2, 1, kv_heads, keys, head_dim], not contiguous
    block_mask = packed.flex_block_mask(kv_offsets=[o - 50 for o in offsets], num_keys=end - 50)
    out = flex(q, view[0], view[1], block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_on_a_torch_without_from_kv_blocks_lengths(monkeypatch) -> None:
    """A torch whose from_kv_blocks takes no seq_lengths (before 2.6): the mask evaluated over the grid, same mask."""
    import ddtree.packing as packing

    g = torch.Generator().manual_seed(8)
    trees = [build_tree(torch.log_softmax(torch.randn(5, 20, generator=g), -1), b) for b in (30, 0, 12)]
    packed = pack(trees, [1, 2, 3], [40, 3, 0])
    layout = {"kv_offsets": [60, 0, 20], "num_keys": 150}
    expected = mask_from_blocks(packed.flex_block_mask(16, **layout), packed.num_tokens, 150)
    monkeypatch.setattr(packing, "_from_kv_blocks_parameters", lambda: frozenset())
    assert torch.equal(mask_from_blocks(packed.flex_block_mask(16, **layout), packed.num_tokens, 150), expected)


def test_a_batch_packed_on_the_host_moves_whole() -> None:
    """`PackedBatch.to`: every tensor on the new device with its own values (one stacked copy), the lists kept."""
    g = torch.Generator().manual_seed(9)
    packed = pack(
        [build_tree(torch.log_softmax(torch.randn(4, 9, generator=g), -1), 12), DraftTree.empty()], [1, 2], [5, 0]
    )
    assert packed.to("cpu") is packed
    moved = packed.to("meta")
    for name in ("input_ids", "position_ids", "seq_index", "node_index", "local_parents", "depths", "ancestor_bits"):
        original, copy = getattr(packed, name), getattr(moved, name)
        assert copy.device.type == "meta" and copy.shape == original.shape and copy.dtype == original.dtype, name
    assert moved.query_starts == packed.query_starts and moved.num_cached == packed.num_cached


def test_flex_mask_mod_on_a_grid_padded_past_the_batch() -> None:
    """torch 2.5's create_block_mask evaluates the mask over a grid rounded up to whole blocks: queries and keys past
    the batch must see nothing, not index past its tensors."""
    g = torch.Generator().manual_seed(10)
    packed = pack([build_tree(torch.log_softmax(torch.randn(5, 20, generator=g), -1), 40)], [1], [9])
    num_queries, num_keys = packed.num_tokens, packed.kv_starts()[-1]
    q, k = torch.arange(num_queries + 30)[:, None], torch.arange(num_keys + 30)[None, :]
    padded = packed.flex_mask_mod()(0, 0, q, k)
    assert torch.equal(padded[:num_queries, :num_keys], packed.dense_mask(0))
    assert not padded[num_queries:].any() and not padded[:, num_keys:].any()
