"""Draft tree builders against a brute-force oracle, and the batched builder against the reference heap."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.tree import (
    HEAP_MAX_TOTAL_NODES,
    DraftTree,
    build_padded_trees,
    build_round_trees,
    build_tree,
    build_tree_from_topk,
    build_trees,
    build_trees_from_topk,
    build_trees_with_heap,
    topk_logprobs,
)

FIELDS = ("token_ids", "parents", "depths", "path_logprobs")


def random_logprobs(*shape: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, generator=g) * scale, dim=-1)


def all_prefixes(logprobs: torch.Tensor) -> list[tuple[tuple[int, ...], float]]:
    """Every prefix of length 1..L over the full vocabulary, with its probability."""
    num_positions, vocab = logprobs.shape
    p = logprobs.double().exp().tolist()
    out = []
    for depth in range(1, num_positions + 1):
        for seq in itertools.product(range(vocab), repeat=depth):
            out.append((seq, math.prod(p[i][t] for i, t in enumerate(seq))))
    return out


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    tokens, parents = tree.token_ids.tolist(), tree.parents.tolist()
    out: list[tuple[int, ...]] = []
    for i, parent in enumerate(parents):
        out.append((out[parent] if parent >= 0 else ()) + (tokens[i],))
    return out


def check_structure(tree: DraftTree, logprobs: torch.Tensor) -> None:
    """Parents precede children, depths and path log-probs are consistent, siblings are distinct, order decreases."""
    n = tree.num_nodes
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i in range(n):
        if parents[i] == -1:
            assert depths[i] == 1
        else:
            assert 0 <= parents[i] < i
            assert depths[i] == depths[parents[i]] + 1
    node_paths = paths(tree)
    assert len(set(node_paths)) == n
    lp = logprobs.double()
    expected = [sum(lp[d, t].item() for d, t in enumerate(path)) for path in node_paths]
    assert torch.allclose(tree.path_logprobs.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    assert bool((tree.path_logprobs[1:] <= tree.path_logprobs[:-1]).all())


def assert_same_tree(a: DraftTree, b: DraftTree) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


# --- the reference heap against the brute-force oracle ---


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_positions,vocab", [(1, 5), (2, 4), (3, 3), (4, 2)])
def test_heap_is_optimal_for_every_budget(seed: int, num_positions: int, vocab: int) -> None:
    logprobs = random_logprobs(num_positions, vocab, seed=seed)
    prefixes = all_prefixes(logprobs)
    best = sorted((p for _, p in prefixes), reverse=True)
    for budget in range(0, len(prefixes) + 3):
        tree = build_tree(logprobs, budget)
        assert tree.num_nodes == min(budget, len(prefixes))
        check_structure(tree, logprobs)
        total = tree.path_logprobs.double().exp().sum().item()
        assert total == pytest.approx(sum(best[:budget]), rel=1e-6, abs=1e-12)


def test_budget_beyond_prefix_count_gives_all_prefixes() -> None:
    logprobs = random_logprobs(3, 3, seed=7)
    tree = build_tree(logprobs, 10_000)
    assert sorted(paths(tree)) == sorted(seq for seq, _ in all_prefixes(logprobs))


def test_budget_one_is_the_best_first_token() -> None:
    logprobs = random_logprobs(4, 9, seed=3)
    tree = build_tree(logprobs, 1)
    assert tree.token_ids.tolist() == [int(logprobs[0].argmax())]
    assert tree.parents.tolist() == [-1] and tree.depths.tolist() == [1]
    assert tree.path_logprobs.tolist() == [pytest.approx(logprobs[0].max().item())]


def test_budget_zero_and_empty_inputs_give_empty_trees() -> None:
    logprobs = random_logprobs(4, 9, seed=3)
    for tree in (build_tree(logprobs, 0), build_tree(torch.zeros(0, 5), 3)):
        assert tree.num_nodes == 0
        assert tree.path_logprobs.dtype == torch.float32
    assert build_trees(logprobs[None], [0])[0].num_nodes == 0


def test_only_top_k_tokens_appear() -> None:
    logprobs = random_logprobs(5, 50, seed=11, scale=0.3)  # flat: deep and wide trees
    for budget in (1, 3, 8, 20):
        tree = build_tree(logprobs, budget)
        top = logprobs.topk(budget, dim=-1).indices
        for d, t in zip(tree.depths.tolist(), tree.token_ids.tolist()):
            assert t in top[d - 1].tolist()


def test_ties_follow_the_documented_rule() -> None:
    # Depth 1: two equally likely tokens; depth 2: token 0 certain. Every depth-2 node ties with a depth-1 node.
    half = math.log(0.5)
    logprobs = torch.tensor([[half, half, float("-inf")], [0.0, float("-inf"), float("-inf")]])
    for tree in (build_tree(logprobs, 4), build_trees(logprobs[None], [4])[0]):
        # Equal log-probs: shallower first; then by the parent's order; then by token rank (lower id for equal values).
        assert tree.token_ids.tolist() == [0, 1, 0, 0]
        assert tree.parents.tolist() == [-1, -1, 0, 1]
        assert tree.depths.tolist() == [1, 1, 2, 2]
    # Uniform over 2 tokens at 2 positions: depth 1 in id order, then depth 2 by parent then token.
    uniform = torch.full((2, 2), half)
    tree = build_tree(uniform, 6)
    assert paths(tree) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]


def test_zero_probability_tokens_come_last_and_still_count_as_prefixes() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    heap = build_tree(logprobs, 100)
    assert heap.num_nodes == 3 + 9
    check_structure(heap, logprobs)
    assert_same_tree(heap, build_trees(logprobs[None], [100])[0])


def test_input_validation() -> None:
    logprobs = random_logprobs(3, 4, seed=0)
    for bad_budget in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            build_tree(logprobs, bad_budget)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            build_trees(logprobs[None], [bad_budget])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        build_tree(logprobs[0], 3)  # 1-D
    with pytest.raises(ValueError):
        build_tree(logprobs[None], 3)  # 3-D
    with pytest.raises(ValueError):
        build_tree(logprobs.abs(), 3)  # logits, not log-probs
    with pytest.raises(ValueError):
        build_tree(torch.full((2, 2), float("nan")), 3)
    with pytest.raises(ValueError):
        build_trees(logprobs, [3, 3, 3])  # 2-D
    with pytest.raises(ValueError):
        build_trees(logprobs[None], [3, 3])  # one budget too many
    with pytest.raises(ValueError):
        build_trees(logprobs.abs()[None], [3])
    with pytest.raises(ValueError):
        topk_logprobs(logprobs[None], 5)  # k > V
    values, ids = topk_logprobs(logprobs.abs()[None], 2)
    with pytest.raises(ValueError):
        build_tree_from_topk(values[0], ids[0], 3)
    with pytest.raises(ValueError):
        build_trees_with_heap(values, ids, [3])
    with pytest.raises(ValueError):
        build_round_trees(values, ids, [3])
    good_values, good_ids = topk_logprobs(logprobs[None], 2)
    for bad_budgets in ([None], [3, 3], ["3"]):
        with pytest.raises(ValueError):
            build_round_trees(good_values, good_ids, bad_budgets)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        build_round_trees(good_values[0], good_ids[0], [3])  # 2-D


def test_topk_ranks_ties_by_token_id() -> None:
    logprobs = torch.tensor([[[-1.0, -2.0, -1.0, -0.5, -1.0, -3.0]]])
    values, ids = topk_logprobs(logprobs, 6)
    assert ids.tolist() == [[[3, 0, 2, 4, 1, 5]]]
    assert values.tolist() == [[[-0.5, -1.0, -1.0, -1.0, -2.0, -3.0]]]


# --- the batched builder against the heap ---


@pytest.mark.parametrize("scale,num_positions", [(1.0, 6), (3.0, 15), (10.0, 15)])  # flat and wide .. peaked and deep
def test_batched_matches_heap_at_large_budgets(scale: float, num_positions: int) -> None:
    logprobs = random_logprobs(3, num_positions, 500, seed=5, scale=scale)
    budgets = [1024, 300, 5]
    trees = build_trees(logprobs, budgets)
    for r, budget in enumerate(budgets):
        heap = build_tree(logprobs[r], budget)
        assert heap.num_nodes == budget
        assert_same_tree(heap, trees[r])


@pytest.mark.parametrize("budgets", [[64], [16] * 4, [HEAP_MAX_TOTAL_NODES], [HEAP_MAX_TOTAL_NODES // 2 + 1] * 2])
def test_round_trees_are_the_same_on_both_sides_of_the_heap_threshold(budgets: list[int], monkeypatch) -> None:
    """The engine's builder picks the heap for small rounds and the batched builder above the threshold; the
    trees are identical either way (the threshold moved to force each)."""
    logprobs = random_logprobs(len(budgets), 15, 700, seed=11, scale=6.0)
    values, ids = topk_logprobs(logprobs, max(budgets))
    chosen = build_round_trees(values, ids, budgets)
    monkeypatch.setattr("ddtree.tree.HEAP_MAX_TOTAL_NODES", -1)  # always batched
    batched = build_round_trees(values, ids, budgets)
    monkeypatch.setattr("ddtree.tree.HEAP_MAX_TOTAL_NODES", 10**9)  # always the heap
    heaps = build_round_trees(values, ids, budgets)
    for r, budget in enumerate(budgets):
        assert chosen[r].num_nodes == budget
        assert_same_tree(chosen[r], batched[r])
        assert_same_tree(chosen[r], heaps[r])
        assert chosen[r].path_logprobs.dtype == batched[r].path_logprobs.dtype


def test_padded_trees_pad_past_each_request() -> None:
    logprobs = random_logprobs(2, 3, 5, seed=1)
    values, ids = topk_logprobs(logprobs, 5)
    padded = build_padded_trees(values, ids, [2, 5])
    assert padded.num_nodes == [2, 5]
    assert padded.token_ids[0, 2:].tolist() == [-1, -1, -1]
    assert padded.depths[0, 2:].tolist() == [0, 0, 0]
    assert torch.isinf(padded.path_logprobs[0, 2:]).all()


def _quantised_logprobs(data, num_requests: int, num_positions: int, vocab: int, distinct: bool) -> torch.Tensor:
    """Log-probs on a coarse grid (many equal path sums); `distinct`: no two tokens of a position tie."""
    levels = st.integers(min_value=0, max_value=vocab - 1 if distinct else 3)
    rows = []
    for _ in range(num_requests * num_positions):
        if distinct:
            perm = data.draw(st.permutations(list(range(vocab))))
            rows.append([-0.5 * p for p in perm])
        else:
            row = [-0.5 * data.draw(levels) for _ in range(vocab)]
            if data.draw(st.booleans()):
                row[data.draw(st.integers(0, vocab - 1))] = float("-inf")
            rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(num_requests, num_positions, vocab)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_requests=st.integers(1, 4),
    num_positions=st.integers(1, 5),
    vocab=st.integers(1, 7),
    distinct=st.booleans(),
)
def test_batched_equals_heap_on_random_inputs(data, num_requests, num_positions, vocab, distinct) -> None:
    logprobs = _quantised_logprobs(data, num_requests, num_positions, vocab, distinct)
    budgets = data.draw(st.lists(st.integers(0, 60), min_size=num_requests, max_size=num_requests))
    if not distinct:
        # Within-position ties at the K-th value make the top-K set depend on torch.topk (see ddtree/tree.py);
        # with K = V every token is in, so compare end to end only then.
        budgets = [max(b, vocab) if b else 0 for b in budgets]
    trees = build_trees(logprobs, budgets)
    for r, budget in enumerate(budgets):
        assert_same_tree(build_tree(logprobs[r], budget), trees[r])


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    num_requests=st.integers(1, 4),
    num_positions=st.integers(1, 5),
    vocab=st.integers(1, 9),
)
def test_batched_equals_heap_from_the_same_topk(data, num_requests, num_positions, vocab) -> None:
    """The two algorithms on one top-K (arbitrary ties included), each request with its own budget."""
    logprobs = _quantised_logprobs(data, num_requests, num_positions, vocab, distinct=False)
    budgets = data.draw(st.lists(st.integers(0, 40), min_size=num_requests, max_size=num_requests))
    k = data.draw(st.integers(min(max(budgets), vocab) or 1, vocab))
    values, ids = topk_logprobs(logprobs, k)
    trees = build_trees_from_topk(values, ids, budgets)
    heaps = build_trees_with_heap(values, ids, budgets)
    for r in range(len(budgets)):
        assert_same_tree(heaps[r], trees[r])
        check_structure(heaps[r], logprobs[r])
