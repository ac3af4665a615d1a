"""`python -m loadtest sweep` (also `ddtree loadtest`): locust against several servers at several concurrencies.

    python -m loadtest sweep                                  # auto, off, hf and (if installed) vllm at 1, 4, 16, 32
    python -m loadtest sweep --quick                          # 1 and 8 users, short runs and answers (~7 min)
    python -m loadtest sweep --servers auto,b8,off --concurrency 1,2,4
    python -m loadtest sweep --servers mine=http://10.0.0.5:8000,vllm

For each server in turn the runner starts it (`serve run` of a config generated from ray_config.yaml per mode, the
naive HF baseline, or `vllm serve`; a NAME=URL server is used as it is), waits until it answers, sends each of the
first `--check-prompts` prompts once at T=0 (warming it up and recording its text, to tell where the servers'
outputs agree), then runs `locust --headless` with loadtest/locustfile.py at each concurrency (that many users,
all started at once), bounded by `--duration` and `--max-requests`, and stops the server. Ctrl-C or SIGTERM stops
what is running and leaves no process behind.

The folder (`--out`, default work/loadtest/sweep-<time>) gets, per run, locust's CSVs (`<server>_c<N>_*.csv`), the
file's llmperf-style summary and a run summary (`<server>_c<N>.json`); per server its config, log and T=0 texts;
then `results.json`, `table.md`, `table.csv`, `throughput.png` and `latency.png` (loadtest/report.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import requests
import yaml

from loadtest import report
from loadtest.servers import DEFAULT_VLLM_ARGS, DEFAULT_VLLM_VENV, REPO, Server, ServerError, ServerSpec, vllm_available

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
DEFAULT_SERVERS = "auto,off,hf,vllm"
DEFAULT_CONCURRENCY = "1,4,16,32"
DEFAULT_STAGGER_S = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help="comma-separated: auto, off, dflash, b<N> (ddtree at a fixed budget), hf (naive HF "
        "generate() on Serve), vllm (skipped with a message when `make vllm-venv` was not run), "
        "NAME=URL (a running server)",
    )
    parser.add_argument(
        "--concurrency",
        default=None,
        help=f"comma-separated numbers of users (default {DEFAULT_CONCURRENCY}; --quick: 1,8)",
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of load per run (default 60; --quick: 15)"
    )
    parser.add_argument("--max-requests", type=int, default=500, help="a run ends after this many requests too")
    parser.add_argument(
        "--stagger",
        type=float,
        default=DEFAULT_STAGGER_S,
        help=f"seconds between two users' starts in a run (default {DEFAULT_STAGGER_S:g}; 0: all at once); the run's "
        "--duration includes the ramp",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        help="seconds the requests in flight at a run's end may take to finish; those still running "
        "after it are reported as unfinished",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64; --quick: 32)")
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the servers this many times, every other pass in reverse order (A B B A): the "
        "table gives each server's mean and range, so that the machine's drift hurts all alike",
    )
    parser.add_argument(
        "--prompts",
        default="",
        help="JSON lines with a 'text' field (default: 16 each of the built-in code, math and chat evaluation prompts)",
    )
    parser.add_argument(
        "--check-prompts",
        type=int,
        default=None,
        help="prompts sent once at T=0 to each server before its runs, to compare the outputs (default 8; --quick: 2)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT bound (0: none)")
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput: TPOT bound (0: none)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an app arg of the ddtree servers (YAML value), e.g. --set max_num_seqs=32; model, "
        "drafter and served_model_name go to the hf and vllm servers too",
    )
    parser.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV), help="the venv of `make vllm-venv`")
    parser.add_argument("--vllm-args", default=DEFAULT_VLLM_ARGS, help="options of `vllm serve`")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="concurrency 1,8, 15 s runs, 32 new tokens, 2 check prompts (unless given explicitly)",
    )
    parser.add_argument("--out", default="", help="the sweep folder (default work/loadtest/sweep-<time>)")


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: comma-separated positive integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency {text!r}: comma-separated positive integers")
    return values


def default_prompts(per_category: int = 16) -> list[dict]:
    from ddtree.training.prompts import load_eval_prompts

    return [
        {"category": category, "text": text}
        for category in ("code", "math", "chat")
        for text in load_eval_prompts(category)[:per_category]
    ]


def run(args: argparse.Namespace) -> int:
    for name, default, quick in (
        ("concurrency", DEFAULT_CONCURRENCY, "1,8"),
        ("duration", 60.0, 15.0),
        ("check_prompts", 8, 2),
        ("max_tokens", 64, 32),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    concurrency = parse_concurrency(args.concurrency)
    specs = [ServerSpec.parse(s) for s in args.servers.split(",") if s.strip()]
    if not specs:
        raise ValueError("--servers: name at least one server")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"--servers {args.servers!r}: a server is named twice")
    if args.duration <= 0 or args.max_requests < 1 or args.max_tokens < 1 or args.passes < 1 or args.drain_timeout < 0:
        raise ValueError(
            "--duration, --max-requests, --max-tokens and --passes must be positive, --drain-timeout not negative"
        )
    if args.stagger < 0 or args.stagger * (max(concurrency) - 1) >= args.duration:
        raise ValueError(
            f"--stagger {args.stagger:g}: the last of {max(concurrency)} users must start within --duration "
            f"({args.duration:g} s), and it is not negative"
        )
    sets = parse_sets(args.set)
    folder = Path(args.out or REPO / "work" / "loadtest" / datetime.now().strftime("sweep-%Y%m%d-%H%M%S"))
    folder.mkdir(parents=True, exist_ok=True)
    if args.prompts:
        from loadtest.metrics import load_prompts

        prompts = [{"text": t} for t in load_prompts(args.prompts)]
    else:
        prompts = default_prompts()
    prompts_path = folder / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))

    skipped = {}
    if any(s.kind == "vllm" for s in specs) and not vllm_available(Path(args.vllm_venv)):
        skipped["vllm"] = f"not installed in {args.vllm_venv}: run `make vllm-venv` to compare against vLLM"
        print(f"skipping vllm: {skipped['vllm']}", flush=True)
        specs = [s for s in specs if s.kind != "vllm"]

    settings = {
        "concurrency": concurrency,
        "duration_s": args.duration,
        "max_requests": args.max_requests,
        "stagger_s": args.stagger,
        "max_tokens": args.max_tokens,
        "passes": args.passes,
        "temperature": 0.0,
        "num_prompts": len(prompts),
        "slo": {"ttft_ms": args.slo_ttft_ms or None, "tpot_ms": args.slo_tpot_ms or None},
        "set": sets,
        "command": " ".join(["python -m loadtest sweep", *getattr(args, "argv", [])]),
        "started": datetime.now().isoformat(),
    }
    runs, outputs, failures = [], {}, {}
    order = [(p, spec) for p in range(args.passes) for spec in (specs if p % 2 == 0 else specs[::-1])]
    progress = Progress(len(order) * len(concurrency))
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: the finally blocks stop what is running
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for number, spec in order:
            if spec.name in failures:
                progress.skip(len(concurrency))
                continue
            server = Server(spec, folder, sets, Path(args.vllm_venv), args.ready_timeout, args.vllm_args)
            progress.say(f"starting {spec.name}" + (f" (pass {number + 1}/{args.passes})" if args.passes > 1 else ""))
            try:
                started = time.monotonic()
                server.start()
                progress.say(
                    f"{spec.name} ready at {server.url} in {time.monotonic() - started:.0f} s (model {server.model})"
                )
                if spec.name not in outputs:
                    outputs[spec.name] = check_outputs(server, prompts[: args.check_prompts], args.max_tokens)
                    (folder / f"{spec.name}.outputs.json").write_text(json.dumps(outputs[spec.name], indent=1))
                for c in concurrency:
                    runs.append(run_locust(server, c, args, prompts_path, folder, progress, number))
            except ServerError as exc:
                failures[spec.name] = str(exc)
                progress.say(f"{spec.name} failed: {exc}")
                progress.skip(len(concurrency) - sum(r["server"] == spec.name and r["pass"] == number for r in runs))
            finally:
                server.stop()
    except KeyboardInterrupt:
        print("\ninterrupted: the servers started are stopped; the runs done so far are reported", file=sys.stderr)
        settings["interrupted"] = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    results = {
        "settings": settings,
        "runs": runs,
        "agreement": report.agreement(outputs),
        "skipped": skipped,
        "failed_servers": failures,
    }
    (folder / "results.json").write_text(json.dumps(results, indent=2))
    table = report.write_all(results, folder)
    print(table)
    print(f"\nwrote {folder}")
    errors = sum(r["summary"]["num_failed_requests"] for r in runs)
    return 1 if failures or errors or settings.get("interrupted") else 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def check_outputs(server: Server, prompts: list[dict], max_tokens: int) -> list[str | None]:
    """Each prompt's T=0 text (None where the request failed), four at a time."""

    def one(prompt: dict) -> str | None:
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": prompt["text"]}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        try:
            response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=600)
            response.raise_for_status()
            return response.json()["choices"][0]["message"]["content"]
        except (requests.RequestException, ValueError, KeyError, IndexError, TypeError):
            return None

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts))


