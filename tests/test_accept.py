"""Acceptance walk: hand-made cases, a brute-force sequential walk, and sample-and-match against autoregressive
sampling (chi-square on a tiny vocabulary)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddtree.accept import accept, accept_on_demand, target_tokens_greedy, target_tokens_sampled
from ddtree.packing import pack
from ddtree.tree import DraftTree, build_tree


def tree_of(tokens: list[int], parents: list[int]) -> DraftTree:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(len(tokens)))


# --- chi-square without scipy ---


def chi_square_p_value(observed: list[int], expected_probs: list[float]) -> float:
    """Upper tail of Pearson's statistic with len - 1 degrees of freedom (categories with zero probability must
    never be observed)."""
    total = sum(observed)
    stat, dof = 0.0, -1
    for o, p in zip(observed, expected_probs):
        if p == 0:
            if o:
                return 0.0
            continue
        e = total * p
        stat += (o - e) ** 2 / e
        dof += 1
    return regularized_upper_gamma(dof / 2, stat / 2)


def regularized_upper_gamma(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): series below a + 1, Lentz's continued fraction above."""
    if x <= 0:
        return 1.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = 1
        while abs(term) > 1e-16 * abs(total):
            term *= x / (a + n)
            total += term
            n += 1
        return 1.0 - total * math.exp(log_prefactor)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefactor) * h


def test_chi_square_helper_against_known_values() -> None:
    # Q(k/2, x/2) for the chi-square distribution: closed forms for 2 degrees of freedom, tables for 10.
    assert regularized_upper_gamma(1.0, 3.0) == pytest.approx(math.exp(-3.0), rel=1e-10)
    assert regularized_upper_gamma(5.0, 18.307 / 2) == pytest.approx(0.05, rel=1e-3)
    assert regularized_upper_gamma(5.0, 2.558 / 2) == pytest.approx(0.99, rel=1e-3)
    assert regularized_upper_gamma(31.5, 100.0 / 2) == pytest.approx(0.0020772, rel=1e-4)  # 63 dof, by quadrature


# --- hand-made walks ---


#   root ─┬─ n0(10) ─┬─ n2(12) ── n4(14)
#         │          └─ n3(13)
#         └─ n1(11) ─── n5(15)
DEPTH3 = tree_of([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 2, 1])


def test_hand_made_walks() -> None:
    chain = tree_of([20, 21, 22], [-1, 0, 1])
    packed = pack([DEPTH3, DraftTree.empty(), chain, DEPTH3], [7, 8, 9, 7], [5, 3, 0, 2])
    # Packed: r0 = [root, n0..n5] 0-6, r1 = [root] 7, r2 = [root, c0, c1, c2] 8-11, r3 = [root, n0..n5] 12-18.
    target = torch.tensor(
        [
            10,
            13,
            99,
            14,
            99,
            99,
            99,  # r0: root -> n0 (10), n0 -> n3 (13), n3 -> 99: bonus 99
            42,  # r1: autoregressive: bonus 42
            20,
            21,
            22,
            5,  # r2: the whole chain, bonus 5
            11,
            99,
            15,
            99,
            99,
            99,
            3,  # r3: root -> n1, n1 -> n5 (15), n5 -> 3
        ]
    )
    result = accept(packed, target)
    assert result.accepted_nodes == [[0, 3], [], [0, 1, 2], [1, 5]]
    assert result.accepted_packed == [[0, 1, 4], [7], [8, 9, 10, 11], [12, 14, 18]]
    assert result.accepted_token_ids == [[10, 13], [], [20, 21, 22], [11, 15]]
    assert result.bonus_token_ids == [99, 42, 5, 3]
    assert result.num_accepted == [2, 0, 3, 2]
    assert result.emitted_token_ids(0) == [10, 13, 99]


def test_root_mismatch_accepts_nothing() -> None:
    packed = pack([DEPTH3], [7], [4])
    target = torch.tensor([12, 14, 99, 99, 99, 99, 99])  # 12 is a grandchild's token, not a child's
    result = accept(packed, target)
    assert result.accepted_nodes == [[]] and result.accepted_packed == [[0]] and result.bonus_token_ids == [12]


