"""`python -m deployments.run [CONFIG]` (`make serve`): `serve run CONFIG`, plus one line once the app answers.

    ready: http://127.0.0.1:8000 (engine loaded in 23 s)

`serve run` deploys the config's applications and streams their logs, but what it prints when they are deployed
is easy to miss among the replicas' lines. This command runs it unchanged (same arguments, same output) and polls
the first application's `/health` until it answers 200, which it does only once the engine has loaded its models
and can answer (`DDTreeServer.check_health`); then it prints the line above. Before that, Serve's proxy answers
the application's routes with an error (404 or 503), never with a 200 that would make the first request wait.
SIGINT or SIGTERM goes on to `serve run` as its Ctrl-C, which shuts the applications down (a second one stops it
at once); the exit status is its own.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def health_url(config: dict) -> str:
    """The first application's /health on the config's HTTP host and port (0.0.0.0: this machine's loopback)."""
    http = config.get("http_options") or {}
    host = http.get("host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    port = int(http.get("port") or 8000)
    prefix = ((config.get("applications") or [{}])[0].get("route_prefix") or "/").rstrip("/")
    return f"http://{host}:{port}{prefix}"


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
    # A process group of its own: a terminal's Ctrl-C reaches this process only, which passes it on once (two would
    # make serve run stop without shutting the applications down). Its SIGINT is reset to the default, since a
    # process started in the background inherits it ignored.
    child = subprocess.Popen(
        [str(serve) if serve.exists() else "serve", "run", args.config],
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
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:  # (a second Ctrl-C while serve run shuts down: it goes on to the child too)
            continue


if __name__ == "__main__":
    raise SystemExit(main())
