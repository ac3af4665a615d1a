"""The closed loop over the budget policy (ddtree/guard.py): scripted rounds whose true speeds the policy gets wrong,
and the engine running plain rounds where the guard says so."""

from __future__ import annotations

import random

import pytest

from ddtree.guard import PLAIN, POLICY, ThroughputGuard


def loop_bound(a: float, b: float, share: float = 0.03, noise: float = 0.02) -> float:
    """The least the loop may deliver over arms of speeds `a` and `b`: the faster one, less the exploring share
    (plus 0.03 for each arm's first windows) of the difference, less `noise` of the faster one."""
    best = max(a, b)
    return best - (share + 0.03) * abs(a - b) - noise * best


def run(guard: ThroughputGuard | None, rates, num_rounds: int, num_requests: int = 8, seed: int = 0) -> float:
    """Tokens/s over `num_rounds` rounds whose true tokens/s per arm is `rates(round)[arm]` (each round's time
    jittered +-20%, as on a noisy machine); without a guard every round follows the policy."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for i in range(num_rounds):
        arm = guard.choose(num_requests) if guard is not None else POLICY
        round_tokens = num_requests * (1.5 if arm == POLICY else 1.0)
        round_seconds = round_tokens / rates(i)[arm] * rng.uniform(0.8, 1.2)
        if guard is not None:
            guard.observe(num_requests, arm, round(round_tokens), round_seconds)
        tokens += round_tokens
        seconds += round_seconds
    return tokens / seconds


@pytest.mark.parametrize("policy_rate, plain_rate", [(90.0, 100.0), (60.0, 100.0), (140.0, 100.0)])
def test_the_loop_ends_within_its_bound_of_the_faster_arm(policy_rate, plain_rate):
    """Whatever the policy believes, the loop delivers the faster arm's speed less at most its exploring share of
    the difference (and the noise); where the policy is the slower arm, the policy alone falls below that bound."""
    share = 0.03
    bound = loop_bound(policy_rate, plain_rate, share, noise=0.01)
    rates = lambda i: {POLICY: policy_rate, PLAIN: plain_rate}  # noqa: E731
    guard = ThroughputGuard(max_explore_share=share)
    assert run(guard, rates, 3000) >= bound
    explored = guard.describe()[0]["explored_share"]
    assert 0 < explored <= 1.1 * share  # (a round's time is known only once it has run)
    if policy_rate < plain_rate:
        assert run(None, rates, 3000) < bound  # without the loop: the policy's loss stays


def test_speculation_comes_back_when_it_pays_again():
    """The load changes half-way: speculation first loses, then wins; exploring finds the change."""
    rates = lambda i: {POLICY: 80.0 if i < 1500 else 150.0, PLAIN: 100.0}  # noqa: E731
    guard = ThroughputGuard(max_explore_share=0.03)
    run(guard, rates, 1500)
    assert guard.best(8) == PLAIN
    second_half = run(guard, lambda i: rates(i + 1500), 1500, seed=1)
    assert guard.best(8) == POLICY
    assert second_half >= 0.9 * 150.0


def run_passages(
    guard: ThroughputGuard | None,
    num_rounds: int,
    seed: int,
    catch_up_seconds: float = 0.0,
    mark_switch: bool = True,
    policy_seconds: float = 0.0175,
) -> float:
    """One request decoding text of easy and hard passages (about 20 tokens each, keyed by the tokens committed so
    far, whichever arm committed them): a speculative round accepts 0-6 draft nodes (each after its parent with
    chance 0.7) on easy text, at most one (chance 0.3) on hard text, and costs 1.25x a plain round. Speculation pays
    on the whole, while a hard passage leaves it a streak of rounds below plain decoding. The first speculative round
    after plain rounds costs `catch_up_seconds` more per plain round (the drafter takes in their features), and tells
    the guard it switches where `mark_switch`, as the engine does. Returns tokens/s."""
    rng, passages = random.Random(seed), random.Random(seed + 1)
    hard, is_hard = False, []
    tokens = seconds = 0.0
    num_plain = 0  # plain rounds since the last speculative one
    for _ in range(num_rounds):
        while len(is_hard) <= tokens:
            hard = hard != (passages.random() < 0.05)
            is_hard.append(hard)
        arm = guard.choose(1) if guard is not None else POLICY
        accepted = 0
        if arm == POLICY and is_hard[int(tokens)]:
            accepted = int(rng.random() < 0.3)
        elif arm == POLICY:
            while accepted < 6 and rng.random() < 0.7:
                accepted += 1
        round_seconds = (policy_seconds if arm == POLICY else 0.014) * rng.uniform(0.8, 1.2)
        switches = arm == POLICY and num_plain > 0
        if switches:
            round_seconds += catch_up_seconds * num_plain
        num_plain = num_plain + 1 if arm == PLAIN else 0
        if guard is not None:
            guard.observe(1, arm, 1 + accepted, round_seconds, measured=not (switches and mark_switch))
        tokens += 1 + accepted
        seconds += round_seconds
    return tokens / seconds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_streak_of_rejections_does_not_leave_speculation_off(seed):
    """A hard passage makes plain decoding measure faster for a while, and the guard switches to it. Speculation
    must come back once the text is easy again: an arm left at a low point of its noise is measured afresh when it is
    explored, not nudged one round at a time (which kept the loop ~5-15% below the policy alone here)."""
    policy_alone, plain = run_passages(None, 3000, seed), 1 / 0.014
    assert policy_alone > 1.5 * plain
    bound = loop_bound(policy_alone, plain)
    assert run_passages(ThroughputGuard(max_explore_share=0.03), 3000, seed) >= bound


def test_speculation_that_pays_a_little_is_not_left_off_for_long():
    """Speculative rounds cost 1.5x a plain round (as at one request on a CPU), so the policy gains ~25% on the
    whole and loses on hard passages; the first speculative round after plain rounds costs 0.06 ms more per plain
    round (the drafter takes in their features: ~10 ms after a typical stretch against a 21 ms round). A guard that
    took the noisy token estimate at its word both ways, and priced a switch's catch-up as a round of the policy, went
    plain on a dip of the noise and stayed there for hundreds of rounds while exploring windows that included the
    catch-up measured the policy slow: it kept about two thirds of the gain. The guard keeps most of it."""
    plain = 1 / 0.014

    def gain_kept(make_guard, mark_switch: bool) -> float:
        kept = []
        for seed in range(6):
            policy_alone = run_passages(None, 3000, seed, policy_seconds=0.021)
            looped = run_passages(make_guard(), 3000, seed, 0.00006, mark_switch, policy_seconds=0.021)
            kept.append((looped - plain) / (policy_alone - plain))
        return sum(kept) / len(kept)

    kept = gain_kept(lambda: ThroughputGuard(max_explore_share=0.03), mark_switch=True)
    assert kept >= 0.75
    before = gain_kept(
        lambda: ThroughputGuard(max_explore_share=0.03, confidence=0.0, first_windows=1), mark_switch=False
    )
    assert before < kept - 0.08


def run_with_prompts(guard: ThroughputGuard | None, net_of_prompts: bool, seed: int, num_rounds: int = 3000) -> float:
    """16 requests under steady load, where 12% of rounds also take a 100-token admitted prompt into their verify
    pass (30 ms, either arm). The policy's rounds cost 1.05x a plain round (30 ms) for 1.06 tokens per request, and
    20 ms more where they speculate beside a prompt: on the whole it loses ~5%. The engine's cost model prices the
    prompt at 27 ms; a prompt round reaches the guard net of that price (`net_of_prompts`, as the engine does), or
    not measured. Returns tokens/s."""
    from ddtree.cost import CostModel

    rng = random.Random(seed)
    cost = CostModel([(1, 0.028), (16, 0.030), (116, 0.057)], [(1, 0.002)])
    tokens = seconds = 0.0
    for _ in range(num_rounds):
        arm = guard.choose(16) if guard is not None else POLICY
        has_prompt = rng.random() < 0.12
        round_tokens = 16 + (sum(rng.random() < 0.06 for _ in range(16)) if arm == POLICY else 0)
        round_seconds = (0.0315 if arm == POLICY else 0.030) + has_prompt * (0.030 + 0.020 * (arm == POLICY))
        round_seconds *= rng.uniform(0.9, 1.1)
        if guard is not None:
            net = round_seconds - has_prompt * cost.verify_seconds_of_part(16 + 100, 100)
            measured = net_of_prompts or not has_prompt
            guard.observe(16, arm, round_tokens, net if measured else round_seconds, measured=measured)
        tokens += round_tokens
        seconds += round_seconds
    return tokens / seconds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rounds_that_take_in_prompts_are_measured_net_of_them(seed):
    """What speculating costs in the rounds that take in prompts is the policy's: measured net of the prompts' price,
    they show the policy's loss and the loop ends within its bound of plain decoding. Left unmeasured (the prompts'
    cost is work of neither arm), they hid it, and the loop kept a policy that loses on the whole."""
    policy_alone, plain = run_with_prompts(None, True, seed), 16 / (0.88 * 0.030 + 0.12 * 0.060)
    bound = loop_bound(policy_alone, plain)
    assert policy_alone < bound
    assert run_with_prompts(ThroughputGuard(max_explore_share=0.03), True, seed) >= bound
    assert run_with_prompts(ThroughputGuard(max_explore_share=0.03), False, seed) < bound


def test_a_verdict_on_the_first_window_is_checked_again_at_once():
    """One request whose opening rounds accept nothing (its first window: one token per round in 1.25x a plain
    round's time), and two tokens per round after (1.6x plain decoding's speed). The first window makes plain decoding
    the faster arm; measured again at once, the policy is back within a few windows, where waiting for the exploring
    share kept plain decoding for ~170 rounds."""

    def plain_rounds(guard: ThroughputGuard) -> int:
        policy_rounds = 0
        chosen = []
        for _ in range(300):
            arm = guard.choose(1)
            chosen.append(arm)
            if arm == POLICY:
                policy_rounds += 1
                guard.observe(1, POLICY, 1 if policy_rounds <= 4 else 2, 0.0125)
            else:
                guard.observe(1, PLAIN, 1, 0.010)
        assert chosen[-1] == POLICY
        return chosen.count(PLAIN)

    assert plain_rounds(ThroughputGuard(max_explore_share=0.03)) <= 20
    assert plain_rounds(ThroughputGuard(max_explore_share=0.03, first_windows=1)) > 100


def test_rounds_the_policy_plans_plain_are_measured_as_plain_decoding():
    """A stretch of rounds in which the policy rests every request in its own fallback (no draft, no chain) is plain
    decoding. Counted as the policy's rounds, it priced the policy at one token per round with no spread, in 1.0x
    a plain round's time, for the ~50 rounds its estimate remembers after the policy drafted again. Measured as plain
    decoding, the stretch leaves the policy's estimate as it was: the policy's arm runs on through it, and its request
    drafts as soon as it may again."""

    def stretch(speculated_flag: bool | None) -> tuple[list[str], float]:
        guard = ThroughputGuard(max_explore_share=0.03)
        rng = random.Random(0)
        chosen = []
        for i in range(600):
            arm = guard.choose(1)
            resting = 200 <= i < 300  # the policy rests its request (e.g. after failed probes)
            speculates = arm == POLICY and not resting
            tokens = 2 if speculates else 1
            seconds = 0.010 * (1.4 if speculates else 1.0) * rng.uniform(0.95, 1.05)
            flag = speculates if speculated_flag is None else speculated_flag
            guard.observe(1, arm, tokens, seconds, speculated=flag)
            chosen.append(arm)
            if i == 299:
                tokens_after_stretch = guard.describe()[0]["policy_tokens_per_request"]
        return chosen, tokens_after_stretch

    honest, honest_tokens = stretch(None)
    assert honest[200:300].count(PLAIN) <= 8  # the policy's arm runs on through the stretch (exploring aside)
    assert honest[300:350].count(POLICY) >= 45  # and its request drafts as soon as it may again
    assert honest_tokens == pytest.approx(2.0)
    _, as_policy_tokens = stretch(True)  # every round of the policy's arm counted as its own
    assert as_policy_tokens < 1.2


def run_arm(rates, arm: str, num_rounds: int, num_requests: int = 8, seed: int = 0) -> float:
    """`run` with every round on `arm`."""

    class Fixed:
        def choose(self, n):
            return arm

        def observe(self, *args):
            pass

    return run(Fixed(), rates, num_rounds, num_requests, seed)


@pytest.mark.parametrize("policy_rate", [88.0, 112.0])
@pytest.mark.parametrize("drift", ["steps", "sawtooth"])
def test_the_machine_drifting_under_the_loop_does_not_choose_for_it(drift, policy_rate):
    """Round times swing by half (other load, the requests' context lengths) in spells of tens to hundreds of
    rounds, both arms alike, while the arms' ratio stays put. Comparing an arm's fresh window against the other arm's
    average over an earlier spell credits the arm that happened to run in the fast spell (about 3-4% below the faster
    arm here); comparing each window's round seconds with the adjacent rounds of the other arm keeps the bound."""
    slow = {"steps": lambda i: 1.5 if (i // 100) % 2 else 1.0, "sawtooth": lambda i: 1.0 + 0.5 * (i % 200) / 200}
    rates = lambda i: {POLICY: policy_rate / slow[drift](i), PLAIN: 100.0 / slow[drift](i)}  # noqa: E731
    num_rounds = 6000
    arms = {arm: run_arm(rates, arm, num_rounds) for arm in (POLICY, PLAIN)}
    bound = loop_bound(arms[POLICY], arms[PLAIN], noise=0.01)
    assert run(ThroughputGuard(max_explore_share=0.03), rates, num_rounds) >= bound


def run_phases(guard: ThroughputGuard | None, num_rounds: int, seed: int) -> float:
    """16 requests. The policy's first 12 drafting rounds in the bucket draft little (1.15 tokens per request in 1.1x
    a plain round's time); every later one drafts more and loses (1.35 tokens in 1.5x: 0.9x plain decoding's speed).
    The policy rests all requests in its own fallback 4 rounds in every 29. Returns tokens/s."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    num_drafting = 0
    for i in range(num_rounds):
        arm = guard.choose(16) if guard is not None else POLICY
        speculates = arm == POLICY and i % 29 < 25
        round_tokens, round_seconds = 16.0, 0.070
        if speculates:
            num_drafting += 1
            round_tokens, round_seconds = (18.4, 0.077) if num_drafting <= 12 else (21.6, 0.105)
        round_seconds *= rng.uniform(0.9, 1.1)
        if guard is not None:
            guard.observe(16, arm, round(round_tokens), round_seconds, speculated=speculates)
        tokens += round_tokens
        seconds += round_seconds
    return tokens / seconds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_seconds_ratio_follows_the_policy_past_its_first_rounds(seed):
    """The seconds ratio is sampled wherever the rounds switch between speculating and plain decoding, the policy's
    own resting rounds included, not only at exploring windows. Sampled at windows alone, it rested on the policy's
    cheap opening rounds and the few windows the share allows after them, and the loop kept a policy that had
    turned 10% slower for hundreds of rounds (0.94-0.95x plain decoding here, against the bound's 0.975)."""
    plain = 16 / 0.070
    assert run_phases(None, 1000, seed) < 0.92 * plain
    assert run_phases(ThroughputGuard(max_explore_share=0.03), 1000, seed) >= loop_bound(plain, 0.91 * plain)


def run_tail(guard: ThroughputGuard, priced: bool, num_rounds: int, seed: int) -> tuple[float, ThroughputGuard]:
    """Batch sizes 9-16 share a bucket. The policy drafts at 16 requests (1.2 tokens per request in 1.1x a plain
    round's time: it pays) and rests where requests have left, at 10 (plain rounds 0.73x those at 16), 4 rounds in
    every 29. `priced`: each round comes with a plain round's price at its batch size, as a cost model of the
    right shape but the wrong level (0.8x) gives it."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for i in range(num_rounds):
        resting = i % 29 >= 25
        n = 10 if resting else 16
        plain_round = 0.030 + 0.0025 * n
        arm = guard.choose(n)
        speculates = arm == POLICY and not resting
        round_tokens = n * (1.2 if speculates else 1.0)
        round_seconds = plain_round * (1.1 if speculates else 1.0) * rng.uniform(0.9, 1.1)
        price = 0.8 * plain_round if priced else None
        guard.observe(n, arm, round(round_tokens), round_seconds, speculated=speculates, plain_seconds=price)
        tokens += round_tokens
        seconds += round_seconds
    return tokens / seconds, guard


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rounds_of_different_batch_sizes_in_a_bucket_are_paired_at_their_plain_price(seed):
    """The policy's resting rounds come where requests have left, so a pair compares its drafting rounds with plain
    rounds of fewer requests. Paired in raw seconds, the policy measured ~0.95x plain decoding and the guard turned
    off speculation that paid 9%; paired relative to each round's plain price, it keeps it."""
    looped, guard = run_tail(ThroughputGuard(max_explore_share=0.03), True, 1000, seed)
    row = guard.describe()[0]
    assert row["policy_speedup"] > 1.0 and row["policy_rounds"] > 0.8 * 1000
    unpriced, guard = run_tail(ThroughputGuard(max_explore_share=0.03), False, 1000, seed)
    assert guard.describe()[0]["policy_speedup"] < 1.0 and unpriced < 0.95 * looped


def test_batch_sizes_are_measured_apart():
    guard = ThroughputGuard(max_explore_share=0.03)
    run(guard, lambda i: {POLICY: 150.0, PLAIN: 100.0}, 500, num_requests=1)
    run(guard, lambda i: {POLICY: 80.0, PLAIN: 100.0}, 500, num_requests=16)
    assert (guard.best(1), guard.best(16)) == (POLICY, PLAIN)
    assert guard.best(12) == PLAIN and guard.best(4) == POLICY  # 12 shares 16's bucket; 4 has none: the policy


def test_the_explore_share_and_the_confidence_are_checked():
    for bad in (-0.1, 0.6):
        with pytest.raises(ValueError, match="max_explore_share"):
            ThroughputGuard(max_explore_share=bad)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="confidence"):
            ThroughputGuard(confidence=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="first_windows"):
            ThroughputGuard(first_windows=bad)


# ---- the loop over the real policy -------------------------------------------------------------------------------


def run_policy(
    true_seconds, accept_chance: float, num_rounds: int, with_guard: bool, num_requests: int = 8, seed: int = 0
) -> tuple[float, float]:
    """The budget policy deciding from a cost model that believes drafting and verifying are nearly free, on a
    machine whose true round time is `true_seconds(num_speculative, num_tokens)` (jittered +-20%), and requests whose
    draft nodes are each accepted with `accept_chance` (a node only after its parent). The cost model learns from the
    timed forwards, as the engine's does; what it cannot see is the part of `true_seconds` outside them. Returns the
    tokens/s and plain decoding's tokens/s on the same machine."""
    from ddtree.budget import BudgetConfig, BudgetPolicy
    from ddtree.cost import CostModel

    rng = random.Random(seed)
    believed = CostModel([(1, 0.010), (16, 0.011), (256, 0.02)], [(1, 0.001), (16, 0.0015)])
    policy = BudgetPolicy(BudgetConfig(), believed)
    guard = ThroughputGuard(max_explore_share=0.03) if with_guard else None
    ids = [f"r{i}" for i in range(num_requests)]
    for rid in ids:
        policy.add(rid)
    values = [0.9 * 0.75**k for k in range(16)]  # the drafter's path probabilities, flattering it
    tokens = seconds = 0.0
    for _ in range(num_rounds):
        arm = guard.choose(num_requests) if guard is not None else POLICY
        plan = policy.plan(ids) if arm == POLICY else None
        spec = plan.speculative_ids if plan is not None else []
        counts = policy.allocate(spec, [values] * len(spec), num_requests - len(spec)) if spec else []
        accepted = []
        for rid, count in zip(spec, counts):
            n = 0
            while n < count and rng.random() < accept_chance:
                n += 1
            accepted.append(n)
            policy.observe(rid, sum(values[:count]), n, count)
        num_tokens = num_requests + sum(counts)
        forward = true_seconds(0, num_tokens) * rng.uniform(0.8, 1.2)
        policy.cost.observe_verify(num_tokens, forward)
        if spec:
            policy.cost.observe_draft(len(spec), 0.001)
        round_seconds = true_seconds(len(spec), num_tokens) * rng.uniform(0.8, 1.2)
        round_tokens = num_requests + sum(accepted)
        if guard is not None:
            guard.observe(num_requests, arm, round_tokens, round_seconds, speculated=bool(spec))
        tokens += round_tokens
        seconds += round_seconds
    return tokens / seconds, num_requests / true_seconds(0, num_requests)


@pytest.mark.parametrize("case", ["hidden cost per draft", "verify grows with tokens", "speculation pays"])
def test_the_loop_over_the_policy_ends_within_its_bound_of_the_better_mode(case):
    """Where the true costs differ from what the policy believes (a per-request cost outside the timed forwards, or
    a verify pass that grows faster than the model was told), the policy alone loses to plain decoding; with the
    loop the engine ends within the bound of the better of the two: plain decoding, or the policy where it pays."""

    def true_seconds(num_speculative, num_tokens):
        if case == "hidden cost per draft":  # e.g. tree building and the accept walk, in Python, on a busy core
            return 0.010 + 0.0002 * num_tokens + 0.004 * num_speculative
        if case == "verify grows with tokens":  # a compute-bound pass: every token costs
            return 0.010 + 0.0012 * num_tokens + 0.001 * (num_speculative > 0)
        return 0.010 + 0.00005 * num_tokens + 0.001 * (num_speculative > 0)

    accept = 0.55
    policy_alone, plain = run_policy(true_seconds, accept, 2000, with_guard=False)
    looped, _ = run_policy(true_seconds, accept, 2000, with_guard=True)
    bound = loop_bound(policy_alone, plain)
    assert looped >= bound, (looped, policy_alone, plain)
    if case == "speculation pays":
        assert policy_alone > 1.2 * plain
    else:
        assert policy_alone < bound  # the case is one the policy gets wrong: without the loop, its loss stays


# ---- in the engine -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    from ddtree.loaders import build_workers
    from tests.factories import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("guard_tiny")
    target = make_tiny_target(root / "target", logit_scale=8.0)
    return build_workers(str(target), str(make_tiny_drafter(root / "drafter", target)), dtype="float64")


def _engine(workers, **config):
    from ddtree.cost import CostModel
    from ddtree.engine import Engine, EngineConfig

    target, drafter, tokenizer = workers
    cost = CostModel([(1, 0.010), (64, 0.012), (1024, 0.05)], [(1, 0.002), (16, 0.003)])
    config = {"speculation": "ddtree", "budget": "auto", "max_num_seqs": 4, **config}
    return Engine(EngineConfig(**config), target, drafter, tokenizer, cost=cost)


def test_where_plain_decoding_measured_faster_the_engine_drafts_nothing_and_answers_alike(workers):
    """A guard whose measurements say plain decoding is faster at this batch size: the rounds call no drafter and
    verify no n-gram chain (a plain round is `off`'s round), and the T=0 answers equal `off`'s."""
    from ddtree import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["hello world", "the cat sat on", "12 + 7 =", "a b a b a b a b"]
    reference = LLM.from_engine(_engine(workers, max_explore_share=0.0)).generate(prompts, params)
    drafting = LLM.from_engine(_engine(workers)).engine
    LLM.from_engine(drafting).generate(prompts, params)
    assert drafting.timings.num_draft_calls > 0  # (what the guard takes away below)
    engine = _engine(workers)
    guard = engine.guard
    for num_requests in (1, 2, 4):  # measured: the policy's rounds slow, plain ones fast, at every batch size
        for _ in range(guard.first_windows * guard.window_rounds):
            guard.observe(num_requests, POLICY, num_requests, 1.0)
            guard.observe(num_requests, PLAIN, num_requests, 0.01)
    guard.max_explore_share = 0.0  # and no exploring: every round is plain
    outputs = LLM.from_engine(engine).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert engine.timings.num_draft_calls == 0 and engine.timings.num_ngram_tokens == 0
    assert engine.timings.num_plain_rounds == engine.timings.num_rounds > 0
    assert all(o.stats.num_speculative_rounds == 0 for o in outputs)


def test_the_guard_runs_in_auto_mode_only(workers):
    assert _engine(workers).guard is not None
    assert _engine(workers, max_explore_share=0.0).guard is None
    assert _engine(workers, budget=8).guard is None and _engine(workers, speculation="dflash").guard is None
    from ddtree.engine import EngineConfig

    for bad in (-0.1, 0.7, True, "0.1"):
        with pytest.raises(ValueError, match="max_explore_share"):
            EngineConfig(max_explore_share=bad)


def test_the_first_drafting_round_after_plain_rounds_is_marked_a_switch(workers):
    """The engine tells the guard which round takes in the plain rounds' features (the policy's first drafting round
    after them), and keeps that round's draft call out of the cost model's draft curve."""
    from ddtree import SamplingParams

    engine = _engine(workers, max_num_seqs=1)
    arms = iter([POLICY] * 3 + [PLAIN] * 5 + [POLICY] * 20)
    engine.guard.choose = lambda num_requests: next(arms)
    observed = []
    original = engine.guard.observe

    def observe(num_requests, arm, num_tokens, seconds, measured=True, speculated=True, plain_seconds=None):
        observed.append((arm, not measured))
        original(num_requests, arm, num_tokens, seconds, measured, speculated, plain_seconds)

    engine.guard.observe = observe
    draft_samples = []
    observe_draft = engine.budget.cost.observe_draft
    engine.budget.cost.observe_draft = lambda n, s: (draft_samples.append(len(observed)), observe_draft(n, s))
    engine.add_request("a b a b a b a b", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    num_draft_calls = []
    while engine.has_unfinished_requests():
        engine.step()
        num_draft_calls.append(engine.timings.num_draft_calls)
    switched = [i for i, (_, switches) in enumerate(observed) if switches]
    assert len(switched) == 1 and observed[switched[0]][0] == POLICY and switched[0] >= 8
    first = switched[0]
    assert num_draft_calls[first] == num_draft_calls[first - 1] + 1  # it drafted, the first since the plain rounds
    assert all(num_draft_calls[i] == num_draft_calls[7] for i in range(3, first))
    assert first not in draft_samples  # (the index the round's draft would be observed at, before its guard call)
    assert any(i > first for i in draft_samples) and any(i < 3 for i in draft_samples)


def test_each_request_s_first_draft_after_plain_rounds_marks_its_round_a_switch(workers):
    """After the guard's plain rounds, a request that drafts for the first time since makes its round a switch, even
    where another request drafted a round earlier: each such draft takes in that request's plain rounds' features.
    Once both have drafted, the policy's rounds are measured again."""
    from ddtree import SamplingParams
    from ddtree.budget import RoundPlan

    engine = _engine(workers, max_num_seqs=2, ngram_tokens=0)
    arms = iter([PLAIN] * 3 + [POLICY] * 40)
    engine.guard.choose = lambda num_requests: next(arms)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a = engine.add_request("a b a b a b a b", params)
    b = engine.add_request("the cat sat on", params)
    drafters = iter([[a], [b], [a, b]] + [[a, b]] * 40)  # who drafts in the policy's rounds, in turn
    cap = engine.budget.draft_node_cap

    def plan(request_ids):
        speculative = [r for r in next(drafters) if r in request_ids]
        rest = [r for r in request_ids if r not in speculative]
        return RoundPlan(speculative, rest, [cap] * len(speculative))

    engine.budget.plan = plan
    observed = []
    original = engine.guard.observe

    def observe(num_requests, arm, num_tokens, seconds, measured=True, speculated=True, plain_seconds=None):
        observed.append((arm, measured))
        original(num_requests, arm, num_tokens, seconds, measured, speculated, plain_seconds)

    engine.guard.observe = observe
    draft_samples = []
    observe_draft = engine.budget.cost.observe_draft
    engine.budget.cost.observe_draft = lambda n, s: (draft_samples.append(len(observed)), observe_draft(n, s))
    for _ in range(6):
        engine.step()
    assert observed == [(PLAIN, True)] * 3 + [(POLICY, False), (POLICY, False), (POLICY, True)]
    assert draft_samples == [5]  # the switches' drafts stay out of the draft curve


def test_the_engine_tells_the_guard_which_rounds_of_the_policy_were_plain(workers):
    """A round of the policy's arm in which the request rests in the policy's fallback (no draft; no n-gram chain
    here) reaches the guard as not speculated; a drafting round as speculated."""
    from ddtree import SamplingParams
    from ddtree.budget import RoundPlan

    engine = _engine(workers, max_num_seqs=1, ngram_tokens=0)
    engine.guard.choose = lambda num_requests: POLICY
    observed = []
    original = engine.guard.observe

    def observe(num_requests, arm, num_tokens, seconds, measured=True, speculated=True, plain_seconds=None):
        observed.append(speculated)
        # (the rounds' seconds are paired relative to the cost model's price of a plain round of that batch)
        assert plain_seconds == engine.budget.cost.verify_seconds(num_requests)
        original(num_requests, arm, num_tokens, seconds, measured, speculated, plain_seconds)

    engine.guard.observe = observe
    plan = engine.budget.plan
    engine.budget.plan = lambda request_ids: RoundPlan([], list(request_ids), [])  # every request resting
    engine.add_request("a b a b a b a b", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert observed and not any(observed)
    assert engine.timings.num_draft_calls == 0

    engine.budget.plan = plan
    observed.clear()
    engine.add_request("a b a b a b a b", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.timings.num_draft_calls > 0 and any(observed)


def test_a_round_that_takes_in_prompts_is_measured_net_of_their_price(workers):
    """A request admitted while another runs has its prompt taken into the round's verify pass: that round reaches
    the guard measured, its seconds less what the cost model prices the prompt's tokens at in that pass."""
    from ddtree import SamplingParams

    engine = _engine(workers, max_num_seqs=2)
    engine.guard.choose = lambda num_requests: POLICY
    observed = []
    original = engine.guard.observe

    def observe(num_requests, arm, num_tokens, seconds, measured=True, speculated=True, plain_seconds=None):
        observed.append((num_requests, seconds, measured))
        original(num_requests, arm, num_tokens, seconds, measured, speculated, plain_seconds)

    engine.guard.observe = observe
    priced = []
    engine.budget.cost.verify_seconds_of_part = lambda *args: (priced.append(args), 100.0)[1]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a b a b a b a b", params)
    for _ in range(3):
        engine.step()
    assert observed and all(s > 0 and measured for _, s, measured in observed) and not priced
    num_before = len(observed)
    prompt = "the cat sat on"
    engine.add_request(prompt, params)
    engine.step()
    assert engine.timings.num_prompts_in_verify == 1
    (num_requests, seconds, measured), (num_tokens, num_prompt_tokens, num_in_pass, num_prompts) = (
        observed[num_before],
        priced[0],
    )
    assert num_requests == 1 and measured and -100.0 < seconds < -99.0  # (the round took well under a second)
    assert num_prompt_tokens == len(engine.tokenizer.encode(prompt)) and num_tokens > num_prompt_tokens
    assert (num_in_pass, num_prompts) == (2, 1)  # the running request and the prompt; the prompt's request priced
    while engine.has_unfinished_requests():
        engine.step()
    assert len(priced) == 1 and all(s > 0 for _, s, _ in observed[num_before + 1 :])
