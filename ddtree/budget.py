"""Node budgets: DDTree at the batch level (policy only: floats, ints and lists; no tensors).

The tree builder pops nodes in decreasing draft path probability q(u), so the expected acceptance of a request's
first b nodes is S(b) = sum of their q(u). The drafter is over- or under-confident per request; an exponential moving
average of observed accepted nodes over predicted S(b) calibrates it: a node is worth c_r * q(u) expected tokens.

Per round:
- `plan()` (before drafting): which requests speculate. Each request's expected gain from drafting is its EMA of
  accepted nodes per round; the requests in decreasing gain, as many of them as maximise the round's committed
  tokens per second (cost = drafter forward for the speculating requests + verify of all packed tokens). The others go
  autoregressive ("fallback"), with no drafter call at all, and are probed (drafted once) now and then so that a
  request whose drafts start to pay comes back.
- `allocate()` (after drafting): merges all speculating requests' nodes in decreasing calibrated value and keeps the
  total that maximises expected committed tokens per second of the whole round. A probe's nodes are valued
  uncalibrated (c_r = 1): its stale calibration would give it no nodes, and a probe with no nodes learns nothing.
- Both choices keep speculation only where the round's predicted tokens per second beat plain decoding's by more than
  `speculation_margin` (5%): the prediction errs toward speculating, since the values that get chosen are the ones
  that look high, and near break-even (a few chain rows beside 16 roots) that bias decides. Plain decoding is what
  the margin falls back to, so a wrong "no" costs at most the margin.
- `observe()` (after verify): updates the calibration and the gain of each request that speculated; a probe that
  pays (drafting this request alone beats one autoregressive step) brings it back.

What probes may cost. A request in fallback commits one token per round, and its share of the round's time is
t = round seconds / expected committed tokens of the round. A probe adds
    extra = (drafter seconds with it - without it) + (verify seconds with its nodes - without) - gain * t
seconds (all from the CostModel, in the context of this round's plan; `gain` is an observed one, never the
optimistic `initial_gain`), so probing it after every I autoregressive rounds costs it extra / (I * t) of its time.
A probe is due when the rounds rested reach both
- the backoff interval: `min_probe_interval`, doubling after each failed probe up to `max_probe_interval`, and
- the cost bound: I >= extra / (max_probe_overhead * t).
Summed over the fallback requests of a round, probes are then expected to cost at most `max_probe_overhead` of
the round time (each probe is priced against the round without probes, which over-counts when the drafter batches
several). A request that starts to pay again is picked up at its next probe: within max(max_probe_interval, the cost
bound with gain 0 and a full tree) rounds. The cost bound can exceed `max_probe_interval` (a drafter much slower
than a verify pass): the overhead is the promise, the pick-up delay follows from it.

Two choices keep probes informative and the start cheap:
- The EMAs age per round, not per observation: after k rounds unobserved the newest observation weighs
  1 - (1 - ema_weight) ** k (the usual EMA for irregular samples), so one probe after a long rest mostly replaces
  the stale estimate instead of moving it by `ema_weight`; a request that pays again comes back after one probe.
- A new request's prior gain is the EMA of gains observed over all requests (`population_gain`), which its first
  observation moves by one round's weight (one round's acceptance is too noisy to replace it); `initial_gain`
  (optimistic, so that the drafter gets tried) applies only before anything has been observed, and each request
  that leaves without having drafted (it started in fallback and left before its first probe) moves the population
  one weight back toward it: after requests that did not pay, new short requests would otherwise start in fallback
  and leave unprobed forever. When the drafter
  does not pay on this workload, a new request therefore starts in fallback and is first probed under the same
  cost bound, instead of paying full-budget drafts at its start; when it pays, new requests draft from round one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ddtree.cost import CostModel
from ddtree.ngram import chain_acceptance, merge_chain

# A request of a closed batch may draft while it is at most this many tokens ahead of the one with the most tokens
# left: about what one drafting round commits beyond a plain one, so that a request that drew ahead rests until the
# others are in reach again, and the requests the batch waits for draft.
CLOSED_BATCH_SLACK = 2


def closed_batch_drafters(tokens_left: dict[str, int], slack: int = CLOSED_BATCH_SLACK) -> set[str]:
    """The requests of a closed batch (nothing waits, and nothing more arrives before its last request finishes:
    `LLM.generate`) that may set its end: those within `slack` tokens of the most tokens left.

    Such a batch takes the rounds until its last request finishes. A token committed for a request ahead of the
    others shortens none of them: the request leaves early, and the batch ends in a tail of rounds of few requests,
    which cost more per token than its full rounds, and which plain decoding, whose requests stay in step, never
    runs. The budget policy prices a round's tokens alike whoever commits them (right where freed seats take new
    requests), so the engine plans only these requests of a closed batch; the others draft nothing meanwhile."""
    most = max(tokens_left.values(), default=0)
    return {rid for rid, n in tokens_left.items() if n >= most - slack}


@dataclass
class RequestBudgetState:
    calibration_num: float = 1.0  # EMA of observed accepted nodes
    calibration_den: float = 1.0  # EMA of predicted S(b)
    gain: float | None = None  # EMA of accepted nodes per speculative round; None until observed
    nodes: float | None = None  # EMA of nodes verified per speculative round; None until observed
    is_fallback: bool = False
    probe_interval: int = 0  # backoff: autoregressive rounds before the next probe (doubles while probes fail)
    num_rounds_rested: int = 0  # autoregressive rounds since it last drafted (0 while it speculates)
    # its n-gram chains' values by depth (`BudgetPolicy.ngram_acceptance`); None until one of its chains is judged
    ngram_acceptance: list[float] | None = None

    @property
    def calibration(self) -> float:
        return self.calibration_num / max(self.calibration_den, 1e-6)


@dataclass(frozen=True)
class _ProbePrice:
    """A round's terms of a probe's price, the same for every request it might probe (`BudgetPolicy._probe_price`)."""

    num_requests: int
    base_tokens: int  # the round's packed tokens without the probe
    seconds_per_token: float  # a fallback request's share of the round's time per committed token
    draft_extra: float  # drafter seconds one more drafting request adds
    base_verify: float  # verify seconds of `base_tokens`


def check_max_probe_overhead(value) -> None:
    """One check for both configs that take it (the engine's runs before any model loads)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"max_probe_overhead must be in (0, 1], got {value!r}")


def check_speculation_margin(value) -> None:
    """One check for both configs that take it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"speculation_margin must be in [0, 1], got {value!r}")


@dataclass
class BudgetConfig:
    fixed_budget: int | None = None  # None: adaptive ("auto"); an int: every speculating request gets exactly this
    max_budget: int = 64  # per-request cap in auto mode (and the top-K the drafter returns)
    ema_weight: float = 0.1  # weight of the newest observation after one round (0.3 fell back on streaks of misses)
    # weight of one chain's outcome in the population's chain values (the prior of a request's own; several chains
    # are judged per round)
    ngram_ema_weight: float = 0.02
    initial_gain: float = 2.0  # prior gain before any request has been observed: optimistic, so the drafter is tried
    min_probe_interval: int = 4  # backoff: first rest in fallback, in rounds
    max_probe_interval: int = 64  # backoff cap, in rounds
    max_probe_overhead: float = 0.03  # probes may cost at most this fraction of a fallback request's time
    # a round speculates only where its predicted tokens per second beat plain decoding's by more than this share:
    # the model's error (values chosen because they look high, costs of rows beside the sizes it measured)
    speculation_margin: float = 0.05
    allow_fallback: bool = True

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if self.fixed_budget is not None and (not is_int(self.fixed_budget) or self.fixed_budget < 1):
            raise ValueError(f"budget (fixed_budget) must be 'auto' or an integer >= 1, got {self.fixed_budget!r}")
        if not is_int(self.max_budget) or self.max_budget < 1:
            raise ValueError(f"max_budget must be an integer >= 1, got {self.max_budget!r}")
        if not is_number(self.ema_weight) or not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight!r}")
        if not is_number(self.ngram_ema_weight) or not 0 < self.ngram_ema_weight <= 1:
            raise ValueError(f"ngram_ema_weight must be in (0, 1], got {self.ngram_ema_weight!r}")
        if not is_number(self.initial_gain) or self.initial_gain < 0:
            raise ValueError(f"initial_gain must be a finite number >= 0, got {self.initial_gain!r}")
        if not is_int(self.min_probe_interval) or self.min_probe_interval < 1:
            raise ValueError(f"min_probe_interval must be an integer >= 1, got {self.min_probe_interval!r}")
        if not is_int(self.max_probe_interval) or self.max_probe_interval < self.min_probe_interval:
            raise ValueError(
                f"max_probe_interval must be an integer >= min_probe_interval ({self.min_probe_interval!r}), "
                f"got {self.max_probe_interval!r}"
            )
        check_max_probe_overhead(self.max_probe_overhead)
        check_speculation_margin(self.speculation_margin)


@dataclass
class RoundPlan:
    speculative_ids: list[str]  # draft these, in this order
    autoregressive_ids: list[str]  # one token each, no drafter call
    max_budgets: list[int]  # per speculative request: nodes the tree builder may produce


@dataclass
class ProposedTree:
    """A request's proposed nodes as lists, in decreasing value (parents first, so any first k form a tree): what
    the allocation ranks, and what an n-gram chain merges into. Without a chain to merge, values alone suffice."""

    values: list[float]
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] | None = None  # set where `allocate_round` built or re-ordered the nodes (a chain merged in)

    @property
    def is_rebuilt(self) -> bool:
        return self.depths is not None


@dataclass
class RoundAllocation:
    """`allocate_round`'s answer: the requests verifying a tree (the drafted ones in plan order, then those in
    fallback verifying an n-gram chain alone), their trees, and how many of each tree's first nodes to verify."""

    request_ids: list[str]
    trees: list[ProposedTree]
    counts: list[int]
    num_drafted: int


