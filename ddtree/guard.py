"""The closed loop over the budget policy: realised throughput decides whether a round speculates at all.

The budget policy (budget.py) prices trees with a cost model and calibrated draft probabilities. When either is
wrong (a loaded machine, a drafter whose probabilities flatter it), it may speculate where plain decoding is faster.
The guard does not second-guess the policy's decisions; it measures what they deliver. For each batch size (in
buckets: 1, 2, 3-4, 5-8, ...) it keeps the committed tokens per second of the rounds run as the policy planned them
("policy" arm) and of rounds run as plain decoding (no draft, no n-gram chain: what `speculation: off` does), each as
a ratio of exponential moving averages (tokens and seconds apart, so that a round's size weighs as it should). It
runs the arm that measures faster.

The other arm is explored in windows of `window_rounds` consecutive rounds, each measuring it afresh (its old
estimate is dropped), and only while the time spent on the arm measured slower stays within `max_explore_share` of
the bucket's round seconds. Exploring thus costs at most that share of the difference between the two arms' speeds,
plus each arm's first window per bucket. Why windows and a fresh estimate: a speculative round's tokens vary a lot
(none accepted in a third of rounds, streaks of them on hard passages), so the arm that runs is averaged over many
rounds (`weight`), and the arm left behind was typically left at a low point of its noise. Updated one exploring
round at a time it would stay low for thousands of rounds; a window's fresh mean is unbiased.

Policy only: integers and floats, no tensors (the engine times the rounds and counts their tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

POLICY, PLAIN = "policy", "plain"


def check_max_explore_share(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.5:
        raise ValueError(f"max_explore_share must be a number in [0, 0.5], got {value!r}")


@dataclass
class _Arm:
    tokens: float = 0.0  # EMA of committed tokens per round
    seconds: float = 0.0  # EMA of round seconds
    num_rounds: int = 0  # since the estimate was last started afresh
    total_rounds: int = 0

    def restart(self) -> None:
        self.tokens = self.seconds = 0.0
        self.num_rounds = 0

    def observe(self, num_tokens: int, seconds: float, weight: float) -> None:
        w = max(weight, 1.0 / (self.num_rounds + 1))  # the first rounds: their plain mean
        self.tokens += w * (num_tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.num_rounds += 1
        self.total_rounds += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    arms: dict[str, _Arm] = field(default_factory=lambda: {POLICY: _Arm(), PLAIN: _Arm()})
    num_rounds: int = 0
    seconds: float = 0.0  # of every round once both arms were measured
    explored_seconds: float = 0.0  # of those, on the arm that measured slower
    window_arm: str | None = None  # the arm being measured afresh, until it has `window_rounds` rounds again


@dataclass
class ThroughputGuard:
    max_explore_share: float = 0.03  # at most this share of a bucket's time on the arm measured slower
    weight: float = 0.02  # EMA weight of a new round of the arm that runs (~50 rounds' memory)
    window_rounds: int = 4  # rounds per exploring window (and per arm's first measurement)
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_max_explore_share(self.max_explore_share)

    @staticmethod
    def bucket_of(num_requests: int) -> int:
        return max(0, num_requests - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def best(self, num_requests: int) -> str:
        """The arm measured faster at this batch size (the policy's while either is not measured yet, and the one
        that was faster when the window began while an exploring window runs)."""
        bucket = self.buckets.get(self.bucket_of(num_requests))
        if bucket is None:
            return POLICY
        if bucket.window_arm is not None:
            return PLAIN if bucket.window_arm == POLICY else POLICY
        policy, plain = bucket.arms[POLICY], bucket.arms[PLAIN]
        if min(policy.num_rounds, plain.num_rounds) < self.window_rounds:
            return POLICY
        return PLAIN if plain.rate > policy.rate else POLICY

    def choose(self, num_requests: int) -> str:
        """The arm of the next round of `num_requests` requests: the faster, or the other in an exploring window
        while the time spent exploring stays within the share. An arm not yet measured `window_rounds` times is run
        first, once per bucket (a bounded, one-off cost)."""
        bucket = self.buckets.setdefault(self.bucket_of(num_requests), _Bucket())
        for arm in (POLICY, PLAIN):  # (an exploring window's arm included: it was restarted)
            if bucket.arms[arm].num_rounds < self.window_rounds:
                return arm
        best = self.best(num_requests)
        other = PLAIN if best == POLICY else POLICY
        expected = self.window_rounds * bucket.arms[other].seconds  # what the window would add (its arm's EMA)
        if bucket.explored_seconds + expected <= self.max_explore_share * (bucket.seconds + expected):
            bucket.window_arm = other
            bucket.arms[other].restart()  # measured afresh: the old estimate is where the arm was left
            return other
        return best

    def observe(self, num_requests: int, arm: str, num_tokens: int, seconds: float) -> None:
        """A round of `num_requests` requests ran on `arm`, committing `num_tokens` tokens in `seconds`."""
        if seconds <= 0:
            return
        bucket = self.buckets.setdefault(self.bucket_of(num_requests), _Bucket())
        is_window = bucket.window_arm == arm
        if is_window or min(a.num_rounds for a in bucket.arms.values()) >= self.window_rounds:
            bucket.seconds += seconds
            if arm != self.best(num_requests):
                bucket.explored_seconds += seconds
        bucket.num_rounds += 1
        bucket.arms[arm].observe(num_tokens, seconds, self.weight)
        if is_window and bucket.arms[arm].num_rounds >= self.window_rounds:
            bucket.window_arm = None

    def describe(self) -> list[dict]:
        """Per bucket: batch sizes, rounds, the share of time explored, each arm's measured tokens/s and rounds."""
        rows = []
        for b in sorted(self.buckets):
            bucket = self.buckets[b]
            low, high = (1, 1) if b == 0 else (2 ** (b - 1) + 1, 2**b)
            rows.append(
                {
                    "batch_sizes": [low, high],
                    "num_rounds": bucket.num_rounds,
                    "explored_share": bucket.explored_seconds / bucket.seconds if bucket.seconds else 0.0,
                    **{f"{name}_tokens_per_second": arm.rate for name, arm in bucket.arms.items()},
                    **{f"{name}_rounds": arm.total_rounds for name, arm in bucket.arms.items()},
                }
            )
        return rows
