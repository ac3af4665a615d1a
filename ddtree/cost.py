"""The cost model: seconds per verify pass by packed tokens and requests, and per drafter forward by requests.

Measured at start-up (`Engine.measure_cost_model`) and refreshed from every round's own timings, so that a
measurement on a quiet machine does not misprice a loaded one. Plain floats and lists: the budget policy
(ddtree.budget) prices rounds with it, and the replay (ddtree.budget_replay) scripts it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class CostModel:
    """Seconds per verify pass as a function of packed tokens and requests, and per drafter forward as a function
    of requests.

    A verify pass of N tokens over R requests is priced as load(R) x (f(N) + g(R)), all three piecewise-linear:
    - f: one request's pass of N tokens (`verify_points`, measured at start-up);
    - g: what its other R - 1 requests add beyond their tokens (`batch_points`, a pass over R one-token requests
      measured at start-up, less f(R)): each request attends to a cache of its own, so 8 requests' roots cost
      more than 8 tokens of one request, while a token that a tree or a chain adds to a request costs what f says;
    - load: the live factor by requests, 1 at start-up.
    Every observed pass moves the load at the two request counts around its own toward the ratio observed / priced
    (an EMA of weight `refresh_weight`, shared between the two by their interpolation shares), and f at the two
    token counts around its own by a quarter of that weight. The load carries what the start-up profile could not
    see (a loaded machine, contexts longer than the profile's) to every size of a batch: refreshed only at the size
    each pass ran at (the rounds of a loaded batch run at one size, most of them), a price learned there would
    leave the sizes beside it at their start-up level, and the rows that a chain or a tree adds beyond it would look
    nearly free. f's slower refresh mends a start-up profile whose shape is off (timed while the machine was busy).
    The ratio is bounded (MAX_REFRESH_RATIO), so one stalled round moves a price by a bounded step.

    f and g are priced as their points' non-decreasing envelopes (more work never costs less: a measured dip is
    noise, and would make large batches look nearly free), extrapolated past the last point at its last segment's
    slope or, if less, the curve's average slope; the load is flat past its first and last points. The drafter's
    curve (`draft_points`, seconds by requests) is refreshed at its own points, by `refresh_weight`."""

    verify_points: list[tuple[int, float]]  # (num_tokens, seconds) of one request's pass, increasing num_tokens
    draft_points: list[tuple[int, float]]  # (num_requests, seconds), increasing num_requests
    # (num_requests, seconds) of a pass over that many one-token requests; None: requests add nothing of their own
    batch_points: list[tuple[int, float]] | None = None
    refresh_weight: float = 0.2

    def __post_init__(self) -> None:
        named = [("verify_points", self.verify_points), ("draft_points", self.draft_points)]
        for name, pts in named + [("batch_points", self.batch_points or [(1, 1.0)])]:
            if not pts or any(n <= 0 or s <= 0 for n, s in pts):
                raise ValueError(f"CostModel.{name} needs positive (count, seconds) points, got {pts!r}")
            if len({int(n) for n, _ in pts}) != len(pts):
                raise ValueError(f"CostModel.{name} has two points at one count: {pts!r}")
        self.verify_points = sorted((int(n), float(s)) for n, s in self.verify_points)
        self.draft_points = sorted((int(n), float(s)) for n, s in self.draft_points)
        batch = sorted((int(r), float(s)) for r, s in self.batch_points or [] if int(r) > 1)
        self._verify_curve = _envelope(self.verify_points)
        # g: (1, 0) first, never below 0
        self.request_points = [(1, 0.0)] + [(r, max(0.0, s - _interpolate(self.verify_points, r))) for r, s in batch]
        self._request_curve = _envelope(self.request_points)
        self.load_points = [(r, 1.0) for r, _ in self.request_points]
        self._draft_curve = _envelope(self.draft_points)

    def verify_seconds(self, num_tokens: int, num_requests: int = 1) -> float:
        return self.load(num_requests) * self._base(num_tokens, num_requests)

    def load(self, num_requests: int) -> float:
        """The live factor of a pass over `num_requests` requests (1 until passes are observed)."""
        return _interpolate_flat(self.load_points, num_requests)

    def verify_seconds_of_part(
        self, num_tokens: int, num_part: int, num_requests: int = 1, num_part_requests: int = 0
    ) -> float:
        """What `num_part` of a verify pass's `num_tokens` packed tokens, and `num_part_requests` of its
        `num_requests` requests, add to it: the pass's price less that of the pass without them, at the pass's
        load (never negative: the curves are non-decreasing)."""
        rest = self._base(max(1, num_tokens - num_part), max(1, num_requests - num_part_requests))
        return self.load(num_requests) * (self._base(num_tokens, num_requests) - rest)

    def verify_seconds_range(self, first: int, count: int, num_requests: int = 1) -> list[float]:
        """`verify_seconds(n, num_requests)` for n = first, first + 1, ..., first + count - 1, in one sweep of the
        points."""
        load, extra = self.load(num_requests), self._g(num_requests)
        return [load * (s + extra) for s in _interpolate_range(self._verify_curve, first, count)]

    def draft_seconds(self, num_requests: int) -> float:
        return 0.0 if num_requests == 0 else _interpolate(self._draft_curve, num_requests)

    def observe_verify(self, num_tokens: int, seconds: float, num_requests: int = 1) -> None:
        ratio = _bounded(seconds / self.verify_seconds(num_tokens, num_requests))
        _scale_around(self.load_points, num_requests, ratio, self.refresh_weight)
        _scale_around(self.verify_points, num_tokens, ratio, self.refresh_weight * SHAPE_REFRESH_SHARE)
        self._verify_curve = _envelope(self.verify_points)

    def observe_draft(self, num_requests: int, seconds: float) -> None:
        if num_requests > 0:
            ratio = _bounded(seconds / _interpolate(self.draft_points, num_requests))
            _scale_around(self.draft_points, num_requests, ratio, self.refresh_weight)
            self._draft_curve = _envelope(self.draft_points)

    def _base(self, num_tokens: int, num_requests: int) -> float:
        """f(N) + g(R): the start-up price, before the load."""
        return _interpolate(self._verify_curve, num_tokens) + self._g(num_requests)

    def _g(self, num_requests: int) -> float:
        return 0.0 if num_requests <= 1 else _interpolate(self._request_curve, num_requests)


def verify_cost_counts(max_tokens: int, largest: int = 256, row_tile: int = 8, tiled_up_to: int = 64) -> list[int]:
    """The packed token counts the start-up profile times: powers of two up to `max_tokens` and `largest`, every
    multiple of `row_tile` up to `tiled_up_to`, and from `row_tile` on the count one past each (where it is at most
    `max_tokens`). Kernels run rows in tiles (8 rows of a panel on the CPU kernels, a power of two on GPUs), so a
    verify's cost steps where a row starts a new tile; a curve interpolated across the step (16 -> 32) would price
    the first rows past it at a fraction of what they cost, and the policy would add them (an n-gram chain's one
    token beside 24 plain rows) for far less than they take. Up to `tiled_up_to` a step is a large share of a
    pass."""
    top = min(max_tokens, largest)
    counts = {n for n in range(row_tile, min(top, tiled_up_to) + 1, row_tile)}
    n = 1
    while n <= top:
        counts.add(n)
        n *= 2
    counts |= {c + 1 for c in counts if c >= row_tile and c + 1 <= max_tokens}
    return sorted(counts)


def batch_cost_counts(max_num_seqs: int) -> list[int]:
    """The request counts the start-up profile times a batch of one-token requests at: powers of two from 2 below
    `max_num_seqs`, and `max_num_seqs` itself (past it, the curve extrapolates linearly: a request's own cost)."""
    counts, r = [], 2
    while r < max_num_seqs:
        counts.append(r)
        r *= 2
    return counts + [max_num_seqs] if max_num_seqs > 1 else []


SHAPE_REFRESH_SHARE = 0.25  # f's refresh weight, as a share of the load's
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


def _interpolate_flat(points: list[tuple[int, float]], x: int) -> float:
    """Linear between the points, flat before the first and past the last."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    return _interpolate(points, x)


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


def _bounded(ratio: float) -> float:
    return min(max(ratio, 1.0 / MAX_REFRESH_RATIO), MAX_REFRESH_RATIO)


def _scale_around(points: list[tuple[int, float]], x: int, ratio: float, weight: float) -> None:
    """Move the points around `x` toward `ratio` (observed / priced there) by `weight`, each by its share of the
    interpolation at `x` (the nearest point alone before the first and past the last one)."""
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
