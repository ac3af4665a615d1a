"""The closed loop over the budget policy: realised throughput decides whether a round speculates at all.

The budget policy (budget.py) prices trees with a cost model and calibrated draft probabilities. When either is
wrong (a loaded machine, a drafter whose probabilities flatter it), it may speculate where plain decoding is faster.
The guard does not second-guess the policy's decisions; it measures what they deliver. For each batch size (in
buckets: 1, 2, 3-4, 5-8, ...) it compares rounds run as the policy planned them ("policy" arm) against rounds run as
plain decoding (no draft, no n-gram chain: what `speculation: off` does), and runs the arm that measures faster.

A round's speed is split in two, measured differently:
- Committed tokens per request per round, an exponential moving average per arm. It depends on the text and the
  drafter, not on how fast the machine is right now, so rounds far apart in time compare fairly.
- Round seconds, compared between adjacent rounds only: wherever a bucket's rounds switch between speculating and
  plain decoding (an exploring window, or the policy resting all its requests in its own fallback, or drafting
  again), the first rounds after the switch against the last ones before it, as a log ratio averaged over such
  pairs. A round's time drifts within a run by more than the arms differ (other load on the machine, the requests'
  context lengths), so an arm's seconds measured minutes ago say little about the other arm's now; adjacent rounds
  see the same machine and nearly the same requests. Each round's seconds are taken relative to the cost model's
  price of a plain round of its batch size, so that the sizes within a bucket compare (the policy rests where
  requests have left); the model only scales between nearby sizes, and its level cancels out. Pairs at the
  policy's own resting rounds cost nothing to explore and follow its rounds as they change (a request's opening
  rounds draft little); exploring windows alone, which the share spaces out, left the ratio where the bucket's
  first rounds had put it.

Only the policy's estimate is noisy (plain decoding commits exactly one token per request-round), so the two are read
asymmetrically: the running policy gives way to plain decoding only where it measures slower by more than
`confidence` standard errors of its token estimate, and plain decoding gives way as soon as a window measures the
policy faster (`_decide`). A round of the policy in which a request drafts for the first time since plain rounds is
not measured (`observe(measured=False)`): its draft also takes in that request's features of the plain rounds, a
cost of switching, not of the arm's rounds. A round whose verify pass also took in newly admitted prompts reaches
the guard net of them (the engine subtracts the cost model's price of the prompts' tokens): the prompts are work of
neither arm, but what speculating costs beside them is the policy's, and left out it hid a policy that lost.
A round of the policy's arm that speculated nothing (its requests resting in the policy's own fallback) was plain
decoding, and is measured as such.

The other arm is explored in windows of `window_rounds` consecutive rounds, each measuring it afresh (its old token
estimate is dropped), and only while the time spent on the arm measured slower stays within `max_explore_share` of
the bucket's round seconds; an arm's first `first_windows` windows in a bucket run at once, outside the share: a
verdict on one window rests on four rounds (a request's opening rounds can accept nothing where drafting pays on the
whole), and early in a bucket's life the share allows the next window only after hundreds of rounds. Exploring
thus costs at most that share of the difference between the two arms' speeds, plus each arm's first windows per
bucket. Why windows and a fresh estimate: a speculative round's tokens vary a lot
(none accepted in a third of rounds, streaks of them on hard passages), so the arm that runs is averaged over many
rounds (`weight`), and the arm left behind was typically left at a low point of its noise. Updated one exploring
round at a time it would stay low for thousands of rounds; a window's fresh mean is unbiased.

Policy only: integers and floats, no tensors (the engine times the rounds and counts their tokens).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

POLICY, PLAIN = "policy", "plain"


def check_max_explore_share(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.5:
        raise ValueError(f"max_explore_share must be a number in [0, 0.5], got {value!r}")


@dataclass
class _Arm:
    tokens: float = 0.0  # EMA of committed tokens per request per round
    squares: float = 0.0  # EMA of their squares (the spread of a round's tokens)
    seconds: float = 0.0  # EMA of round seconds (what a window of this arm is expected to cost)
    num_rounds: int = 0  # since the estimate was last started afresh
    total_rounds: int = 0

    def restart(self) -> None:
        self.tokens = self.squares = self.seconds = 0.0
        self.num_rounds = 0

    def observe(self, tokens_per_request: float, seconds: float, weight: float) -> None:
        w = max(weight, 1.0 / (self.num_rounds + 1))  # the first rounds: their plain mean
        self.tokens += w * (tokens_per_request - self.tokens)
        self.squares += w * (tokens_per_request**2 - self.squares)
        self.seconds += w * (seconds - self.seconds)
        self.num_rounds += 1
        self.total_rounds += 1

    def relative_error(self, weight: float) -> float:
        """The standard error of `tokens` over its value: a plain mean's for the first rounds, then an EMA's (whose
        variance is weight / (2 - weight) of one round's)."""
        if self.tokens <= 0 or self.num_rounds == 0:
            return math.inf
        variance = max(0.0, self.squares - self.tokens**2)
        return math.sqrt(variance / min(self.num_rounds, (2 - weight) / weight)) / self.tokens


@dataclass
class _Run:
    """Consecutive measured rounds of a bucket that ran alike (speculating, or plain decoding), as relative seconds
    (`ThroughputGuard.observe`): its first and its last `window_rounds`, the ends that border the runs around it."""

    ran: str
    window_rounds: int
    head: list[float] = field(default_factory=list)
    tail: deque = field(init=False)
    last_index: int = 0  # the guard's round index of its last round
    is_paired: bool = False  # its head was compared with the run before it

    def __post_init__(self) -> None:
        self.tail = deque(maxlen=self.window_rounds)

    def add(self, relative_seconds: float, index: int) -> None:
        if len(self.head) < self.window_rounds:
            self.head.append(relative_seconds)
        self.tail.append(relative_seconds)
        self.last_index = index


@dataclass
class _Bucket:
    window_rounds: int
    arms: dict[str, _Arm] = field(init=False)
    num_rounds: int = 0
    seconds: float = 0.0  # of every round once both arms were measured
    explored_seconds: float = 0.0  # of those, on the arm that measured slower
    current: str = POLICY  # the arm measured faster (as `_decide` reads the estimates)
    window_arm: str | None = None  # the arm being measured afresh, until it has `window_rounds` rounds again
    is_exploring: bool = False  # the window explores (else it is the arm's first measurement in the bucket)
    run: _Run | None = None  # the measured rounds running alike now
    before: _Run | None = None  # the run of the other kind just before it (None where it ended rounds earlier)
    log_seconds_ratio: float = 0.0  # log(speculating round seconds / plain round seconds), averaged over pairs
    pair_weights: float = 0.0  # the pairs' weights summed (`_pair`; 0 until the first pair)

    def __post_init__(self) -> None:
        self.arms = {POLICY: _Arm(), PLAIN: _Arm()}


@dataclass
class ThroughputGuard:
    max_explore_share: float = 0.03  # at most this share of a bucket's time on the arm measured slower
    weight: float = 0.02  # EMA weight of a new round's tokens on the arm that runs (~50 rounds' memory)
    window_rounds: int = 4  # rounds per exploring window (and per arm's first measurement)
    # windows per arm and bucket that explore outside the share: the first verdicts rest on a few rounds each
    first_windows: int = 2
    pair_weight: float = 0.25  # EMA weight of a pair's seconds ratio (~4 pairs' memory)
    # standard errors of its token estimate by which the running policy must measure slower before plain decoding
    # replaces it (plain decoding's tokens per request-round are known exactly: 1)
    confidence: float = 1.0
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    num_rounds: int = 0  # of every bucket: a run's neighbour counts as adjacent within `window_rounds` of them

    def __post_init__(self) -> None:
        check_max_explore_share(self.max_explore_share)
        if not self.confidence >= 0:
            raise ValueError(f"confidence must be a number >= 0, got {self.confidence!r}")
        if isinstance(self.first_windows, bool) or not isinstance(self.first_windows, int) or self.first_windows < 1:
            raise ValueError(f"first_windows must be an integer >= 1, got {self.first_windows!r}")

    @staticmethod
    def bucket_of(num_requests: int) -> int:
        return max(0, num_requests - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def _bucket(self, num_requests: int) -> _Bucket:
        return self.buckets.setdefault(self.bucket_of(num_requests), _Bucket(self.window_rounds))

    def speedup(self, num_requests: int) -> float | None:
        """The policy's measured tokens/s over plain decoding's at this batch size (None until both are measured):
        the ratio of their tokens per request-round times the paired ratio of their round seconds."""
        bucket = self.buckets.get(self.bucket_of(num_requests))
        if bucket is None:
            return None
        policy, plain = bucket.arms[POLICY], bucket.arms[PLAIN]
        if min(policy.num_rounds, plain.num_rounds) < self.window_rounds or plain.tokens <= 0:
            return None
        if bucket.pair_weights:
            return policy.tokens / plain.tokens * math.exp(-bucket.log_seconds_ratio)
        # (rounds observed without a window, e.g. replayed: their seconds as measured)
        return (policy.tokens / policy.seconds) / (plain.tokens / plain.seconds)

    def best(self, num_requests: int) -> str:
        """The arm measured faster at this batch size (the policy's while either is not measured yet, and the one
        that was faster when the window began while an exploring window runs)."""
        bucket = self.buckets.get(self.bucket_of(num_requests))
        if bucket is None:
            return POLICY
        if bucket.window_arm is not None:
            return PLAIN if bucket.window_arm == POLICY else POLICY
        return bucket.current

    def _decide(self, bucket: _Bucket, num_requests: int) -> None:
        """The arm measured faster, read asymmetrically (module docstring): taking the policy's noisy estimate at its
        word both ways left speculation off on a dip of its noise for the hundreds of rounds until a window measured
        it again."""
        speedup = self.speedup(num_requests)
        if speedup is None:
            bucket.current = POLICY
        elif bucket.current == POLICY:
            error = bucket.arms[POLICY].relative_error(self.weight)
            if speedup * (1.0 + self.confidence * error) < 1.0:
                bucket.current = PLAIN
        elif speedup >= 1.0:
            bucket.current = POLICY

    def choose(self, num_requests: int) -> str:
        """The arm of the next round of `num_requests` requests: the faster, or the other in an exploring window
        while the time spent exploring stays within the share. An arm not yet measured `window_rounds` times is run
        first, once per bucket (a bounded, one-off cost)."""
        bucket = self._bucket(num_requests)
        for arm in (POLICY, PLAIN):  # (an exploring window's arm included: it was restarted)
            if bucket.arms[arm].num_rounds < self.window_rounds:
                if bucket.window_arm is None:
                    self._start_window(bucket, arm, is_exploring=False)
                return arm
        best = self.best(num_requests)
        other = PLAIN if best == POLICY else POLICY
        expected = self.window_rounds * bucket.arms[other].seconds  # what the window would add (its arm's EMA)
        # An arm left behind on its first few windows was judged on a dozen rounds or fewer (a request's opening
        # rounds can accept nothing where it pays on the whole): it is measured again at once, up to
        # `first_windows` windows, a one-off cost per bucket; later windows wait for the share.
        is_young = bucket.arms[other].total_rounds < self.first_windows * self.window_rounds
        if is_young or bucket.explored_seconds + expected <= self.max_explore_share * (bucket.seconds + expected):
            self._start_window(bucket, other, is_exploring=True)
            bucket.arms[other].restart()  # measured afresh: the old estimate is where the arm was left
            return other
        return best

    @staticmethod
    def _start_window(bucket: _Bucket, arm: str, is_exploring: bool) -> None:
        bucket.window_arm, bucket.is_exploring = arm, is_exploring

    def observe(
        self,
        num_requests: int,
        arm: str,
        num_tokens: int,
        seconds: float,
        measured: bool = True,
        speculated: bool = True,
        plain_seconds: float | None = None,
    ) -> None:
        """A round of `num_requests` requests ran on `arm`, committing `num_tokens` tokens in `seconds`. A round not
        `measured` counts in the time spent but not in the arm's measure: one that switches arms (a round of the
        policy in which a request drafts for the first time since plain rounds: its draft also takes in that
        request's features of the plain rounds), whose extra cost is paid once per request and exploring window and
        would price every later round of the arm. (A round that also took in new prompts is measured, its
        `seconds` given net of them.)

        A policy round that did not speculate (`speculated` false: every request resting in the policy's own
        fallback, no n-gram chain) was plain decoding, and is measured on the plain arm. Counted as the policy's,
        it would price the policy at exactly one token per round with no spread, for the ~50 rounds its estimate
        remembers after it drafts again.

        `plain_seconds`: what the cost model prices a plain round of `num_requests` requests at. Round seconds are
        paired as `seconds / plain_seconds`, so that adjacent rounds of different batch sizes in a bucket compare
        (the policy's resting rounds come where requests leave, fewer of them than in its drafting rounds); the
        model only scales between nearby batch sizes, and its level cancels out."""
        if seconds <= 0 or num_requests <= 0:
            return
        self.num_rounds += 1
        bucket = self._bucket(num_requests)
        ran = arm if speculated else PLAIN  # what the round did, where `arm` is what was chosen
        if (bucket.window_arm == arm and bucket.is_exploring) or min(
            a.num_rounds for a in bucket.arms.values()
        ) >= self.window_rounds:
            bucket.seconds += seconds
            best = self.best(num_requests)
            if arm != best and ran != best:  # (a window of the policy whose requests rest costs plain decoding)
                bucket.explored_seconds += seconds
        bucket.num_rounds += 1
        if not measured:
            return
        arm_ran = bucket.arms[ran]
        arm_ran.observe(num_tokens / num_requests, seconds, self.weight)
        self._extend_run(bucket, ran, seconds / plain_seconds if plain_seconds else seconds)
        if bucket.window_arm == ran and arm_ran.num_rounds >= self.window_rounds:
            bucket.window_arm = None
        if bucket.window_arm is None:
            self._decide(bucket, num_requests)

    def _extend_run(self, bucket: _Bucket, ran: str, relative_seconds: float) -> None:
        """The round joins its bucket's run of rounds that ran alike, or starts the next one. A run's first
        `window_rounds` rounds are compared with the last ones of the run just before it, where that one ended
        within `window_rounds` rounds (of any bucket) of its start: adjacent rounds see the same machine."""
        run = bucket.run
        if run is None or run.ran != ran:
            if run is not None and not run.is_paired:
                self._pair(bucket)  # (a run shorter than a window: paired as it ends)
            is_adjacent = run is not None and self.num_rounds - run.last_index <= self.window_rounds
            bucket.before = run if is_adjacent else None
            bucket.run = run = _Run(ran, self.window_rounds)
        run.add(relative_seconds, self.num_rounds)
        if len(run.head) == self.window_rounds and not run.is_paired:
            self._pair(bucket)

    def _pair(self, bucket: _Bucket) -> None:
        """One sample of the seconds ratio: the run's first rounds against the last rounds of the run before it,
        weighed by the shorter side's share of a window (a round or two alone say less)."""
        run, before = bucket.run, bucket.before
        run.is_paired = True
        if before is None:
            return
        means = {r.ran: sum(seconds) / len(seconds) for r, seconds in ((run, run.head), (before, before.tail))}
        share = min(len(run.head), len(before.tail)) / self.window_rounds
        bucket.pair_weights += share
        w = max(self.pair_weight * share, share / bucket.pair_weights)  # the first pairs: their plain mean
        bucket.log_seconds_ratio += w * (math.log(means[POLICY] / means[PLAIN]) - bucket.log_seconds_ratio)

    def describe(self) -> list[dict]:
        """Per bucket: batch sizes, rounds, the share of time explored, the policy's measured speedup over plain
        decoding, each arm's tokens per request-round and rounds."""
        rows = []
        for b in sorted(self.buckets):
            bucket = self.buckets[b]
            low, high = (1, 1) if b == 0 else (2 ** (b - 1) + 1, 2**b)
            rows.append(
                {
                    "batch_sizes": [low, high],
                    "num_rounds": bucket.num_rounds,
                    "explored_share": bucket.explored_seconds / bucket.seconds if bucket.seconds else 0.0,
                    "policy_speedup": self.speedup(high),
                    **{f"{name}_tokens_per_request": arm.tokens for name, arm in bucket.arms.items()},
                    **{f"{name}_rounds": arm.total_rounds for name, arm in bucket.arms.items()},
                }
            )
        return rows