def test_a_mismatched_parent_cuts_its_matching_descendants() -> None:
    packed = pack([DEPTH3], [7], [4])
    # n2 and n4 match their parents' targets, but n0 does not match the root's.
    target = torch.tensor([11, 12, 0, 14, 0, 0, 0])
    result = accept(packed, target)
    assert result.accepted_nodes == [[1]] and result.bonus_token_ids == [0]


def test_ambiguous_trees_and_bad_shapes_are_rejected() -> None:
    twins = tree_of([5, 5], [-1, -1])
    packed = pack([twins], [1], [0])
    with pytest.raises(ValueError):
        accept(packed, torch.tensor([5, 0, 0]))
    with pytest.raises(ValueError):
        accept(packed, torch.tensor([5, 0]))


def sequential_walk(tree: DraftTree, target: list[int]) -> tuple[list[int], int]:
    """Brute force: from the root, repeatedly look for the child carrying the target's token at the current node."""
    tokens, parents = tree.token_ids.tolist(), tree.parents.tolist()
    path, current = [], -1  # -1: the root; the target of node i is target[i + 1]
    while True:
        wanted = target[current + 1]
        child = next((i for i in range(len(tokens)) if parents[i] == current and tokens[i] == wanted), None)
        if child is None:
            return path, wanted
        path.append(child)
        current = child


