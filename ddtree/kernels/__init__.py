"""Small native kernels, built on first use for the machine that runs them (torch.utils.cpp_extension).

    cpu_ops() -> module | None      the target runner's float32 CPU ops (cpu_ops.cpp says why each exists):
                                    `panel_linear` (a GEMM over panel-packed weights that reads them once per
                                    call), `gemv`, `rms_norm`, `decode_attention` (rotary + KV write + attention
                                    of one token) and `silu_and_mul`; None where they cannot be built
    pack_panels(w [K, N]) -> [P, K, 32]   a weight matrix in the panel layout `panel_linear` reads
    PanelLinear(linear, ops)              an nn.Linear's inference forward on `panel_linear`
    use_panel_linears(module, ops)        swaps every nn.Linear inside `module` for a PanelLinear (inference only)

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

import torch

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
_NO_TENSOR = torch.empty(0)  # "no bias" / "no residual" for the native ops


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """W [K, N] (any strides) -> [ceil(N / 32), K, 32] contiguous float32: panel p holds W[:, 32p : 32p + 32],
    zero-padded past N, so that a GEMM streams each panel as one contiguous block."""
    k, n = w.shape
    num_panels = -(-n // PANEL_WIDTH)
    padded = torch.zeros(k, num_panels * PANEL_WIDTH, dtype=torch.float32, device=w.device)
    padded[:, :n] = w
    return padded.view(k, num_panels, PANEL_WIDTH).transpose(0, 1).contiguous()


class PanelLinear(torch.nn.Module):
    """`linear`'s forward (inference, float32 CPU) on the native panel GEMM: its weight packed once."""

    def __init__(self, linear: torch.nn.Linear, ops):
        super().__init__()
        self.ops = ops
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("panels", pack_panels(linear.weight.detach().t()), persistent=False)
        bias = linear.bias.detach().contiguous() if linear.bias is not None else torch.empty(0)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self.ops.panel_linear(rows, self.panels, self.out_features, self.bias, _NO_TENSOR)
        return out.view(*x.shape[:-1], self.out_features)


def use_panel_linears(module, ops) -> int:
    """Replace every nn.Linear inside `module` by a PanelLinear (float32 CPU inference); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            if child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
                raise ValueError(f"{name}: panel linears are float32 CPU only, got {child.weight.dtype} on "
                                 f"{child.weight.device}")
            setattr(module, name, PanelLinear(child, ops))
            count += 1
        else:
            count += use_panel_linears(child, ops)
    return count


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
            from torch.utils.cpp_extension import load

            source = SOURCE_DIR / f"{name}.cpp"
            key = hashlib.sha256(
                source.read_bytes() + torch.__version__.encode() + sys.version.encode() + _cpu_signature().encode()
            ).hexdigest()[:16]
            cache = Path(os.environ.get("DDTREE_KERNEL_CACHE", DEFAULT_CACHE_DIR)).expanduser()
            build_dir = cache / f"{name}-{key}"
            build_dir.mkdir(parents=True, exist_ok=True)
            # -fopenmp: at::parallel_for splits work over torch's OpenMP threads only when compiled with it
            flags = ["-O3", "-march=native", "-fopenmp"]
            if platform.machine().lower() in ("x86_64", "amd64"):
                flags.append("-mprefer-vector-width=512")  # GCC would pick 256-bit vectors on some AVX-512 CPUs
            logger.info("ddtree: building native kernel %s in %s (once, ~30 s)", name, build_dir)
            module = load(name=f"ddtree_{name}_{key}", sources=[str(source)], build_directory=str(build_dir),
                          extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as error:  # no compiler, no headers, a read-only cache: torch's kernels remain
            logger.warning("ddtree: native kernel %s unavailable, using torch's (%s: %s)", name,
                           type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else "")
        _loaded[name] = module
        return module
