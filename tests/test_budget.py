import math
import random

import pytest

from ddtree.budget import CLOSED_BATCH_SLACK, BudgetConfig, BudgetPolicy, closed_batch_drafters
from ddtree.cost import CostModel, verify_cost_counts


def linear_cost(per_token=1.0, fixed=30.0, draft=10.0):
    verify = [(n, (fixed + per_token * n) / 1000) for n in (1, 8, 32, 128, 512)]
    return CostModel(verify, [(r, draft / 1000 * (1 + 0.1 * r)) for r in (1, 4, 16)])


def test_cost_model_interpolates_and_refreshes():
    c = CostModel([(1, 1.0), (11, 2.0)], [(1, 0.5)])
    assert c.verify_seconds(6) == pytest.approx(1.5)
    assert c.verify_seconds(21) == pytest.approx(3.0)  # linear extrapolation
    c.observe_verify(11, 4.0)
    assert c.verify_seconds(11) > 2.0
    with pytest.raises(ValueError):
        CostModel([], [(1, 1.0)])
    with pytest.raises(ValueError, match="two points"):
        CostModel([(8, 0.02), (8, 0.03)], [(1, 1.0)])


def test_the_start_up_profile_times_both_sides_of_each_row_tile():
    tiles = [1, 2, 4, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57, 64, 65]
    assert verify_cost_counts(600) == tiles + [128, 129, 256, 257]
    assert verify_cost_counts(17) == [1, 2, 4, 8, 9, 16, 17]
    assert verify_cost_counts(16) == [1, 2, 4, 8, 9, 16]
    assert verify_cost_counts(30) == [1, 2, 4, 8, 9, 16, 17, 24, 25]
    assert verify_cost_counts(1) == [1]

    def tiled(n):  # rows in tiles of 8: each tile costs 3 ms, each row 0.5 ms on top, 30 ms fixed
        return (30 + 3 * -(-n // 8) + 0.5 * n) / 1000

    stepped = CostModel([(n, tiled(n)) for n in verify_cost_counts(64)], [(1, 0.01)])
    powers = CostModel([(n, tiled(n)) for n in (1, 2, 4, 8, 9, 16, 17, 32, 33, 64, 65)], [(1, 0.01)])
    for n in (17, 20, 24, 25, 33, 40, 41, 57):
        assert stepped.verify_seconds(n) == pytest.approx(tiled(n), rel=1e-9)
    # across a step between the powers of two, the first row past a tile comes cheap: beside 24 roots a token of a
    # chain is priced at a third of what it costs
    assert powers.verify_seconds(25) - powers.verify_seconds(24) < (tiled(25) - tiled(24)) / 3


def test_the_price_of_part_of_a_verify_pass_is_what_it_adds_to_the_pass():
    c = CostModel([(1, 0.010), (11, 0.020), (111, 0.030)], [(1, 0.5)])
    assert c.verify_seconds_of_part(111, 100) == pytest.approx(0.010)
    assert c.verify_seconds_of_part(61, 50) == pytest.approx(0.025 - 0.020)
    assert c.verify_seconds_of_part(11, 0) == 0.0
    # the pass without the part keeps at least one token
    assert c.verify_seconds_of_part(11, 10) == c.verify_seconds_of_part(11, 40) == pytest.approx(0.010)


def test_cost_curve_never_falls_and_one_stall_moves_it_little():
    """A measured dip (noise) neither makes larger batches cheaper nor is extrapolated downward; one stalled round
    moves the curve by a bounded step, on the points around it (both, by their share)."""
    dip = CostModel([(1, 0.010), (128, 0.040), (256, 0.0392)], [(1, 0.005), (4, 0.0051), (16, 0.0049)])
    sizes = [1, 64, 128, 200, 256, 1024, 8192]
    prices = [dip.verify_seconds(n) for n in sizes]
    assert prices == sorted(prices) and dip.verify_seconds(8192) > 0.040
    assert dip.verify_seconds_range(250, 20) == [dip.verify_seconds(n) for n in range(250, 270)]
    drafts = [dip.draft_seconds(r) for r in (1, 4, 16, 256, 512)]
    assert drafts == sorted(drafts) and drafts[-1] >= 0.0051
    c = CostModel([(1, 0.020), (4, 0.021), (16, 0.030)], [(1, 0.005)])
    c.observe_verify(1, 2.0)  # one 2 s stall of a one-token verify (predicted 20 ms)
    # the ratio counts as 2: the load moves by refresh_weight of it, one request's curve by a quarter of that
    assert c.verify_seconds(1) == pytest.approx(0.020 * (1 + 0.2 * (2.0 - 1.0)) * (1 + 0.05 * (2.0 - 1.0)))
    # a size under the envelope (a dip) is priced at what is observed at it, and follows when costs rise
    c = CostModel([(1, 0.010), (128, 0.040), (256, 0.030), (512, 0.080)], [(1, 0.005)])
    for _ in range(200):
        c.observe_verify(256, 0.030)
    assert c.verify_seconds(256) == pytest.approx(0.030, rel=1e-6)
    for _ in range(60):
        c.observe_verify(256, 0.060)
    assert c.verify_seconds(256) == pytest.approx(0.060, rel=0.02)
    c = CostModel([(1, 0.020), (16, 0.030)], [(1, 0.005)], batch_points=[(2, 0.021), (4, 0.023)])
    c.observe_verify(4, 1.5 * c.verify_seconds(4, 3), num_requests=3)  # half way between 2 and 4: half the step
    assert c.load_points == [(1, 1.0), (2, pytest.approx(1.05)), (4, pytest.approx(1.05))]


def test_a_pass_over_many_requests_costs_what_their_caches_add():
    """8 requests' roots cost more than one request's 8 tokens (each attends to a cache of its own, on CPU kernels
    in a call of its own); a token a tree adds to one of them costs what one request's curve says."""
    c = CostModel([(1, 0.010), (8, 0.012), (16, 0.016)], [(1, 0.005)], batch_points=[(8, 0.020), (16, 0.032)])
    assert c.verify_seconds(8) == pytest.approx(0.012)  # one request of 8 tokens
    assert c.verify_seconds(8, 8) == pytest.approx(0.020)  # eight of one token
    assert c.verify_seconds(16, 8) == pytest.approx(0.016 + 0.008)
    assert c.verify_seconds(4, 4) == pytest.approx(0.010 + 0.002 / 7 * 3 + 0.008 / 7 * 3)
    # both extrapolated, at their last segment's slope or their average slope, the steeper
    assert c.verify_seconds(24, 24) == pytest.approx(0.016 + 0.004 / 8 * 8 + 0.016 + 0.016 / 15 * 8)
    assert c.verify_seconds_range(8, 9, 8) == [c.verify_seconds(n, 8) for n in range(8, 17)]
    assert c.verify_seconds_of_part(16, 8, 9, 1) == pytest.approx(c.verify_seconds(16, 9) - c.verify_seconds(8, 8))
    assert CostModel([(1, 0.010), (8, 0.012)], [(1, 0.005)], batch_points=[(8, 0.011)]).verify_seconds(8, 8) == 0.012
    with pytest.raises(ValueError, match="batch_points"):
        CostModel([(1, 0.010)], [(1, 0.005)], batch_points=[(8, 0.0)])


def test_the_load_learned_at_one_size_prices_the_rows_beside_it():
    """Rounds of 8 requests that all run plain, on a machine 1.4x slower than the start-up profile: the price of a
    round of 8 requests that adds 1 to 24 rows (chains, trees) follows at every size, so those rows keep their
    cost; refreshed by tokens alone, the sizes beside 8 would keep their start-up level, and the first rows past 8
    would be priced at nothing by the envelope. The load is by requests: one request's pass keeps its price."""
    startup = [(1, 0.028), (2, 0.028), (4, 0.028), (8, 0.031), (9, 0.031), (16, 0.034), (17, 0.050), (32, 0.055)]
    batch = [(2, 0.030), (4, 0.033), (8, 0.040), (16, 0.058)]
    c = CostModel(startup, [(1, 0.005)], batch_points=batch)
    before = [c.verify_seconds(n, 8) for n in range(8, 33)]
    for _ in range(40):
        c.observe_verify(8, 0.040 * 1.4, num_requests=8)
    assert c.verify_seconds(8, 8) == pytest.approx(1.4 * before[0], rel=0.01)
    # beside it, most of the level: one request's curve learns slowly where passes run (a quarter of the rate)
    assert all(1.3 * s < c.verify_seconds(n, 8) < 1.41 * s for n, s in zip(range(9, 33), before[1:]))
    assert c.verify_seconds(17, 8) - c.verify_seconds(16, 8) > 1.3 * 0.016
    fresh = CostModel(startup, [(1, 0.005)], batch_points=batch)
    assert [c.verify_seconds(n) for n in (1, 33)] == [fresh.verify_seconds(n) for n in (1, 33)]
    assert fresh.verify_seconds(8) < c.verify_seconds(8) < 1.1 * fresh.verify_seconds(8)


def test_a_closed_batch_drafts_for_the_requests_within_the_slack_of_the_most_tokens_left():
    tokens_left = {"a": 40, "b": 40 - CLOSED_BATCH_SLACK, "c": 39 - CLOSED_BATCH_SLACK, "d": 5}
    assert closed_batch_drafters(tokens_left) == {"a", "b"}
    assert closed_batch_drafters(tokens_left, slack=0) == {"a"}
    assert closed_batch_drafters({"a": 3, "b": 3}) == {"a", "b"}  # in step: all of them
    assert closed_batch_drafters({}) == set()


def test_plan_keeps_the_best_number_of_speculating_requests_not_the_first_local_best():
    """A drafter forward that costs the same for 1 or 16 requests (a GPU's): one request drafting alone lowers the
    rate, all four raise it. Every prefix is priced, so all four draft."""
    cost = CostModel([(1, 0.020), (64, 0.020), (128, 0.030)], [(1, 0.020), (16, 0.020)])
    policy = BudgetPolicy(BudgetConfig(max_budget=8), cost)
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        policy.add(rid)
        policy.states[rid].gain, policy.states[rid].nodes = 1.5, 8.0
    assert policy.plan(rids).speculative_ids == rids


def test_allocate_merges_requests_by_calibrated_probability():
    policy = BudgetPolicy(BudgetConfig(), linear_cost(per_token=0.01))
    for rid in "ab":
        policy.add(rid)
    # Nearly free verify tokens: every node with any value is worth verifying.
    counts = policy.allocate(["a", "b"], [[0.9, 0.5, 0.1], [0.8, 0.05]], num_autoregressive=0)
    assert counts == [3, 2]


def test_allocate_stops_when_tokens_cost_more_than_they_return():
    policy = BudgetPolicy(BudgetConfig(), linear_cost(per_token=5.0, fixed=30.0))
    policy.add("a")
    counts = policy.allocate(["a"], [[0.99, 0.95, 0.9, 0.01, 0.01, 0.01]], num_autoregressive=0)
    assert counts == [3]


def test_rows_that_beat_plain_decoding_by_less_than_the_margin_are_not_verified():
    """16 requests' roots at 1 ms per row beyond a 30 ms pass: the best of a chain, its first two nodes (worth 1.05
    tokens), is predicted 2.1% faster than the roots alone. Within the default 5% margin it is left out; without a
    margin it is verified."""
    cost = linear_cost(per_token=1.0, fixed=30.0)
    chain = [[0.6, 0.45, 0.3]]
    for margin, expected in ((0.05, [0]), (0.0, [2])):
        policy = BudgetPolicy(BudgetConfig(speculation_margin=margin), cost)
        policy.add("a")
        assert policy.allocate(["a"], chain, num_autoregressive=15, num_drafted=0) == expected
    # far past the margin, the same policy verifies it
    policy = BudgetPolicy(BudgetConfig(), cost)
    policy.add("a")
    assert policy.allocate(["a"], [[1.0, 1.0, 0.9]], num_autoregressive=0, num_drafted=0) == [3]


def test_plan_speculates_only_where_it_beats_plain_decoding_by_the_margin():
    """Two requests whose drafts are predicted 2.5% faster than plain rounds: within the margin both decode
    plainly; with a gain that clears it, both draft."""
    cost = CostModel([(1, 0.030), (64, 0.030), (128, 0.060)], [(1, 0.010), (16, 0.010)])
    for gain, expected in ((0.37, []), (1.5, ["a", "b"])):
        policy = BudgetPolicy(BudgetConfig(max_budget=8), cost)
        for rid in "ab":
            policy.add(rid)
            policy.states[rid].gain, policy.states[rid].nodes = gain, 8.0
        # 2 requests + gains over 30 ms of verify + 10 ms of drafting, against 2 tokens per 30 ms
        assert policy.plan(["a", "b"]).speculative_ids == expected
    loose = BudgetPolicy(BudgetConfig(max_budget=8, speculation_margin=0.0), cost)
    for rid in "ab":
        loose.add(rid)
        loose.states[rid].gain, loose.states[rid].nodes = 0.37, 8.0
    assert loose.plan(["a", "b"]).speculative_ids == ["a", "b"]


def test_verify_seconds_range_equals_pointwise_interpolation():
    for points in ([(1, 0.5)], [(4, 1.0), (9, 1.5)], [(1, 1.0), (2, 1.5), (8, 1.6), (64, 4.0), (65, 9.0)]):
        c = CostModel(points, [(1, 0.1)])
        for first, count in ((1, 80), (3, 5), (7, 1), (70, 10), (5, 0)):
            assert c.verify_seconds_range(first, count) == [c.verify_seconds(n) for n in range(first, first + count)]


def test_allocate_equals_a_scan_of_every_total():
    """The allocation keeps the node total with the best expected tokens per second (the fewest on ties), taking
    nodes in decreasing calibrated value, ties in request order: checked against a direct scan."""
    rng = random.Random(0)
    for trial in range(30):
        cost = CostModel(
            [(n, 0.01 + rng.uniform(0, 0.002) * n) for n in (1, 4, 16, 64)], [(r, 0.005 * r) for r in (1, 8)]
        )
        policy = BudgetPolicy(BudgetConfig(), cost)
        rids = [f"r{i}" for i in range(rng.randint(1, 6))]
        probs = []
        for rid in rids:
            policy.add(rid)
            policy.observe(rid, predicted=2.0, num_accepted_nodes=rng.choice([0, 1, 3, 4]))
            probs.append(sorted((round(rng.random(), 1) for _ in range(rng.randint(0, 12))), reverse=True))
        num_drafted, num_ar = rng.randint(0, len(rids)), rng.randint(0, 3)
        nodes = []
        for i, (rid, p) in enumerate(zip(rids, probs)):
            c = 1.0 if i >= num_drafted else policy.states[rid].calibration
            nodes += [(min(1.0, c * v), i) for v in p]
        nodes.sort(key=lambda n: -n[0])
        total = len(rids) + num_ar
        best, best_rate, expected_tokens = 0, 0.0, float(total)
        for k in range(len(nodes) + 1):
            expected_tokens += nodes[k - 1][0] if k else 0.0
            rate = expected_tokens / (cost.draft_seconds(num_drafted) + cost.verify_seconds(total + k))
            if rate > best_rate:
                best, best_rate = k, rate
        plain_rate = total / (cost.draft_seconds(num_drafted) + cost.verify_seconds(total))
        if best_rate < plain_rate * (1 + policy.config.speculation_margin):
            best = 0
        expected = [sum(1 for _, i in nodes[:best] if i == r) for r in range(len(rids))]
        assert policy.allocate(rids, probs, num_ar, num_drafted=num_drafted) == expected, trial


def test_calibration_scales_values():
    policy = BudgetPolicy(BudgetConfig(), linear_cost(per_token=2.0))
    policy.add("a")
    policy.add("b")
    for _ in range(20):  # the drafter is overconfident for "a": nothing is ever accepted
        policy.observe("a", predicted=3.0, num_accepted_nodes=0)
        policy.observe("b", predicted=3.0, num_accepted_nodes=3)
    counts = policy.allocate(["a", "b"], [[0.9, 0.8, 0.7], [0.9, 0.8, 0.7]], num_autoregressive=0)
    assert counts[0] < counts[1]


def test_fixed_budget_always_drafts():
    policy = BudgetPolicy(BudgetConfig(fixed_budget=8), linear_cost())
    policy.add("a")
    for _ in range(10):
        policy.observe("a", predicted=5.0, num_accepted_nodes=0)
    plan = policy.plan(["a"])
    assert plan.speculative_ids == ["a"] and plan.max_budgets == [8]
    assert policy.allocate(["a"], [[0.5] * 5], 0) == [5]


def test_fallback_and_probe_and_recovery():
    # A generous overhead bound: the backoff alone decides when probes come.
    cfg = BudgetConfig(min_probe_interval=2, max_probe_interval=8, max_probe_overhead=1.0)
    policy = BudgetPolicy(cfg, linear_cost(per_token=1.0, fixed=30.0, draft=20.0))
    policy.add("a")
    assert policy.plan(["a"]).speculative_ids == ["a"]  # optimistic prior
    policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    plan = policy.plan(["a"])
    assert plan.autoregressive_ids == ["a"] and plan.speculative_ids == []
    # Exactly probe_interval autoregressive rounds (this one included), then one probe.
    modes = [bool(policy.plan(["a"]).speculative_ids) for _ in range(2)]
    assert modes == [False, True]
    # One probe that pays big is enough after a rest: the estimates aged while it rested.
    policy.observe("a", predicted=5.0, num_accepted_nodes=8)
    assert not policy.states["a"].is_fallback
    assert policy.plan(["a"]).speculative_ids == ["a"]


def test_failed_probes_back_off():
    cfg = BudgetConfig(min_probe_interval=2, max_probe_interval=8, max_probe_overhead=1.0)
    policy = BudgetPolicy(cfg, linear_cost(per_token=1.0, fixed=30.0, draft=20.0))
    policy.add("a")
    policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    modes = ""
    for _ in range(40):
        is_probe = bool(policy.plan(["a"]).speculative_ids)
        modes += "S" if is_probe else "a"
        if is_probe:
            policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    # Autoregressive rounds between probes: the first rest, then doubling up to the cap.
    assert [len(run) for run in modes.split("S")[:5]] == [2, 4, 8, 8, 8]


# A drafter forward that costs five verify passes of one token (the case where backoff alone overspends).
def slow_drafter_cost():
    return CostModel([(1, 0.010), (64, 0.012), (1024, 0.05)], [(1, 0.050), (16, 0.060)])


PATH_PROBS = [0.6, 0.5, 0.45, 0.4, 0.3, 0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05, 0.02, 0.02, 0.01, 0.01]


def simulate(policy, arrivals, num_rounds, accepted):
    """Rounds of plan -> allocate -> verify -> observe, priced by the policy's own cost model (never refreshed).
    `arrivals[rid]` is the round a request joins; `accepted(rid, round, num_nodes)` its accepted nodes.
    Returns per round: (seconds, the seconds of the same requests decoding autoregressively, speculative ids)."""
    cost, rounds = policy.cost, []
    for t in range(num_rounds):
        for rid, start in arrivals.items():
            if start == t:
                policy.add(rid)
        rids = [rid for rid, start in arrivals.items() if start <= t]
        plan = policy.plan(rids)
        counts = policy.allocate(
            plan.speculative_ids, [PATH_PROBS] * len(plan.speculative_ids), len(plan.autoregressive_ids)
        )
        seconds = cost.draft_seconds(len(plan.speculative_ids)) + cost.verify_seconds(len(rids) + sum(counts))
        for rid, n in zip(plan.speculative_ids, counts):
            policy.observe(rid, predicted=sum(PATH_PROBS[:n]), num_accepted_nodes=accepted(rid, t, n), num_nodes=n)
        rounds.append((seconds, cost.verify_seconds(len(rids)), plan.speculative_ids))
    return rounds


def never_pays(rid, t, n):
    return 0


def probe_overhead(rounds):
    spent = sum(s for s, _, _ in rounds)
    return (spent - sum(off for _, off, _ in rounds)) / spent


@pytest.mark.parametrize("max_probe_overhead", [0.03, 0.01])
def test_probes_of_a_request_that_never_pays_stay_within_the_bound(max_probe_overhead):
    policy = BudgetPolicy(BudgetConfig(max_probe_overhead=max_probe_overhead), slow_drafter_cost())
    rounds = simulate(policy, {"a": 0}, 6000, never_pays)
    entered = next(t for t, (_, _, spec) in enumerate(rounds) if not spec)  # the optimistic start is over
    after = rounds[entered:]
    probes = [t for t, (_, _, spec) in enumerate(after) if spec]
    assert len(probes) >= 5  # it keeps being probed
    assert probe_overhead(after) <= max_probe_overhead
    # Every probe cycle on its own, not only the average (the backoff's early short intervals included).
    for prev, probe in zip([0] + probes, probes):
        assert probe_overhead(after[prev + 1 if prev else 0 : probe + 1]) <= max_probe_overhead
    # The backoff alone (a bound that never binds) spends more than that: the test sees the difference.
    loose = BudgetPolicy(BudgetConfig(max_probe_overhead=1.0), slow_drafter_cost())
    loose_rounds = simulate(loose, {"a": 0}, 6000, never_pays)
    assert probe_overhead(loose_rounds[entered:]) > 0.05


def test_probes_of_many_fallback_requests_stay_within_the_bound_of_the_round():
    policy = BudgetPolicy(BudgetConfig(max_probe_overhead=0.03), slow_drafter_cost())
    arrivals = {f"r{k}": 37 * k for k in range(4)}  # staggered, so their probes do not share drafter calls
    rounds = simulate(policy, arrivals, 8000, never_pays)
    after = rounds[200:]
    assert sum(1 for _, _, spec in after if spec) >= 10
    assert probe_overhead(after) <= 0.03


def test_a_request_that_pays_again_is_picked_up_within_the_bound():
    cfg = BudgetConfig(max_probe_overhead=0.03)
    cost = slow_drafter_cost()
    policy = BudgetPolicy(cfg, cost)
    switch = 3000

    def pays_after_switch(rid, t, n):
        return 0 if t < switch else min(n, 8)

    rounds = simulate(policy, {"a": 0}, switch + 400, pays_after_switch)
    assert sum(1 for _, _, spec in rounds[:switch] if spec) < 30  # it was in fallback, probed now and then
    # The longest the bound may make it wait: a full tree, no expected gain, priced alone (its round).
    v1 = cost.verify_seconds(1)
    extra = cost.draft_seconds(1) + cost.verify_seconds(1 + cfg.max_budget) - v1
    max_wait = max(cfg.max_probe_interval, math.ceil(extra / (cfg.max_probe_overhead * v1)))
    back = next(t for t in range(switch, len(rounds) - 20) if all(rounds[u][2] for u in range(t, t + 20)))
    assert back - switch <= max_wait + 1
    assert not policy.states["a"].is_fallback


def test_new_requests_start_from_the_gain_observed_over_all_requests():
    cost = linear_cost(per_token=1.0, fixed=30.0, draft=20.0)  # the optimistic prior pays here: "a" drafts at first
    weak = BudgetPolicy(BudgetConfig(), cost)
    rounds = simulate(weak, {"a": 0}, 50, never_pays)
    assert rounds[0][2] == ["a"]
    weak.add("b")
    assert weak.plan(["a", "b"]).speculative_ids == []  # "b" starts in fallback: the drafter does not pay here
    strong = BudgetPolicy(BudgetConfig(), cost)
    simulate(strong, {"a": 0}, 50, lambda rid, t, n: min(n, 10))
    strong.add("b")
    assert "b" in strong.plan(["a", "b"]).speculative_ids


def test_one_rejected_round_does_not_send_a_new_request_to_fallback():
    """A request's first observation moves the population's gain by one round's weight instead of replacing it:
    one round accepts nothing in ~40% of rounds even where drafting pays well on average."""
    cost = linear_cost(per_token=1.0, fixed=30.0, draft=20.0)
    policy = BudgetPolicy(BudgetConfig(), cost)
    simulate(policy, {"a": 0}, 50, lambda rid, t, n: min(n, 3))  # drafts pay: 3 accepted nodes per round
    policy.add("b")
    assert policy.plan(["a", "b"]).speculative_ids == ["a", "b"]
    policy.observe("b", predicted=3.0, num_accepted_nodes=0, num_nodes=8)
    assert policy.states["b"].gain == pytest.approx(0.9 * policy.states["a"].gain, rel=0.05)
    assert policy.plan(["a", "b"]).speculative_ids == ["a", "b"]
    for _ in range(40):  # a trend, not a streak: "b" leaves
        policy.observe("b", predicted=3.0, num_accepted_nodes=0, num_nodes=8)
    assert "b" not in policy.plan(["a", "b"]).speculative_ids


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_probe_overhead", 0.0),
        ("max_probe_overhead", 1.5),
        ("max_probe_overhead", float("nan")),
        ("min_probe_interval", 0),
        ("max_probe_interval", 2),  # below min_probe_interval (4)
        ("max_budget", 0),
        ("ema_weight", 0.0),
        ("ngram_ema_weight", 1.5),
        ("initial_gain", -1.0),
        ("speculation_margin", -0.1),
        ("speculation_margin", True),
    ],
)
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BudgetConfig(**{field: value})


