import pytest

from ddtree.budget import BudgetConfig, BudgetPolicy, CostModel


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
    cfg = BudgetConfig(min_probe_interval=2, max_probe_interval=8)
    policy = BudgetPolicy(cfg, linear_cost(per_token=1.0, fixed=30.0, draft=20.0))
    policy.add("a")
    assert policy.plan(["a"]).speculative_ids == ["a"]  # optimistic prior
    policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    plan = policy.plan(["a"])
    assert plan.autoregressive_ids == ["a"] and plan.speculative_ids == []
    # Rests for probe_interval rounds, then probes once.
    modes = [bool(policy.plan(["a"]).speculative_ids) for _ in range(3)]
    assert modes == [False, False, True]
    # The probe succeeds big: back to speculation.
    for _ in range(3):
        policy.observe("a", predicted=5.0, num_accepted_nodes=8)
    assert not policy.states["a"].is_fallback
    assert policy.plan(["a"]).speculative_ids == ["a"]


def test_failed_probes_back_off():
    cfg = BudgetConfig(min_probe_interval=2, max_probe_interval=8)
    policy = BudgetPolicy(cfg, linear_cost(per_token=1.0, fixed=30.0, draft=20.0))
    policy.add("a")
    policy.observe("a", predicted=3.0, num_accepted_nodes=0)
    policy.plan(["a"])
    intervals = []
    for _ in range(4):
        while not policy.plan(["a"]).speculative_ids:
            pass
        policy.observe("a", predicted=3.0, num_accepted_nodes=0)
        intervals.append(policy.states["a"].probe_interval)
    assert intervals == sorted(intervals) and intervals[-1] == 8


def test_invalid_budget_config():
    with pytest.raises(ValueError, match="budget"):
        BudgetConfig(fixed_budget=0)
