import pytest

from ddtree.budget import BudgetConfig, BudgetPolicy
from ddtree.budget_replay import Replay, Result, Trace, accepted_along
from ddtree.cost import CostModel

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


def token_trace(category: str, token_ids: list[int], prompt_length: int, depth_matched: int) -> Trace:
    """A chain tree of 8 nodes at every position: the target's next `depth_matched` tokens, then wrong ones (-1)."""
    probs = [0.5 ** (k + 1) for k in range(8)]
    trace = Trace(category, [], [], [], [], token_ids, prompt_length)
    for anchor in range(prompt_length, len(token_ids) - 1):
        truth = token_ids[anchor + 1 :]
        tokens = [truth[k] if k < min(depth_matched, len(truth)) else -1 for k in range(8)]
        trace.path_probs.append(probs)
        trace.matched_nodes.append(list(range(min(depth_matched, len(truth)))))
        trace.tree_tokens.append(tokens)
        trace.tree_parents.append(list(range(-1, 7)))
    return trace


def test_accepted_along_walks_the_kept_tree():
    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 2]  # 5 -> 7 -> 8, and 6
    assert accepted_along(tokens, parents, [5, 7, 8, 9]) == 3
    assert accepted_along(tokens[:3], parents[:3], [5, 7, 8, 9]) == 2
    assert accepted_along(tokens, parents, [6, 7]) == 1 and accepted_along([], [], [5]) == 0


def test_token_traces_replay_like_node_traces_without_ngrams():
    ids = list(range(10)) + [3, 4, 5, 6] * 10
    c = cost()
    with_tokens = token_trace("code", ids, 10, depth_matched=2)
    nodes_only = Trace("code", with_tokens.path_probs, with_tokens.matched_nodes)
    for policy in (BudgetConfig(fixed_budget=4), BudgetConfig(max_budget=8)):
        a = total(Replay(c).run_policy(BudgetPolicy(policy, c), [with_tokens]))
        b = total(Replay(c).run_policy(BudgetPolicy(policy, c), [nodes_only]))
        assert a == b


def test_ngram_chains_carry_a_repetitive_request_the_drafter_cannot():
    """The response repeats a 4-token phrase: the drafter's trees never match, n-gram chains from the history do.
    Every token is still counted once; chains verified in fallback commit most of them at no drafter cost."""
    ids = list(range(10)) + [3, 4, 5, 6] * 30
    slow_drafter = cost(draft=0.040)
    trace = token_trace("code", ids, 10, depth_matched=0)
    off = total(Replay(slow_drafter).run_off([trace]))
    plain = total(Replay(slow_drafter).run_policy(BudgetPolicy(BudgetConfig(max_budget=8), slow_drafter), [trace]))
    ngram = total(
        Replay(slow_drafter).run_policy(BudgetPolicy(BudgetConfig(max_budget=8), slow_drafter), [trace], ngram_tokens=3)
    )
    assert off.tokens == plain.tokens == ngram.tokens == trace.num_positions == 119
    assert plain.tokens_per_second < 1.05 * off.tokens_per_second
    assert ngram.tokens_per_second > 2.5 * off.tokens_per_second and ngram.ngram_tokens > 60
    with pytest.raises(ValueError, match="n-gram"):
        Replay(slow_drafter).run_policy(
            BudgetPolicy(BudgetConfig(), slow_drafter), [Trace("x", [[0.5]], [[]])], ngram_tokens=3
        )


def test_truncated_traces_keep_their_tokens():
    trace = token_trace("math", list(range(20)), 5, depth_matched=3)
    short = trace.truncated(4)
    assert short.num_positions == 4 and len(short.tree_tokens) == 4 and short.token_ids == trace.token_ids
    assert total(Replay(cost()).run_off([short])).tokens == 4
