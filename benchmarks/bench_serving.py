"""Served against offline: the same prompts through the offline engine and through the Ray Serve app's HTTP API.

    python benchmarks/bench_serving.py                                   # off and auto at concurrency 1, 8, 16
    python benchmarks/bench_serving.py --modes off --concurrency 1 --num-prompts 2 --max-tokens 32

Each mode is served by its own app (`build_app`, the args of ray_config.yaml with `speculation` / `budget` set), all
deployed at once on one Ray instance, so the runs can alternate without restarting anything. A closed loop of C
clients sends streaming chat completions (`stream_options.include_usage`) until every prompt is answered; the
offline runs keep C requests in the engine the same way (a finished request is replaced at once). For each
concurrency, after `--warmup` unmeasured runs of everything, the order is: offline mode 1, served mode 1, offline
mode 2, served mode 2, ..., then the same in reverse order of modes, and so on for `--passes` passes, so that the
machine's drift (and whatever a served run leaves running behind it) hits every row alike; tokens/s is the median
over passes, and each ratio (served / offline, x `off`) the median of the passes' own ratios (`paired_ratio`: the
runs of one pass ran side by side). `--served-only` leaves the offline runs out, so that served runs follow served
runs only.

Each served app verifies on a load of the target of its own, and two loads of the same weights differ in speed by up
to a few percent (where the weights land in memory; docs/engine.md), which a ratio between two apps' runs would
count as the modes' difference. `--reload-workers` gives every app a fresh load before each pass after the first:
its target actor's process is killed and the replica's own recovery starts a new target and drafter (docs/serving.md,
"Fault tolerance"), and one unmeasured served run warms the new load up. The median over passes then spans as many
loads per mode as passes.

The table gives output tokens/s (completion tokens over the wall time of the whole run), the served/offline ratio,
the served tokens/s until the prompts ran out ("steady": the replica's emitted tokens, `info()`, from the start to the
moment a client first found no prompt left; from then on the seats empty one by one, and how long that tail lasts
depends on how far apart the last requests end, which speculation sets apart and `off`'s lock-step keeps together),
and a served round broken down, per engine round, into compute (inside the worker actors, plus the engine's own
work between calls), actor hops (the actor calls' wall time minus the time inside the actors) and the rest of a
served round's wall time beyond those (serving: HTTP, the ingress, streaming, the loop's wake-ups). For offline
and served alike it gives the share of request-rounds that drafted ("spec share") and the output tokens per
request-round: where served speculation makes less than offline at the same round time, these say whether it
drafted less often or committed less per draft. T=0 outputs are compared token for token between offline and
served. A second table gives the cores each kind of process used during the served runs (the target and drafter
actors, the engine replica, Serve's proxy and controller, everything else, this process's HTTP clients) and the
cores left idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The in-process engine's OpenMP threads wait, and its memory takes pages, as the worker actors' do (before torch).
from deployments.config import use_worker_env  # noqa: E402
from deployments.run import direct_ingress_env  # noqa: E402

use_worker_env()

from ddtree.bench_report import paired_ratio  # noqa: E402
from ddtree.engine import ROUND_STAGES as STAGES  # noqa: E402  (after the workers' environment: it loads torch)

PROXY_PORT = 8123  # Serve's proxy
DIRECT_INGRESS_PORT = 8124  # the apps' replicas, one port each from here (Serve's direct ingress)
MODES = {
    "off": {"speculation": "off"},
    "auto": {"speculation": "ddtree", "budget": "auto"},
    "dflash": {"speculation": "dflash"},
    # auto's parts, as `ddtree bench` names them: without n-gram chains, and the budget policy without the closed loop
    "auto-no-ngram": {"speculation": "ddtree", "budget": "auto", "ngram_tokens": 0},
    "auto-no-loop": {"speculation": "ddtree", "budget": "auto", "max_explore_share": 0.0},
    # the served workers' memory on 4 KB pages instead of 2 MB ones (`worker_env`; their offline runs are as the
    # mode's without the suffix: the benchmark's own process keeps the workers' default)
    "off-4k-pages": {"speculation": "off", "worker_env": {"THP_MEM_ALLOC_ENABLE": "0"}},
    "auto-4k-pages": {"speculation": "ddtree", "budget": "auto", "worker_env": {"THP_MEM_ALLOC_ENABLE": "0"}},
    # the round's threads at the nice value they start with instead of `round_nice`'s default
    "off-nice0": {"speculation": "off", "round_nice": None},
    "auto-nice0": {"speculation": "ddtree", "budget": "auto", "round_nice": None},
    # the replica's thread switch interval at Python's default (5 ms) instead of `gil_switch_interval_ms`'s
    "off-gil5ms": {"speculation": "off", "gil_switch_interval_ms": None},
    "auto-gil5ms": {"speculation": "ddtree", "budget": "auto", "gil_switch_interval_ms": None},
}


@dataclass
class Run:
    tokens_per_second: list[float] = field(default_factory=list)
    # served: output tokens/s from the start until a client first found no prompt left (`run_served`'s on_drain)
    steady_tokens_per_second: list[float] = field(default_factory=list)
    outputs: dict[int, str] = field(default_factory=dict)  # prompt index -> text (T=0: the same every pass)
    ttft: list[float] = field(default_factory=list)
    per_round: dict[str, float] = field(default_factory=dict)  # ms per engine round, served runs
    num_rounds: int = 0
    engine_state: dict = field(default_factory=dict)  # the engine's closed loop and cumulative timings, last pass
    # summed over passes: output tokens, request-rounds speculative and in fallback (offline and served alike)
    mix: dict[str, int] = field(default_factory=dict)
    # served runs, summed over passes: CPU seconds by process role (`cpu_snapshot`), and the runs' wall seconds
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    cpu_wall: float = 0.0
    # summed over passes: the engine's stage seconds and counts (`RoundTimings` deltas), offline and served alike
    stages: dict[str, float] = field(default_factory=dict)
    # served runs, summed over passes: per worker operation, [calls, hop seconds there, hop seconds back]
    hops_by_op: dict[str, list] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_second) if self.tokens_per_second else 0.0

    @property
    def steady_median(self) -> float:
        return statistics.median(self.steady_tokens_per_second) if self.steady_tokens_per_second else 0.0


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off,auto", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--concurrency", default="1,8,16", help="comma-separated client counts")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per category (code, math, chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured runs of every mode, offline and served, before each concurrency's passes (a "
        "replica's first rounds at a batch size include its closed loop's learning)",
    )
    p.add_argument("--config", default=str(REPO / "ray_config.yaml"), help="the app args come from this file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an app arg of the served runs (YAML value), e.g. --set stream_interval_ms=50; without "
        "--set max_num_seqs, every engine seats the largest --concurrency, and with it, that many (the rest queue)",
    )
    p.add_argument(
        "--served-only",
        action="store_true",
        help="no offline runs: the served apps alone, alternating (a served run then follows another served run, not "
        "an offline run in this process); the offline columns are '-', and T=0 texts are compared with the first "
        "mode's served texts",
    )
    p.add_argument(
        "--serve-proxy",
        action="store_true",
        help="send the requests through Serve's proxy, not to the apps' replicas directly (Serve's direct ingress, "
        "as `make serve` serves)",
    )
    p.add_argument(
        "--reload-workers",
        action="store_true",
        help="before each pass after the first, a fresh load of every app's workers (its target actor killed, the "
        "replica's recovery starting new ones), then one unmeasured served run of it: passes sample loads",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency must be integers separated by commas, got {args.concurrency!r}")
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--max-tokens", args.max_tokens),
        ("--passes", args.passes),
        ("--concurrency", min(args.concurrency)),
    ):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def app_url(mode: str, ports) -> str:
    """The URL of the app of `mode` (route prefix /mode): the first of `ports` where its /health answers 200 (with
    direct ingress, each app's replica took one port of the range, in no set order; others answer 404)."""
    from deployments.run import is_healthy

    for port in ports:
        url = f"http://127.0.0.1:{port}/{mode}"
        if is_healthy(url):
            return url
    raise RuntimeError(f"no port of {list(ports)} serves /{mode}/health")


def reload_workers(handle, timeout_s: float = 300.0) -> float:
    """Kill the app's target actor's process and wait until the replica's recovery has a new target (and drafter)
    serving (`info()`: one more target restart, no target lost); the seconds that took."""
    import signal

    t0 = time.monotonic()
    before = handle.info.remote().result()
    os.kill(before["worker_pids"]["target"], signal.SIGKILL)
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
        info = handle.info.remote().result()
        if info["num_target_restarts"] > before["num_target_restarts"] and info["target_lost"] is None:
            return time.monotonic() - t0
    raise RuntimeError(f"the app's target actor was killed and no new one served within {timeout_s:.0f} s")


def run_offline(engine, prompts: list[list[int]], params, concurrency: int) -> tuple[float, dict[int, str], int]:
    """Closed loop in the engine: `concurrency` requests in flight, a finished one replaced at once; returns
    tokens/s, text per prompt, output tokens."""
    ids: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    num_tokens, pending = 0, list(enumerate(prompts))
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_running + engine.num_waiting < concurrency:
            i, prompt = pending.pop(0)
            ids[engine.add_request(prompt, params)] = i
        for out in engine.step():
            if out.finished:
                outputs[ids[out.request_id]] = out.text
                num_tokens += len(out.token_ids)
    return num_tokens / (time.perf_counter() - t0), outputs, num_tokens


async def run_served(
    url: str, model: str, messages: list[list[dict]], max_tokens: int, concurrency: int, on_drain=None
) -> tuple[float, dict[int, str], list[float], int]:
    """Closed loop of `concurrency` streaming clients; returns tokens/s, text per prompt, TTFTs, output tokens.
    `on_drain(seconds)`: called (in a thread) once, when a client first finds no prompt left, with the seconds since
    the start: from then on the seats empty one by one."""
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(messages):
        queue.put_nowait(item)
    outputs: dict[int, str] = {}
    ttfts: list[float] = []
    num_tokens = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal num_tokens
        while not queue.empty():
            i, msgs = queue.get_nowait()
            body = {
                "model": model,
                "messages": msgs,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            t0 = time.perf_counter()
            first = None
            texts: list[str] = []
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:300]!r}")
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        num_tokens += chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", ()):
                        content = (choice.get("delta") or {}).get("content")
                        if content and first is None:
                            first = time.perf_counter() - t0
                        texts.append(content or "")
            outputs[i] = "".join(texts)
            if first is not None:
                ttfts.append(first)
        if on_drain is not None and not drained:
            drained.append(True)  # (the first client out of prompts only)
            await asyncio.to_thread(on_drain, time.perf_counter() - started)

    drained: list[bool] = []
    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return num_tokens / seconds, outputs, ttfts, num_tokens