@pytest.mark.parametrize("seed", range(10))
def test_greedy_walk_equals_sequential_walk(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab, num_positions = 3, 5
    budgets = [int(b) for b in torch.randint(0, 60, (6,), generator=g)]
    trees = [build_tree(torch.log_softmax(torch.randn(num_positions, vocab, generator=g), -1), b) for b in budgets]
    packed = pack(trees, [0] * len(trees), [4] * len(trees))
    # A target that often agrees with the drafter, so that long paths happen.
    logits = torch.randn(packed.num_tokens, vocab, generator=g)
    target = target_tokens_greedy(logits)
    assert torch.equal(target, logits.argmax(-1))
    result = accept(packed, target)
    for r, tree in enumerate(trees):
        path, bonus = sequential_walk(tree, target[packed.segment(r)].tolist())
        assert result.accepted_nodes[r] == path
        assert result.bonus_token_ids[r] == bonus
        assert result.accepted_packed[r] == [packed.query_starts[r] + 1 + i for i in [-1] + path]
        assert result.accepted_token_ids[r] == [int(tree.token_ids[i]) for i in path]


@pytest.mark.parametrize("seed", range(10))
def test_walk_on_demand_equals_the_walk_over_every_token(seed: int) -> None:
    """`accept_on_demand` asks for the target's token at the nodes it reaches only (passes of the current node and
    its first-child chain), and gives `accept`'s result; it asks for each root and every accepted node, never twice,
    and for fewer tokens than the batch holds when trees are bushy."""
    g = torch.Generator().manual_seed(seed)
    vocab, num_positions = 3, 5
    budgets = [int(b) for b in torch.randint(0, 60, (6,), generator=g)]
    trees = [build_tree(torch.log_softmax(torch.randn(num_positions, vocab, generator=g), -1), b) for b in budgets]
    packed = pack(trees, [0] * len(trees), [4] * len(trees))
    target = target_tokens_greedy(torch.randn(packed.num_tokens, vocab, generator=g))
    passes = []

    def target_tokens_of(rows: list[int]) -> list[int]:
        passes.append(rows)
        return target[rows].tolist()

    result, asked = accept_on_demand(packed, target_tokens_of)
    expected = accept(packed, target)
    assert result == expected
    assert asked == [p for rows in passes for p in rows] and len(set(asked)) == len(asked)
    assert all(p in asked for path in result.accepted_packed for p in path)
    assert len(asked) < packed.num_tokens or packed.num_tokens <= 2 * len(trees)


def test_walk_on_demand_refuses_an_ambiguous_path_only_when_it_walks_it() -> None:
    twins = tree_of([5, 5, 7], [-1, -1, -1])
    packed = pack([twins], [1], [0])
    with pytest.raises(ValueError, match="ambiguous"):
        accept_on_demand(packed, lambda rows: [5] * len(rows))
    result, _ = accept_on_demand(packed, lambda rows: [7] * len(rows))  # the walk takes the third child
    assert result.accepted_token_ids == [[7]]


# --- sampling ---


def filtered_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Independent plain-Python statement of the filters: temperature, top-k (ties kept), then top-p."""
    scaled = [x / temperature for x in logits]
    if top_k > 0:
        kth = sorted(scaled, reverse=True)[min(top_k, len(scaled)) - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    m = max(scaled)
    weights = [math.exp(x - m) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    if top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [p if i in kept else 0.0 for i, p in enumerate(probs)]
    return [p / sum(probs) for p in probs]


def test_sampled_tokens_follow_the_filtered_distribution() -> None:
    vocab, rows_per_request = 6, 20_000
    base = [1.2, 0.3, -0.4, 0.9, -1.5, 0.0]
    params = [  # (temperature, top_k, top_p)
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (1.3, 3, 1.0),
        (1.0, 0, 0.7),
        (2.0, 4, 0.8),
        (0.0, 0, 1.0),  # greedy
    ]
    num_requests = len(params)
    seq_index = torch.arange(num_requests).repeat(rows_per_request)  # requests interleaved in the packed order
    logits = torch.tensor(base).expand(seq_index.numel(), vocab)
    tokens = target_tokens_sampled(
        logits,
        seq_index,
        torch.arange(seq_index.numel()),  # a distinct position per row: independent samples
        temperature=[t for t, _, _ in params],
        top_k=[k for _, k, _ in params],
        top_p=[p for _, _, p in params],
        seeds=[100 + r for r in range(num_requests)],
    )
    for r, (temperature, top_k, top_p) in enumerate(params):
        counts = torch.bincount(tokens[seq_index == r], minlength=vocab).tolist()
        if temperature == 0:
            assert counts[0] == rows_per_request
            continue
        probs = filtered_probs(base, temperature, top_k, top_p)
        assert chi_square_p_value(counts, probs) > 1e-4, (r, counts, probs)


@pytest.mark.parametrize("vocab", [512, 600])  # whole blocks of CDF_BLOCK tokens, and a padded last block
def test_sampled_tokens_across_blocks_follow_the_distribution(vocab) -> None:
    """The inverse CDF finds the block, then the token in it: tokens at both edges of blocks, the last token of the
    vocabulary included, come out at their probabilities."""
    from ddtree.accept import CDF_BLOCK

    assert CDF_BLOCK == 256
    likely = [0, 3, 255, 256, 300, 510, vocab - 1]
    base = torch.full((vocab,), -60.0)
    base[likely] = torch.tensor([0.5, 1.0, -0.3, 0.2, 0.8, -0.5, 0.1])
    num_rows = 20_000
    tokens = target_tokens_sampled(
        base.expand(num_rows, vocab),
        torch.zeros(num_rows, dtype=torch.long),
        torch.arange(num_rows),
        [1.0],
        [1.0],
        [0],
        [9],
    )
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts.sum() == num_rows and counts[likely].sum() == num_rows
    probs = base.softmax(-1)[likely]
    assert chi_square_p_value(counts[likely].tolist(), (probs / probs.sum()).tolist()) > 1e-4


def test_seeded_requests_do_not_depend_on_the_rest_of_the_batch() -> None:
    vocab = 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, vocab, generator=g)
    alone = target_tokens_sampled(
        logits[:5], torch.zeros(5, dtype=torch.long), torch.arange(10, 15), [0.9], [1.0], [0], [7]
    )
    seq_index = torch.tensor([1, 0, 1, 0, 0, 2, 0, 3, 1, 2, 3, 0])  # request 0 at rows 1, 3, 4, 6, 11
    positions = torch.arange(12)
    positions[seq_index == 0] = torch.arange(10, 15)
    mixed_logits = torch.randn(12, vocab, generator=g)
    mixed_logits[seq_index == 0] = logits[:5]
    mixed = target_tokens_sampled(
        mixed_logits,
        seq_index,
        positions,
        [0.9, 1.0, 0.7, 0.0],  # request 3 is greedy
        [1.0, 0.9, 1.0, 1.0],
        [0, 0, 5, 0],
        [7, 11, 3, 5],
    )
    assert torch.equal(mixed[seq_index == 0], alone)
    assert torch.equal(mixed[seq_index == 3], mixed_logits[seq_index == 3].argmax(-1))
    # rows of the batch's greedy request only (a pass of the on-demand walk can ask for just those): its argmax
    greedy_rows = seq_index == 3
    only_greedy = target_tokens_sampled(
        mixed_logits[greedy_rows],
        seq_index[greedy_rows],
        positions[greedy_rows],
        [0.9, 1.0, 0.7, 0.0],
        [1.0, 0.9, 1.0, 1.0],
        [0, 0, 5, 0],
        [7, 11, 3, 5],
    )
    assert torch.equal(only_greedy, mixed_logits[greedy_rows].argmax(-1))


def test_tiny_temperatures_sample_the_argmax() -> None:
    """Logits divided by 1e-40 overflow float32 (several +inf, and 0 / 0 = NaN): below GREEDY_TEMPERATURE a request
    is greedy instead of sampling whichever infinite score argmax meets first."""
    logits = torch.tensor([[-1.0, 0.5, 3.0, 0.0, 2.0]] * 3)
    tokens = target_tokens_sampled(
        logits,
        torch.tensor([0, 1, 2]),
        torch.zeros(3, dtype=torch.long),
        [1e-6, 1e-40, 1e-50],
        [1.0] * 3,
        [0] * 3,
        [1, 2, 3],
    )
    assert tokens.tolist() == [2, 2, 2]


def test_extreme_top_p_and_temperature_keep_their_meaning() -> None:
    """top_p below float32's range (0 in float32) still samples the most likely token, not token 0; a temperature
    beyond float32's range still honours top_k (the scores would all round to 0 and tie)."""
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]] * 4)
    seq_index, positions = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 1])
    tokens = target_tokens_sampled(logits, seq_index, positions, [1.0, 1e39], [1e-300, 1.0], [0, 1], [1, 2])
    assert tokens.tolist() == [2, 2, 2, 2]
    # a huge temperature without top-k is the uniform limit: every token is sampled
    many = torch.tensor([[0.0, 1.0, 9.0, 2.0]]).expand(4000, 4)
    sampled = target_tokens_sampled(
        many, torch.zeros(4000, dtype=torch.long), torch.arange(4000), [1e39], [1.0], [0], [3]
    )
    assert chi_square_p_value(torch.bincount(sampled, minlength=4).tolist(), [0.25] * 4) > 1e-4


