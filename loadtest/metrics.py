"""The load test's measurements as plain data, apart from locust (importing locust monkey-patches the process with
gevent): per-request metrics, the run's summary and its text and CSV forms, and the prompts in their shared order.
loadtest/locustfile.py documents what each metric means."""

from __future__ import annotations

import importlib.resources
import json
import random
import statistics
import time
from dataclasses import dataclass, field

METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms", "output_tokens_per_s", "output_tokens")
COUNTS = (
    "num_started",
    "num_completed",
    "num_failed",
    "num_good",
    "total_output_tokens",
    "num_speculative_rounds",
    "num_autoregressive_rounds",
    "num_accepted_tokens",
    "num_ngram_tokens",
    "num_reporting_speculation",
    "speculation_output_tokens",
)
QUANTILES = (25, 50, 75, 90, 95, 99)


@dataclass
class Speculation:
    """A request's `usage.ddtree` counts."""

    speculative_rounds: int
    autoregressive_rounds: int
    accepted_tokens: int  # committed in its speculative rounds, bonus tokens included
    ngram_tokens: int  # accepted from n-gram chains in rounds without a draft

    @classmethod
    def from_usage(cls, ddtree: dict) -> Speculation | None:
        if "num_speculative_rounds" not in ddtree:
            return None
        return cls(
            int(ddtree["num_speculative_rounds"]),
            int(ddtree["num_autoregressive_rounds"]),
            int(sum(ddtree.get("acceptance_lengths") or [])),
            int(ddtree.get("num_ngram_tokens") or 0),
        )