def test_invalid_budget_config():
    with pytest.raises(ValueError, match="budget"):
        BudgetConfig(fixed_budget=0)


def test_pipeline_speedup_follows_the_cost_model():
    """Two groups pay when the drafter is costly and the verify grows with its tokens (compute-bound); they lose
    when the verify costs the same for any token count (bandwidth-bound) and the drafter is cheap."""
    compute_bound = CostModel([(1, 0.01), (1000, 1.0)], [(1, 0.05), (16, 0.8)])
    bandwidth_bound = CostModel([(1, 0.04), (1000, 0.05)], [(1, 0.002), (16, 0.004)])
    ids = [f"r{i}" for i in range(8)]
    for cost, low, high in ((compute_bound, 1.2, 2.0), (bandwidth_bound, 0.0, 0.8)):
        policy = BudgetPolicy(BudgetConfig(fixed_budget=16), cost)
        for rid in ids:
            policy.add(rid)
            policy.observe(rid, predicted=2.0, num_accepted_nodes=2, num_nodes=16)
        assert low < policy.pipeline_speedup(ids) < high
        assert policy.pipeline_speedup(ids[:1]) == 1.0  # one speculating request: nothing to overlap


def _random_tree(rng: random.Random, num_nodes: int) -> tuple[list[int], list[int], list[float]]:
    """Tokens, parents and decreasing values of a random prefix-closed tree over a small vocabulary."""
    tokens, parents, values, children = [], [], [], {}
    value = 0.9
    for node in range(num_nodes):
        parent = rng.randrange(-1, node)
        token = rng.choice([t for t in range(6) if t not in children.setdefault(parent, set())] or [None])
        if token is None:
            parent, token = -1, 6 + node  # the parent's children are full: a new root child
        children.setdefault(parent, set()).add(token)
        value *= rng.uniform(0.7, 1.0)
        tokens.append(token)
        parents.append(parent)
        values.append(value)
    return tokens, parents, values