def test_sampling_never_picks_a_filtered_token_at_the_ends_of_the_uniform(monkeypatch) -> None:
    """A sample is the first token whose cumulative probability exceeds u x the total: at the largest u the last
    token kept (not a filtered one past it, nor an index past the vocabulary), at u = 0 the first token kept."""
    import ddtree.accept as accept_module

    logits = torch.tensor([[-30.0, 2.0, 1.0, 5.0, 0.5, -1.0]] * 2)  # top-2 keeps tokens 3 and 1
    seq_index, positions = torch.tensor([0, 1]), torch.tensor([4, 4])
    for bits, expected in ((2**64 - 1, 3), (0, 1)):  # u = 1 - 2^-52 and u = 0; kept: tokens 1 and 3
        monkeypatch.setattr(accept_module, "_mix_seed", lambda seed, position, bits=bits: bits)
        tokens = target_tokens_sampled(logits, seq_index, positions, [1.0, 2.0], [1.0, 1.0], [2, 2], [1, 2])
        assert tokens.tolist() == [expected, expected]
    # without a filter the last token of the vocabulary is reachable, and nothing past it
    monkeypatch.setattr(accept_module, "_mix_seed", lambda seed, position: 2**64 - 1)
    flat = torch.zeros(1, 6)
    assert target_tokens_sampled(flat, torch.tensor([0]), torch.tensor([0]), [1.0], [1.0], [0], [0]).tolist() == [5]


def test_sampling_input_validation() -> None:
    logits, seq = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)
    for temperature, top_p, top_k in ((-1.0, 1.0, 0), (1.0, 0.0, 0), (1.0, 1.5, 0), (1.0, 1.0, -2), (1.0, 1.0, 1.5)):
        with pytest.raises(ValueError):
            target_tokens_sampled(logits, seq, seq, [temperature], [top_p], [top_k], [0])
    with pytest.raises(ValueError):
        target_tokens_sampled(logits, seq, seq, [1.0, 1.0], [1.0], [0], [0])
    with pytest.raises(ValueError):
        target_tokens_sampled(logits, seq[:2], seq[:2], [1.0], [1.0], [0], [0])
    with pytest.raises(ValueError):
        target_tokens_sampled(logits, seq, seq[:2], [1.0], [1.0], [0], [0])


