"""Load test of the OpenAI API with llmperf-style per-request metrics.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 -t 2m --csv work/loadtest/run1 \
        --max-tokens 128 --temperature 0 --summary-json work/loadtest/run1_summary.json

Each user sends streaming chat (or completion) requests back to back with `stream_options.include_usage`. Locust's
own statistics (and `--csv`'s `_stats.csv`) hold the HTTP requests: one entry per endpoint, failures included (a
status other than 200, an error event in the stream, a broken or unparsable stream, no usage chunk; their response
time is the time to the response headers, as Locust times a streamed request). Per request
the file also measures, llmperf-style:

    ttft_ms                  time to the first content token
    inter_token_latency_ms   (end-to-end - TTFT) / (output tokens - 1): per token, not per chunk, since one
                             speculative round streams several tokens at once
    e2e_latency_ms           request sent -> last byte
    output_tokens_per_s      output tokens / end-to-end latency of that request
    output_tokens            output tokens of the request (from the usage chunk)
    acceptance_length        mean accepted length of the request (usage.ddtree), when the server reports one

These are not Locust requests (they would multiply its request counts and rates, and Locust rounds response times
to integers): at the end their p25/50/75/90/95/99, mean, min and max, the error rate, overall output tokens/s and
completed requests per minute are printed, written to `--summary-json`, and with `--csv PREFIX` to
`PREFIX_llm.csv`. In distributed runs each worker's summary covers its own users; Locust's own CSV covers all.
"""

from __future__ import annotations

import importlib.resources
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import requests
from locust import HttpUser, between, events, task

METRICS = ("ttft_ms", "inter_token_latency_ms", "e2e_latency_ms", "output_tokens_per_s", "output_tokens",
           "acceptance_length")
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


@dataclass
class RequestMetrics:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    acceptance_length: float | None

    def values(self) -> dict[str, float]:
        values = {
            "ttft_ms": 1000 * self.ttft_s,
            "e2e_latency_ms": 1000 * self.e2e_s,
            "output_tokens": float(self.output_tokens),
            "output_tokens_per_s": self.output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0,
        }
        if self.output_tokens > 1:
            values["inter_token_latency_ms"] = 1000 * (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
        if self.acceptance_length is not None:
            values["acceptance_length"] = self.acceptance_length
        return values


@dataclass
class Summary:
    """Every completed request's metrics and every failure, for the end-of-run summary."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    num_completed: int = 0
    num_failed: int = 0
    total_output_tokens: int = 0
    start_time: float = field(default_factory=time.time)

    def add(self, metrics: RequestMetrics) -> None:
        self.num_completed += 1
        self.total_output_tokens += metrics.output_tokens
        for name, value in metrics.values().items():
            self.samples[name].append(value)

    def report(self) -> dict:
        duration = max(time.time() - self.start_time, 1e-9)
        num_requests = self.num_completed + self.num_failed
        return {
            "num_completed_requests": self.num_completed,
            "num_failed_requests": self.num_failed,
            "error_rate": self.num_failed / num_requests if num_requests else 0.0,
            "duration_s": duration,
            "overall_output_tokens_per_s": self.total_output_tokens / duration,
            "completed_requests_per_min": 60 * self.num_completed / duration,
            "metrics": {name: _describe(values) for name, values in self.samples.items() if values},
        }


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


@events.test_start.add_listener
def _on_start(environment, **_) -> None:
    environment.ddtree_summary.start_time = time.time()


@events.quitting.add_listener
def _on_quit(environment, **_) -> None:
    report = environment.ddtree_summary.report()
    print(format_summary(report))
    options = environment.parsed_options
    if options is not None and options.summary_json:
        with open(options.summary_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if options is not None and getattr(options, "csv_prefix", None):
        with open(f"{options.csv_prefix}_llm.csv", "w", encoding="utf-8") as f:
            f.write(summary_csv(report))


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
        t0 = time.perf_counter()
        with self.client.post(path, json=body, headers=self.headers, stream=True, catch_response=True,
                              name=f"{path} (stream)") as response:
            try:
                metrics = self._read_stream(response, t0, chat=options.endpoint == "chat")
            # a broken connection mid-stream, an event that is not JSON or lacks a field: failures too
            except (StreamError, requests.RequestException, ValueError, KeyError, TypeError) as exc:
                summary.num_failed += 1
                response.failure(f"{type(exc).__name__}: {exc}")
                return
            response.success()
        summary.add(metrics)

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
            if "error" in event:
                raise StreamError(f"stream error: {event['error'].get('message')}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
        e2e = time.perf_counter() - t0
        if usage is None:
            raise StreamError("no usage chunk (stream_options.include_usage)")
        ddtree = usage.get("ddtree") or {}
        return RequestMetrics(ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e,
                              output_tokens=int(usage["completion_tokens"]),
                              acceptance_length=ddtree.get("mean_acceptance_length"))


class StreamError(Exception):
    pass
