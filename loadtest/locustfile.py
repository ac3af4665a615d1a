"""Load test of the OpenAI API with llmperf-style per-request metrics.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 2m --csv work/loadtest/run1 \
        --max-tokens 128 --temperature 0 --summary-json work/loadtest/run1_summary.json

Each user sends streaming chat (or completion) requests back to back with `stream_options.include_usage`. Locust's
own statistics (and `--csv`'s `_stats.csv`) hold the HTTP requests: one entry per endpoint, failures included (a
status other than 200, an error event in the stream, a broken or unparsable stream, a stream silent for longer than
`--read-timeout`, no usage chunk; their response time is the time to the response headers, as Locust times a
streamed request). Per request the file also measures, llmperf-style:

    ttft_ms                  time to the first content token
    inter_token_latency_ms   (end-to-end - TTFT) / (output tokens - 1): per token, not per chunk, since one
                             speculative round streams several tokens at once
    e2e_latency_ms           request sent -> last byte
    output_tokens_per_s      output tokens / end-to-end latency of that request
    output_tokens            output tokens of the request (from the usage chunk)

These are not Locust requests (they would multiply its request counts and rates, and Locust rounds response times
to integers): at the end their p25/50/75/90/95/99, mean, min and max, the error rate, overall output tokens/s and
completed requests per minute (of the completed requests: those still streaming when the run ends are counted as
unfinished, not in the rates, as llmperf does) are printed, written to `--summary-json`, and with `--csv PREFIX` to
`PREFIX_llm.csv`. Where the server reports `usage.ddtree`, the summary's `speculation` block says how the tokens
were made, over all completed requests: speculative and autoregressive (fallback) rounds and the speculative share,
the acceptance length per speculative round (each round weighs the same, so a run that mostly falls back is not
summarised by its few drafted rounds alone), output tokens per round, and the share of tokens from n-gram chains.

Distributed runs (`--processes N`, or `--master` / `--worker`): each worker sends its requests' metrics to the master
with its periodic stats report, and the master alone prints and writes the summary of all users.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import requests
from locust import HttpUser, between, events, task
from locust.runners import WorkerRunner

METRICS = ("ttft_ms", "inter_token_latency_ms", "e2e_latency_ms", "output_tokens_per_s", "output_tokens")
COUNTS = ("num_started", "num_completed", "num_failed", "total_output_tokens", "num_speculative_rounds",
          "num_autoregressive_rounds", "num_accepted_tokens", "num_ngram_tokens", "num_reporting_speculation",
          "speculation_output_tokens")
QUANTILES = (25, 50, 75, 90, 95, 99)


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("DDTree / OpenAI")
    group.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    group.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer <key>' when set")
    group.add_argument("--prompts-file", default="",
                       help="JSON lines with a 'text' field (default: ddtree/assets/eval/chat.jsonl)")
    group.add_argument("--summary-json", default="", help="write the llmperf-style summary here")
    group.add_argument("--think-time", type=float, default=0.0, help="max seconds between a user's requests")
    group.add_argument("--read-timeout", type=float, default=300.0,
                       help="seconds a stream may stay silent before the request counts as failed")


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
        return cls(int(ddtree["num_speculative_rounds"]), int(ddtree["num_autoregressive_rounds"]),
                   int(sum(ddtree.get("acceptance_lengths") or [])), int(ddtree.get("num_ngram_tokens") or 0))


@dataclass
class RequestMetrics:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    speculation: Speculation | None = None

    def values(self) -> dict[str, float]:
        values = {
            "ttft_ms": 1000 * self.ttft_s,
            "e2e_latency_ms": 1000 * self.e2e_s,
            "output_tokens": float(self.output_tokens),
            "output_tokens_per_s": self.output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0,
        }
        if self.output_tokens > 1:
            values["inter_token_latency_ms"] = 1000 * (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
        return values


@dataclass
class Summary:
    """Every completed request's metrics and the run's counts, for the end-of-run summary. A worker of a distributed
    run hands what it gathered to the master with each stats report (`take`); the master `merge`s it."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    start_time: float = field(default_factory=time.time)

    def start(self) -> None:
        self.counts["num_started"] += 1

    def fail(self) -> None:
        self.counts["num_failed"] += 1

    def add(self, metrics: RequestMetrics) -> None:
        counts = self.counts
        counts["num_completed"] += 1
        counts["total_output_tokens"] += metrics.output_tokens
        for name, value in metrics.values().items():
            self.samples[name].append(value)
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
                "acceptance_length": (c["num_accepted_tokens"] / c["num_speculative_rounds"]
                                      if c["num_speculative_rounds"] else None),
                # of the speculation-reporting requests: their output tokens (the prefill's first one included) per
                # decoding round, speculative and autoregressive alike (1.0 = plain decoding)
                "output_tokens_per_round": c["speculation_output_tokens"] / rounds if rounds else None,
                "ngram_token_share": (c["num_ngram_tokens"] / c["speculation_output_tokens"]
                                      if c["speculation_output_tokens"] else 0.0),
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