def main(argv=None) -> int:
    args = parse(argv)
    if not args.serve_proxy:  # before Ray starts: its processes take this environment
        os.environ.update(direct_ingress_env({}, DIRECT_INGRESS_PORT, len(args.modes)))
    import ray
    import yaml
    from ray import serve

    from ddtree.engine import Engine
    from ddtree.loaders import build_workers
    from ddtree.sampling_params import SamplingParams
    from ddtree.training.prompts import load_eval_conversations
    from deployments.app import build_app
    from deployments.config import parse_args

    app = yaml.safe_load(Path(args.config).read_text())["applications"][0]
    base_args = dict(app["args"])
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        base_args[key] = yaml.safe_load(value)
    messages = load_eval_conversations(args.num_prompts)
    max_c = max(args.concurrency)
    # Seats: as many as the most clients, unless --set gave max_num_seqs (then the clients beyond it queue, as a
    # server's do)
    seats_given = any(item.partition("=")[0] == "max_num_seqs" for item in args.set)

    # Offline: one set of workers in this process, an engine per mode (as `ddtree bench`).
    parsed = parse_args({**base_args, **MODES[args.modes[0]]})
    target, drafter, tokenizer = build_workers(
        parsed.model,
        parsed.drafter,
        device="cpu",
        dtype=parsed.dtype,
        need_drafter=any(MODES[m]["speculation"] != "off" for m in args.modes),
    )
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in messages
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # `off` offline on a target loaded as its served app loads it (no drafter, no features)
    plain_target = target
    if drafter is not None and any(MODES[m]["speculation"] == "off" for m in args.modes):
        plain_target, _, _ = build_workers(parsed.model, None, device="cpu", dtype=parsed.dtype, need_drafter=False)
    engines = {}
    for mode in args.modes:
        seats = parsed.max_num_seqs if seats_given else max(max_c, parsed.max_num_seqs)
        mode_args = parse_args({**base_args, **MODES[mode], "max_num_seqs": seats})
        # the served app's engine settings (in one process `pipeline: auto` never pipelines, as on `cpu` served)
        config = mode_args.engine_config()
        is_plain = mode_args.speculation == "off"
        engines[mode] = Engine(config, plain_target if is_plain else target, None if is_plain else drafter, tokenizer)

    # Served: every mode's app at once (Ray's logical CPUs sized so that all their placement groups fit; each
    # replica's threads follow its own placement, not this count).
    num_cpus = 0.0
    for mode in args.modes:
        layout = parse_args({**base_args, **MODES[mode]}).worker_layout()
        num_cpus += sum(b.get("CPU", 0.0) for b in layout.bundles)
    ray.init(num_cpus=int(num_cpus) + 2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PROXY_PORT})
    urls = {}
    for mode in args.modes:
        seats = base_args["max_num_seqs"] if seats_given else max(max_c, base_args.get("max_num_seqs") or 1)
        mode_args = {**base_args, **MODES[mode], "max_num_seqs": seats}
        serve.run(build_app(mode_args), name=mode, route_prefix=f"/{mode}")
        ports = [PROXY_PORT] if args.serve_proxy else range(DIRECT_INGRESS_PORT, DIRECT_INGRESS_PORT + len(args.modes))
        urls[mode] = app_url(mode, ports)
        print(f"served {mode} at {urls[mode]}", flush=True)
    model_name = parsed.model_name

    results: dict[tuple[str, str, int], Run] = {}
    try:
        for c in args.concurrency:
            for _ in range(args.warmup):
                for mode in args.modes:
                    if not args.served_only:
                        run_offline(engines[mode], prompts, params, c)
                    asyncio.run(run_served(urls[mode], model_name, messages, args.max_tokens, c))
            for p in range(args.passes):
                if args.reload_workers and p > 0:
                    for mode in args.modes:
                        seconds = reload_workers(serve.get_app_handle(mode))
                        asyncio.run(run_served(urls[mode], model_name, messages, args.max_tokens, c))
                        print(f"  c={c} pass {p + 1} {mode}: workers reloaded in {seconds:.1f} s", flush=True)
                # ABBA: the order flips every pass, so that no mode always runs right after another's served run
                for mode in args.modes if p % 2 == 0 else args.modes[::-1]:
                    off_run = None
                    if not args.served_only:
                        off_run = results.setdefault(("offline", mode, c), Run())
                        timings_before = engines[mode].timings.as_dict()
                        rate, outs, num_tokens = run_offline(engines[mode], prompts, params, c)
                        off_run.tokens_per_second.append(rate)
                        off_run.outputs = outs
                        _add_mix(
                            off_run, timings_before, engines[mode].timings.as_dict(), num_tokens, num_tokens / rate
                        )
                        off_run.engine_state = {
                            "guard": engines[mode].guard.describe() if engines[mode].guard else None,
                            "timings": engines[mode].timings.as_dict(),
                        }
                    served_run = results.setdefault(("served", mode, c), Run())
                    handle = serve.get_app_handle(mode)
                    before = handle.info.remote().result()
                    drain: list[tuple[float, dict]] = []  # (seconds since the start, info()) when prompts ran out

                    def on_drain(seconds: float, handle=handle, drain=drain) -> None:
                        info = handle.info.remote().result()  # (read between two rounds)
                        drain.append((seconds, info))

                    cpu_before, t0 = cpu_snapshot(), time.perf_counter()
                    # (more clients than prompts: some find none at the start, and no window has every seat busy)
                    drains = on_drain if c <= len(messages) else None
                    rate, outs, ttfts, num_tokens = asyncio.run(
                        run_served(urls[mode], model_name, messages, args.max_tokens, c, drains)
                    )
                    wall = time.perf_counter() - t0
                    _add_cpu(served_run, cpu_before, cpu_snapshot(), wall)
                    after = handle.info.remote().result()
                    served_run.tokens_per_second.append(rate)
                    steady = None
                    if drain:
                        seconds, drained = drain[0]
                        steady = (drained["num_generated_tokens"] - before["num_generated_tokens"]) / seconds
                        served_run.steady_tokens_per_second.append(steady)
                    served_run.outputs = outs
                    served_run.ttft += ttfts
                    _add_breakdown(served_run, before, after, wall)
                    _add_mix(served_run, before["timings"], after["timings"], num_tokens, wall)
                    served_run.engine_state = {"guard": after["guard"], "timings": after["timings"]}
                    offline = f"offline {off_run.tokens_per_second[-1]:.1f}, " if off_run is not None else ""
                    summary = _pass_summary(before["timings"], after["timings"], num_tokens, wall)
                    print(
                        f"  c={c} pass {p + 1} {mode}: {offline}served {rate:.1f} tok/s"
                        + (f", {steady:.1f} until the prompts ran out" if steady is not None else "")
                        + f" ({summary})",
                        flush=True,
                    )
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(args, results)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                [
                    {
                        "where": w,
                        "mode": m,
                        "concurrency": c,
                        "tokens_per_second": r.tokens_per_second,
                        "steady_tokens_per_second": r.steady_tokens_per_second,
                        "per_round_ms": r.per_round,
                        "mix": r.mix,
                        "ttft_p50_s": statistics.median(r.ttft) if r.ttft else None,
                        "engine_state": r.engine_state,
                        "cpu_cores": {k: v / r.cpu_wall for k, v in r.cpu_seconds.items()} if r.cpu_wall else None,
                    }
                    for (w, m, c), r in results.items()
                ],
                indent=2,
            )
        )
    return 0


