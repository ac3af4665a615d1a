"""Numerical building blocks shared by the target runner and the DFlash drafter.

Everything follows the Hugging Face Llama/Qwen3 conventions bit for bit where it matters for equality tests:
RMSNorm normalises in float32 for half-precision inputs (and in the input dtype for float32/float64), and rotary
embeddings use the "rotate half" (non-interleaved) layout with angles computed in float32 (float64 for float64
models, so that float64 exactness tests are not limited by the angles).
"""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; half precision is normalised in float32 like Hugging Face."""
    compute_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xc = x.to(compute_dtype)
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, with the scaling types real Llama-family checkpoints use."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float64) / head_dim))
    rope_type = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class Rotary:
    """Rotary position embedding tables computed on demand for arbitrary position ids."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None = None):
        self.head_dim = head_dim
        self.inv_freq64 = rope_inv_freq(head_dim, rope_theta, rope_scaling)  # [head_dim // 2]
        self.inv_freq32 = self.inv_freq64.to(torch.float32)
        # copies on other devices, made once: a blocking host-to-device copy in every forward would make the host
        # wait for the device each time
        self._inv_freq_on: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape positions.shape + [head_dim] in `dtype`."""
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        key = (positions.device, angle_dtype)
        inv_freq = self._inv_freq_on.get(key)
        if inv_freq is None:
            inv_freq = (self.inv_freq64 if angle_dtype == torch.float64 else self.inv_freq32).to(positions.device)
            self._inv_freq_on[key] = inv_freq
        freqs = positions.to(angle_dtype).unsqueeze(-1) * inv_freq  # [..., head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, head_dim] with cos/sin [..., T, head_dim]: rotate-half rotary embedding."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(torch.nn.Module):
    """RMSNorm with a learnable scale named `weight` (the checkpoint name of every norm we load)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