@dataclass
class BudgetPolicy:
    config: BudgetConfig
    cost: CostModel
    states: dict[str, RequestBudgetState] = field(default_factory=dict)
    population_gain: float | None = None  # EMA of accepted nodes per speculative round over all requests
    # n-gram proposals (ddtree.ngram): per chain depth d, an EMA over all requests of whether verifying the chain
    # alone would have accepted its first d tokens; the prior is what SmolLM2's own answers gave. A request's chain
    # nodes are valued at its own EMA, which starts from this one (`ngram_values`).
    ngram_acceptance: list[float] = field(default_factory=lambda: [0.5, 0.35, 0.25])

    def add(self, request_id: str) -> None:
        self.states[request_id] = RequestBudgetState()

    def remove(self, request_id: str) -> None:
        """A request leaves. One that never drafted (it started in fallback and left before its first probe) taught
        nothing: the population's gain moves one weight back toward the optimistic `initial_gain`, so that a run of
        requests that did not pay (a long sampled one that accepted nothing for thousands of rounds, say) cannot
        keep drafting off for every short request after it, none of which would live to be probed."""
        s = self.states.pop(request_id, None)
        if s is not None and s.gain is None and self.population_gain is not None:
            pw = self.config.ema_weight
            self.population_gain = (1 - pw) * self.population_gain + pw * self.config.initial_gain

    @property
    def draft_node_cap(self) -> int:
        """Nodes one request may draft in a round: the fixed budget, or auto mode's cap."""
        return self.config.fixed_budget or self.config.max_budget

    def plan(self, request_ids: list[str]) -> RoundPlan:
        cap = self.draft_node_cap
        if not self.config.allow_fallback or self.config.fixed_budget is not None:
            return RoundPlan(list(request_ids), [], [cap] * len(request_ids))
        num_requests = len(request_ids)
        candidates = [rid for rid in request_ids if not self.states[rid].is_fallback]
        resting = [rid for rid in request_ids if self.states[rid].is_fallback]
        chosen, gain, nodes = self._choose_speculative(candidates, num_requests)
        chosen_set = set(chosen)
        # Probes are priced against the round without them (once per round: `_ProbePrice`), and only for requests
        # whose backoff has passed, since a probe needs both.
        probing = []
        price = None
        for rid in resting:
            s = self.states[rid]
            if s.num_rounds_rested < s.probe_interval:
                continue
            price = price or self._probe_price(num_requests, len(chosen), nodes, num_requests + gain)
            if s.num_rounds_rested >= self._probe_cost_interval(price, s):
                probing.append(rid)
        chosen_set.update(probing)
        for rid in candidates:
            if rid not in chosen_set:
                self._enter_fallback(self.states[rid])
        for rid in request_ids:
            if rid not in chosen_set:
                self.states[rid].num_rounds_rested += 1
        speculative = [rid for rid in request_ids if rid in chosen_set]
        autoregressive = [rid for rid in request_ids if rid not in chosen_set]
        return RoundPlan(speculative, autoregressive, [cap] * len(speculative))

    def _choose_speculative(self, candidates: list[str], num_requests: int) -> tuple[list[str], float, float]:
        """The candidates in decreasing expected gain, as many as maximise the round's tokens per second (ties: the
        more); returns them with their summed expected gain and nodes."""
        candidates = sorted(candidates, key=lambda rid: -self._gain(self.states[rid]))
        # Every prefix is priced, not only until the rate first drops: a drafter forward that costs about the same
        # for 1 or 16 requests (a GPU's) makes one more request alone look worse than none, several better.
        plain_rate = num_requests / self._round_seconds(num_requests, 0, 0.0)
        best = (plain_rate, 0, 0.0, 0.0)  # (rate, count, gain, nodes)
        gain = nodes = 0.0
        for count, rid in enumerate(candidates, start=1):
            s = self.states[rid]
            gain, nodes = gain + self._gain(s), nodes + self._expected_nodes(s)
            rate = (num_requests + gain) / self._round_seconds(num_requests, count, nodes)
            if rate >= best[0]:
                best = (rate, count, gain, nodes)
        rate, count, gain, nodes = best
        if not self._beats_plain(rate, plain_rate):
            return [], 0.0, 0.0
        return candidates[:count], gain, nodes

    def _probe_price(
        self, num_requests: int, num_speculative: int, num_nodes: float, num_tokens_expected: float
    ) -> _ProbePrice:
        """What a probe is priced against in a round of `num_requests` requests of which `num_speculative` draft
        `num_nodes` nodes in all and commit `num_tokens_expected` tokens (see the module docstring)."""
        base_tokens = num_requests + round(num_nodes)
        round_seconds = self._round_seconds(num_requests, num_speculative, num_nodes)
        return _ProbePrice(
            num_requests,
            base_tokens,
            round_seconds / max(num_tokens_expected, 1e-9),
            self.cost.draft_seconds(num_speculative + 1) - self.cost.draft_seconds(num_speculative),
            self.cost.verify_seconds(base_tokens, num_requests),
        )

    def _probe_cost_interval(self, price: _ProbePrice, s: RequestBudgetState) -> int:
        """Fewest autoregressive rounds between probes of `s` for which its probes' expected extra seconds stay
        within `max_probe_overhead` of its time, in the round `price` describes (see the module docstring)."""
        extra = (
            price.draft_extra
            + self.cost.verify_seconds(price.base_tokens + round(self._expected_nodes(s)), price.num_requests)
            - price.base_verify
            - self._observed_gain(s) * price.seconds_per_token
        )
        if extra <= 0:
            return 0
        return math.ceil(extra / (self.config.max_probe_overhead * price.seconds_per_token))

    def pipeline_speedup(self, request_ids: list[str]) -> float:
        """Predicted speed of two request groups in flight over one round for all, for these running requests.

        Sequential: draft(S) + verify(T) for S speculating requests and T packed tokens. Pipelined: the round's work
        in two phases, each costing the larger of drafting half the speculating requests and verifying half the
        tokens (drafter and target work at the same time on separate devices); 1.0 below two speculating
        requests, where the phases would just alternate draft and verify."""
        is_speculating = self.config.fixed_budget is not None or not self.config.allow_fallback
        speculating = [r for r in request_ids if is_speculating or not self.states[r].is_fallback]
        if len(speculating) < 2:
            return 1.0
        num_tokens = len(request_ids) + round(sum(self._expected_nodes(self.states[r]) for r in speculating))
        num_requests = len(request_ids)
        sequential = self.cost.draft_seconds(len(speculating)) + self.cost.verify_seconds(num_tokens, num_requests)
        phase = max(
            self.cost.draft_seconds((len(speculating) + 1) // 2),
            self.cost.verify_seconds((num_tokens + 1) // 2, (num_requests + 1) // 2),
        )
        return sequential / (2 * phase)

    def _beats_plain(self, rate: float, plain_rate: float) -> bool:
        """A round's predicted tokens per second clear plain decoding's by the margin (`speculation_margin`)."""
        return rate >= plain_rate * (1 + self.config.speculation_margin)

    def _round_seconds(self, num_requests: int, num_speculative: int, num_nodes: float) -> float:
        return self.cost.draft_seconds(num_speculative) + self.cost.verify_seconds(
            num_requests + round(num_nodes), num_requests
        )

    def _gain(self, s: RequestBudgetState) -> float:
        if s.gain is not None:
            return s.gain
        return self.config.initial_gain if self.population_gain is None else self.population_gain

    def _observed_gain(self, s: RequestBudgetState) -> float:
        """The gain a probe is credited with: observed on this request or on the others, never the optimistic
        `initial_gain` (which buys the drafter a try, not cheaper probes)."""
        if s.gain is not None:
            return s.gain
        return 0.0 if self.population_gain is None else self.population_gain

    def _expected_nodes(self, s: RequestBudgetState) -> float:
        """Nodes the request is expected to verify if it drafts: what the allocation gave it lately; before any
        observation, a prior that grows with its expected gain."""
        if s.nodes is not None:
            return max(1.0, s.nodes)
        return min(self.draft_node_cap, max(1.0, 4.0 * self._gain(s)))

    def _enter_fallback(self, s: RequestBudgetState) -> None:
        s.is_fallback = True
        s.probe_interval = min(
            self.config.max_probe_interval, max(self.config.min_probe_interval, 2 * s.probe_interval)
        )
        s.num_rounds_rested = 0

    def allocate(
        self,
        request_ids: list[str],
        path_probs: list[list[float]],
        num_autoregressive: int,
        num_drafted: int | None = None,
        packed: tuple[int, float, int] = (0, 0.0, 0),
    ) -> list[int]:
        """Node count per request with a tree. `path_probs[i]` are request i's node values in pop order: the first
        `num_drafted` requests (default: all) were drafted (values calibrated per request); the others carry only
        an n-gram chain (values from `ngram_values`, no drafter cost). `num_autoregressive` requests verify their
        root alone. `packed`: tokens that trees allocated earlier put into the same verify pass, the tokens they
        are expected to commit, and their requests (pipelined mode: the group drafted in the previous phase; newly
        admitted prompts)."""
        num_drafted = len(request_ids) if num_drafted is None else num_drafted
        if self.config.fixed_budget is not None:
            return [min(self.config.fixed_budget, len(p)) for p in path_probs]
        # All nodes in decreasing calibrated value (a flat list and its owners; the sort is stable, so ties keep
        # each request's pop order, and values within a request are non-increasing).
        values: list[float] = []
        owners: list[int] = []
        for i, (rid, probs) in enumerate(zip(request_ids, path_probs)):
            s = self.states[rid]
            # A probe asks whether the drafter pays again, so its tree is sized by the draft's own probabilities:
            # the stale calibration that put the request in fallback would give it no nodes, and it would learn
            # nothing.
            c = 1.0 if i >= num_drafted or s.is_fallback else s.calibration
            values.extend([min(1.0, c * p) for p in probs] if c > 1.0 else [c * p for p in probs])
            owners.extend([i] * len(probs))
        order = sorted(range(len(values)), key=values.__getitem__, reverse=True)
        num_requests = len(request_ids) + num_autoregressive
        num_packed_tokens, packed_expected, num_packed_requests = packed
        draft_seconds = self.cost.draft_seconds(num_drafted)
        verify_seconds = self.cost.verify_seconds_range(
            num_requests + num_packed_tokens, len(values) + 1, num_requests + num_packed_requests
        )
        expected = itertools.accumulate((values[j] for j in order), initial=num_requests + packed_expected)
        rates = [e / (draft_seconds + v) for e, v in zip(expected, verify_seconds)]
        best_k = rates.index(max(rates))  # the first maximum: the fewest nodes at the best rate
        if not self._beats_plain(rates[best_k], rates[0]):
            best_k = 0
        counts = [0] * len(request_ids)
        for j in order[:best_k]:
            counts[owners[j]] += 1
        return counts

    def allocate_round(
        self,
        plan: RoundPlan,
        drafted: list[ProposedTree],
        chains: dict[str, list[int]],
        packed: tuple[int, float, int] = (0, 0.0, 0),
    ) -> RoundAllocation:
        """The round's allocation with n-gram chains (`chains`: per request id, possibly empty): a drafted request's
        chain merges into its tree (`drafted`, one per `plan.speculative_ids`); a request planned autoregressive
        verifies its chain as a tree of its own; the rest verify their root alone. `packed`: as for `allocate`.

        A merge re-orders a tree in Python, so it goes into what an allocation without chains keeps, plus room for
        the chain: chain nodes only raise the value a tree node must have to be kept, so the nodes cut first would
        be cut anyway. Two allocations cost less than merging into the whole trees at GPU batch sizes
        (`python -m benchmarks.bench_policy`: 64 requests x 64 nodes 2.7 ms against 3.8; one request 0.09 against
        0.06)."""
        trees = list(drafted)
        if any(chains.get(rid) for rid in plan.speculative_ids):
            first = self.allocate(
                plan.speculative_ids, [t.values for t in trees], len(plan.autoregressive_ids), packed=packed
            )
            for i, rid in enumerate(plan.speculative_ids):
                if chains.get(rid):
                    keep = first[i] + len(chains[rid])
                    trees[i] = self._merged(
                        rid, trees[i].token_ids[:keep], trees[i].parents[:keep], trees[i].values[:keep], chains[rid]
                    )
        request_ids = list(plan.speculative_ids)
        for rid in plan.autoregressive_ids:
            if chains.get(rid):
                trees.append(self._merged(rid, [], [], [], chains[rid]))
                request_ids.append(rid)
        num_drafted = len(plan.speculative_ids)
        if not trees:
            return RoundAllocation([], [], [], 0)
        num_root_only = len(plan.autoregressive_ids) - (len(request_ids) - num_drafted)
        counts = self.allocate(
            request_ids, [t.values for t in trees], num_root_only, num_drafted=num_drafted, packed=packed
        )
        return RoundAllocation(request_ids, trees, counts, num_drafted)

    def _merged(
        self, request_id: str, token_ids: list[int], parents: list[int], values: list[float], chain: list[int]
    ) -> ProposedTree:
        token_ids, parents, depths, values = merge_chain(
            token_ids, parents, values, chain, self.ngram_values(len(chain), request_id)
        )
        return ProposedTree(values, token_ids, parents, depths)

    def ngram_values(self, chain_length: int, request_id: str | None = None) -> list[float]:
        """Values of an n-gram chain's nodes: the observed chance that the chain alone is accepted that deep, for
        this request (the population's until one of its chains is judged).

        Per request because how often chains hold differs by text far more than by round (code repeats its names,
        chat seldom itself): at the population's mean, a batch's chat requests' chains would be priced at what its
        code requests' earn, and verified where they do not repay their rows."""
        s = self.states.get(request_id) if request_id is not None else None
        values = s.ngram_acceptance if s is not None and s.ngram_acceptance is not None else self.ngram_acceptance
        _extend_chain_values(values, chain_length)
        return list(values[:chain_length])

    def observe_ngram(self, num_known: int, num_accepted: int, request_id: str | None = None) -> None:
        """A proposed chain (of `request_id`, if given) whose first `num_known` depths have a known outcome: the
        first `num_accepted` of them would be accepted by verifying the chain alone, the rest not. The request's
        values move by `ema_weight` (a round's weight, as its other estimates), the population's by
        `ngram_ema_weight` per chain."""
        s = self.states.get(request_id) if request_id is not None else None
        if s is not None:
            if s.ngram_acceptance is None:
                s.ngram_acceptance = list(self.ngram_acceptance)
            _observe_chain_values(s.ngram_acceptance, num_known, num_accepted, self.config.ema_weight)
        _observe_chain_values(self.ngram_acceptance, num_known, num_accepted, self.config.ngram_ema_weight)

    def observe_proposal(self, chain: list[int] | None, committed: list[int], request_id: str | None = None) -> int:
        """How many of a proposed chain's tokens the target's own (`committed`: accepted + bonus) confirm, recorded
        for the chain values, whether or not the chain was verified: at T=0 the target's tokens along the committed
        path are what verifying the chain alone would have compared it with (at T>0 too: samples are keyed by
        position). A rejection at depth k settles every depth from k on: the chain is not accepted that deep (a
        depth's value is the chance of accepting the chain that deep, not past the depth before). Depths past the
        committed tokens, after a confirmed prefix, stay unknown."""
        if not chain:
            return 0
        num_confirmed = chain_acceptance(chain, committed)
        is_rejection_known = num_confirmed < min(len(chain), len(committed))
        self.observe_ngram(len(chain) if is_rejection_known else num_confirmed, num_confirmed, request_id)
        return num_confirmed

    def observe(
        self,
        request_id: str,
        predicted: float,
        num_accepted_nodes: int,
        num_nodes: int | None = None,
        num_accepted_without_draft: int = 0,
    ) -> None:
        """After a speculative round: `predicted` = S(b) of the `num_nodes` verified nodes (uncalibrated);
        `num_accepted_without_draft`: what the round's n-gram chain alone would have accepted. Drafting's gain is
        the accepted nodes beyond that (a request in fallback verifies its chain too)."""
        s = self.states[request_id]
        # The estimates aged over the rounds it rested: the newest observation weighs what those rounds would have.
        w = 1.0 - (1.0 - self.config.ema_weight) ** (1 + s.num_rounds_rested)
        if num_nodes is not None:
            s.nodes = num_nodes if s.nodes is None else (1 - w) * s.nodes + w * num_nodes
        s.calibration_num = (1 - w) * s.calibration_num + w * num_accepted_nodes
        s.calibration_den = (1 - w) * s.calibration_den + w * predicted
        # A request's first observation moves its prior, the population's gain, by one round's weight: one round's
        # acceptance varies too much (0 in ~40% of rounds) to replace what all requests have shown.
        gain = max(0, num_accepted_nodes - num_accepted_without_draft)  # < 0 only where the allocation cut the chain
        prior = s.gain if s.gain is not None else self.population_gain
        s.gain = gain if prior is None else (1 - w) * prior + w * gain
        pw = self.config.ema_weight
        pg = self.population_gain
        self.population_gain = gain if pg is None else (1 - pw) * pg + pw * gain
        if s.is_fallback:  # this was a probe: stay out unless it paid
            if self.plan_would_keep(s):
                s.is_fallback, s.probe_interval, s.num_rounds_rested = False, 0, 0
            else:
                self._enter_fallback(s)

    def plan_would_keep(self, s: RequestBudgetState) -> bool:
        """A probe pays when drafting one request alone beats one autoregressive step in tokens per second, by the
        margin a round's plan asks (`speculation_margin`)."""
        nodes = self._expected_nodes(s)
        spec = (1 + self._gain(s)) / (self.cost.draft_seconds(1) + self.cost.verify_seconds(1 + round(nodes)))
        return spec > (1 + self.config.speculation_margin) / self.cost.verify_seconds(1)


def _extend_chain_values(values: list[float], chain_length: int) -> None:
    while len(values) < chain_length:  # deeper than the prior: decay as it does
        values.append(0.7 * values[-1])


def _observe_chain_values(values: list[float], num_known: int, num_accepted: int, weight: float) -> None:
    _extend_chain_values(values, num_known)
    for d in range(num_known):
        values[d] = (1 - weight) * values[d] + weight * float(d < num_accepted)
    for d in range(1, len(values)):  # values must not grow with depth (chains stay trees)
        values[d] = min(values[d], values[d - 1])
