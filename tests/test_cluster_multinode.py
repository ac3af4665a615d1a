"""A two-node Ray cluster on this machine, the app deployed to it with `serve deploy`: the engine's actors run on the
worker node and a chat request is answered through the head's proxy (cluster/README.md, "The multi-node test").

The head has no CPUs, so the engine's placement groups fit only on the worker. Both nodes are started with `ray start`
in process sessions of their own: teardown kills those sessions, never `ray stop`, which would stop every Ray on the
machine (the test session's own included)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from loadtest.servers import free_port, kill_session, session_processes
from tests.factories import make_tiny_drafter, make_tiny_target

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL_NAME = "tiny-multinode"


# Every process of the cluster and every CLI call shares one token (Ray's token authentication, as a real cluster
# would run): nothing then depends on whatever ~/.ray/auth_token holds on this machine.
_ENV = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
_ENV.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=_ENV
    )
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def _start_node(*args: str) -> int:
    """`ray start ...` in a session of its own; returns the session id (its daemons stay in it)."""
    env = _ENV
    process = subprocess.Popen(
        [str(BIN / "ray"), "start", *args, "--disable-usage-stats"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = process.communicate(timeout=180)
    if process.returncode != 0:
        kill_session(process.pid, wait_s=0.5)
        raise RuntimeError(f"ray start {' '.join(args)} failed:\n{out[-3000:]}")
    return process.pid


@pytest.fixture
def two_nodes(tmp_path):
    # Ray's Unix sockets live under the temp dir, and a socket path has at most 107 bytes: a short one
    temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")
    gcs_port, dashboard_port, http_port = free_port(), free_port(), free_port()
    sessions = []
    try:
        sessions.append(
            _start_node(
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={gcs_port}",
                "--num-cpus=0",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}",
                f"--temp-dir={temp_dir}",
            )
        )
        sessions.append(_start_node(f"--address=127.0.0.1:{gcs_port}", "--node-ip-address=127.0.0.1", "--num-cpus=2"))
        yield {
            "gcs": f"127.0.0.1:{gcs_port}",
            "dashboard": f"http://127.0.0.1:{dashboard_port}",
            "http": f"http://127.0.0.1:{http_port}",
            "http_port": http_port,
            "sessions": sessions,
        }
    finally:
        for sid in sessions:
            kill_session(sid, wait_s=10)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert all(session_processes(sid) == [] for sid in sessions)


def _wait_for_app(base_url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = requests.get(f"{base_url}/v1/models", timeout=5)
            if r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME:
                return
        except (requests.RequestException, ValueError, KeyError, IndexError):
            pass
        time.sleep(2)
    raise TimeoutError(f"the app did not answer at {base_url} within {timeout_s:.0f} s")


def test_serve_deploy_on_two_nodes_places_the_engine_on_the_worker(two_nodes, tmp_path):
    target = make_tiny_target(tmp_path / "target", logit_scale=8.0)
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    config = yaml.safe_load((REPO / "ray_config.yaml").read_text())
    # one proxy, on the head (two proxies on one machine would want the same port)
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": two_nodes["http_port"]}
    (app,) = config["applications"]
    app["args"].update(
        model=str(target),
        drafter=str(drafter),
        served_model_name=MODEL_NAME,
        dtype="float64",
        worker_torch_threads=1,
        max_budget=16,
    )
    path = tmp_path / "ray_config-multinode.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    _run("serve", "deploy", str(path), "--address", two_nodes["dashboard"])
    _wait_for_app(two_nodes["http"])

    nodes = json.loads(_run("ray", "list", "nodes", "--format", "json", "--address", two_nodes["gcs"]).stdout)
    alive = {n["node_id"]: n for n in nodes if n["state"] == "ALIVE"}
    (head,) = [i for i, n in alive.items() if n["is_head_node"]]
    (worker,) = [i for i, n in alive.items() if not n["is_head_node"]]
    actors = json.loads(
        _run(
            "ray", "list", "actors", "--detail", "--format", "json", "--limit", "1000", "--address", two_nodes["gcs"]
        ).stdout
    )
    alive_actors = [a for a in actors if a["state"] == "ALIVE"]
    where = {a["class_name"]: a["node_id"] for a in alive_actors}
    assert where["TargetActor"] == worker and where["DrafterActor"] == worker
    (replica,) = [name for name in where if name.startswith("ServeReplica:ddtree:")]
    assert where[replica] == worker
    assert where["ServeController"] == head  # (the controller and the proxy need no CPU)

    r = requests.post(
        f"{two_nodes['http']}/v1/chat/completions",
        timeout=120,
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("stop", "length")

    _run("serve", "shutdown", "-y", "--address", two_nodes["dashboard"])
