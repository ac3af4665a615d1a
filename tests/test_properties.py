"""Property tests (hypothesis): tree building, packing and acceptance on generated shapes and budgets, each
against its brute-force oracle (tests/test_tree.py, tests/test_packing.py, tests/test_accept.py hold the oracles
and the hand-drawn cases)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from ddtree.accept import accept, accept_on_demand
from ddtree.packing import pack
from ddtree.tree import DraftTree, build_tree
from tests.test_accept import sequential_walk
from tests.test_packing import ancestor_mask_by_walking
from tests.test_tree import all_prefixes, check_structure

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trees(draw, max_nodes: int = 30, max_vocab: int = 5) -> DraftTree:
    """Any valid draft tree: every parent before its children, siblings with distinct tokens (what the builders
    and the n-gram merge produce), path log-probs decreasing in node order."""
    vocab = draw(st.integers(1, max_vocab))
    num_nodes = draw(st.integers(0, max_nodes))
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    used: dict[int, set[int]] = {}
    for _ in range(num_nodes):
        parent = draw(st.integers(-1, len(tokens) - 1))
        free = sorted(set(range(vocab)) - used.setdefault(parent, set()))
        if not free:
            continue
        token = draw(st.sampled_from(free))
        used[parent].add(token)
        index = len(tokens)
        tokens.append(token)
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        used.setdefault(index, set())
    return DraftTree(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(parents, dtype=torch.int64),
        torch.tensor(depths, dtype=torch.int64),
        -torch.arange(len(tokens), dtype=torch.float32),
    )


@st.composite
def batches(draw, max_requests: int = 5):
    """A verify batch: trees (empty ones are autoregressive requests), root tokens and cached lengths."""
    batch = draw(st.lists(trees(), min_size=1, max_size=max_requests))
    roots = draw(st.lists(st.integers(0, 4), min_size=len(batch), max_size=len(batch)))
    cached = draw(st.lists(st.integers(0, 12), min_size=len(batch), max_size=len(batch)))
    return batch, roots, cached


@SETTINGS
@given(data=st.data(), num_positions=st.integers(1, 3), vocab=st.integers(1, 4))
def test_the_heap_tree_is_the_best_tree_of_every_budget(data, num_positions, vocab) -> None:
    """build_tree's B nodes are B most probable prefixes (the optimal tree of B nodes), for any budget."""
    raw = data.draw(
        st.lists(st.floats(-4, 4, allow_nan=False), min_size=num_positions * vocab, max_size=num_positions * vocab)
    )
    logprobs = torch.log_softmax(torch.tensor(raw, dtype=torch.float64).reshape(num_positions, vocab), -1).float()
    prefixes = all_prefixes(logprobs)
    budget = data.draw(st.integers(0, len(prefixes) + 2))
    tree = build_tree(logprobs, budget)
    assert tree.num_nodes == min(budget, len(prefixes))
    check_structure(tree, logprobs)
    best = sorted((p for _, p in prefixes), reverse=True)[:budget]
    assert tree.path_logprobs.double().exp().sum().item() == pytest.approx(sum(best), rel=1e-5, abs=1e-9)


@SETTINGS
@given(batch=batches())
def test_packing_lays_out_every_tree_with_its_ancestor_mask(batch) -> None:
    """Each request's segment is its root then its nodes; positions continue its cache by depth; each token sees
    its request's cache, its ancestors and itself, nothing else (dense and FlexAttention masks alike)."""
    trees_, roots, cached = batch
    packed = pack(trees_, roots, cached)
    assert packed.num_tokens == sum(1 + t.num_nodes for t in trees_)
    for r, tree in enumerate(trees_):
        seg = packed.segment(r)
        assert packed.input_ids[seg].tolist() == [roots[r]] + tree.token_ids.tolist()
        assert packed.position_ids[seg].tolist() == [cached[r]] + [cached[r] + d for d in tree.depths.tolist()]
        assert torch.equal(packed.tree_mask(r), ancestor_mask_by_walking(tree))
        assert torch.equal(
            packed.dense_mask(r),
            torch.cat([torch.ones(1 + tree.num_nodes, cached[r], dtype=torch.bool), ancestor_mask_by_walking(tree)], 1),
        )
    flex = create_mask(packed.flex_mask_mod(), 1, 1, packed.num_tokens, packed.kv_starts()[-1], device="cpu")[0, 0]
    assert torch.equal(flex, torch.block_diag(*[packed.dense_mask(r) for r in range(packed.num_requests)]))


@SETTINGS
@given(batch=batches(), data=st.data())
def test_acceptance_follows_the_targets_tokens_down_each_tree(batch, data) -> None:
    """Whatever the target's token at every packed position, the walk accepts exactly the path a node-by-node
    search accepts, and its bonus token; the on-demand walk gives the same and asks for each token once."""
    trees_, roots, cached = batch
    packed = pack(trees_, roots, cached)
    target = torch.tensor(
        data.draw(st.lists(st.integers(0, 5), min_size=packed.num_tokens, max_size=packed.num_tokens)),
        dtype=torch.int64,
    )
    result = accept(packed, target)
    for r, tree in enumerate(trees_):
        path, bonus = sequential_walk(tree, target[packed.segment(r)].tolist())
        assert result.accepted_nodes[r] == path and result.bonus_token_ids[r] == bonus
        assert result.accepted_token_ids[r] == [int(tree.token_ids[i]) for i in path]
    asked_rows: list[int] = []

    def target_tokens_of(rows: list[int]) -> list[int]:
        asked_rows.extend(rows)
        return target[rows].tolist()

    on_demand, asked = accept_on_demand(packed, target_tokens_of)
    assert on_demand == result and len(set(asked)) == len(asked) == len(asked_rows)