def spawn_rate(users: int, stagger_s: float) -> float:
    """Locust's users started per second: one every `stagger_s` seconds, or all at once (0).

    Users that all start in the same instant, asking for answers of one length, stay in step on a server that
    decodes every request at the same pace: their requests finish together and are replaced together, so the server
    batches their prompts into one prefill while nothing decodes, and works in cycles of one request's latency. Real
    traffic does not arrive in step, so by default the users start a few rounds apart."""
    return 1.0 / stagger_s if stagger_s > 0 else float(users)


def run_locust(
    server: Server, users: int, args, prompts_path: Path, folder: Path, progress: Progress, number: int = 0
) -> dict:
    name = f"{server.spec.name}_c{users}" + (f"_p{number + 1}" if number else "")
    prefix, summary_path = folder / name, folder / f"{name}.locust_summary.json"
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--host",
        server.url,
        "--headless",
        "-u",
        str(users),
        "-r",
        f"{spawn_rate(users, args.stagger):g}",
        "-t",
        f"{args.duration:g}s",
        # requests in flight at the end get to finish (a slow server's whole batch may take minutes)
        "--stop-timeout",
        f"{args.drain_timeout:g}",
        "--csv",
        str(prefix),
        "--summary-json",
        str(summary_path),
        "--model",
        server.model,
        "--max-tokens",
        str(args.max_tokens),
        "--temperature",
        "0",
        "--prompts-file",
        str(prompts_path),
        "--max-requests",
        str(args.max_requests),
        "--slo-ttft-ms",
        f"{args.slo_ttft_ms:g}",
        "--slo-tpot-ms",
        f"{args.slo_tpot_ms:g}",
        "--exit-code-on-error",
        "0",
        "--only-summary",
        "--loglevel",
        "WARNING",
    ]
    progress.begin(f"{server.spec.name} c={users}", args.duration)
    with open(folder / f"{name}.locust.log", "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True
        )
        try:
            while process.poll() is None:
                progress.tick(_requests_so_far(prefix))
                time.sleep(1.0)
        finally:
            if process.poll() is None:  # interrupted
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    progress.end()
    if process.returncode != 0 or not summary_path.is_file():
        log_tail = (folder / f"{name}.locust.log").read_text(errors="replace")[-2000:]
        raise ServerError(f"locust failed on {name} (status {process.returncode}):\n{log_tail}")
    summary = json.loads(summary_path.read_text())
    stats = summary.pop("locust")
    record = {
        "server": server.spec.name,
        "kind": server.spec.kind,
        "concurrency": users,
        "pass": number,
        "summary": summary,
        "locust": stats,
        "command": " ".join(command),
    }
    (folder / f"{name}.json").write_text(json.dumps(record, indent=2))
    return record


