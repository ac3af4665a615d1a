"""A worker actor's process runs one OpenMP team: its channel thread's (deployments/actors.py: `worker_env`,
`_set_torch_threads`). Checked in a fresh process with a worker actor's environment, without Ray: the process's
own thread (where an actor loads its model) does parallel torch work, then a channel's thread computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.actors import worker_env
from deployments.config import REPLICA_OPENMP_ENV, WORKER_OPENMP_ENV

REPO = Path(__file__).resolve().parents[1]

_WORKER_PROCESS = """
import json, os, sys, threading
import torch
from deployments.actors import _set_torch_threads
from deployments.channel import ChannelClient, ChannelServer
from deployments.config import WorkerSpec

def num_threads():
    return len(os.listdir("/proc/self/task"))

spec = WorkerSpec(None, None, "cpu", None, 4, None, "sdpa", torch_threads=2)
x = torch.randn(1024, 1024)
before = num_threads()
loader_threads = torch.get_num_threads()
(x @ x).sum()  # the actor's thread: loading, Ray calls
after_load = num_threads()

def handle(message):
    _set_torch_threads(spec)  # (torch's own pool of idle threads for non-OpenMP kernels starts here)
    if message == "verify":
        (x @ x).sum()
    return torch.get_num_threads()

server = ChannelServer("node", "target", handle=handle)
client = ChannelClient(server.address, "target")
channel_threads = client.call("connect")
before_compute = num_threads()
client.call("verify")
client.call("verify")
after_compute = num_threads()
print(json.dumps({"loader_threads": loader_threads, "new_on_load": after_load - before,
                  "channel_threads": channel_threads, "new_on_compute": after_compute - before_compute}))
"""


def test_a_worker_process_computes_on_one_openmp_team():
    """libgomp counts the threads of every team in the process against its cores; past them, every wait between two
    parallel regions sleeps at once. So the actor's own thread must not start a team while the channel thread
    computes on another: it runs torch on the environment's one thread, and the channel thread on the spec's two."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one thread per process is never a team")
    env = {**os.environ, **worker_env(), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _WORKER_PROCESS], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["loader_threads"] == 1 and seen["new_on_load"] == 0  # no team of the loading thread
    # the channel thread's team: one thread besides it, started by its first parallel region, and no more after
    assert seen["channel_threads"] == 2 and seen["new_on_compute"] == 1


def test_a_worker_actor_inherits_none_of_the_replicas_openmp_waits():
    """A worker actor inherits its replica's environment (Ray merges runtime_env env_vars into a child's): each
    OpenMP variable the replica sets, the worker sets to its own value."""
    assert set(REPLICA_OPENMP_ENV) <= set(WORKER_OPENMP_ENV)
    env = worker_env()
    assert {key: env[key] for key in WORKER_OPENMP_ENV} == WORKER_OPENMP_ENV and env["OMP_NUM_THREADS"] == "1"


_HUGE_PAGES_PROCESS = """
import json, torch
x = torch.empty(64 << 20, dtype=torch.uint8)  # a weight-sized allocation
x.fill_(1)  # (pages are given on first touch)
address = x.data_ptr()
huge_kb, inside = 0, False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
        start, end = (int(a, 16) for a in head.split("-"))
        inside = start <= address < end
    elif inside and head == "AnonHugePages:":
        huge_kb = int(line.split()[1])
print(json.dumps({"huge_kb": huge_kb}))
"""


def _transparent_huge_pages() -> str | None:
    """The kernel's THP mode (always, madvise or never), None where it cannot be read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _huge_kb(env: dict[str, str]) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_PAGES_PROCESS],
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["huge_kb"]


def test_a_worker_actors_weights_are_on_huge_pages_and_the_app_can_keep_them_off():
    """With a worker actor's environment, a weight-sized tensor lands on 2 MB pages; with the app's `worker_env`
    setting THP_MEM_ALLOC_ENABLE=0 it does not (where the kernel gives huge pages only on request)."""
    mode = _transparent_huge_pages()
    if mode not in ("always", "madvise"):
        pytest.skip(f"the kernel gives no transparent huge pages here (mode {mode})")
    assert _huge_kb(worker_env()) >= 2048
    if mode == "madvise":  # ("always": every large mapping gets them, asked or not)
        assert _huge_kb(worker_env({"THP_MEM_ALLOC_ENABLE": "0"})) == 0


def test_the_apps_worker_env_reaches_the_worker_actors_environment():
    from deployments.config import WORKER_MEMORY_ENV, AppArgs, WorkerSpec

    args = AppArgs(worker_env={"THP_MEM_ALLOC_ENABLE": "0", "MALLOC_ARENA_MAX": "2"})
    spec = WorkerSpec.from_args(args)
    env = worker_env(spec.env)
    assert env["THP_MEM_ALLOC_ENABLE"] == "0" and env["MALLOC_ARENA_MAX"] == "2" and env["OMP_NUM_THREADS"] == "1"
    assert worker_env()["THP_MEM_ALLOC_ENABLE"] == WORKER_MEMORY_ENV["THP_MEM_ALLOC_ENABLE"] == "1"
    for bad in ({"": "1"}, {"A=B": "1"}, {"A": 1}):
        with pytest.raises(ValueError, match="worker_env"):
            AppArgs(worker_env=bad)


def test_worker_nice_reaches_the_threads_a_worker_starts_after_it():
    """`set_thread_nice` runs first in an actor's `__init__`: the threads it starts later (its channels' and their
    OpenMP teams) take the value, the threads running before it (Ray's) keep theirs."""
    import threading

    from deployments.priority import set_thread_nice

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base + 3 > 19:
        pytest.skip(f"this process already runs at nice {base}")
    seen = {}

    def actor_init():
        set_thread_nice(base + 3)
        seen["set"] = os.getpriority(os.PRIO_PROCESS, 0)
        child = threading.Thread(target=lambda: seen.setdefault("child", os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()

    thread = threading.Thread(target=actor_init)
    thread.start()
    thread.join()
    assert seen == {"set": base + 3, "child": base + 3}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_worker_nice_without_the_privilege_keeps_the_value_and_warns(monkeypatch, caplog):
    from deployments import priority

    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    base = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setattr(priority.os, "setpriority", refuse)
    with caplog.at_level("WARNING", logger="deployments.priority"):
        priority.set_thread_nice(-10)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    assert "round_nice=-10 needs CAP_SYS_NICE" in caplog.text
    priority.set_thread_nice(None)  # (None: never touched: `refuse` would raise)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_the_apps_round_nice_reaches_the_worker_spec_and_is_checked():
    from deployments.config import AppArgs, WorkerSpec

    assert WorkerSpec.from_args(AppArgs()).nice == -10
    assert WorkerSpec.from_args(AppArgs(round_nice=5)).nice == 5
    assert WorkerSpec.from_args(AppArgs(round_nice=None)).nice is None
    for bad in (-21, 20, 1.5, "high"):
        with pytest.raises(ValueError, match="round_nice"):
            AppArgs(round_nice=bad)


def test_the_replicas_gil_switch_interval_is_checked():
    from deployments.config import AppArgs

    assert AppArgs().gil_switch_interval_ms == 0.2
    assert AppArgs(gil_switch_interval_ms=None).gil_switch_interval_ms is None  # (Python's own)
    for bad in (0, -1.0, float("inf"), float("nan"), "fast"):
        with pytest.raises(ValueError, match="gil_switch_interval_ms"):
            AppArgs(gil_switch_interval_ms=bad)
