"""Target model configuration for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

One dataclass covers the family; the differences are flags: Qwen2 has q/k/v biases (read from the weights),
Qwen3 has per-head q/k RMSNorm, Mistral may have a sliding window (served exactly only up to that length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = (None, "default", "linear", "llama3")  # ddtree.models.layers.rope_inv_freq


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_sizes_and_activation(d: dict, where: str) -> None:
    """What a target's and a drafter's config.json both need here: the sizes, and SiLU MLPs (the layers are SwiGLU;
    transformers' `swish` is SiLU too)."""
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ValueError(f"{where}: hidden_act {hidden_act!r} is not supported (the MLPs here use SiLU)")
    missing = [k for k in REQUIRED_SIZES if d.get(k) is None]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")


def read_rope(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json in transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
    (`rope_parameters`, which holds both) layout; a null `rope_theta` beside `rope_parameters` counts as absent."""
    rope_params = d.get("rope_parameters") or {}
    rope_theta = d.get("rope_theta") or rope_params.get("rope_theta", 10000.0)
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    return float(rope_theta), rope_scaling


@dataclass
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # None: full attention at every length
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        rope_type = (
            None if self.rope_scaling is None else self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        )
        if rope_type not in SUPPORTED_ROPE_TYPES:  # before any weight is read (a GGUF dequantises for minutes)
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")

    @property
    def has_qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict) -> TargetConfig:
        """From a Hugging Face config.json (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if d.get("mlp_bias"):
            raise ValueError("checkpoints with mlp_bias are not supported")
        check_sizes_and_activation(d, f"config.json of a {model_type} model")
        quantization = d.get("quantization_config")
        if quantization:  # FP8 / GPTQ / AWQ weights need their scales: read as plain weights they would be garbage
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
            raise ValueError(
                f"quantized checkpoints ({method}) are not supported: use the unquantized "
                f"(bfloat16 / float16) checkpoint"
            )
        rope_theta, rope_scaling = read_rope(d)
        # (transformers' MistralConfig defaults to a 4096-token window when the key is absent; null means none)
        sliding_window = d.get("sliding_window", 4096 if model_type == "mistral" else None)
        uses_window = model_type == "mistral" or bool(d.get("use_sliding_window"))
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_heads = int(d["num_attention_heads"])
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            sliding_window=int(sliding_window) if (uses_window and sliding_window) else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict:
        """A config.json that transformers and `from_hf_dict` both read (used for converted checkpoints)."""
        archs = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }
        d = {
            "architectures": [archs[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if self.sliding_window is not None or self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window  # (Mistral: null, not absent, which reads as 4096)
        return d
