"""Node budgets: DDTree at the batch level (policy only: floats, ints and lists; no tensors).

The tree builder pops nodes in decreasing draft path probability q(u), so the expected acceptance of a request's
first b nodes is S(b) = sum of their q(u). The drafter is over- or under-confident per request; an exponential moving
average of observed accepted nodes over predicted S(b) calibrates it: a node is worth c_r * q(u) expected tokens.

Per round:
- `plan()` (before drafting): which requests speculate. Each request's expected gain from drafting is its EMA of
  accepted nodes per round; the requests are added in decreasing gain while the round's committed tokens per second
  improve (cost = drafter forward for the speculating requests + verify of all packed tokens). The others go
  autoregressive, with no drafter call at all, and are probed again after `probe_interval` rounds (doubling while
  the probe fails, so a request that never pays costs almost nothing).
- `allocate()` (after drafting): merges all speculating requests' nodes in decreasing calibrated value and keeps the
  total that maximises expected committed tokens per second of the whole round.
- `observe()` (after verify): updates the calibration and the gain of each request that speculated.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class CostModel:
    """Seconds per verify pass as a function of packed tokens, and per drafter forward as a function of requests.

    Piecewise-linear in the measured points (measured at start-up), extrapolated linearly past the last one; live
    timings refresh it (an EMA of the ratio observed / predicted per point)."""

    verify_points: list[tuple[int, float]]  # (num_tokens, seconds), increasing num_tokens
    draft_points: list[tuple[int, float]]  # (num_requests, seconds), increasing num_requests
    refresh_weight: float = 0.2

    def __post_init__(self) -> None:
        for name, pts in (("verify_points", self.verify_points), ("draft_points", self.draft_points)):
            if not pts or any(n <= 0 or s <= 0 for n, s in pts):
                raise ValueError(f"CostModel.{name} needs positive (count, seconds) points, got {pts!r}")
        self.verify_points = sorted((int(n), float(s)) for n, s in self.verify_points)
        self.draft_points = sorted((int(n), float(s)) for n, s in self.draft_points)

    def verify_seconds(self, num_tokens: int) -> float:
        return _interpolate(self.verify_points, num_tokens)

    def draft_seconds(self, num_requests: int) -> float:
        return 0.0 if num_requests == 0 else _interpolate(self.draft_points, num_requests)

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        _refresh(self.verify_points, num_tokens, seconds, self.refresh_weight)

    def observe_draft(self, num_requests: int, seconds: float) -> None:
        if num_requests > 0:
            _refresh(self.draft_points, num_requests, seconds, self.refresh_weight)


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i < len(points) and xs[i] == x:
        return points[i][1]
    if len(points) == 1:
        return points[0][1] * max(x, 1) / points[0][0] if x > points[0][0] else points[0][1]
    if i == 0:
        return points[0][1]
    if i == len(points):
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


def _refresh(points: list[tuple[int, float]], x: int, seconds: float, weight: float) -> None:
    """Scale the nearest measured point toward the observed/predicted ratio."""
    predicted = _interpolate(points, x)
    ratio = seconds / predicted
    i = min(range(len(points)), key=lambda k: abs(points[k][0] - x))
    n, s = points[i]
    points[i] = (n, s * (1.0 - weight + weight * ratio))


@dataclass
class RequestBudgetState:
    calibration_num: float = 1.0  # EMA of observed accepted nodes
    calibration_den: float = 1.0  # EMA of predicted S(b)
    gain: float | None = None  # EMA of accepted nodes per speculative round; None until observed
    nodes: float | None = None  # EMA of nodes verified per speculative round; None until observed
    is_fallback: bool = False
    rounds_until_probe: int = 0
    probe_interval: int = 0

    @property
    def calibration(self) -> float:
        return self.calibration_num / max(self.calibration_den, 1e-6)


@dataclass
class BudgetConfig:
    fixed_budget: int | None = None  # None: adaptive ("auto"); an int: every speculating request gets exactly this
    max_budget: int = 64  # per-request cap in auto mode (and the top-K the drafter returns)
    ema_weight: float = 0.3  # weight of the newest observation
    initial_gain: float = 2.0  # optimistic prior so that every request drafts at first
    min_probe_interval: int = 4
    max_probe_interval: int = 64
    allow_fallback: bool = True

    def __post_init__(self) -> None:
        if self.fixed_budget is not None and (not isinstance(self.fixed_budget, int) or self.fixed_budget < 1):
            raise ValueError(f"budget must be 'auto' or an integer >= 1, got {self.fixed_budget!r}")
        if self.max_budget < 1:
            raise ValueError(f"max_budget must be >= 1, got {self.max_budget!r}")
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight!r}")


@dataclass
class RoundPlan:
    speculative_ids: list[str]  # draft these, in this order
    autoregressive_ids: list[str]  # one token each, no drafter call
    max_budgets: list[int]  # per speculative request: nodes the tree builder may produce


@dataclass
class BudgetPolicy:
    config: BudgetConfig
    cost: CostModel
    states: dict[str, RequestBudgetState] = field(default_factory=dict)

    def add(self, request_id: str) -> None:
        self.states[request_id] = RequestBudgetState()

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @property
    def budget_cap(self) -> int:
        return self.config.fixed_budget or self.config.max_budget

    def _gain(self, s: RequestBudgetState) -> float:
        return self.config.initial_gain if s.gain is None else s.gain

    def plan(self, request_ids: list[str]) -> RoundPlan:
        cap = self.budget_cap
        if not self.config.allow_fallback or self.config.fixed_budget is not None:
            return RoundPlan(list(request_ids), [], [cap] * len(request_ids))
        probing, candidates, resting = [], [], []
        for rid in request_ids:
            s = self.states[rid]
            if not s.is_fallback:
                candidates.append(rid)
            elif s.rounds_until_probe <= 0:
                probing.append(rid)
            else:
                s.rounds_until_probe -= 1
                resting.append(rid)
        # Add candidates in decreasing expected gain while the round's tokens per second improve.
        candidates.sort(key=lambda rid: -self._gain(self.states[rid]))
        num_requests = len(request_ids)
        chosen = list(probing)
        gain = sum(self._gain(self.states[r]) for r in chosen)
        nodes = sum(self._expected_nodes(self.states[r]) for r in chosen)

        def rate(num_spec: int, gain: float, nodes: float) -> float:
            seconds = self.cost.draft_seconds(num_spec) + self.cost.verify_seconds(num_requests + round(nodes))
            return (num_requests + gain) / seconds

        best = rate(len(chosen), gain, nodes)
        num_taken = 0
        for rid in candidates:
            s = self.states[rid]
            g, n = gain + self._gain(s), nodes + self._expected_nodes(s)
            r = rate(len(chosen) + 1, g, n)
            if r < best:
                break
            best, gain, nodes = r, g, n
            chosen.append(rid)
            num_taken += 1
        for rid in candidates[num_taken:]:
            self._enter_fallback(self.states[rid])
            resting.append(rid)
        chosen_set = set(chosen)
        speculative = [rid for rid in request_ids if rid in chosen_set]
        autoregressive = [rid for rid in request_ids if rid not in chosen_set]
        return RoundPlan(speculative, autoregressive, [cap] * len(speculative))

    def _expected_nodes(self, s: RequestBudgetState) -> float:
        """Nodes the request is expected to verify if it drafts: what the allocation gave it lately; before any
        observation, a prior that grows with its expected gain."""
        if s.nodes is not None:
            return max(1.0, s.nodes)
        return min(self.budget_cap, max(1.0, 4.0 * self._gain(s)))

    def _enter_fallback(self, s: RequestBudgetState) -> None:
        s.is_fallback = True
        s.probe_interval = min(
            self.config.max_probe_interval, max(self.config.min_probe_interval, 2 * s.probe_interval)
        )
        s.rounds_until_probe = s.probe_interval

    def allocate(self, request_ids: list[str], path_probs: list[list[float]], num_autoregressive: int) -> list[int]:
        """Node count per speculating request. `path_probs[i]` are request i's node probabilities in pop order."""
        if self.config.fixed_budget is not None:
            return [min(self.config.fixed_budget, len(p)) for p in path_probs]
        values = []  # (calibrated value, request index); within a request values are non-increasing
        for i, (rid, probs) in enumerate(zip(request_ids, path_probs)):
            c = self.states[rid].calibration
            values.extend((min(1.0, c * p), i) for p in probs)
        values.sort(key=lambda v: -v[0])  # stable: ties keep each request's pop order
        num_requests = len(request_ids) + num_autoregressive
        draft_seconds = self.cost.draft_seconds(len(request_ids))
        best_rate, best_k, expected = -1.0, 0, float(num_requests)
        for k in range(len(values) + 1):
            if k > 0:
                expected += values[k - 1][0]
            rate = expected / (draft_seconds + self.cost.verify_seconds(num_requests + k))
            if rate > best_rate:
                best_rate, best_k = rate, k
        counts = [0] * len(request_ids)
        for _, i in values[:best_k]:
            counts[i] += 1
        return counts

    def observe(
        self, request_id: str, predicted: float, num_accepted_nodes: int, num_nodes: int | None = None
    ) -> None:
        """After a speculative round: `predicted` = S(b) of the `num_nodes` verified nodes (uncalibrated)."""
        s = self.states[request_id]
        w = self.config.ema_weight
        if num_nodes is not None:
            s.nodes = num_nodes if s.nodes is None else (1 - w) * s.nodes + w * num_nodes
        s.calibration_num = (1 - w) * s.calibration_num + w * num_accepted_nodes
        s.calibration_den = (1 - w) * s.calibration_den + w * predicted
        s.gain = num_accepted_nodes if s.gain is None else (1 - w) * s.gain + w * num_accepted_nodes
        if s.is_fallback:  # this was a probe: stay out unless it paid
            if self.plan_would_keep(s):
                s.is_fallback, s.probe_interval = False, 0
            else:
                self._enter_fallback(s)

    def plan_would_keep(self, s: RequestBudgetState) -> bool:
        """A probe pays when drafting one request alone beats one autoregressive step in tokens per second."""
        nodes = self._expected_nodes(s)
        spec = (1 + self._gain(s)) / (self.cost.draft_seconds(1) + self.cost.verify_seconds(1 + round(nodes)))
        return spec > 1.0 / self.cost.verify_seconds(1)
