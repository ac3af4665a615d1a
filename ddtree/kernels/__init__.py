"""Small native kernels, built on first use for the machine that runs them (torch.utils.cpp_extension).

    cpu_ops() -> module | None      the target runner's float32 CPU ops (cpu_ops.cpp says why each exists):
                                    `panel_linear` (a GEMM over panel-packed weights that reads them once per
                                    call), `rms_norm`, `attention_block` (rotary + KV write + attention of
                                    a request's new tokens) and `silu_and_mul`; None where they cannot be
                                    built
    loaded_cpu_ops() -> module | None   the same, only once something in this process has loaded it
    bf16_panels_pay() -> bool             whether bfloat16 panels run on bf16 dot products here (else float32 ones)
    pack_panels(w [K, N], dtype)          a weight matrix in the panel layout `panel_linear` reads: float32, or
                                          bfloat16 (x rounded to bf16, bf16 dot products, float32 sums: for the
                                          drafter, whose numbers only shape proposals; on AMX tiles where the CPU
                                          has them)
    split_panels_pay() -> bool            whether a float32 target's matrices run as split panels here (AMX)
    pack_split_panels(w [K, N])           float32 weights as bf16 hi + lo in AMX tile layout, for `panel_linear`
    PanelLinear(w [K, N], bias, ops, weight_dtype)   x @ w (+ bias) on `panel_linear`; PanelLinear.of(nn.Linear, ...)
    use_panel_linears(module, ops, weight_dtype)     swaps every nn.Linear inside `module` for a PanelLinear

Building needs a C++ compiler (g++ with the Python headers torch's extensions use) and ninja (a dependency of the
project, put on PATH here when only the environment's bin folder has it); the first build takes ~30 s and is cached
under ~/.cache/ddtree/kernels (or $DDTREE_KERNEL_CACHE), keyed by the source, torch, Python, the compile flags
(`$DDTREE_KERNEL_CFLAGS` appends to them, e.g. `-mno-avx512bf16`: the portable bf16 loop) and the CPU; concurrent
first uses (several Ray actors) build once, and a build killed half-way is redone by the next process. On CPUs
without AVX-512 or AVX2 (`kernels_enabled`), without a compiler, or with DDTREE_CPU_KERNELS=0, callers keep torch's
own kernels (a failed build logs the compiler's error lines once): the kernels change speed, never results beyond
float32 rounding. The ops release the GIL while they run, as torch's ops do.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
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
    """DDTREE_CPU_KERNELS: 0 / false / no / off: never; 1 / true / yes / on: wherever they build; unset or auto:
    on x86 CPUs with AVX-512, or AVX2 and FMA. The kernels' tiles are sized for those vector registers (cpu_ops.cpp);
    built for AVX2 (`DDTREE_KERNEL_CFLAGS=-march=x86-64-v3` on this project's CPU) a decode step took 18.8 ms against
    31.1 on torch's kernels. Elsewhere (older x86, ARM) they were never measured, and torch's kernels run."""
    value = os.environ.get("DDTREE_CPU_KERNELS", "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return _has_vector_units()


@functools.cache
def _has_vector_units() -> bool:
    """Whether this is an x86 CPU with AVX-512 Foundation, or AVX2 and FMA (/proc/cpuinfo's flags)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.lower().startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return "avx512f" in flags or {"avx2", "fma"} <= flags
    return False


def cpu_ops():
    """The compiled module, or None (disabled, not this CPU's, or the build failed: logged once with the reason)."""
    if not kernels_enabled():
        return None
    return _load("cpu_ops")


def loaded_cpu_ops():
    """The compiled module if this process has loaded it already (a target or drafter running on the native ops),
    else None: never builds or loads it, so a caller inside the decoding round never waits ~30 s for a build, and a
    process whose model runs on torch's kernels (float64, `cpu_kernels=False`) keeps to them."""
    return _loaded.get("cpu_ops") if kernels_enabled() else None


PANEL_WIDTH = 32  # output columns per panel (cpu_ops.cpp: kPanelWidth)
NO_TENSOR = torch.empty(0)  # the native ops' "no bias / residual / add / mask"


PANEL_DTYPES = (torch.float32, torch.bfloat16)


def bf16_panels_pay() -> bool:
    """Whether bfloat16 panels are the faster ones here: the native ops build with AVX-512 bf16 dot products
    (without them the portable loop runs 0.23-0.47x float32 panels at 8-16 rows, docs/runtime_benchmark.md)."""
    ops = cpu_ops()
    return ops is not None and ops.has_bf16_dot_products()


SPLIT_BLOCK_WIDTH, SPLIT_STEP = 16, 32  # split panels: output columns per block, inputs per step (cpu_ops.cpp)


def split_panels_pay() -> bool:
    """Whether float32 matrices run as split panels here (`pack_split_panels`): the native ops are built with AMX
    tiles and the OS grants them (DDTREE_AMX=0 keeps float32 panels). On this project's CPU a verify of up to 8
    tokens then costs about 1.1x one token, and 16 tokens 1.3x (docs/runtime_benchmark.md)."""
    if os.environ.get("DDTREE_AMX", "auto").strip().lower() in ("0", "false", "no", "off"):
        return False
    ops = cpu_ops()
    return ops is not None and ops.amx_tiles_ready()


def pack_split_panels(w: torch.Tensor) -> torch.Tensor:
    """W [K, N] float32 -> split panels int16 [ceil(N / 16), ceil(K / 32), 2, 16, 32] for `panel_linear` on AMX
    tiles: block b, step s holds W[32s : 32s + 32, 16b : 16b + 16] (zero-padded) twice, as bfloat16 hi = bf16(W)
    and lo = bf16(W - hi) (16 significant bits of each weight), each as 16 rows of the step's input pairs (2i,
    2i + 1) by 16 columns, a pair's two values adjacent (the layout of an AMX tile of bf16 pairs)."""
    if w.dim() != 2:
        raise ValueError(f"a [K, N] matrix expected, got shape {tuple(w.shape)}")
    k, n = w.shape
    num_blocks, steps = -(-n // SPLIT_BLOCK_WIDTH), -(-k // SPLIT_STEP)
    padded = torch.zeros(steps * SPLIT_STEP, num_blocks * SPLIT_BLOCK_WIDTH, dtype=torch.float32, device=w.device)
    padded[:k, :n] = w
    hi = padded.to(torch.bfloat16)
    lo = (padded - hi.float()).to(torch.bfloat16)
    parts = torch.stack([hi, lo]).view(torch.int16)  # [2, S * 32, B * 16]
    # [2, S, 16 pairs, 2, B, 16 columns] -> [B, S, 2, 16 pairs, 16 columns, 2]
    parts = parts.view(2, steps, SPLIT_STEP // 2, 2, num_blocks, SPLIT_BLOCK_WIDTH).permute(4, 1, 0, 2, 5, 3)
    return parts.reshape(num_blocks, steps, 2, SPLIT_STEP // 2, 2 * SPLIT_BLOCK_WIDTH).contiguous()


def pack_panels(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] (any strides) -> panels of 32 output columns, zero-padded past N, each one contiguous block that a
    GEMM streams: float32 [ceil(N / 32), K, 32] (panel p holds W[:, 32p : 32p + 32]), or bfloat16
    [ceil(N / 32), ceil(K / 2), 64] (row i of a panel: its columns' weights of inputs 2i and 2i + 1 interleaved,
    input K zero when K is odd), for the bf16 dot products (cpu_ops.cpp)."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"panels are float32 or bfloat16, not {dtype}")
    k, n = w.shape
    num_panels = -(-n // PANEL_WIDTH)
    num_rows = k if dtype == torch.float32 else -(-k // 2) * 2
    padded = torch.zeros(num_rows, num_panels * PANEL_WIDTH, dtype=dtype, device=w.device)
    padded[:k, :n] = w
    panels = padded.view(num_rows, num_panels, PANEL_WIDTH).transpose(0, 1)  # [P, rows, 32]
    if dtype == torch.bfloat16:  # [P, rows / 2, 2, 32] -> [P, rows / 2, 32, 2]: the pairs adjacent
        panels = panels.reshape(num_panels, num_rows // 2, 2, PANEL_WIDTH).transpose(2, 3)
        return panels.reshape(num_panels, num_rows // 2, 2 * PANEL_WIDTH).contiguous()
    return panels.contiguous()


class PanelLinear(torch.nn.Module):
    """x @ W (+ bias) for inference (float32 x on a CPU) on the native panel GEMM, W [K, N] packed once as
    `weight_dtype` panels (float32, or bfloat16: weight-only): an nn.Linear's forward (`PanelLinear.of(linear,
    ops)`) or a bare matrix's."""

    def __init__(
        self, weight_in_out: torch.Tensor, bias: torch.Tensor | None, ops, weight_dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.ops = ops
        self.in_features, self.out_features = weight_in_out.shape
        self.register_buffer("panels", pack_panels(weight_in_out.detach(), weight_dtype), persistent=False)
        self.register_buffer(
            "bias", NO_TENSOR if bias is None else bias.detach().float().contiguous(), persistent=False
        )

    @classmethod
    def of(cls, linear: torch.nn.Linear, ops, weight_dtype: torch.dtype = torch.float32) -> PanelLinear:
        return cls(linear.weight.t(), linear.bias, ops, weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = self.ops.panel_linear(rows, self.panels, self.out_features, self.bias, NO_TENSOR)
        return out.view(*x.shape[:-1], self.out_features)


def use_panel_linears(module, ops, weight_dtype: torch.dtype = torch.float32) -> int:
    """Replace every nn.Linear inside `module` (float32 CPU, inference) by a PanelLinear with `weight_dtype`
    panels; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            if child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
                raise ValueError(
                    f"{name}: panel linears are float32 CPU only, got {child.weight.dtype} on {child.weight.device}"
                )
            setattr(module, name, PanelLinear.of(child, ops, weight_dtype))
            count += 1
        else:
            count += use_panel_linears(child, ops, weight_dtype)
    return count


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: it is built with -march=native (x86: `model name` and
    `flags`; ARM: `CPU implementer` / `CPU part` and `Features`)."""
    keys = ("model name", "flags", "cpu implementer", "cpu part", "features")
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in keys and key not in seen:  # the first processor's: the machine's CPUs are alike
            seen[key] = value.strip()
    return platform.machine() + repr(sorted(seen.items()))


def _compile_flags() -> list[str]:
    # -fopenmp: at::parallel_for splits work over torch's OpenMP threads only when compiled with it.
    # -fno-trapping-math: lets GCC vectorise floor() (exp_approx); nothing here reads floating-point exception flags.
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # GCC would pick 256-bit vectors on some AVX-512 CPUs
    return flags + os.environ.get("DDTREE_KERNEL_CFLAGS", "").split()


def _build_error(error: Exception) -> str:
    """The lines of a failed build that say why (torch's message ends with ninja's "subcommand failed")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reasons = ("error", "not found", "no such file", "fatal", "ninja is required")
    errors = [line for line in lines if any(r in line.lower() for r in reasons) and "subcommand failed" not in line]
    errors = errors or lines[-1:]
    return " | ".join(errors if len(errors) <= 5 else errors[:4] + errors[-1:])  # the first (the cause) and the last


def _load(name: str):
    with _lock:
        if name in _loaded:
            return _loaded[name]
        module = None
        try:
            module = _build_and_import(name)
        except Exception as error:  # no compiler, no headers, a read-only cache: torch's kernels remain
            logger.warning(
                "ddtree: native kernel %s unavailable, using torch's (%s: %s)",
                name,
                type(error).__name__,
                _build_error(error),
            )
        _loaded[name] = module
        return module


def build_directory(name: str) -> Path:
    """Where kernel `name` is built for this source, torch, Python, compile flags and CPU."""
    key = hashlib.sha256(
        "\n".join(
            [
                (SOURCE_DIR / f"{name}.cpp").read_text(),
                torch.__version__,
                torch.__file__,
                sys.version,
                " ".join(_compile_flags()),
                _cpu_signature(),
            ]
        ).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("DDTREE_KERNEL_CACHE", DEFAULT_CACHE_DIR)).expanduser()
    return cache / f"{name}-{key}"


def _put_ninja_on_path() -> None:
    """torch builds extensions with ninja, found on PATH: the `ninja` package (a dependency) installs it next to the
    interpreter, which is not on PATH when `.venv/bin/python` runs without the environment activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # torch then says "Ninja is required", and the warning passes that on
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _build_and_import(name: str):
    import fcntl

    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    source = SOURCE_DIR / f"{name}.cpp"
    flags = _compile_flags()
    build_dir = build_directory(name)
    key = build_dir.name.rsplit("-", 1)[1]
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a file that a killed builder leaves behind, and then every later load waits for it
    # forever. Our lock is an flock, released by the kernel when its holder dies: whoever holds it is the only
    # live builder, so a `lock` file found then is stale.
    with open(build_dir / ".ddtree.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            if not any(build_dir.glob("*.so")):
                logger.warning("ddtree: building native kernel %s in %s (once, ~30 s)", name, build_dir)
            return load(
                name=f"ddtree_{name}_{key}",
                sources=[str(source)],
                build_directory=str(build_dir),
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
