"""Loading the workers: devices and dtypes resolved (and refused) before anything loads, the target and the drafter
read from their folders, the KV cache sized, and `build_workers`, both workers in this process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.models.dflash import DFlashConfig
from ddtree.workers import DrafterWorker, TargetWorker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DEFAULT_KV_CACHE_BYTES = 1 << 30  # on a CPU; on a GPU, GPU_KV_CACHE_FRACTION of the memory free after the weights
GPU_KV_CACHE_FRACTION = 0.5
KV_PLACEHOLDER_BYTES = 1 << 26  # a GPU target's cache until it is sized: one token of any model (65B bf16: 2.7 MB)
DEFAULT_DRAFTER_DIR = Path(__file__).parent / "assets" / "drafter" / "smollm2-135m-dflash"


def resolve_device(device: str | torch.device, what: str = "device") -> torch.device:
    """The torch device named (cpu, cuda, cuda:N), or a ValueError saying why it cannot be used here, before anything
    loads: a model meant for a GPU never loads for minutes only to fail, nor silently runs on the CPU. `what`: how
    the messages name the setting (a CLI's `--device`)."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what} {device!r} is not a torch device (use cpu, cuda or cuda:N)") from e
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"{what} {device!r}: DDTree runs on cpu or cuda only")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{what} {device!r}: CUDA is not available here (torch.cuda.is_available() is False; "
            f"torch {torch.__version__} sees no GPU, or is a CPU-only build)"
        )
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def compute_and_kernel_dtypes(dtype: torch.dtype, device: str | torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype a model computes and caches in, the native CPU kernels' weight dtype) for the `dtype` asked for.

    On a CPU whose native kernels have AVX-512 bf16 dot products (`ddtree.kernels.bf16_panels_pay`), bfloat16 means
    bf16 weights on them: each matrix product takes bf16-rounded inputs and weights with float32 sums, while
    activations, norms, attention, the KV cache and the features stay float32. That reads half the weight bytes of
    float32: a decode step 1.85x faster here, a 32-token verify 1.49x (docs/runtime_benchmark.md); torch's own
    bfloat16 CPU kernels are slower than float32 at one row. Elsewhere (a GPU, a CPU without those dot products,
    where bf16 panels run slower than float32 ones, no compiler) the model computes in `dtype` itself."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        from ddtree.kernels import bf16_panels_pay

        if bf16_panels_pay():
            return torch.float32, torch.bfloat16
    return dtype, torch.float32


def resolve_drafter_path(model: str | None, drafter: str | None) -> Path:
    """The drafter folder: the shipped one for the embedded default target, else the one given."""
    if drafter is None:
        if model is not None:
            raise ValueError("a custom target model needs its own drafter (drafter=...), or speculation='off'")
        path = DEFAULT_DRAFTER_DIR
    else:
        path = Path(drafter)
    if not (path / "config.json").is_file():
        raise ValueError(f"drafter {str(path)!r} is not a DFlash checkpoint folder (no config.json)")
    return path


def load_target_worker(
    model: str | None,
    drafter_path: Path | None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    kv_cache_bytes: int | None = None,
    attention: str = "auto",
) -> TargetWorker:
    """The target (model None: the embedded default), producing the features `drafter_path`'s drafter reads."""
    from ddtree.models.target import TargetModel

    feature_layer_ids: list[int] = []
    if drafter_path is not None:
        config = DFlashConfig.from_dict(json.loads((Path(drafter_path) / "config.json").read_text()))
        feature_layer_ids = config.target_layer_ids
    is_cuda = torch.device(device).type == "cuda"
    if attention == "auto":
        attention = "flex" if is_cuda else "sdpa"
    sized_after_loading = kv_cache_bytes is None and is_cuda
    compute_dtype, kernel_weight_dtype = compute_and_kernel_dtypes(resolve_dtype(dtype, device), device)
    target_model = TargetModel.load(
        model if model is not None else "default",
        device=device,
        dtype=compute_dtype,
        kernel_weight_dtype=kernel_weight_dtype,
        feature_layer_ids=feature_layer_ids,
        max_kv_bytes=KV_PLACEHOLDER_BYTES if sized_after_loading else kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
        attention=attention,
    )
    if sized_after_loading:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # memory the loading's temporaries left in torch's cache counts as free
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
        target_model.resize_kv_cache(gpu_kv_cache_bytes(free_bytes + target_model.kv.max_bytes))
    return TargetWorker(target_model, keep_features=drafter_path is not None)


def gpu_kv_cache_bytes(free_bytes: int) -> int:
    """The KV cache a GPU target gets without `kv_cache_bytes`: a share of the device memory free once its weights
    are loaded, the rest left to the drafter's weights and contexts (when it shares the GPU) and to the activations
    of verify passes (logits of up to ~1000 rows x the vocabulary)."""
    return int(free_bytes * GPU_KV_CACHE_FRACTION)


def load_drafter_worker(
    drafter_path: Path, head, *, device: str = "cpu", dtype: str | torch.dtype | None = None
) -> DrafterWorker:
    """The drafter, with the target's `TargetHead` (embedding + LM head; `TargetModel.head()`)."""
    from ddtree.drafter import DFlashDrafter

    head = head.to(device)
    compute_dtype, _ = compute_and_kernel_dtypes(resolve_dtype(dtype, device), device)  # its panels: its own choice
    return DrafterWorker(DFlashDrafter.load(drafter_path, head, device=device, dtype=compute_dtype))


def build_workers(
    model: str | None = None,
    drafter: str | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    need_drafter: bool = True,
    kv_cache_bytes: int | None = None,
    attention: str = "auto",
) -> tuple[TargetWorker, DrafterWorker | None, object]:
    """Both workers in this process (sharing the target's embedding and LM head), and the tokenizer.

    model None: the embedded default SmolLM2-135M-Instruct; drafter None: the drafter shipped for it."""
    device = str(resolve_device(device))
    drafter_path = resolve_drafter_path(model, drafter) if need_drafter else None
    target = load_target_worker(
        model, drafter_path, device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes, attention=attention
    )
    drafter_worker = None
    if drafter_path is not None:
        drafter_worker = load_drafter_worker(drafter_path, target.model.head(), device=device, dtype=dtype)
    return target, drafter_worker, target.model.tokenizer
