import pytest

from ddtree.budget import BudgetConfig, BudgetPolicy, CostModel
from ddtree.budget_replay import Replay, Result, Trace

VERIFY = [(1, 0.020), (2, 0.021), (4, 0.022), (8, 0.028), (16, 0.050), (64, 0.190)]


def cost(draft=0.004):
    return CostModel(list(VERIFY), [(1, draft), (4, 4 * draft)])


def total(results: dict[str, Result]) -> Result:
    out = Result()
    for r in results.values():
        out.add(r)
    return out


def chain_trace(category: str, num_positions: int, depth_matched: int) -> Trace:
    """A chain of 8 nodes (probabilities halving) at every position; the first `depth_matched` are the target's."""
    probs = [0.5 ** (k + 1) for k in range(8)]
    return Trace(category, [probs] * num_positions, [list(range(depth_matched))] * num_positions)


def test_trace_counts_the_matched_nodes_inside_the_kept_prefix():
    trace = Trace("code", [[0.9, 0.5, 0.4, 0.3, 0.2, 0.1]], [[0, 2, 5]])
    assert [trace.accepted(0, n) for n in range(7)] == [0, 1, 1, 2, 2, 2, 3]


def test_off_and_fixed_budgets_cost_what_the_model_says():
    c = cost()
    traces = [chain_trace("code", 40, depth_matched=3)]
    off = total(Replay(c).run_off(traces))
    assert off.tokens == 40 and off.seconds == pytest.approx(40 * 0.020)
    fixed = total(Replay(c).run_policy(BudgetPolicy(BudgetConfig(fixed_budget=4), c), traces))
    # every round: 3 accepted + the bonus token, a draft and a verify of 1 + 4 tokens
    assert fixed.tokens == 40 and fixed.drafted_request_rounds == 10 and fixed.tau == 4.0
    assert fixed.seconds == pytest.approx(10 * (0.004 + c.verify_seconds(5)))


def test_auto_drafts_where_it_pays_and_falls_back_where_it_does_not():
    paying = [chain_trace("code", 200, depth_matched=4) for _ in range(3)]
    c = cost()
    off = total(Replay(c).run_off(paying)).tokens_per_second
    auto = total(Replay(c).run_policy(BudgetPolicy(BudgetConfig(max_budget=8), c), paying))
    assert auto.tokens_per_second > 2.0 * off and auto.drafted_request_rounds == auto.request_rounds

    useless = [chain_trace("chat", 200, depth_matched=0) for _ in range(3)]
    slow = cost(draft=0.040)
    off = total(Replay(slow).run_off(useless)).tokens_per_second
    auto = total(Replay(slow).run_policy(BudgetPolicy(BudgetConfig(max_budget=8), slow), useless))
    assert auto.tokens_per_second > 0.95 * off  # probes stay within max_probe_overhead (3%), plus the first draft
    assert auto.drafted_request_rounds < 0.05 * auto.request_rounds


def test_concurrent_requests_share_rounds_and_every_token_is_counted():
    c = cost()
    traces = [chain_trace("code", 30, 2), chain_trace("math", 50, 1), chain_trace("chat", 10, 0)]
    results = Replay(c, concurrency=2).run_policy(BudgetPolicy(BudgetConfig(fixed_budget=2), c), traces)
    assert {k: r.tokens for k, r in results.items()} == {"code": 30, "math": 50, "chat": 10}
    assert results["code"].tau == 3.0 and results["math"].tau == 2.0 and results["chat"].tau == 1.0
    with pytest.raises(ValueError, match="one request at a time"):
        Replay(c, concurrency=2).run_oracle(traces, 8)
