"""The load-test runner (loadtest/sweep.py, servers.py, report.py, hf_baseline.py): its parts on scripted data, and one
short sweep of two ddtree modes and the naive HF baseline on the tiny test model, started and stopped by the
runner."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import report
from loadtest import sweep as sweep_cli
from loadtest.metrics import PromptOrder, RequestMetrics, Summary, load_prompts
from loadtest.servers import Server, ServerSpec, ddtree_config, kill_session, session_processes
from loadtest.sweep import add_arguments, parse_concurrency, parse_sets, spawn_rate
from tests.factories import make_tiny_drafter, make_tiny_target

REPO = Path(__file__).resolve().parent.parent


def test_server_specs_parse_and_refuse_what_they_do_not_know():
    assert ServerSpec.parse("auto") == ServerSpec("ddtree-auto", "ddtree", {"speculation": "ddtree", "budget": "auto"})
    assert ServerSpec.parse("off").app_args == {"speculation": "off"}
    assert ServerSpec.parse("b8") == ServerSpec("ddtree-b8", "ddtree", {"speculation": "ddtree", "budget": 8})
    assert ServerSpec.parse("hf").kind == "hf" and ServerSpec.parse("vllm").kind == "vllm"
    mine = ServerSpec.parse("mine=http://10.0.0.5:8000/")
    assert (mine.name, mine.kind, mine.url) == ("mine", "url", "http://10.0.0.5:8000")
    for bad in ("b0", "bx", "fast", "mine=10.0.0.5:8000", "=http://x"):
        with pytest.raises(ValueError):
            ServerSpec.parse(bad)
    assert parse_concurrency("1,4, 16") == [1, 4, 16]
    for bad in ("", "0,1", "a"):
        with pytest.raises(ValueError):
            parse_concurrency(bad)
    assert parse_sets(["max_num_seqs=32", "model=/m", "pipeline=false"]) == {
        "max_num_seqs": 32,
        "model": "/m",
        "pipeline": False,
    }
    with pytest.raises(ValueError):
        parse_sets(["max_num_seqs"])


def test_users_start_apart_within_the_run():
    assert spawn_rate(16, 0.0) == 16.0  # all within locust's first second
    assert spawn_rate(16, 0.25) == 4.0
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).stagger == 0.25
    for concurrency, stagger in (("4,32", "2"), ("1", "-1")):  # the 32nd user would start after the run; negative
        args = parser.parse_args(["--concurrency", concurrency, "--duration", "60", "--stagger", stagger, "--out", "x"])
        with pytest.raises(ValueError, match="--stagger"):
            sweep_cli.run(args)


def test_ddtree_config_is_ray_config_with_the_mode_and_port():
    from ray.serve.schema import ServeDeploySchema

    config = ddtree_config({"speculation": "off", "max_num_seqs": 4}, 18123)
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": "127.0.0.1", "port": 18123}
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    assert app["args"]["speculation"] == "off" and app["args"]["max_num_seqs"] == 4
    assert app["args"]["budget"] == "auto"  # the rest is ray_config.yaml's


def test_prompts_are_taken_in_one_shared_seeded_order(tmp_path):
    order = PromptOrder(["a", "b", "c"], seed=5)
    taken = [order.take() for _ in range(6)]
    assert sorted(taken[:3]) == ["a", "b", "c"] and taken[3:] == taken[:3]
    again = PromptOrder(["a", "b", "c"], seed=5)
    assert [again.take() for _ in range(3)] == taken[:3]  # the same seed, the same order
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_prompts(str(bad))


def test_summary_counts_goodput_and_one_itl_sample_per_chunk_gap():
    summary = Summary(slo=(100.0, 20.0))
    # TTFT 50 ms, 11 tokens in 250 ms: TPOT 20 ms, within the SLO; three chunks after the first
    summary.start()
    summary.add(RequestMetrics(ttft_s=0.05, e2e_s=0.25, output_tokens=11, chunk_gaps_s=[0.05, 0.1, 0.05]))
    summary.start()
    summary.add(RequestMetrics(ttft_s=0.2, e2e_s=0.3, output_tokens=2))  # TTFT over the bound
    summary.start()
    summary.fail()
    rep = summary.report()
    assert rep["num_completed_requests"] == 2 and rep["num_failed_requests"] == 1
    assert rep["slo_attainment"] == 0.5
    assert rep["metrics"]["itl_ms"]["count"] == 3 and rep["metrics"]["itl_ms"]["max"] == pytest.approx(100.0)
    assert rep["metrics"]["tpot_ms"]["min"] == pytest.approx(20.0)
    assert rep["goodput_requests_per_s"] == pytest.approx(1 / rep["duration_s"])


def _run(server: str, users: int, tok_s: float, failed: int = 0, tau: float | None = None) -> dict:
    metrics = {
        name: {"p50": 10.0 * users, "p99": 30.0 * users} for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms")
    }
    summary = {
        "overall_output_tokens_per_s": tok_s,
        "num_completed_requests": 10,
        "num_failed_requests": failed,
        "num_unfinished_requests": 0,
        "metrics": metrics,
        "goodput_requests_per_s": 1.0,
        "slo_attainment": 1.0,
    }
    if tau is not None:
        summary["speculation"] = {"output_tokens_per_round": tau}
    return {
        "server": server,
        "kind": "ddtree",
        "concurrency": users,
        "summary": summary,
        "locust": {"num_requests": 10 + failed, "num_failures": failed},
    }


def _results(runs: list[dict], concurrency: list[int]) -> dict:
    return {
        "settings": {
            "concurrency": concurrency,
            "duration_s": 10.0,
            "max_requests": 100,
            "max_tokens": 64,
            "num_prompts": 3,
            "slo": {"ttft_ms": 2000.0, "tpot_ms": None},
            "command": "cmd",
        },
        "runs": runs,
        "agreement": report.agreement({"ddtree-off": ["x", "y"], "hf": ["x", "z"]}),
        "skipped": {"vllm": "not installed"},
        "failed_servers": {},
    }


def test_report_table_goals_agreement_and_plots(tmp_path):
    runs = [
        _run("ddtree-off", 1, 30.0, tau=1.0),
        _run("ddtree-off", 16, 100.0, tau=1.0),
        _run("ddtree-auto", 1, 42.0, tau=1.9),
        _run("ddtree-auto", 16, 97.0, tau=1.1),
        _run("hf", 1, 12.0),
        _run("hf", 16, 20.0, failed=2),
    ]
    results = _results(runs, [1, 16])
    text = report.write_all(results, tmp_path)
    table = [r for r in report.rows(results)]
    auto16 = next(r for r in table if r["server"] == "ddtree-auto" and r["users"] == 16)
    assert auto16["x_off"] == pytest.approx(0.97) and auto16["tokens_per_round"] == 1.1
    goals = dict(report.goals(results))
    assert goals["ddtree-auto >= 5x hf at 16 users"] == "NOT met: 4.85x at 16"
    assert goals["ddtree-auto >= 0.98x ddtree-off at every concurrency"].startswith("NOT met: 1.40x at 1, 0.97x")
    assert goals["ddtree-auto >= 1.3x ddtree-off at 1 user"] == "met: 1.40x at 1"
    assert goals["ddtree-auto >= 1.5x vllm at every concurrency"] == "not measured"
    assert goals["no failed or unfinished request in any run"] == "NOT met: hf at 16: 2 failed, 0 unfinished"
    assert "- hf: 1/2 identical (differ: prompts 1)" in text and "vllm skipped: not installed" in text
    assert "| hf | 16 | 20.0 | 0.20 | 10 | 2 | 0 |" in text
    with open(tmp_path / "table.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[0]["server"] == "ddtree-off" and float(rows[4]["output_tok_s"]) == 12.0
    for name in ("throughput.png", "latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stop_leaves_no_process_of_the_session_even_one_that_ignores_signals(tmp_path):
    """A server whose processes ignore SIGINT and SIGTERM (and have children of their own) is still gone."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print('up', flush=True); time.sleep(600)\n"
    )
    server = Server(ServerSpec("stubborn", "url", url="http://127.0.0.1:1"), tmp_path, {})
    server.process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert server.process.stdout.readline() == b"up\n"
    sid = server.process.pid
    assert len(session_processes(sid)) == 2
    started = time.monotonic()
    server.stop(grace_s=1.0, term_s=1.0)
    assert session_processes(sid) == [] and time.monotonic() - started < 30


