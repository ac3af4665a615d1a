"""The prepared GPU check runs its CPU form end to end (so that a session lent a GPU finds it working)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~50 s: the default target loaded seven times
def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
         "--concurrency", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    statuses = {name: status for name, _, status in report["rows"]}
    assert statuses["engine float32: auto outputs identical to off"] == "ok"
    assert statuses["runner: flex vs sdpa verify, float32, max abs logit difference"] == "ok"
    assert report["auto x2"]["tokens_per_s"] > 0
    assert "| check | value |" in result.stdout
