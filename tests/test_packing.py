"""Packing draft trees into one verify batch: ids, positions, and masks against hand-drawn trees."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_mask

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
    trees = [
        build_tree(torch.log_softmax(torch.randn(6, 30, generator=g), -1), budget) for budget in (200, 63, 64, 1)
    ]
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
