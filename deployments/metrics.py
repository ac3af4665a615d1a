"""Engine replica metrics through `ray.serve.metrics` (exported by Ray's Prometheus endpoint, tagged with the
deployment, replica and application). Taken once per round on the engine loop thread and recorded into Ray's metrics
once a second (`EngineMetrics.flush`), and every second while the engine is idle (`on_idle`: the gauges say 0
running, 0 queued, the token rate decays to 0, rather than keeping the last round's values; Ray also stops exporting
a gauge nobody sets).

    ddtree_generated_tokens_total            Counter    tokens emitted (rate() = output tokens/s)
    ddtree_output_tokens_per_second          Gauge      tokens emitted over the last `window_s` seconds / window
    ddtree_acceptance_length                 Histogram  tau per speculative request-round (bonus token included)
    ddtree_round_budget                      Histogram  draft tree nodes verified per speculative request-round
    ddtree_speculative_requests              Gauge      requests that drafted in the last round
    ddtree_autoregressive_requests           Gauge      requests in fallback (no draft) in the last round
    ddtree_ngram_tokens_total                Counter    tokens accepted from the n-gram chains of requests in fallback
    ddtree_running_requests                  Gauge      requests being decoded
    ddtree_queue_depth                       Gauge      requests waiting for admission
    ddtree_kv_cache_bytes_used               Gauge      target KV cache bytes in use (refreshed every `kv_every_s`)
    ddtree_round_seconds                     Histogram  wall time of one engine round (a phase when pipelined)
    ddtree_pipelined                         Gauge      1 when the last round ran two request groups in flight
    ddtree_stage_seconds_total{stage}        Counter    time per stage: prefill, draft, tree, verify, accept, emit,
                                                        other (the rest of the round's wall time); they add up to
                                                        the rounds' wall time, except when pipelined: draft and
                                                        verify then overlap and "other" is not recorded; a prompt
                                                        taken in by a round's verify pass counts in verify
    ddtree_drafter_available                 Gauge      1 while the engine drafts with a live drafter, 0 from its
                                                        loss until a restarted one is attached (speculating modes)
    ddtree_drafter_losses_total              Counter    drafter actors lost while the engine ran (each one's
                                                        requests decoded on without drafts)
    ddtree_target_available                  Gauge      1 while the engine has a live target, 0 from its loss until
                                                        a restarted one is attached (its requests wait meanwhile)
    ddtree_target_losses_total               Counter    target actors lost while the engine ran (each one's requests
                                                        prefilled again on the restarted target)
    ddtree_actor_hop_seconds_total           Counter    time in actor calls beyond the actors' own work (overlaps
                                                        the stages: prefill and draft are timed around the call,
                                                        verify and accept inside the target actor, so a verify's
                                                        hop lands in "other")
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from ddtree.engine import ROUND_STAGES as STAGES
from deployments.engine_loop import RoundReport

_TAU_BOUNDARIES = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32]
_BUDGET_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
_ROUND_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class EngineMetrics:
    """The engine's metrics, taken per round on the loop thread and recorded into Ray's metrics every `flush_every_s`
    (and whenever the engine goes idle). A Ray metric call merges and checks its tags in Python, and the loop thread
    runs between two worker calls of the round: 15-18 calls per round lengthened every round (docs/serving.md,
    "Metrics"). Between flushes a round only adds to plain numbers here; Ray exports metrics every few seconds
    anyway, so a flush a second loses nothing a scrape would see. Gauges take the last round's values at a flush."""

    def __init__(
        self,
        engine,
        hops,
        kv_cache_stats=None,
        window_s: float = 10.0,
        kv_every_s: float = 1.0,
        flush_every_s: float = 1.0,
    ):
        from ray.serve.metrics import Counter, Gauge, Histogram

        self.engine = engine
        self.hops = hops
        self.kv_cache_stats = kv_cache_stats  # () -> {"bytes_used": ...}, or None when the worker has none
        self.window_s = window_s
        self.kv_every_s = kv_every_s
        self.flush_every_s = flush_every_s
        self.tokens = Counter("ddtree_generated_tokens_total", "Output tokens emitted.")
        self.num_generated_tokens = 0  # the counter's value, read by `DDTreeEngine.info` (on the loop thread)
        self.tokens_per_second = Gauge("ddtree_output_tokens_per_second", "Output tokens/s over a sliding window.")
        self.tau = Histogram(
            "ddtree_acceptance_length", "Accepted length per speculative request-round.", boundaries=_TAU_BOUNDARIES
        )
        self.budget = Histogram(
            "ddtree_round_budget", "Draft nodes verified per speculative request-round.", boundaries=_BUDGET_BOUNDARIES
        )
        self.speculative = Gauge("ddtree_speculative_requests", "Requests that drafted in the last round.")
        self.fallback = Gauge("ddtree_autoregressive_requests", "Requests decoding without a draft (fallback).")
        self.ngram_tokens = Counter(
            "ddtree_ngram_tokens_total", "Tokens accepted from n-gram chains of requests in fallback (no draft)."
        )
        self.running = Gauge("ddtree_running_requests", "Requests being decoded.")
        self.queue_depth = Gauge("ddtree_queue_depth", "Requests waiting for admission.")
        self.kv_bytes = Gauge("ddtree_kv_cache_bytes_used", "Target KV cache bytes in use.")
        self.round_seconds = Histogram(
            "ddtree_round_seconds", "Wall time of one engine round.", boundaries=_ROUND_BOUNDARIES
        )
        self.pipelined = Gauge("ddtree_pipelined", "1 when the last round ran two request groups in flight.")
        self.stage_seconds = Counter("ddtree_stage_seconds_total", "Seconds per round stage.", tag_keys=("stage",))
        self.hop_seconds = Counter("ddtree_actor_hop_seconds_total", "Actor call overhead (overlaps stages).")
        self.drafter_available = Gauge("ddtree_drafter_available", "1 while the drafter is live, 0 after its loss.")
        self.drafter_losses = Counter("ddtree_drafter_losses_total", "Drafter actors lost while the engine ran.")
        self._last_drafter_losses = 0
        self.target_available = Gauge("ddtree_target_available", "1 while the target is live, 0 after its loss.")
        self.target_losses = Counter("ddtree_target_losses_total", "Target actors lost while the engine ran.")
        self._last_target_losses = 0
        self._last_timings = engine.timings.as_dict()
        self._last_hop_seconds = hops.seconds
        self._rounds_seen: dict[str, int] = {}
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._last_kv_time = 0.0
        self._last_flush = time.monotonic()
        self.num_flushes = 0
        # Taken since the last flush: counters' increments, histograms' observations, the last round's gauges
        self.pending = PendingMetrics()

    def on_idle(self) -> None:
        """No round runs: nothing is running or queued, or the target is lost and its requests wait for a new one
        (the engine loop calls this while it waits on its inbox). What the rounds left is recorded first. No worker
        call here: a hung worker must not block the idle loop, where no round would time it; no KV cache entry is
        in use on a live target then."""
        now = time.monotonic()
        self.flush(now)
        self.tokens_per_second.set(self._tokens_per_second(now, 0))
        for gauge in (self.speculative, self.fallback, self.pipelined, self.kv_bytes):
            gauge.set(0)
        self.running.set(self.engine.num_running)
        self.queue_depth.set(self.engine.num_waiting)
        self._worker_state()

    def _worker_state(self) -> None:
        engine = self.engine
        self.target_available.set(0 if engine.target_lost is not None else 1)
        if engine.num_target_losses > self._last_target_losses:
            self.target_losses.inc(engine.num_target_losses - self._last_target_losses)
            self._last_target_losses = engine.num_target_losses
        if engine.drafter is None:
            return
        self.drafter_available.set(0 if engine.drafter_lost is not None else 1)
        if engine.num_drafter_losses > self._last_drafter_losses:
            self.drafter_losses.inc(engine.num_drafter_losses - self._last_drafter_losses)
            self._last_drafter_losses = engine.num_drafter_losses

    def _tokens_per_second(self, now: float, num_tokens: int) -> float:
        self._window.append((now, num_tokens))
        while self._window and self._window[0][0] < now - self.window_s:
            self._window.popleft()
        return sum(n for _, n in self._window) / self.window_s

    def on_round(self, report: RoundReport) -> None:
        """Takes the round into `pending` (no Ray call), and flushes once `flush_every_s` has passed."""
        now = time.monotonic()
        pending = self.pending
        num_tokens = sum(len(o.new_token_ids) for o in report.outputs)
        pending.tokens += num_tokens
        self.num_generated_tokens += num_tokens
        self._window.append((now, num_tokens))

        for out in report.outputs:
            stats = out.stats
            seen = self._rounds_seen.get(out.request_id, 0)
            if len(stats.acceptance_lengths) > seen:
                pending.taus += stats.acceptance_lengths[seen:]
                pending.budgets += stats.budgets[seen:]
            if out.finished:
                self._rounds_seen.pop(out.request_id, None)
            else:
                self._rounds_seen[out.request_id] = len(stats.acceptance_lengths)
        if len(self._rounds_seen) > len(self.engine.requests):  # aborted requests' final outputs never pass here
            self._rounds_seen = {rid: n for rid, n in self._rounds_seen.items() if rid in self.engine.requests}

        timings = self.engine.timings.as_dict()
        delta = {k: timings[k] - self._last_timings.get(k, 0) for k in timings}
        self._last_timings = timings
        pending.speculative = delta["num_speculative_request_rounds"]
        pending.fallback = delta["num_autoregressive_request_rounds"]
        pending.ngram_tokens += delta["num_ngram_tokens"]
        pending.running = report.num_running
        pending.queue_depth = report.num_waiting
        pending.round_seconds.append(report.wall_seconds)
        pending.pipelined = 1 if delta["num_pipelined_phases"] else 0

        hop_seconds = self.hops.seconds - self._last_hop_seconds
        self._last_hop_seconds = self.hops.seconds
        pending.hop_seconds += max(0.0, hop_seconds)
        staged = 0.0
        for stage in STAGES:
            if delta[stage] > 0:
                pending.stage_seconds[stage] += delta[stage]
                staged += delta[stage]
        other = report.wall_seconds - staged
        if other > 0 and not delta["num_pipelined_phases"]:
            pending.stage_seconds["other"] += other
        pending.num_rounds += 1
        if now - self._last_flush >= self.flush_every_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Records what the rounds since the last flush took into Ray's metrics."""
        now = time.monotonic() if now is None else now
        self._last_flush = now
        pending, self.pending = self.pending, PendingMetrics()
        if not pending.num_rounds:
            return
        self.num_flushes += 1
        if pending.tokens:
            self.tokens.inc(pending.tokens)
        self.tokens_per_second.set(self._tokens_per_second(now, 0))
        for tau, nodes in zip(pending.taus, pending.budgets):
            self.tau.observe(tau)
            self.budget.observe(nodes)
        if pending.ngram_tokens:
            self.ngram_tokens.inc(pending.ngram_tokens)
        self.speculative.set(pending.speculative)
        self.fallback.set(pending.fallback)
        self.running.set(pending.running)
        self.queue_depth.set(pending.queue_depth)
        for seconds in pending.round_seconds:
            self.round_seconds.observe(seconds)
        self.pipelined.set(pending.pipelined)
        self._worker_state()
        for stage, seconds in pending.stage_seconds.items():
            if seconds > 0:
                self.stage_seconds.inc(seconds, tags={"stage": stage})
        if pending.hop_seconds > 0:
            self.hop_seconds.inc(pending.hop_seconds)
        if (
            self.kv_cache_stats is not None
            and self.engine.target_lost is None
            and now - self._last_kv_time >= self.kv_every_s
        ):
            self._last_kv_time = now
            self.kv_bytes.set(self.kv_cache_stats()["bytes_used"])


@dataclass
class PendingMetrics:
    """What rounds took since the last flush: sums for the counters, values for the histograms, the last round's
    values for the gauges."""

    num_rounds: int = 0
    tokens: int = 0
    ngram_tokens: int = 0
    hop_seconds: float = 0.0
    stage_seconds: collections.Counter = field(default_factory=collections.Counter)  # stage (and "other") -> seconds
    round_seconds: list[float] = field(default_factory=list)
    taus: list[int] = field(default_factory=list)  # per speculative request-round, with `budgets`
    budgets: list[int] = field(default_factory=list)
    speculative: int = 0
    fallback: int = 0
    running: int = 0
    queue_depth: int = 0
    pipelined: int = 0