def _node_paths(tree, num_nodes: int) -> list[tuple[int, ...]]:
    paths = []
    for node in range(num_nodes):
        path = []
        while node >= 0:
            path.append(tree.token_ids[node])
            node = tree.parents[node]
        paths.append(tuple(reversed(path)))
    return paths


@pytest.mark.parametrize("seed", range(24))
def test_allocate_round_keeps_what_merging_into_the_whole_trees_keeps(seed):
    """The merge goes into what a first allocation keeps: the same nodes as merging every chain into the whole tree
    and allocating once. Requests in fallback verify their chain alone; the others their root."""
    from ddtree.budget import ProposedTree, RoundPlan
    from ddtree.ngram import merge_chain

    rng = random.Random(seed)
    # linear, or shaped like a measured CPU curve: flat (memory-bound), then steep, then flatter (not convex)
    stepped = CostModel([(1, 0.030), (8, 0.031), (16, 0.045), (64, 0.060), (512, 0.3)], [(1, 0.005), (16, 0.008)])
    cost = [linear_cost(per_token=0.5, fixed=30.0), linear_cost(per_token=2.0, fixed=30.0), stepped][seed % 3]
    policy = BudgetPolicy(BudgetConfig(), cost)
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        policy.add(rid)
        policy.observe(rid, predicted=2.0, num_accepted_nodes=rng.randrange(5))
    plan = RoundPlan(ids[:3], ids[3:], [24] * 3)
    drafted = [ProposedTree(v, t, p) for t, p, v in (_random_tree(rng, 24) for _ in range(3))]
    chains = {rid: [rng.randrange(6) for _ in range(rng.randrange(4))] for rid in ids[:4]}  # r4: no chain
    allocation = policy.allocate_round(plan, drafted, chains)
    assert allocation.request_ids == [rid for rid in ids if rid in plan.speculative_ids or chains.get(rid)]
    assert allocation.num_drafted == 3

    whole = []
    for rid, tree in zip(plan.speculative_ids, drafted):
        chain = chains[rid]
        if chain:
            t, p, d, v = merge_chain(tree.token_ids, tree.parents, tree.values, chain, policy.ngram_values(len(chain)))
            tree = ProposedTree(v, t, p, d)
        whole.append(tree)
    for rid in allocation.request_ids[3:]:
        t, p, d, v = merge_chain([], [], [], chains[rid], policy.ngram_values(len(chains[rid])))
        whole.append(ProposedTree(v, t, p, d))
    counts = policy.allocate(
        allocation.request_ids,
        [t.values for t in whole],
        len(plan.autoregressive_ids) - (len(whole) - 3),
        num_drafted=3,
    )
    assert allocation.counts == counts and 0 < sum(counts[:3]) < 72  # some nodes cut, some kept
    for got, want, n in zip(allocation.trees, whole, counts):
        assert sorted(_node_paths(got, n)) == sorted(_node_paths(want, n))
        assert got.values[:n] == pytest.approx(want.values[:n])