def _requests_so_far(prefix: Path) -> int | None:
    """Requests done so far, from the last line of locust's stats history (written every second or so)."""
    try:
        with open(f"{prefix}_stats_history.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    for row in reversed(rows):
        if row.get("Name") == "Aggregated":
            try:
                return int(row["Total Request Count"])
            except (KeyError, ValueError):
                return None
    return None


class Progress:
    """One line per event, and the running run's elapsed time and requests: redrawn in place on a terminal, a line
    every 15 s otherwise (a CI log)."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.tty = sys.stdout.isatty()
        self.label, self.duration, self.started, self.last_line = "", 0.0, 0.0, 0.0

    def say(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(f"[{self.done}/{self.total}] {text}", flush=True)

    def begin(self, label: str, duration: float) -> None:
        self.label, self.duration, self.started = label, duration, time.monotonic()
        self.say(f"run {self.done + 1}/{self.total}: {label}")

    def tick(self, num_requests: int | None) -> None:
        elapsed = time.monotonic() - self.started
        state = "draining" if elapsed > self.duration else f"{elapsed:.0f}/{self.duration:.0f} s"
        line = f"  {self.label}: {state}, {'-' if num_requests is None else num_requests} requests"
        if self.tty:
            sys.stdout.write("\r\033[K" + line)
            sys.stdout.flush()
        elif time.monotonic() - self.last_line >= 15:
            print(line, flush=True)
            self.last_line = time.monotonic()

    def end(self) -> None:
        self.done += 1
        if self.tty:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()

    def skip(self, count: int) -> None:
        self.done += count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser("sweep", help="locust against several servers at several concurrencies")
    add_arguments(sweep)
    from loadtest import soak

    soak.add_arguments(
        commands.add_parser(
            "soak", help="one server under a steady load for a long time, watched for leaks (loadtest/soak.py)"
        )
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    try:
        return soak.run(args) if args.command == "soak" else run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
