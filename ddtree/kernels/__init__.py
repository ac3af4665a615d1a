"""Small native kernels, built on first use for the machine that runs them (torch.utils.cpp_extension).

    cpu_ops() -> module | None      the target runner's float32 CPU ops (cpu_ops.cpp says why each exists):
                                    `panel_linear` (a GEMM over panel-packed weights that reads them once per
                                    call), `gemv`, `rms_norm`, `decode_attention` (rotary + KV write + attention
                                    of one token) and `silu_and_mul`; None where they cannot be built
    pack_panels(w [K, N]) -> [P, K, 32]   a weight matrix in the panel layout `panel_linear` reads

Building needs a C++ compiler (g++ with the Python headers torch's extensions use); the first build takes ~30 s and
is cached under ~/.cache/ddtree/kernels (or $DDTREE_KERNEL_CACHE), keyed by the source, torch, Python and the CPU.
Without a compiler, or with DDTREE_CPU_KERNELS=0, callers keep torch's own kernels: the kernels change speed,
never results beyond float32 rounding.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
DEFAULT_CACHE_DIR = Path("~/.cache/ddtree/kernels")
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def kernels_enabled() -> bool:
    return os.environ.get("DDTREE_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_ops():
    """The compiled module, or None (disabled, or the build failed: logged once with the reason)."""
    if not kernels_enabled():
        return None
    return _load("cpu_ops")


PANEL_WIDTH = 32  # output columns per panel (cpu_ops.cpp: kPanelWidth)


def pack_panels(w):
    """W [K, N] (any strides) -> [ceil(N / 32), K, 32] contiguous float32: panel p holds W[:, 32p : 32p + 32],
    zero-padded past N, so that a GEMM streams each panel as one contiguous block."""
    import torch

    k, n = w.shape
    num_panels = -(-n // PANEL_WIDTH)
    padded = torch.zeros(k, num_panels * PANEL_WIDTH, dtype=torch.float32, device=w.device)
    padded[:, :n] = w
    return padded.view(k, num_panels, PANEL_WIDTH).transpose(0, 1).contiguous()


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: it is built with -march=native."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
            if line.startswith("flags"):
                break
    except OSError:
        flags = platform.processor()
    return flags


def _load(name: str):
    with _lock:
        if name in _loaded:
            return _loaded[name]
        module = None
        try:
            import torch
            from torch.utils.cpp_extension import load

            source = SOURCE_DIR / f"{name}.cpp"
            key = hashlib.sha256(
                source.read_bytes() + torch.__version__.encode() + sys.version.encode() + _cpu_signature().encode()
            ).hexdigest()[:16]
            cache = Path(os.environ.get("DDTREE_KERNEL_CACHE", DEFAULT_CACHE_DIR)).expanduser()
            build_dir = cache / f"{name}-{key}"
            build_dir.mkdir(parents=True, exist_ok=True)
            module = load(name=f"ddtree_{name}_{key}", sources=[str(source)], build_directory=str(build_dir),
                          extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd"],
                          verbose=False)
        except Exception as error:  # no compiler, no headers, a read-only cache: torch's kernels remain
            logger.warning("ddtree: native kernel %s unavailable, using torch's (%s: %s)", name,
                           type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else "")
        _loaded[name] = module
        return module