def test_allocate_prices_nodes_after_the_tokens_already_packed():
    """Pipelined mode: a verify pass already holding another group's trees. Its tokens move the new nodes up the
    cost curve (here past the flat part) and its expected tokens raise the rate they must keep up."""
    flat_then_steep = CostModel([(1, 0.010), (8, 0.010), (16, 0.030), (64, 0.130)], [(1, 0.005)])
    policy = BudgetPolicy(BudgetConfig(), flat_then_steep)
    policy.add("a")
    chain = [[0.6, 0.45, 0.3]]
    assert policy.allocate(["a"], chain, 0, num_drafted=0) == [3]  # free inside the flat part
    assert policy.allocate(["a"], chain, 0, num_drafted=0, packed=(8, 3.0, 2)) == [0]
    assert policy.allocate(["a"], chain, 0, num_drafted=0, packed=(4, 1.0, 1)) == [3]  # still inside it


def test_requests_that_leave_undrafted_bring_drafting_back():
    """One long request that accepted nothing drives the population's gain to ~0, so new requests start in
    fallback; short ones leave before their first probe, having taught nothing. Each moves the population back
    toward the optimistic prior: within a few such requests, new ones draft again (they used to stay off for good)."""
    cost = linear_cost(per_token=1.0, fixed=30.0, draft=20.0)
    policy = BudgetPolicy(BudgetConfig(), cost)
    simulate(policy, {"long": 0}, 300, lambda rid, t, n: 0)  # sampling noise: nothing accepted
    policy.remove("long")
    assert policy.population_gain < 0.01
    drafted_at = None
    for i in range(40):
        rid = f"short-{i}"
        policy.add(rid)
        if policy.plan([rid]).speculative_ids:
            drafted_at = i
            break
        policy.remove(rid)  # left after two rounds, never probed
    assert drafted_at is not None and drafted_at <= 15