def _load_prompts(path: str) -> list[str]:
    if path:
        text = open(path, encoding="utf-8").read()
    else:
        text = (importlib.resources.files("ddtree") / "assets" / "eval" / "chat.jsonl").read_text(encoding="utf-8")
    prompts = [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path or 'ddtree/assets/eval/chat.jsonl'}")
    return prompts


@events.init.add_listener
def _on_init(environment, **_) -> None:
    options = environment.parsed_options
    environment.ddtree_summary = Summary()
    environment.ddtree_prompts = _load_prompts(options.prompts_file if options else "")

    # Distributed runs: the workers' metrics travel to the master with their stats reports (every few seconds, and
    # a last one when they quit), so the master's summary covers every user.
    def report_to_master(client_id, data, **_) -> None:
        data["ddtree_summary"] = environment.ddtree_summary.take()

    def worker_report(client_id, data, **_) -> None:
        if "ddtree_summary" in data:
            environment.ddtree_summary.merge(data["ddtree_summary"])

    environment.events.report_to_master.add_listener(report_to_master)
    environment.events.worker_report.add_listener(worker_report)


@events.test_start.add_listener
def _on_start(environment, **_) -> None:
    # a new run (the web UI can start several in one process) starts a new summary
    environment.ddtree_summary = Summary()


@events.quitting.add_listener
def _on_quit(environment, **_) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return  # its metrics went to the master, which writes the summary
    report = environment.ddtree_summary.report()
    print(format_summary(report))
    options = environment.parsed_options
    if options is not None and options.summary_json:
        _write(options.summary_json, json.dumps(report, indent=2))
    if options is not None and getattr(options, "csv_prefix", None):
        _write(f"{options.csv_prefix}_llm.csv", summary_csv(report))


def _write(path: str, text: str) -> None:
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


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
        f"completed/min {report['completed_requests_per_min']:.1f}",
        f"{'metric':<24}" + "".join(f"{k:>10}" for k in [f"p{q}" for q in QUANTILES] + ["mean", "min", "max"]),
    ]
    for name, d in report["metrics"].items():
        lines.append(f"{name:<24}" + "".join(f"{d[k]:>10.2f}" for k in
                                             [f"p{q}" for q in QUANTILES] + ["mean", "min", "max"]))
    if report["num_unfinished_requests"]:
        lines.append(f"unfinished at the end (not in the rates): {report['num_unfinished_requests']}")
    spec = report.get("speculation")
    if spec is not None:
        tau = "-" if spec["acceptance_length"] is None else f"{spec['acceptance_length']:.2f}"
        lines.append(f"speculation: {spec['speculative_rounds']} speculative + {spec['autoregressive_rounds']} "
                     f"autoregressive rounds ({100 * spec['speculative_round_share']:.0f}% speculative), acceptance "
                     f"length {tau} per speculative round, {spec['output_tokens_per_round'] or 0:.2f} output tokens "
                     f"per round, {100 * spec['ngram_token_share']:.0f}% of tokens from n-gram chains")
    return "\n".join(lines)


class OpenAIUser(HttpUser):
    wait_time = between(0, 0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.options = options
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        if options.think_time > 0:
            self.wait_time = lambda: random.uniform(0, options.think_time)

    @task
    def generate(self) -> None:
        options = self.options
        prompt = random.choice(self.environment.ddtree_prompts)
        body = {"model": options.model, "max_tokens": options.max_tokens, "temperature": options.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if options.endpoint == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        summary = self.environment.ddtree_summary
        summary.start()
        t0 = time.perf_counter()
        with self.client.post(path, json=body, headers=self.headers, stream=True, catch_response=True,
                              name=f"{path} (stream)", timeout=(30, options.read_timeout)) as response:
            try:
                metrics = self._read_stream(response, t0, chat=options.endpoint == "chat")
            # a broken or silent connection mid-stream, an event that is not JSON or lacks a field: failures too
            except (StreamError, requests.RequestException, ValueError, KeyError, TypeError, AttributeError) as exc:
                self.environment.ddtree_summary.fail()
                response.failure(f"{type(exc).__name__}: {exc}")
                return
            response.success()
        self.environment.ddtree_summary.add(metrics)

    @staticmethod
    def _read_stream(response, t0: float, chat: bool) -> RequestMetrics:
        if response.status_code != 200:
            raise StreamError(f"HTTP {response.status_code}: {response.text[:300]}")
        ttft = None
        usage = None
        for raw in response.iter_lines():
            if not raw:
                continue
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if not isinstance(event, dict):
                raise StreamError(f"an event that is not a JSON object: {data[:200]}")
            if "error" in event:
                error = event["error"]
                raise StreamError(f"stream error: {error.get('message') if isinstance(error, dict) else error}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
        e2e = time.perf_counter() - t0
        if usage is None:
            raise StreamError("no usage chunk (stream_options.include_usage)")
        return RequestMetrics(ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e,
                              output_tokens=int(usage["completion_tokens"]),
                              speculation=Speculation.from_usage(usage.get("ddtree") or {}))


class StreamError(Exception):
    pass
