"""Reading Llama-family checkpoints into Hugging Face-named tensors: safetensors folders, hub ids, GGUF files.

All readers return (TargetConfig, {hf_name: tensor [out, in] as in transformers}); the runner converts that into
its own layout. GGUF tensors are dequantised to float32; llama.cpp stores the q/k projections of `llama`
architectures permuted for its rotary kernel, which is undone here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.models.config import TargetConfig

GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def resolve_source(source: str | Path) -> Path:
    """A local folder or .gguf file as is; otherwise a Hugging Face hub id, downloaded (needs a network)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if str(source).count("/") == 1 and not str(source).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
            raise ValueError(f"{source!r} is not a local path and huggingface_hub is not installed") from e
        try:
            # Mistral's repos also hold the same weights as consolidated.safetensors (its own format): not fetched
            return Path(
                snapshot_download(
                    str(source),
                    allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"],
                    ignore_patterns=["consolidated*"],
                )
            )
        except Exception as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]  # (hub errors add advice lines)
            raise ValueError(f"{source!r} is not a local path and could not be fetched from the hub: {reason}") from e
    raise ValueError(f"model source {source!r} does not exist (expected a folder, a .gguf file or a hub id)")


def read_checkpoint(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face safetensors folder or a GGUF file."""
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return read_gguf(ggufs[0])
        return read_safetensors_folder(path)
    raise ValueError(f"{path} is neither a checkpoint folder nor a .gguf file")


def read_safetensors_folder(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json")
    config = TargetConfig.from_hf_dict(json.loads(config_file.read_text()))
    generation_config = path / "generation_config.json"
    if generation_config.is_file():  # the end tokens `generate` stops at (Qwen lists more there than in config.json)
        config.eos_token_ids = _merged_ids(
            config.eos_token_ids, json.loads(generation_config.read_text()).get("eos_token_id")
        )
    tensors = read_weight_files(safetensors_files(path))
    non_float = sorted(name for name, t in tensors.items() if not t.is_floating_point())
    if non_float:
        raise ValueError(
            f"{path}: tensors {non_float[:3]} are not floating point (a quantized checkpoint?); "
            f"use the unquantized checkpoint"
        )
    return config, tensors


def read_weight_files(files: list[Path], rename=lambda name: name) -> dict[str, torch.Tensor]:
    """Every tensor of the given safetensors files, by `rename(name)`; a name in two files is an error (which copy
    would win is an accident of file order: e.g. a leftover model_best.safetensors next to model.safetensors)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            key = rename(name)
            if key in tensors:
                raise ValueError(f"tensor {key} is in both {origin[key].name} and {f.name}: remove the stale copy")
            tensors[key], origin[key] = tensor, f
    return tensors


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names when it has one (a folder may also hold other copies,
    e.g. Mistral's consolidated.safetensors), otherwise every *.safetensors but a consolidated one or a PEFT
    adapter_model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{path}: files {missing[:3]} named in {index.name} are missing")
        return [path / n for n in names]
    files = [
        f for f in sorted(path.glob("*.safetensors")) if not f.name.startswith(("consolidated", "adapter_model"))
    ]  # (PEFT adapters are not the model)
    if not files:
        raise ValueError(f"{path} holds no .safetensors weights")
    return files


def _merged_ids(ids: list[int], more) -> list[int]:
    """`ids` then the new ones of `more` (an id, a list of ids or None; None entries skipped)."""
    more = [] if more is None else [more] if isinstance(more, int) else list(more)
    return list(dict.fromkeys([*ids, *(int(i) for i in more if i is not None)]))


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_gguf_config(reader) -> TargetConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCH_TO_MODEL_TYPE)}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with precomputed rope_freqs (Llama 3.1 rope scaling) are not supported")

    def a(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    missing = [
        f"{arch}.{k}"
        for k in ("embedding_length", "attention.head_count", "feed_forward_length", "block_count")
        if a(k) is None
    ]
    if missing:
        raise ValueError(f"the GGUF file lacks {', '.join(missing)}: not a complete {arch} model")
    hidden = int(a("embedding_length"))
    num_heads = int(a("attention.head_count"))
    num_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    if a("vocab_size", num_tokens) is None:
        raise ValueError(f"the GGUF file has neither {arch}.vocab_size nor a tokenizer.ggml.tokens list")
    # end of sequence, and of turn / message (Llama 3's <|eot_id|>, <|eom_id|>): generation stops at any of them
    eos_ids = _merged_ids([], [_gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")])
    rope_scaling = _gguf_rope_scaling(a)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return TargetConfig(
        model_type=GGUF_ARCH_TO_MODEL_TYPE[arch],
        vocab_size=int(a("vocab_size", num_tokens)),
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_hidden_layers=int(a("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(a("attention.head_count_kv", num_heads)),
        head_dim=int(a("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
        max_position_embeddings=int(a("context_length", 4096)),
        sliding_window=None,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _gguf_rope_scaling(field) -> dict | None:
    """llama.cpp's rope scaling keys as a Hugging Face `rope_scaling` ("linear" is applied; others are refused by
    TargetConfig, as on the safetensors path)."""
    kind = field("rope.scaling.type")
    factor = field("rope.scaling.factor")
    if kind is None:
        scale_linear = field("rope.scale_linear")  # the older key
        if scale_linear is None or float(scale_linear) == 1.0:
            return None
        kind, factor = "linear", scale_linear
    if kind == "none" or (kind == "linear" and (factor is None or float(factor) == 1.0)):
        return None
    scaling = {"rope_type": str(kind), "factor": None if factor is None else float(factor)}
    original = field("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (pairs interleaved per head) back to the rotate-half layout."""
    out_dim = w.shape[0]
    head_dim = out_dim // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(out_dim, *rest)


def read_gguf(path: Path, progress: bool = False) -> tuple[TargetConfig, dict[str, torch.Tensor]]:
    """Dequantise a GGUF file to float32 tensors with Hugging Face names."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    config = read_gguf_config(reader)
    permuted = _gguf_field(reader, "general.architecture") in ("llama", "mistral")
    items = reader.tensors
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"dequantising {Path(path).name}", unit="tensor")
    tensors: dict[str, torch.Tensor] = {}
    for t in items:
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, base, kind = int(parts[1]), parts[2], parts[3]
            if base not in GGUF_TO_HF:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            name = f"model.layers.{layer}.{GGUF_TO_HF[base]}.{kind}"
        else:
            base, kind = parts[0], parts[1]
            if base not in GGUF_TO_HF:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            name = f"{GGUF_TO_HF[base]}.{kind}"
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        array = dequantize(t.data, t.tensor_type).reshape(shape)
        tensor = torch.from_numpy(array.astype("float32", copy=False).copy())
        if permuted and base == "attn_q":
            tensor = _unpermute_rope(tensor, config.num_attention_heads)
        elif permuted and base == "attn_k":
            tensor = _unpermute_rope(tensor, config.num_key_value_heads)
        tensors[name] = tensor
    return config, tensors


def load_tokenizer(path: Path):
    """The tokenizer (with its chat template) from a checkpoint folder or a GGUF file (slow: ~20 s for GGUF)."""
    from transformers import AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if path.is_dir() and not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        if len(ggufs) == 1:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=ggufs[0].name)
        raise ValueError(f"{path} holds no tokenizer files")
    return AutoTokenizer.from_pretrained(str(path))