def test_kill_session_ends_what_a_session_left_behind():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        assert session_processes(process.pid) == [process.pid]
        kill_session(process.pid, wait_s=0.5)
        process.wait(timeout=10)
        assert process.returncode == -signal.SIGKILL and session_processes(process.pid) == []
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("loadtest_tiny")
    target = make_tiny_target(root / "target", logit_scale=8.0)
    return target, make_tiny_drafter(root / "drafter", target)


def test_sweep_runs_modes_and_the_hf_baseline_and_stops_them(tiny_pair, tmp_path):
    """`python -m loadtest sweep` against the tiny model: two ddtree modes and the HF baseline at two concurrencies.
    Every run's summary agrees with locust's own statistics, the table and plots exist, the T=0 outputs of the two
    ddtree modes are identical, and no process of the servers is left."""
    target, drafter = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("hello there", "abc abc abc", "one two")))
    out = tmp_path / "sweep"
    sets = {
        "model": target,
        "drafter": drafter,
        "dtype": "float64",
        "served_model_name": "tiny",
        "worker_torch_threads": 1,
        "max_budget": 16,
    }
    command = [
        sys.executable,
        "-m",
        "loadtest",
        "sweep",
        "--servers",
        "off,auto,hf",
        "--concurrency",
        "1,2",
        "--duration",
        "3",
        "--drain-timeout",
        "60",
        "--max-tokens",
        "8",
        "--check-prompts",
        "3",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--ready-timeout",
        "300",
        "--stagger",
        "2",
    ]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    before = set(_ray_processes())
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["server"], r["concurrency"]) for r in results["runs"]] == [
        ("ddtree-off", 1),
        ("ddtree-off", 2),
        ("ddtree-auto", 1),
        ("ddtree-auto", 2),
        ("hf", 1),
        ("hf", 2),
    ]
    for run in results["runs"]:
        summary, stats = run["summary"], run["locust"]
        assert summary["num_completed_requests"] > 0 and summary["num_failed_requests"] == 0
        assert summary["num_unfinished_requests"] == 0  # --stop-timeout lets the last requests finish
        # locust counts each HTTP request once, as the file's summary does
        assert stats["num_requests"] == summary["num_completed_requests"] and stats["num_failures"] == 0
        assert summary["metrics"]["output_tokens"]["max"] <= 8
        assert (out / f"{run['server']}_c{run['concurrency']}_stats.csv").is_file()
        if run["server"].startswith("ddtree"):
            assert summary["speculation"]["output_tokens_per_round"] >= 1.0
        assert " -r 0.5 " in run["command"]  # a user every 2 s (--stagger)
    agreement = results["agreement"]
    assert agreement["reference"] == "ddtree-off"
    assert agreement["servers"]["ddtree-auto"] == {"compared": 3, "equal": 3, "differ": [], "failed": 0}
    assert agreement["servers"]["hf"]["compared"] == 3  # (float32 against float64: texts may differ)
    table = (out / "table.md").read_text()
    assert "| ddtree-auto | 2 |" in table and "ddtree-auto >= 0.98x ddtree-off" in table
    assert "users started 2 s apart" in table
    for name in ("table.csv", "throughput.png", "latency.png", "ddtree-off.serve.yaml", "hf.outputs.json"):
        assert (out / name).is_file()
    # started as `make serve` starts it: one readiness line, once /health answered
    log = (out / "ddtree-auto.server.log").read_text(errors="replace")
    assert re.search(r"^ready: http://127\.0\.0\.1:\d+ \(engine loaded in \d+ s\)$", log, re.M), log[-2000:]
    # on its own Ray with one replica: the replica serves the HTTP port itself, Serve's proxy another one
    assert re.search(r"^direct ingress: the application serves http://127\.0\.0\.1:\d+ itself", log, re.M), log[-2000:]
    assert set(_ray_processes()) <= before


