"""Load test of the OpenAI API with llmperf-style per-request metrics.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 2m --csv work/loadtest/run1 \
        --max-tokens 128 --temperature 0 --summary-json work/loadtest/run1_summary.json

`python -m loadtest sweep` (loadtest/sweep.py) runs this file over several servers and concurrencies.

Each user sends streaming chat (or completion) requests back to back with `stream_options.include_usage`, taking the
prompts in one shared order (shuffled once with `--seed`), so that two runs of the same length send the same
prompts. Locust's own statistics (and `--csv`'s `_stats.csv`) hold the HTTP requests: one entry per endpoint,
failures included (a status other than 200, an error event in the stream, a broken or unparsable stream, a stream
silent for longer than `--read-timeout`, no usage chunk; their response time is the time to the response headers, as
Locust times a streamed request). Per request the file also measures:

    ttft_ms                  time to the first content token
    itl_ms                   gap between two successive content chunks (vLLM's ITL; one sample per gap): a
                             speculative round or a server that merges chunks streams several tokens in one
    tpot_ms                  (end-to-end - TTFT) / (output tokens - 1): time per output token after the first
                             (llmperf's inter-token latency)
    e2e_latency_ms           request sent -> last byte
    output_tokens_per_s      output tokens / end-to-end latency of that request
    output_tokens            output tokens of the request (from the usage chunk)

These are not Locust requests (they would multiply its request counts and rates, and Locust rounds response times
to integers): at the end their p25/50/75/90/95/99, mean, min and max, the error rate, overall output tokens/s,
completed requests per minute (of the completed requests: those still streaming when the run ends are counted as
unfinished, not in the rates, as llmperf does) and the goodput (completed requests per second that met
`--slo-ttft-ms` and `--slo-tpot-ms`) are printed, written to `--summary-json`, and with `--csv PREFIX` to
`PREFIX_llm.csv`. Where the server reports `usage.ddtree`, the summary's `speculation` block says how the tokens
were made, over all completed requests: speculative and autoregressive (fallback) rounds and the speculative share,
the acceptance length per speculative round (each round weighs the same, so a run that mostly falls back is not
summarised by its few drafted rounds alone), output tokens per round, and the share of tokens from n-gram chains.

`--max-requests N` bounds a run in requests as `-t` bounds it in time: after the N-th request starts, users stop
one by one as their requests end, and the run ends with the last (`--stop-timeout` bounds how long `-t` waits for
the requests in flight).

Distributed runs (`--processes N`, or `--master` / `--worker`): each worker sends its requests' metrics to the master
with its periodic stats report, and the master alone prints and writes the summary of all users. `--max-requests`
then counts per worker process.
"""

from __future__ import annotations

import json
import os
import random
import time

import gevent
import requests
from locust import HttpUser, between, events, task
from locust.exception import StopUser
from locust.runners import WorkerRunner

from loadtest.metrics import (
    PromptOrder,
    RequestMetrics,
    Speculation,
    Summary,
    format_summary,
    load_prompts,
    summary_csv,
)


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    group = parser.add_argument_group("DDTree / OpenAI")
    group.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    group.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    group.add_argument("--max-tokens", type=int, default=128)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer <key>' when set")
    group.add_argument(
        "--prompts-file", default="", help="JSON lines with a 'text' field (default: ddtree/assets/eval/chat.jsonl)"
    )
    group.add_argument("--summary-json", default="", help="write the llmperf-style summary here")
    group.add_argument("--think-time", type=float, default=0.0, help="max seconds between a user's requests")
    group.add_argument(
        "--read-timeout",
        type=float,
        default=300.0,
        help="seconds a stream may stay silent before the request counts as failed",
    )
    group.add_argument("--seed", type=int, default=0, help="the prompts' shared order is shuffled with this seed")
    group.add_argument(
        "--max-requests",
        type=int,
        default=0,
        help="end the run once this many requests have started and ended (0: no bound)",
    )
    group.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="goodput counts a request only if its TTFT is at most this (0: no bound)",
    )
    group.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=0.0,
        help="goodput counts a request only if its TPOT is at most this (0: no bound)",
    )


@events.init.add_listener
def _on_init(environment, **_) -> None:
    options = environment.parsed_options
    environment.ddtree_summary = _new_summary(options)
    environment.ddtree_prompts = PromptOrder(
        load_prompts(options.prompts_file if options else ""), options.seed if options else 0
    )

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
    environment.ddtree_summary = _new_summary(environment.parsed_options)


def _new_summary(options) -> Summary:
    if options is None:
        return Summary()
    return Summary(slo=(options.slo_ttft_ms, options.slo_tpot_ms))


@events.quitting.add_listener
def _on_quit(environment, **_) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return  # its metrics went to the master, which writes the summary
    report = environment.ddtree_summary.report()
    # Locust's own totals at the end (its `--csv` stats file is written periodically and may miss the last seconds)
    total = environment.stats.total
    report["locust"] = {
        "num_requests": total.num_requests,
        "num_failures": total.num_failures,
        "median_response_time_ms": total.median_response_time,
    }
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
        summary = self.environment.ddtree_summary
        if options.max_requests and summary.counts["num_started"] >= options.max_requests:
            _quit_when_done(self.environment)
            raise StopUser()
        prompt = self.environment.ddtree_prompts.take()
        body = {
            "model": options.model,
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.endpoint == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        summary.start()
        t0 = time.perf_counter()
        with self.client.post(
            path,
            json=body,
            headers=self.headers,
            stream=True,
            catch_response=True,
            name=f"{path} (stream)",
            timeout=(30, options.read_timeout),
        ) as response:
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
        gaps: list[float] = []
        last_chunk = None
        for raw in response.iter_lines():
            if not raw:
                continue
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
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
                if text:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gaps.append(now - last_chunk)
                    last_chunk = now
        e2e = time.perf_counter() - t0
        if usage is None:
            raise StreamError("no usage chunk (stream_options.include_usage)")
        return RequestMetrics(
            ttft_s=ttft if ttft is not None else e2e,
            e2e_s=e2e,
            output_tokens=int(usage["completion_tokens"]),
            speculation=Speculation.from_usage(usage.get("ddtree") or {}),
            chunk_gaps_s=gaps,
        )


def _quit_when_done(environment) -> None:
    """Once every started request has ended (`--max-requests` reached), end the run."""
    summary = environment.ddtree_summary
    if getattr(environment, "ddtree_quitting", False):
        return
    if summary.counts["num_started"] <= summary.counts["num_completed"] + summary.counts["num_failed"]:
        environment.ddtree_quitting = True
        # (not from inside the user's own greenlet, which quit() kills)
        gevent.spawn(environment.runner.quit)


class StreamError(Exception):
    pass