def test_chain_values_estimate_the_chance_of_accepting_the_chain_that_deep():
    """A depth's value is the chance that verifying the chain alone accepts it that deep. A chain rejected at its
    first token is known not to be accepted two or three deep either: counted only at the first depth, the deeper
    values would estimate acceptance given the depth before (0.9 here) and price chains' deep nodes at up to 1 / p1
    times their worth. What the committed tokens do not reach stays unknown."""
    policy = BudgetPolicy(BudgetConfig(), linear_cost())
    rng = random.Random(0)
    chain = [7, 8, 9]
    sums = [0.0] * 3  # the values averaged over the rounds (one EMA value is a noisy estimate of its own)
    num_rounds = 4000
    for _ in range(num_rounds):
        depth = 0  # how deep the target's tokens agree with the chain: first token 0.4, each next one 0.9
        while depth < 3 and rng.random() < (0.4 if depth == 0 else 0.9):
            depth += 1
        policy.observe_proposal(chain, chain[:depth] + [0])  # the accepted tokens, then the bonus token
        sums = [a + b for a, b in zip(sums, policy.ngram_values(3))]
    expected = [0.4, 0.4 * 0.9, 0.4 * 0.81]
    assert [a / num_rounds for a in sums] == pytest.approx(expected, abs=0.03)
    # confirmed as far as the committed tokens go: nothing known past them
    before = policy.ngram_values(3)
    policy.observe_proposal(chain, [7])
    after = policy.ngram_values(3)
    assert after[0] > before[0] and after[1:] == before[1:]


