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
