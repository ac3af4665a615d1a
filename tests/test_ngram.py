import random

import pytest

from ddtree.ngram import NgramIndex, chain_acceptance, merge_chain


def test_proposes_what_followed_the_longest_most_recent_earlier_match():
    index = NgramIndex([1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3])
    # the tail (1, 2, 3) was seen once, followed by 9; (2, 3) more recently, followed by 4: the longest wins
    assert index.propose(3) == [9, 2, 3]
    index.extend([7])
    assert index.propose(2) == []  # 7 never occurred before
    index.extend([1, 2])
    assert index.propose(4) == [3, 7, 1, 2]  # (7, 1, 2) unseen; (1, 2) last came before 3, 7, ...
    assert index.propose(0) == []
    with pytest.raises(ValueError, match="max_n"):
        NgramIndex([], max_n=0)


def test_extending_token_by_token_equals_building_at_once():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    incremental = NgramIndex(tokens[:5])
    for i in range(5, len(tokens)):
        incremental.extend(tokens[i : i + 1])
        whole = NgramIndex(tokens[: i + 1])
        assert incremental.propose(3) == whole.propose(3) == brute_force_proposal(tokens[: i + 1], 3)


def brute_force_proposal(tokens, k, max_n=3):
    for n in range(min(max_n, len(tokens)), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def test_merge_chain_shares_nodes_and_keeps_every_prefix_a_tree():
    # tree: 5 (0.6) -> 6 (0.3); 7 (0.2) at the root
    tokens, parents, values = [5, 6, 7], [-1, 0, -1], [0.6, 0.3, 0.2]
    merged_tokens, merged_parents, merged_depths, merged_values = merge_chain(
        tokens, parents, values, [5, 8, 9], [0.5, 0.35, 0.25]
    )
    assert merged_values == sorted(merged_values, reverse=True)
    assert len(merged_tokens) == 5  # 5 is shared, 8 and 9 are new
    for i, p in enumerate(merged_parents):
        assert p < i  # parents first: any first k nodes are a tree
    paths = {}
    for i, (t, p) in enumerate(zip(merged_tokens, merged_parents)):
        paths[i] = (paths[p] if p >= 0 else ()) + (t,)
    assert sorted(paths.values()) == sorted([(5,), (5, 6), (7,), (5, 8), (5, 8, 9)])
    assert merged_depths == [len(paths[i]) for i in range(len(merged_tokens))]
    assert merged_values[merged_tokens.index(8)] == 0.35

    # a chain alone is a tree of its own; a chain value above the tree's raises the shared node
    assert merge_chain([], [], [], [4, 4], [0.5, 0.4]) == ([4, 4], [-1, 0], [1, 2], [0.5, 0.4])
    assert merge_chain([5], [-1], [0.1], [5], [0.5]) == ([5], [-1], [1], [0.5])


def test_chain_acceptance_counts_the_confirmed_prefix():
    assert chain_acceptance([1, 2, 3], [1, 2, 4, 5]) == 2
    assert chain_acceptance([1, 2], [1]) == 1
    assert chain_acceptance([9], [1, 2]) == 0