@dataclass
class RequestMetrics:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    speculation: Speculation | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)  # between successive content chunks

    def values(self) -> dict[str, float]:
        """One value per metric (itl_ms, one per chunk gap, is not among them)."""
        values = {
            "ttft_ms": 1000 * self.ttft_s,
            "e2e_latency_ms": 1000 * self.e2e_s,
            "output_tokens": float(self.output_tokens),
            "output_tokens_per_s": self.output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0,
        }
        if self.output_tokens > 1:
            values["tpot_ms"] = 1000 * (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
        return values

    def meets(self, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
        """Within the SLO (a bound of 0 is no bound); a one-token answer has no TPOT to miss."""
        values = self.values()
        return (not slo_ttft_ms or values["ttft_ms"] <= slo_ttft_ms) and (
            not slo_tpot_ms or values.get("tpot_ms", 0.0) <= slo_tpot_ms
        )


@dataclass
class Summary:
    """Every completed request's metrics and the run's counts, for the end-of-run summary. A worker of a distributed
    run hands what it gathered to the master with each stats report (`take`); the master `merge`s it."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    start_time: float = field(default_factory=time.time)
    slo: tuple[float, float] = (0.0, 0.0)  # (TTFT ms, TPOT ms) bounds of the goodput; 0: no bound

    def start(self) -> None:
        self.counts["num_started"] += 1

    def fail(self) -> None:
        self.counts["num_failed"] += 1

    def add(self, metrics: RequestMetrics) -> None:
        counts = self.counts
        counts["num_completed"] += 1
        counts["total_output_tokens"] += metrics.output_tokens
        counts["num_good"] += metrics.meets(*self.slo)
        for name, value in metrics.values().items():
            self.samples[name].append(value)
        self.samples["itl_ms"].extend(1000 * gap for gap in metrics.chunk_gaps_s)
        if metrics.speculation is not None:
            spec = metrics.speculation
            counts["num_reporting_speculation"] += 1
            counts["speculation_output_tokens"] += metrics.output_tokens
            counts["num_speculative_rounds"] += spec.speculative_rounds
            counts["num_autoregressive_rounds"] += spec.autoregressive_rounds
            counts["num_accepted_tokens"] += spec.accepted_tokens
            counts["num_ngram_tokens"] += spec.ngram_tokens

    def take(self) -> dict:
        """What was gathered since the last take, as plain data (a worker's report to the master), and reset."""
        taken = {"samples": self.samples, "counts": self.counts}
        self.samples, self.counts = {m: [] for m in METRICS}, dict.fromkeys(COUNTS, 0)
        return taken

    def merge(self, taken: dict) -> None:
        for name, values in taken["samples"].items():
            self.samples.setdefault(name, []).extend(values)
        for name, value in taken["counts"].items():
            self.counts[name] = self.counts.get(name, 0) + value

    def report(self) -> dict:
        duration = max(time.time() - self.start_time, 1e-9)
        c = self.counts
        num_requests = c["num_completed"] + c["num_failed"]
        report = {
            "num_completed_requests": c["num_completed"],
            "num_failed_requests": c["num_failed"],
            "num_unfinished_requests": max(c["num_started"] - num_requests, 0),  # still streaming at the end
            "error_rate": c["num_failed"] / num_requests if num_requests else 0.0,
            "duration_s": duration,
            "overall_output_tokens_per_s": c["total_output_tokens"] / duration,
            "completed_requests_per_min": 60 * c["num_completed"] / duration,
            "slo": {"ttft_ms": self.slo[0] or None, "tpot_ms": self.slo[1] or None},
            "goodput_requests_per_s": c["num_good"] / duration,
            # of the completed requests, the share within the SLO
            "slo_attainment": c["num_good"] / c["num_completed"] if c["num_completed"] else 0.0,
            "metrics": {name: _describe(values) for name, values in self.samples.items() if values},
        }
        if c["num_reporting_speculation"]:
            rounds = c["num_speculative_rounds"] + c["num_autoregressive_rounds"]
            report["speculation"] = {
                "num_requests": c["num_reporting_speculation"],
                "speculative_rounds": c["num_speculative_rounds"],
                "autoregressive_rounds": c["num_autoregressive_rounds"],
                "speculative_round_share": c["num_speculative_rounds"] / rounds if rounds else 0.0,
                # tokens committed per speculative round (tau), every round of every request weighing the same
                "acceptance_length": (
                    c["num_accepted_tokens"] / c["num_speculative_rounds"] if c["num_speculative_rounds"] else None
                ),
                # of the speculation-reporting requests: their output tokens (the prefill's first one included) per
                # decoding round, speculative and autoregressive alike (1.0 = plain decoding)
                "output_tokens_per_round": c["speculation_output_tokens"] / rounds if rounds else None,
                "ngram_token_share": (
                    c["num_ngram_tokens"] / c["speculation_output_tokens"] if c["speculation_output_tokens"] else 0.0
                ),
            }
        return report


def _describe(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    out = {f"p{q}": _quantile(ordered, q / 100) for q in QUANTILES}
    out.update(mean=statistics.fmean(ordered), min=ordered[0], max=ordered[-1], count=len(ordered))
    return out


def _quantile(ordered: list[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def load_prompts(path: str = "") -> list[str]:
    """The 'text' field of each JSON line of `path` (default: ddtree/assets/eval/chat.jsonl)."""
    if path:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        text = (importlib.resources.files("ddtree") / "assets" / "eval" / "chat.jsonl").read_text(encoding="utf-8")
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = record["text"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: not a JSON object with a 'text' field: {line[:80]!r}") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{number}: 'text' must be a non-empty string")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"no prompts in {path or 'ddtree/assets/eval/chat.jsonl'}")
    return prompts


class PromptOrder:
    """The prompts in one order shared by every user of the process: shuffled once, then taken in turn."""

    def __init__(self, prompts: list[str], seed: int) -> None:
        self.prompts = list(prompts)
        random.Random(seed).shuffle(self.prompts)
        self.next = 0

    def take(self) -> str:
        prompt = self.prompts[self.next % len(self.prompts)]
        self.next += 1
        return prompt


def summary_csv(report: dict) -> str:
    columns = [f"p{q}" for q in QUANTILES] + ["mean", "min", "max", "count"]
    lines = ["metric," + ",".join(columns)]
    for name, d in report["metrics"].items():
        lines.append(name + "," + ",".join(f"{d[k]:.6g}" for k in columns))
    return "\n".join(lines) + "\n"


def format_summary(report: dict) -> str:
    lines = [
        f"completed {report['num_completed_requests']}  failed {report['num_failed_requests']}  "
        f"error rate {report['error_rate']:.3f}  overall output tokens/s {report['overall_output_tokens_per_s']:.1f}  "
        f"completed/min {report['completed_requests_per_min']:.1f}  goodput {report['goodput_requests_per_s']:.2f} "
        f"requests/s ({100 * report['slo_attainment']:.0f}% within the SLO)",
        f"{'metric':<24}" + "".join(f"{k:>10}" for k in [f"p{q}" for q in QUANTILES] + ["mean", "min", "max"]),
    ]
    for name, d in report["metrics"].items():
        lines.append(
            f"{name:<24}" + "".join(f"{d[k]:>10.2f}" for k in [f"p{q}" for q in QUANTILES] + ["mean", "min", "max"])
        )
    if report["num_unfinished_requests"]:
        lines.append(f"unfinished at the end (not in the rates): {report['num_unfinished_requests']}")
    spec = report.get("speculation")
    if spec is not None:
        tau = "-" if spec["acceptance_length"] is None else f"{spec['acceptance_length']:.2f}"
        lines.append(
            f"speculation: {spec['speculative_rounds']} speculative + {spec['autoregressive_rounds']} "
            f"autoregressive rounds ({100 * spec['speculative_round_share']:.0f}% speculative), acceptance "
            f"length {tau} per speculative round, {spec['output_tokens_per_round'] or 0:.2f} output tokens "
            f"per round, {100 * spec['ngram_token_share']:.0f}% of tokens from n-gram chains"
        )
    return "\n".join(lines)