# --- sample-and-match is lossless ---

VOCAB = 4
# The target: logits for every context of length 0, 1 and 2 (index = the context read as a base-VOCAB number).
TARGET_LOGITS = torch.randn(1 + VOCAB + VOCAB**2, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.7
# The drafter disagrees with the target (its own distributions per position), and its tree has branches.
DRAFT_LOGPROBS = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 1.5, -0.5, 1.0]]), -1)
TREE = build_tree(DRAFT_LOGPROBS, 7)


def context_row(context: tuple[int, ...]) -> int:
    offset = sum(VOCAB**i for i in range(len(context)))
    return offset + sum(t * VOCAB ** (len(context) - 1 - i) for i, t in enumerate(context))


def target_probs(context: tuple[int, ...]) -> torch.Tensor:
    return TARGET_LOGITS[context_row(context)].softmax(-1)


def lossless_check(num_samples: int, sample_targets) -> float:
    """Emit with the tree, complete to 3 tokens from the target, and test against autoregressive sampling."""
    tree_paths: list[tuple[int, ...]] = []
    for t, p in zip(TREE.token_ids.tolist(), TREE.parents.tolist()):
        tree_paths.append((tree_paths[p] if p >= 0 else ()) + (t,))
    packed = pack([TREE] * num_samples, [0] * num_samples, [3] * num_samples)
    rows = torch.tensor([context_row(())] + [context_row(path) for path in tree_paths])
    logits = TARGET_LOGITS[rows.repeat(num_samples)]  # [N, V]: the target's logits given each token's path
    result = accept(packed, sample_targets(packed, logits))

    # Complete every sample to 3 tokens from the target (the next rounds, autoregressively), all at once.
    g = torch.Generator().manual_seed(12345)
    emitted = torch.tensor([(result.emitted_token_ids(r) + [-1, -1])[:3] for r in range(num_samples)])
    for position in (1, 2):
        todo = emitted[:, position] < 0
        contexts = emitted[todo, :position]  # [n, position]
        rows = sum(VOCAB**i for i in range(position)) + (contexts * VOCAB ** torch.arange(position - 1, -1, -1)).sum(1)
        probs = TARGET_LOGITS[rows].softmax(-1)
        emitted[todo, position] = torch.multinomial(probs, 1, generator=g).squeeze(1)
    codes = (emitted * torch.tensor([VOCAB**2, VOCAB, 1])).sum(1)
    counts = torch.bincount(codes, minlength=VOCAB**3).tolist()
    expected = [
        float(target_probs(())[a] * target_probs((a,))[b] * target_probs((a, b))[c])
        for a, b, c in itertools.product(range(VOCAB), repeat=3)
    ]
    assert min(expected) * num_samples > 5  # the chi-square approximation holds
    return chi_square_p_value(counts, expected)


def test_tree_covers_branches_and_depth_two() -> None:
    assert TREE.depths.max() == 2 and (TREE.depths == 1).sum() >= 2 and (TREE.depths == 2).sum() >= 2


def test_sample_and_match_is_lossless() -> None:
    def sample(packed, logits):
        # Nodes at the same depth share their noise (keyed by position): the test covers that design.
        return target_tokens_sampled(
            logits,
            packed.seq_index,
            packed.position_ids,
            [1.0] * packed.num_requests,
            [1.0] * packed.num_requests,
            [0] * packed.num_requests,
            [2024 + r for r in range(packed.num_requests)],
        )

    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert lossless_check(40_000, sample) > 1e-4


def test_lossless_check_rejects_a_sampler_that_follows_the_draft() -> None:
    """The same check has the power to catch a wrong sampler: here the tokens come from the draft's distribution."""

    def sample_from_draft(packed, logits):
        g = torch.Generator().manual_seed(5)
        # The draft's distribution for the position after each packed token (beyond its depth: the target's).
        depth = packed.depths.clamp(max=DRAFT_LOGPROBS.shape[0] - 1)
        probs = torch.where(
            (packed.depths < DRAFT_LOGPROBS.shape[0])[:, None], DRAFT_LOGPROBS.exp()[depth], logits.softmax(-1)
        )
        return torch.multinomial(probs, 1, generator=g).squeeze(1)

    assert lossless_check(40_000, sample_from_draft) < 1e-4