def _ray_processes() -> list[int]:
    """Pids of Ray's own daemons (a cluster a sweep started and left would show up here)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"gcs_server" in cmdline or b"raylet" in cmdline:
                out.append(int(entry))
    return out


def test_passes_are_averaged_with_their_range_and_counts_summed(tmp_path):
    runs = [
        dict(_run("ddtree-off", 1, 30.0), **{"pass": 0}),
        dict(_run("ddtree-auto", 1, 40.0), **{"pass": 0}),
        dict(_run("ddtree-auto", 1, 44.0, failed=1), **{"pass": 1}),
        dict(_run("ddtree-off", 1, 34.0), **{"pass": 1}),
    ]
    results = _results(runs, [1])
    results["settings"]["passes"] = 2
    (off, auto) = report.rows(results)
    assert (off["server"], off["passes"], off["output_tok_s"]) == ("ddtree-off", 2, 32.0)
    assert (auto["tok_s_min"], auto["tok_s_max"], auto["output_tok_s"]) == (40.0, 44.0, 42.0)
    assert auto["x_off"] == pytest.approx(42 / 32) and auto["completed"] == 20 and auto["failed"] == 1
    text = report.write_all(results, tmp_path)
    assert "| ddtree-auto | 1 | 42.0 (40.0-44.0) | 1.31 | 20 | 1 | 0 |" in text and "2 passes in A B B A order" in text


def test_soak_memory_summary_and_failures_by_status(tmp_path):
    from loadtest.soak import failures_by_status, memory_summary, rss_bytes

    samples = [
        {
            "t_s": t,
            "rss_session_mib": 1000.0 + t,
            "rss_replica_mib": 400.0,
            "rss_target_mib": 1800.0 + t / 10,
            "rss_drafter_mib": None,
            "kv_cache_bytes_used": 0 if t in (0, 200) else 1000 * t,
            "num_running": 0,
            "num_waiting": 0,
            "num_threads": 9,
            "num_asyncio_tasks": 4,
        }
        for t in range(0, 210, 10)
    ]
    memory = memory_summary(samples, (10, 190))  # 19 samples under load: a tenth is one sample
    assert memory["rss_session_mib"] == {
        "first_tenth": 1010.0,
        "last_tenth": 1190.0,
        "max": 1190.0,
        "growth": round(1190 / 1010 - 1, 4),
    }
    assert memory["rss_replica_mib"]["growth"] == 0.0 and "rss_drafter_mib" not in memory  # (no values: not read)
    assert memory["kv_cache_bytes_used"] == {"max_under_load": 190000, "after": 0}
    assert memory["num_threads"] == [9] and memory["num_asyncio_tasks_max"] == 4
    assert memory["num_asyncio_tasks_after"] == 4
    assert rss_bytes(os.getpid()) > 0 and rss_bytes(None) == 0
    path = tmp_path / "failures.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Method", "Name", "Error", "Occurrences", "First Seen", "Last Seen"])
        writer.writerow(["POST", "chat", "StreamError('HTTP 429: {\"error\": ...}')", "30", "", ""])
        writer.writerow(["POST", "chat", "StreamError('HTTP 503: queue_timeout')", "4", "", ""])
        writer.writerow(["POST", "chat", "StreamError('HTTP 429: another message')", "2", "", ""])
        writer.writerow(["POST", "chat", "ConnectionResetError(104, 'reset')", "1", "", ""])
    assert failures_by_status(path) == {"HTTP 429": 32, "HTTP 503": 4, "ConnectionResetError": 1}
    assert failures_by_status(tmp_path / "missing.csv") == {}


def test_soak_settings_record_the_users_stagger():
    import argparse

    from loadtest.soak import add_arguments, soak_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--server", "off", "--users", "4", "--duration", "30"])
    args.stagger = 0.5
    settings = soak_settings(args, {"max_num_seqs": 8})
    assert settings["stagger_s"] == 0.5 and settings["users"] == 4 and settings["server"] == "off"
    assert settings["set"] == {"max_num_seqs": 8} and settings["duration_s"] == 30.0