# Whose CPU a served run spends: each process on the machine by its role (Ray names an actor's process after its
# class), this process's (the HTTP clients'), and the cores' idle time.
_ROLES = (
    (b"TargetActor", "target"),
    (b"DrafterActor", "drafter"),
    (b"ServeReplica", "replica"),
    (b"ProxyActor", "proxy"),
    (b"ServeController", "controller"),
)
CPU_COLUMNS = ("target", "drafter", "replica", "proxy", "controller", "other", "clients", "idle")
# the engine's request-rounds (`RoundTimings`), speculative and plain: together, requests per round times rounds
REQUEST_ROUNDS = ("num_speculative_request_rounds", "num_autoregressive_request_rounds")


def cpu_snapshot() -> dict[str, float] | None:
    """CPU seconds used so far by role (`CPU_COLUMNS`; "other": Ray's own processes and anything else running), and
    the machine's idle seconds, from /proc (None where there is none)."""
    if not os.path.exists("/proc/stat"):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    seconds = dict.fromkeys(CPU_COLUMNS, 0.0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # (exited meanwhile)
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # from the state on: utime and stime are the 12th and 13th
        used = (int(fields[11]) + int(fields[12])) / tick
        if int(entry) == os.getpid():
            role = "clients"
        else:
            role = next((name for key, name in _ROLES if key in cmdline), "other")
        seconds[role] += used
    cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()  # "cpu user nice system idle iowait ..."
    seconds["idle"] = (int(cpu[4]) + int(cpu[5])) / tick
    return seconds


def _add_cpu(run: Run, before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> None:
    if before is None or after is None:
        return
    for role in CPU_COLUMNS:
        run.cpu_seconds[role] = run.cpu_seconds.get(role, 0.0) + after[role] - before[role]
    run.cpu_wall += wall


def _add_breakdown(run: Run, before: dict, after: dict, wall: float) -> None:
    """Per-round ms of the served run, summed over passes: compute (the stage timings: time inside the workers and
    the engine's own stages, hops excluded), hops, and the rest."""
    t0, t1 = before["timings"], after["timings"]
    rounds = t1["num_rounds"] - t0["num_rounds"]
    compute = sum(t1[k] - t0[k] for k in STAGES)
    hops = after["actor_hop_seconds"] - before["actor_hop_seconds"]
    there = after["actor_hop_there_seconds"] - before["actor_hop_there_seconds"]
    total = {"compute": compute, "hops": hops, "hops_there": there, "wall": wall}
    for k, v in total.items():
        run.per_round[k] = run.per_round.get(k, 0.0) + v
    run.num_rounds += rounds
    ops_before = before.get("actor_hops_by_op", {})
    for op, values in after.get("actor_hops_by_op", {}).items():
        entry = run.hops_by_op.setdefault(op, [0] + [0.0] * (len(values) - 1))
        for i, (value, value_before) in enumerate(zip(values, ops_before.get(op, [0] * len(values)))):
            entry[i] += value - value_before


def _add_mix(run: Run, before: dict, after: dict, num_tokens: int, wall: float) -> None:
    """Adds a run's output tokens and its request-rounds, speculative and in fallback, its stage seconds and counts
    (`RoundTimings` deltas) and its wall seconds."""
    delta = {"tokens": num_tokens}
    for k in REQUEST_ROUNDS:
        delta[k] = after[k] - before[k]
    for k, v in delta.items():
        run.mix[k] = run.mix.get(k, 0) + v
    for k in (*STAGES, "num_rounds", "num_draft_calls", "num_plain_rounds", "num_prefill_calls"):
        run.stages[k] = run.stages.get(k, 0.0) + after[k] - before[k]
    run.stages["wall"] = run.stages.get("wall", 0.0) + wall


def _pass_summary(before: dict, after: dict, num_tokens: int, wall: float) -> str:
    """One served run's rounds in a few words: requests per round, tokens per request-round, wall ms per round, the
    share of rounds the closed loop ran plain."""
    rounds = after["num_rounds"] - before["num_rounds"]
    request_rounds = sum(after[k] - before[k] for k in REQUEST_ROUNDS)
    if not rounds or not request_rounds:
        return "no rounds"
    plain = (after["num_plain_rounds"] - before["num_plain_rounds"]) / rounds
    return (
        f"batch {request_rounds / rounds:.1f}, {num_tokens / request_rounds:.2f} tokens per request-round, "
        f"{1000 * wall / rounds:.1f} ms per round, {plain:.0%} of rounds plain"
    )


def _mix_columns(run: Run) -> str:
    """'speculative share | tokens per request-round' of a run (a prefill's first token counts in the tokens)."""
    spec = run.mix.get("num_speculative_request_rounds", 0)
    total = spec + run.mix.get("num_autoregressive_request_rounds", 0)
    if not total:
        return "- | -"
    return f"{spec / total:.2f} | {run.mix['tokens'] / total:.2f}"


def _print_stages(args, results: dict) -> None:
    """Each run's round by the engine's stages, ms per round (served: hops included in draft, excluded from verify
    and accept, which are timed inside the target), the rest of the round's wall time ("other": the engine's host
    work between stages, hops, and served the replica's serving), and the share of rounds that drafted, that the
    closed loop ran plain, and that ran a prefill pass."""
    print("\nRound by stage, ms per round (offline / served):\n")
    print(
        "| mode | concurrency | round | " + " | ".join(STAGES)
        + " | other | drafting rounds | plain rounds | prefill rounds |"
    )  # fmt: skip
    print("|---|---|" + "---|" * (len(STAGES) + 5))
    for c in args.concurrency:
        for mode in args.modes:
            runs = [results.get((w, mode, c)) for w in ("offline", "served")]
            runs = [r for r in runs if r is not None and r.stages.get("num_rounds")]

            def per_round(r: Run, key: str) -> float:
                if key == "other":  # the round's wall time outside the stages
                    return (r.stages["wall"] - sum(r.stages[k] for k in STAGES)) / r.stages["num_rounds"]
                return r.stages[key] / r.stages["num_rounds"]

            def cell(key: str, scale: float) -> str:
                return " / ".join(f"{scale * per_round(r, key):.2f}" for r in runs)

            cells = [cell(k, 1000) for k in ("wall", *STAGES, "other")]
            cells += [cell(k, 1) for k in ("num_draft_calls", "num_plain_rounds", "num_prefill_calls")]
            print(f"| {mode} | {c} | " + " | ".join(cells) + " |")


def _print_hops(args, results: dict) -> None:
    """Each served run's hops by worker operation: calls per round, ms per call there and back (back = waiting for
    the reply to arrive + reading it), and ms per round."""
    print("\nServed hops by worker operation (calls per round; ms per call):\n")
    print("| mode | concurrency | operation | calls per round | there | back: wait | back: read | ms per round |")
    print("|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        for mode in args.modes:
            run = results[("served", mode, c)]
            rounds = max(run.num_rounds, 1)
            for op, (calls, there, back, wait) in sorted(run.hops_by_op.items(), key=lambda kv: -kv[1][0]):
                if not calls:
                    continue
                print(
                    f"| {mode} | {c} | {op} | {calls / rounds:.2f} | {1000 * there / calls:.3f} "
                    f"| {1000 * wait / calls:.3f} | {1000 * (back - wait) / calls:.3f} "
                    f"| {1000 * (there + back) / rounds:.3f} |"
                )


def _ratio_cell(rates: list[float], base_rates: list[float]) -> str:
    """A table's ratio (`paired_ratio`), or '-' where either side measured nothing."""
    return f"{paired_ratio(rates, base_rates):.2f}" if rates and any(base_rates) else "-"


def print_table(args, results: dict) -> None:
    print(
        f"\n{len(args.modes)} mode(s), {3 * args.num_prompts} prompts, max_tokens={args.max_tokens}, T=0, "
        f"{args.passes} pass(es); tokens/s: median over passes; ratios: median of the passes' ratios\n"
    )
    print(
        "| mode | concurrency | offline tok/s | served tok/s | served / offline | served x off | steady tok/s "
        "| steady x off | batch | round ms "
        "| compute ms | hops ms (there) | serving ms | spec share offline | tok/req-round offline "
        "| spec share served | tok/req-round served | T=0 equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        for mode in args.modes:
            off, srv = results.get(("offline", mode, c)), results[("served", mode, c)]
            base = results.get(("served", "off", c))
            rounds = max(srv.num_rounds, 1)
            wall = 1000 * srv.per_round["wall"] / rounds
            compute = 1000 * srv.per_round["compute"] / rounds
            hops = 1000 * srv.per_round["hops"] / rounds
            there = 1000 * srv.per_round["hops_there"] / rounds
            if off is None:  # --served-only: T=0 texts against the first mode's served ones
                off_rate, ratio, off_mix = "-", "-", "- | -"
                reference = results[("served", args.modes[0], c)]
            else:
                ratio = _ratio_cell(srv.tokens_per_second, off.tokens_per_second)
                off_rate, off_mix = f"{off.median:.1f}", _mix_columns(off)
                reference = off
            equal = reference.outputs == srv.outputs
            x_off = _ratio_cell(srv.tokens_per_second, base.tokens_per_second if base else [])
            steady_x_off = _ratio_cell(srv.steady_tokens_per_second, base.steady_tokens_per_second if base else [])
            batch = sum(srv.mix[k] for k in REQUEST_ROUNDS) / rounds
            print(
                f"| {mode} | {c} | {off_rate} | {srv.median:.1f} | {ratio} | {x_off} "
                f"| {f'{srv.steady_median:.1f}' if srv.steady_median else '-'} | {steady_x_off} "
                f"| {batch:.1f} "
                f"| {wall:.1f} | {compute:.1f} | {hops:.2f} ({there:.2f}) | {wall - compute - hops:.1f} "
                f"| {off_mix} | {_mix_columns(srv)} | {equal} |"
            )
    _print_stages(args, results)
    _print_hops(args, results)
    served = [(mode, c, results[("served", mode, c)]) for c in args.concurrency for mode in args.modes]
    if all(run.cpu_wall for _, _, run in served):
        print(f"\nCores used while served (CPU seconds over the served runs' wall time; {os.cpu_count()} cores):\n")
        print("| mode | concurrency | " + " | ".join(CPU_COLUMNS) + " |")
        print("|---|---|" + "---|" * len(CPU_COLUMNS))
        for mode, c, run in served:
            cores = " | ".join(f"{run.cpu_seconds[role] / run.cpu_wall:.2f}" for role in CPU_COLUMNS)
            print(f"| {mode} | {c} | {cores} |")


if __name__ == "__main__":
    raise SystemExit(main())
