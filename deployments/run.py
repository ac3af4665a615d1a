"""`python -m deployments.run [CONFIG]` (`make serve`): `serve run CONFIG`, plus one line once the app answers.

    ready: http://127.0.0.1:8000 (engine loaded in 23 s)

`serve run` deploys the config's applications and streams their logs, but what it prints when they are deployed
is easy to miss among the replicas' lines. This command runs it unchanged (same arguments, same output) and polls
the first application's `/health` until it answers 200, which it does only once the engine has loaded its models
and can answer (`DDTreeServer.check_health`); then it prints the line above. Before that, Serve's proxy answers
the application's routes with an error (404 or 503), never with a 200 that would make the first request wait.
SIGINT or SIGTERM goes on to `serve run` as its Ctrl-C, which shuts the applications down (a second one stops it
at once); the exit status is its own.

Where `serve run` starts a Ray instance of its own (no `RAY_ADDRESS`) for one application with one ingress replica
(as ray_config.yaml), that replica serves HTTP itself on the config's port (Serve's direct ingress), and Serve's
proxy, which Serve still starts, listens on a free port instead. A streamed chunk then goes from the replica to the
client, not through the proxy's actor as well: on a CPU, whose cores the model shares with every serving process,
that hop slowed the model by more than its own CPU time (docs/serving.md, "Direct ingress").
`RAY_SERVE_ENABLE_DIRECT_INGRESS=0` keeps Serve's proxy on the config's port; a config of several applications or
replicas keeps it too (one port cannot reach several replicas: Serve's HAProxy mode does that, cluster/README.md).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def http_address(config: dict) -> tuple[str, int]:
    """The host and port the config's HTTP server binds (Serve's defaults where it names none)."""
    http = config.get("http_options") or {}
    return http.get("host") or "127.0.0.1", int(http.get("port") or 8000)


def health_url(config: dict) -> str:
    """The first application's /health on the config's HTTP host and port (0.0.0.0: this machine's loopback)."""
    host, port = http_address(config)
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    prefix = ((config.get("applications") or [{}])[0].get("route_prefix") or "/").rstrip("/")
    return f"http://{host}:{port}{prefix}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serves_directly(config: dict, environ: dict) -> bool:
    """Whether the runner serves `config` by direct ingress (see the module's docstring): a Ray of its own, one
    application of this project with at most one ingress replica, and no choice of the user's in `environ`."""
    if environ.get("RAY_ADDRESS") or "RAY_SERVE_ENABLE_DIRECT_INGRESS" in environ:
        return False
    applications = config.get("applications") or []
    if len(applications) != 1 or applications[0].get("import_path") != "deployments.app:build_app":
        return False
    from deployments.app import max_ingress_replicas
    from deployments.config import parse_args

    try:
        return max_ingress_replicas(parse_args(applications[0].get("args") or {})) == 1
    except (ValueError, TypeError):  # bad args: serve run reports them, as it would without this runner
        return False


def direct_ingress_env(environ: dict, first_port: int, num_ports: int = 1) -> dict[str, str]:
    """`environ` for a Ray instance whose ingress replicas serve HTTP themselves (Serve's direct ingress) on ports
    first_port .. first_port + num_ports - 1, each released at once when its replica stops (Serve holds ports back,
    and drains an ingress replica for 30 s, for external load balancers: none runs here)."""
    return {
        **environ,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first_port + num_ports),  # (Serve's range leaves it out)
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def direct_ingress(config: dict, environ: dict, proxy_port: int) -> tuple[dict, dict[str, str]]:
    """The config and environment of `serve run` for direct ingress: Serve's proxy moved to `proxy_port`, the
    replica on the config's port, the only one it may take (a replica that replaces it waits for the port, so the
    address never moves)."""
    served = copy.deepcopy(config)
    served["http_options"] = {**(served.get("http_options") or {}), "port": proxy_port}
    return served, direct_ingress_env(environ, http_address(config)[1])


PORT_WAIT_S = 65.0  # Linux keeps a closed connection's port in TIME_WAIT for 60 s


def wait_for_port(host: str, port: int, timeout_s: float, on_wait=None, poll_s: float = 1.0) -> bool:
    """Whether `host:port` can be bound without SO_REUSEADDR, as Serve's direct-ingress replica binds it, within
    `timeout_s`; `on_wait()` is called once if it has to wait. A server stopped moments before leaves its answered
    connections in TIME_WAIT, and a replica that cannot bind its only port is stopped and the port blocked: the app
    would never start."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return True
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return False
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        time.sleep(poll_s)


def is_healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.run", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(REPO / "ray_config.yaml"), help="a Serve config file")
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between /health polls")
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(Path(args.config).read_text())
    except (OSError, yaml.YAMLError) as exc:
        print(f"deployments.run: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(config, dict) or not config.get("applications"):
        print(f"deployments.run: {args.config} has no applications", file=sys.stderr)
        return 2
    base_url = health_url(config)
    serve = Path(sys.executable).parent / "serve"
    t0 = time.monotonic()
    config_path, env, folder = args.config, None, None
    host, port = http_address(config)
    direct = serves_directly(config, os.environ)
    if direct and not wait_for_port(
        host,
        port,
        PORT_WAIT_S,
        lambda: print(f"port {port} is still held (a server stopped moments ago?): waiting for it", flush=True),
    ):
        print(f"port {port} is in use: Serve's proxy serves the application instead of direct ingress", flush=True)
        direct = False
    if direct:
        proxy_port = free_port()
        served, env = direct_ingress(config, dict(os.environ), proxy_port)
        folder = tempfile.TemporaryDirectory(prefix="ddtree-serve-")
        config_path = str(Path(folder.name) / Path(args.config).name)
        Path(config_path).write_text(yaml.safe_dump(served, sort_keys=False))
        print(
            f"direct ingress: the application serves {base_url} itself; Serve's proxy listens on :{proxy_port}",
            flush=True,
        )
    # A process group of its own: a terminal's Ctrl-C reaches this process only, which passes it on once (two would
    # make serve run stop without shutting the applications down). Its SIGINT is reset to the default, since a
    # process started in the background inherits it ignored.
    child = subprocess.Popen(
        [str(serve) if serve.exists() else "serve", "run", config_path],
        env=env,
        process_group=0,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    num_signals = 0

    def forward(_signum, _frame) -> None:
        """SIGINT or SIGTERM: serve run's Ctrl-C (it shuts the applications down); a second one: SIGTERM."""
        nonlocal num_signals
        num_signals += 1
        if child.poll() is None:
            child.send_signal(signal.SIGINT if num_signals == 1 else signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    while child.poll() is None:
        if is_healthy(base_url):
            print(f"ready: {base_url} (engine loaded in {time.monotonic() - t0:.0f} s)", flush=True)
            break
        time.sleep(args.poll_s)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # (a second Ctrl-C while serve run shuts down: it goes on to the child too)
                continue
    finally:
        if folder is not None:
            folder.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