def test_each_request_values_its_chains_at_what_its_own_chains_earned():
    """Chains hold far more often in some texts (code repeats its names) than in others: a request's chain nodes are
    valued at its own record, which starts from the population's, so a batch's chat requests are not priced at what
    its code requests earn. A request not yet judged gets the population's values."""
    policy = BudgetPolicy(BudgetConfig(), linear_cost())
    chain = [7, 8, 9]
    policy.add("code")
    policy.add("chat")
    for _ in range(30):
        policy.observe_proposal(chain, chain + [0], "code")  # accepted whole
        policy.observe_proposal(chain, [0], "chat")  # rejected at its first token
    code, chat = policy.ngram_values(3, "code"), policy.ngram_values(3, "chat")
    assert all(v > 0.9 for v in code) and all(v < 0.05 for v in chat)
    population = policy.ngram_values(3)
    assert chat[0] < population[0] < code[0]
    policy.add("new")
    assert policy.ngram_values(3, "new") == population
    policy.remove("code")
    assert policy.ngram_values(3, "code") == population  # (a request that left: the population's)


@pytest.mark.parametrize("values", [[0.9, 0.6, 0.6, 0.2], [0.3, 0.5, 0.1, 0.1]])
def test_a_chain_verified_alone_is_the_tree_merging_it_into_no_tree_gives(values):
    """A request in fallback verifies its chain as a tree of its own: the path as it comes where its values already
    decrease, else re-ordered as `merge_chain` orders any merged tree (the same nodes either way)."""
    from ddtree.budget import RoundPlan
    from ddtree.ngram import merge_chain

    policy = BudgetPolicy(BudgetConfig(), linear_cost())
    policy.add("a")
    policy.states["a"].ngram_acceptance = list(values)
    chain = [11, 12, 13, 14]
    allocation = policy.allocate_round(RoundPlan([], ["a"], []), [], {"a": chain})
    (tree,) = allocation.trees
    token_ids, parents, depths, tree_values = merge_chain([], [], [], chain, values)
    assert (tree.token_ids, tree.parents, tree.depths, tree.values) == (token_ids, parents, depths, tree_values)
    # the same nodes either way: each chain token once, under the one before it, at its own depth and value
    by_token = {t: (p, d, v) for t, p, d, v in zip(token_ids, parents, depths, tree_values)}
    assert sorted(by_token) == chain
    for depth, (token, value) in enumerate(zip(chain, values), start=1):
        parent, node_depth, node_value = by_token[token]
        assert node_depth == depth and node_value == value
        assert (parent == -1) if depth == 1 else token_ids[parent] == chain[depth - 2]
