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
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--concurrency",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    statuses = {name: status for name, _, status in report["rows"]}
    assert statuses["engine float32: auto outputs identical to off"] == "ok"
    assert statuses["runner: flex vs sdpa verify, float32, max abs logit difference"] == "ok"
    assert report["auto x2"]["tokens_per_s"] > 0
    assert "| check | value |" in result.stdout


def test_random_weights_of_a_carried_config_and_tokenizer(tmp_path):
    """The GPU machine's form: a folder with only a model's config and tokenizer becomes a loadable model of those
    shapes, its config (rope, window, tying) kept as given."""
    import json

    import torch

    from ddtree.models.target import TargetModel
    from ddtree.models.testing import write_random_target
    from tests.tiny_tokenizer import make_char_tokenizer

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import random_weights_target

    kit = write_random_target(tmp_path / "kit", tie_word_embeddings=True)
    (kit / "model.safetensors").unlink()
    config = json.loads((kit / "config.json").read_text()) | {"rope_theta": 12345.0, "max_position_embeddings": 300}
    (kit / "config.json").write_text(json.dumps(config))
    make_char_tokenizer().save_pretrained(str(kit))
    model_dir = random_weights_target(kit)
    assert json.loads((model_dir / "config.json").read_text()) == config
    runner = TargetModel.load(model_dir, dtype=torch.float64)
    assert runner.config.rope_theta == 12345.0 and runner.tokenizer is not None
    runner.kv.allocate(0, 16)
    logits, _ = runner.prefill([0], [[3, 4, 5]])
    assert logits.shape == (1, config["vocab_size"]) and torch.isfinite(logits).all()
