"""`python -m loadtest soak`: one server under a steady load for a long time, watched for leaks.

The server starts as `make serve` runs it (ray_config.yaml, `--set` to change an arg), answers the check prompts at
T=0, then serves `--users` locust users for `--duration` seconds while a sampler records, every `--sample-every`
seconds, the resident memory of the server's processes (the engine replica, its target and drafter actors, and the
whole process session: Ray's own processes included) and the engine's state through its Serve handle (KV cache
bytes in use, requests running and waiting, threads, asyncio tasks). After the load it answers the check prompts
again, stops, and the offline engine (`ddtree.LLM`, speculation off) answers them too: all three must agree token
for token.

It writes `samples.csv`, `soak.png` (memory and KV cache against time), `soak.json` (settings, locust's summary,
what the samples show, the agreement) and the server's and locust's logs to `--out`. The exit status is 1 when a
request failed, the texts disagree, or memory grew by more than `--max-rss-growth` between the first and the last
tenth of the run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from loadtest.servers import REPO, Server, ServerError, ServerSpec, session_processes

APP_NAME = "ddtree"  # ray_config.yaml's application


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="auto", help="auto, off, dflash or b<N> (default auto: ray_config.yaml)")
    parser.add_argument("--users", type=int, default=32, help="locust users, each streaming requests back to back")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds under load (default 30 min)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--check-prompts", type=int, default=8, help="prompts answered at T=0 before, after, offline")
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.10,
        help="the largest accepted growth of the replica's and workers' memory, first to last tenth",
    )
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="seconds the last requests may take")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an app arg (repeatable)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds the server may take to start")
    parser.add_argument("--out", default="", help="the folder (default work/loadtest/soak-<time>)")


def rss_bytes(pid: int | None) -> int:
    """A process's resident set (0 when it is gone)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Sampler(threading.Thread):
    """Every `every_s` seconds: memory of the server's processes and the engine's state (`DDTreeEngine.info`)."""

    FIELDS = (
        "t_s",
        "rss_session_mib",
        "rss_replica_mib",
        "rss_target_mib",
        "rss_drafter_mib",
        "kv_cache_bytes_used",
        "num_running",
        "num_waiting",
        "num_threads",
        "num_asyncio_tasks",
    )

    def __init__(self, session_id: int, every_s: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.session_id, self.every_s = session_id, every_s
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()
        self._handle = None

    def connect(self) -> None:
        """A Ray driver on the server's cluster (the newest one on this machine), for the engine's handle."""
        import ray
        from ray import serve

        os.environ.pop("RAY_ADDRESS", None)
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        self._handle = serve.get_app_handle(APP_NAME)

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._stop_event.is_set():
            self.samples.append(self.sample(time.monotonic() - t0))
            self._stop_event.wait(self.every_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(60)

    def sample(self, t_s: float) -> dict:
        row = dict.fromkeys(self.FIELDS)
        row["t_s"] = round(t_s, 1)
        row["rss_session_mib"] = sum(rss_bytes(p) for p in session_processes(self.session_id)) / 2**20
        try:
            info = self._handle.info.remote().result(timeout_s=30)
        except Exception as exc:  # noqa: BLE001 - recorded; the memory columns are still worth having
            self.errors.append(f"{t_s:.0f} s: {type(exc).__name__}: {exc}")
            return row
        row["rss_replica_mib"] = rss_bytes(info["pid"]) / 2**20
        row["rss_target_mib"] = rss_bytes(info["worker_pids"]["target"]) / 2**20
        row["rss_drafter_mib"] = rss_bytes(info["worker_pids"]["drafter"]) / 2**20
        for key in ("kv_cache_bytes_used", "num_running", "num_waiting", "num_threads", "num_asyncio_tasks"):
            row[key] = info[key]
        return row


def memory_summary(samples: list[dict], under_load: tuple[float, float]) -> dict:
    """Each memory column's median over the first and the last tenth of the loaded samples, and its maximum; the
    KV cache's maximum under load and its value after."""
    start, end = under_load
    loaded = [s for s in samples if start <= s["t_s"] <= end]
    tenth = max(1, len(loaded) // 10)
    out = {}
    for key in ("rss_session_mib", "rss_replica_mib", "rss_target_mib", "rss_drafter_mib"):
        values = [s[key] for s in loaded if s[key]]
        if len(values) < 2:
            continue
        first, last = statistics.median(values[:tenth]), statistics.median(values[-tenth:])
        out[key] = {
            "first_tenth": round(first, 1),
            "last_tenth": round(last, 1),
            "max": round(max(values), 1),
            "growth": round(last / first - 1, 4),
        }
    kv = [s["kv_cache_bytes_used"] for s in loaded if s["kv_cache_bytes_used"] is not None]
    # after the load: the idle samples before the check prompts run again (the smallest values after its end)
    after = [s for s in samples if s["t_s"] > end and s["kv_cache_bytes_used"] is not None]
    out["kv_cache_bytes_used"] = {
        "max_under_load": max(kv, default=None),
        "after": min((s["kv_cache_bytes_used"] for s in after), default=None),
    }
    out["num_threads"] = sorted({s["num_threads"] for s in samples if s["num_threads"] is not None})
    out["num_asyncio_tasks_max"] = max(
        (s["num_asyncio_tasks"] for s in samples if s["num_asyncio_tasks"]), default=None
    )
    out["num_asyncio_tasks_after"] = min(
        (s["num_asyncio_tasks"] for s in after if s["num_asyncio_tasks"]), default=None
    )
    return out


def failures_by_status(path: Path) -> dict[str, int]:
    """locust's failures CSV, counted by HTTP status ("HTTP 429") or, for a failure without one, its error type."""
    counts: dict[str, int] = {}
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return counts
    for row in rows:
        error = row.get("Error") or ""
        match = re.search(r"HTTP (\d{3})", error)
        key = f"HTTP {match.group(1)}" if match else (error.split("(")[0].split(":")[0].strip() or "unknown")
        counts[key] = counts.get(key, 0) + int(row.get("Occurrences") or 0)
    return counts


def offline_outputs(prompts: list[dict], max_tokens: int, sets: dict) -> list[str]:
    """The check prompts' T=0 texts from the offline engine (the served model, speculation off)."""
    from ddtree import LLM, SamplingParams

    llm = LLM(sets.get("model"), speculation="off", dtype=sets.get("dtype"))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.text for o in llm.chat([[{"role": "user", "content": p["text"]}] for p in prompts], params)]


def plot(samples: list[dict], under_load: tuple[float, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, memory = plt.subplots(figsize=(9, 4.5))
    t = [s["t_s"] / 60 for s in samples]
    for key, label in (
        ("rss_session_mib", "all server processes"),
        ("rss_replica_mib", "engine replica"),
        ("rss_target_mib", "target actor"),
        ("rss_drafter_mib", "drafter actor"),
    ):
        memory.plot(t, [s[key] or float("nan") for s in samples], label=label)
    memory.set_xlabel("minutes")
    memory.set_ylabel("resident memory (MiB)")
    memory.axvspan(under_load[0] / 60, under_load[1] / 60, color="0.92", zorder=0)
    kv = memory.twinx()
    kv.plot(
        t,
        [(s["kv_cache_bytes_used"] or 0) / 2**20 for s in samples],
        color="black",
        linestyle=":",
        label="KV cache in use",
    )
    kv.set_ylabel("KV cache in use (MiB)")
    lines = memory.get_legend_handles_labels()[0] + kv.get_legend_handles_labels()[0]
    memory.legend(lines, [ln.get_label() for ln in lines], loc="center right", fontsize=8)
    memory.set_title("soak: memory and KV cache (shaded: under load)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soak_settings(args: argparse.Namespace, sets: dict) -> dict:
    """What soak.json records of how the run was made: enough to repeat it (the users' stagger included, which
    changes how requests line up in the engine's rounds)."""
    return {
        "server": args.server,
        "users": args.users,
        "stagger_s": args.stagger,
        "duration_s": args.duration,
        "sample_every_s": args.sample_every,
        "max_tokens": args.max_tokens,
        "set": sets,
        "command": " ".join(["python -m loadtest soak", *getattr(args, "argv", [])]),
        "started": datetime.now().isoformat(),
    }


def run(args: argparse.Namespace) -> int:
    from loadtest.sweep import DEFAULT_STAGGER_S, Progress, check_outputs, default_prompts, parse_sets, run_locust

    if args.users < 1 or args.duration <= 0 or args.sample_every <= 0 or args.max_tokens < 1:
        raise ValueError("--users, --duration, --sample-every and --max-tokens must be positive")
    sets = parse_sets(args.set)
    folder = Path(args.out or REPO / "work" / "loadtest" / datetime.now().strftime("soak-%Y%m%d-%H%M%S"))
    folder.mkdir(parents=True, exist_ok=True)
    prompts = default_prompts()
    prompts_path = folder / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    checks = prompts[: args.check_prompts]
    # run_locust's settings: the soak is one long run, ended by time only
    args.max_requests, args.slo_ttft_ms, args.slo_tpot_ms, args.stagger = 10**9, 2000.0, 100.0, DEFAULT_STAGGER_S
    settings = soak_settings(args, sets)
    server = Server(ServerSpec.parse(args.server), folder, sets, ready_timeout_s=args.ready_timeout)
    progress = Progress(1)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    sampler = None
    try:
        progress.say(f"starting {server.spec.name}")
        server.start()
        progress.say(f"{server.spec.name} ready at {server.url}")
        before = check_outputs(server, checks, args.max_tokens)
        sampler = Sampler(server.process.pid, args.sample_every)
        sampler.connect()
        sampler.start()
        time.sleep(min(args.sample_every, 10.0) * 2)  # a baseline before the load
        load_start = sampler.samples[-1]["t_s"] if sampler.samples else 0.0
        record = run_locust(server, args.users, args, prompts_path, folder, progress)
        load_end = sampler.samples[-1]["t_s"] if sampler.samples else 0.0
        time.sleep(min(args.sample_every, 10.0) * 2)  # idle again: KV back to 0
        after = check_outputs(server, checks, args.max_tokens)
        sampler.stop()
    except KeyboardInterrupt:
        print("\ninterrupted: the server is stopped, nothing is reported", file=sys.stderr)
        return 1
    except ServerError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    progress.say("the offline engine answers the check prompts")
    offline = offline_outputs(checks, args.max_tokens, sets)
    samples = sampler.samples
    with open(folder / "samples.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, Sampler.FIELDS)
        writer.writeheader()
        writer.writerows(samples)
    memory = memory_summary(samples, (load_start, load_end))
    plot(samples, (load_start, load_end), folder / "soak.png")
    summary = record["summary"]
    agreement = {
        "before_equals_offline": sum(a == b for a, b in zip(before, offline)),
        "after_equals_offline": sum(a == b for a, b in zip(after, offline)),
        "num_prompts": len(checks),
    }
    failures = failures_by_status(folder / f"{server.spec.name}_c{args.users}_failures.csv")
    result = {
        "settings": settings,
        "summary": summary,
        "locust": record["locust"],
        "failures": failures,
        "memory": memory,
        "agreement": agreement,
        "sampler_errors": sampler.errors,
        "locust_command": record["command"],
    }
    (folder / "soak.json").write_text(json.dumps(result, indent=2))
    growth = max(
        (m["growth"] for k, m in memory.items() if k in ("rss_replica_mib", "rss_target_mib", "rss_drafter_mib")),
        default=0.0,
    )
    print(
        f"requests: {summary['num_completed_requests']} completed, {summary['num_failed_requests']} failed, "
        f"{summary['overall_output_tokens_per_s']:.1f} output tokens/s" + (f"; failures {failures}" if failures else "")
    )
    for key, m in memory.items():
        if key.startswith("rss_"):
            print(
                f"{key}: {m['first_tenth']:.0f} -> {m['last_tenth']:.0f} MiB (max {m['max']:.0f}, {m['growth']:+.1%})"
            )
    print(
        f"KV cache: max {memory['kv_cache_bytes_used']['max_under_load']} bytes under load, "
        f"{memory['kv_cache_bytes_used']['after']} after; threads {memory['num_threads']}; asyncio tasks at most "
        f"{memory['num_asyncio_tasks_max']}, {memory['num_asyncio_tasks_after']} after"
    )
    print(
        f"T=0 texts equal to the offline engine's: before {agreement['before_equals_offline']}/{len(checks)}, "
        f"after {agreement['after_equals_offline']}/{len(checks)}"
    )
    print(f"wrote {folder}")
    ok = (
        summary["num_failed_requests"] == 0
        and summary["num_unfinished_requests"] == 0
        and agreement["before_equals_offline"] == len(checks)
        and agreement["after_equals_offline"] == len(checks)
        and growth <= args.max_rss_growth
    )
    return 0 if ok else 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
