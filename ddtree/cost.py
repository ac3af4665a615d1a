"""The cost model: seconds per verify pass by packed tokens, and per drafter forward by requests.

Measured at start-up (`Engine.measure_cost_model`) and refreshed from every round's own timings, so that a
measurement on a quiet machine does not misprice a loaded one. Plain floats and lists: the budget policy
(ddtree.budget) prices rounds with it, and the replay (ddtree.budget_replay) scripts it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class CostModel:
    """Seconds per verify pass as a function of packed tokens, and per drafter forward as a function of requests.

    Piecewise-linear in the measured points (measured at start-up); live timings refresh them (an EMA of the ratio
    observed / predicted, shared between the two points around the observation, the ratio bounded so that one
    stalled round moves the curve by at most `refresh_weight` x (MAX_REFRESH_RATIO - 1)). The curve priced is the
    points' non-decreasing envelope (more work never costs less: a measured dip is noise, and would make large
    batches look nearly free), extrapolated past the last point at its last segment's slope or, if less, the
    curve's average slope."""

    verify_points: list[tuple[int, float]]  # (num_tokens, seconds), increasing num_tokens
    draft_points: list[tuple[int, float]]  # (num_requests, seconds), increasing num_requests
    refresh_weight: float = 0.2

    def __post_init__(self) -> None:
        for name, pts in (("verify_points", self.verify_points), ("draft_points", self.draft_points)):
            if not pts or any(n <= 0 or s <= 0 for n, s in pts):
                raise ValueError(f"CostModel.{name} needs positive (count, seconds) points, got {pts!r}")
            if len({int(n) for n, _ in pts}) != len(pts):
                raise ValueError(f"CostModel.{name} has two points at one count: {pts!r}")
        self.verify_points = sorted((int(n), float(s)) for n, s in self.verify_points)
        self.draft_points = sorted((int(n), float(s)) for n, s in self.draft_points)
        self._verify_curve = _envelope(self.verify_points)
        self._draft_curve = _envelope(self.draft_points)

    def verify_seconds(self, num_tokens: int) -> float:
        return _interpolate(self._verify_curve, num_tokens)

    def verify_seconds_of_part(self, num_tokens: int, num_part: int) -> float:
        """What `num_part` of a verify pass's `num_tokens` packed tokens add to it: the pass's price less that of
        the pass without them (the curve is non-decreasing, so never negative)."""
        return self.verify_seconds(num_tokens) - self.verify_seconds(max(1, num_tokens - num_part))

    def verify_seconds_range(self, first: int, count: int) -> list[float]:
        """`verify_seconds(n)` for n = first, first + 1, ..., first + count - 1, in one sweep of the points."""
        return _interpolate_range(self._verify_curve, first, count)

    def draft_seconds(self, num_requests: int) -> float:
        return 0.0 if num_requests == 0 else _interpolate(self._draft_curve, num_requests)

    def observe_verify(self, num_tokens: int, seconds: float) -> None:
        _refresh(self.verify_points, num_tokens, seconds, self.refresh_weight)
        self._verify_curve = _envelope(self.verify_points)

    def observe_draft(self, num_requests: int, seconds: float) -> None:
        if num_requests > 0:
            _refresh(self.draft_points, num_requests, seconds, self.refresh_weight)
            self._draft_curve = _envelope(self.draft_points)


def verify_cost_counts(max_tokens: int, largest: int = 256) -> list[int]:
    """The packed token counts the start-up profile times: powers of two up to `max_tokens` and `largest`, and from
    8 on the count one past each (where it is at most `max_tokens`). Kernels run rows in tiles of a power of two (8
    or 16 on CPU kernels, more on GPUs), so a verify's cost steps where a row starts a new tile; a curve
    interpolated across the step (16 -> 32) would price the first rows past it at a fraction of what they cost, and
    the policy would add them (an n-gram chain's one token beside 16 plain rows) for far less than they take."""
    counts, n = [], 1
    while n <= min(max_tokens, largest):
        counts += [n, n + 1] if n >= 8 and n + 1 <= max_tokens else [n]
        n *= 2
    return counts


MAX_REFRESH_RATIO = 2.0  # an observation counts as at most this many times (at least 1 / this) its prediction


def _envelope(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points made non-decreasing (each at least the one before)."""
    out, highest = [], 0.0
    for n, s in points:
        highest = max(highest, s)
        out.append((n, highest))
    return out


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
        (x1, y1) = points[-1]
        return y1 + _extrapolation_slope(points) * (x - x1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


def _extrapolation_slope(points: list[tuple[int, float]]) -> float:
    """Past the last point: its segment's slope, or the curve's average slope where that is less (a last segment
    flattened by noise would make larger batches look free)."""
    (x0, y0), (x1, y1) = points[-2], points[-1]
    (xf, yf) = points[0]
    return max((y1 - y0) / (x1 - x0), (y1 - yf) / (x1 - xf))


def _interpolate_range(points: list[tuple[int, float]], first: int, count: int) -> list[float]:
    """`_interpolate(points, x)` for x = first .. first + count - 1, segment by segment."""
    end = first + count
    if len(points) == 1 or count <= 0:
        return [_interpolate(points, x) for x in range(first, end)]
    out: list[float] = []
    x = first
    if x < points[0][0]:
        n = min(end, points[0][0]) - x
        out += [points[0][1]] * n
        x += n
    for i in range(1, len(points)):  # segment points[i - 1] .. points[i]
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        stop = min(end, x1 + 1)
        if x < stop:
            out += [max(y0 + (y1 - y0) * (v - x0) / (x1 - x0), 1e-9) for v in range(x, stop)]
            x = stop
    if x < end:  # past the last point
        (x1, y1), slope = points[-1], _extrapolation_slope(points)
        out += [y1 + slope * (v - x1) for v in range(x, end)]
    for px, py in points:  # measured points exactly, as `_interpolate` gives them
        if first <= px < end:
            out[px - first] = py
    return out


def _refresh(points: list[tuple[int, float]], x: int, seconds: float, weight: float) -> None:
    """Scale the points around `x` toward the ratio observed / what they predict there (the points themselves, not
    the envelope priced: a point below the envelope must still converge to what is observed at it), each by its
    share of the interpolation there (the nearest point alone before the first and past the last one)."""
    ratio = min(max(seconds / _interpolate(points, x), 1.0 / MAX_REFRESH_RATIO), MAX_REFRESH_RATIO)
    xs = [n for n, _ in points]
    i = bisect.bisect_left(xs, x)
    if i == 0 or i == len(points) or xs[i] == x:
        shares = [(min(i, len(points) - 1), 1.0)]
    else:
        right = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        shares = [(i - 1, 1.0 - right), (i, right)]
    for k, share in shares:
        n, s = points[k]
        points[k] = (n, s * (1.0 + weight * share * (ratio - 1.0)))
