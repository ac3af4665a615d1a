"""The servers a load-test sweep runs against: started, checked for readiness and stopped by the runner.

    ServerSpec.parse("auto")           DDTree Serve as `make serve` runs it (`python -m deployments.run`: `serve run`
                                       of ray_config.yaml), with speculation ddtree, budget auto
    ServerSpec.parse("off" | "dflash" | "b8")    the same with speculation off, dflash, or ddtree at a fixed budget 8
    ServerSpec.parse("hf")             loadtest/hf_baseline.py: Hugging Face generate() per request on Ray Serve
    ServerSpec.parse("vllm")           `vllm serve` from the venv of `make vllm-venv`
    ServerSpec.parse("NAME=URL")       a server already running at URL, neither started nor stopped

A started server runs in a session of its own (`serve run` starts a Ray cluster: GCS, raylet, dashboard, workers,
all in that session). `stop()` sends SIGINT (Serve shuts the app down, as on Ctrl-C), then SIGTERM, then SIGKILL to
every process left in the session, so nothing outlives the sweep.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml

from deployments.run import free_port

REPO = Path(__file__).resolve().parent.parent
DDTREE_MODES = {
    "auto": {"speculation": "ddtree", "budget": "auto"},
    "off": {"speculation": "off"},
    "dflash": {"speculation": "dflash"},
}
DEFAULT_VLLM_VENV = REPO / ".venv-vllm"
# vLLM's CPU backend reserves this share of the NUMA node's memory up front (the flag keeps its GPU name) and refuses
# to start if that much is not free; its default (0.92) fails beside the other servers' leftovers and page cache.
DEFAULT_VLLM_ARGS = "--dtype float32 --gpu-memory-utilization 0.4"


class ServerError(RuntimeError):
    """A server that could not start (its log's tail is in the message)."""


@dataclass
class ServerSpec:
    name: str  # the label in the report: ddtree-auto, ddtree-off, ddtree-b8, hf, vllm, or the NAME of NAME=URL
    kind: str  # ddtree | hf | vllm | url
    app_args: dict = field(default_factory=dict)  # ddtree: over ray_config.yaml's args
    url: str | None = None

    @classmethod
    def parse(cls, text: str) -> ServerSpec:
        text = text.strip()
        if "=" in text:
            name, url = text.split("=", 1)
            if not name or not url.startswith(("http://", "https://")):
                raise ValueError(f"server {text!r}: a running server is NAME=http://HOST:PORT")
            return cls(name, "url", url=url.rstrip("/"))
        if text in DDTREE_MODES:
            return cls(f"ddtree-{text}", "ddtree", dict(DDTREE_MODES[text]))
        if text.startswith("b") and text[1:].isdigit() and int(text[1:]) >= 1:
            return cls(f"ddtree-{text}", "ddtree", {"speculation": "ddtree", "budget": int(text[1:])})
        if text in ("hf", "vllm"):
            return cls(text, text)
        raise ValueError(f"unknown server {text!r}: auto, off, dflash, b<N> (a fixed budget), hf, vllm or NAME=URL")


def ddtree_config(args: dict, port: int, base: Path = REPO / "ray_config.yaml") -> dict:
    """ray_config.yaml with its app args updated by `args` (validated by the app when it starts), served on
    127.0.0.1:port."""
    config = yaml.safe_load(base.read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = config["applications"]
    app["args"] = {**(app.get("args") or {}), **args}
    return config


def hf_config(args: dict, port: int) -> dict:
    return {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {"name": "hf", "route_prefix": "/", "import_path": "loadtest.hf_baseline:build_app", "args": args}
        ],
    }


def vllm_available(venv: Path = DEFAULT_VLLM_VENV) -> bool:
    return (Path(venv) / "bin" / "vllm").is_file()


class Server:
    """One server of the sweep. `start()` launches it (unless it is a URL) and waits until `/v1/models` answers;
    `model` is then the served model's name."""

    def __init__(
        self,
        spec: ServerSpec,
        folder: Path,
        model_args: dict,
        vllm_venv: Path = DEFAULT_VLLM_VENV,
        ready_timeout_s: float = 900.0,
        vllm_args: str = DEFAULT_VLLM_ARGS,
    ) -> None:
        self.spec = spec
        self.folder = Path(folder)
        self.model_args = dict(model_args)  # model / drafter / served_model_name / ...: --set of the sweep
        self.vllm_venv = Path(vllm_venv)
        self.vllm_args = shlex.split(vllm_args)
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.log_path = self.folder / f"{spec.name}.server.log"
        self.url = spec.url
        self.model: str | None = None

    def command(self, port: int) -> tuple[list[str], dict]:
        """The command that starts the server and its environment."""
        spec, env = self.spec, dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # a cluster of its own: never an app on whatever cluster the shell points at
        serve = str(Path(sys.executable).parent / "serve")
        if spec.kind == "ddtree":
            config = ddtree_config({**self.model_args, **spec.app_args}, port)
        elif spec.kind == "hf":
            keys = ("model", "served_model_name")
            config = hf_config({k: self.model_args[k] for k in keys if self.model_args.get(k) is not None}, port)
        elif spec.kind == "vllm":
            model = self.model_args.get("model")
            if model is None:
                from ddtree.models.default import default_target_dir

                model = str(default_target_dir())
            name = self.model_args.get("served_model_name") or "SmolLM2-135M-Instruct"
            env["VLLM_TARGET_DEVICE"] = "cpu"
            return (
                [
                    str(self.vllm_venv / "bin" / "vllm"),
                    "serve",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--served-model-name",
                    name,
                    *self.vllm_args,
                ],
                env,
            )
        else:
            raise ValueError(f"{spec.name} is not started by the runner")
        path = self.folder / f"{spec.name}.serve.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        if spec.kind == "ddtree":  # as `make serve` runs it: `serve run`, and a "ready: ..." line in the log
            return [sys.executable, "-m", "deployments.run", str(path)], env
        return [serve, "run", str(path)], env

    def start(self) -> None:
        if self.spec.kind == "url":
            self.model = self._models(timeout_s=30.0)
            if self.model is None:
                raise ServerError(f"{self.spec.name}: nothing answers {self.url}/v1/models")
            return
        if self.spec.kind == "vllm" and not vllm_available(self.vllm_venv):
            raise ServerError(f"vllm: no vLLM in {self.vllm_venv} (install it with `make vllm-venv`)")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command, env = self.command(port)
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.spec.name} exited with status {self.process.returncode} before it was "
                    f"ready:\n{self.log_tail()}"
                )
            self.model = self._models(timeout_s=2.0)
            if self.model is not None:
                return
            time.sleep(1.0)
        raise ServerError(f"{self.spec.name} was not ready within {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def _models(self, timeout_s: float) -> str | None:
        try:
            response = requests.get(f"{self.url}/v1/models", timeout=timeout_s)
            if response.status_code == 200:
                data = response.json().get("data") or []
                return data[0]["id"] if data else None
        except (requests.RequestException, ValueError, KeyError, TypeError):
            pass
        return None

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_bytes().replace(b"\0", b"").decode("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(line[:300] for line in lines[-num_lines:])

    def stop(self, grace_s: float = 30.0, term_s: float = 15.0) -> None:
        """Stop what `start()` launched; every process of its session is gone afterwards."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, term_s)):
            if process.poll() is not None:
                break
            _signal(process.pid, sig)
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        kill_session(process.pid)
        process.wait()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def session_processes(sid: int) -> list[int]:
    """Pids of the live processes (zombies left out) in session `sid`, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def kill_session(sid: int, wait_s: float = 5.0) -> None:
    """Let what is left of the session end on its own for a moment (Ray's processes follow their parent), then
    SIGKILL the rest."""
    _wait_until_gone(sid, wait_s)
    for pid in session_processes(sid):
        _signal(pid, signal.SIGKILL)
    _wait_until_gone(sid, 5.0)  # (a killed process lives on until the kernel has torn it down)


def _wait_until_gone(sid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
