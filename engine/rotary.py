"""Rotary position embedding of the MLA decoder, as transformers computes it: the inverse
frequencies of each rope kind (default, linear, yarn) and the cos/sin tables that rotate the
queries' and the shared key's rope dims."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvstore.engine.config import ModelConfig, yarn_mscale

__all__ = ["Rotary", "rope_inv_freq"]


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies f32[qk_rope/2] and the cos/sin scale, as transformers computes them.

    ``default`` is ``1 / theta^(2i/d)``; ``linear`` divides by the factor; ``yarn`` blends
    interpolated and extrapolated frequencies with a linear ramp between the correction dims and
    scales cos/sin by its attention factor (mscale ratio).
    """
    dim = cfg.qk_rope_head_dim
    base = cfg.rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kind = cfg.rope.kind
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = float(cfg.rope_factor() or 1.0)  # ModelConfig.validate refuses a linear/yarn rope without one
    if kind == "linear":
        return (1.0 / pos_freqs) / factor, 1.0
    rope = cfg.rope
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    original = cfg.original_max_positions()

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """cos/sin tables f32[T, qk_rope] for absolute positions (``cat(freqs, freqs)`` layout)."""

    inv_freq: torch.Tensor  # a registered buffer (typed here: nn.Module's __getattr__ is not)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = cfg.rope_interleave

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, R] or [T, H, R]; ``cos``/``sin`` are [T, R].

        With ``rope_interleave`` the input pairs are ``(x0, x1), (x2, x3) ...`` and the output is
        de-interleaved (evens then odds), exactly transformers' layout for the cached key.
        """
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleave:
            half = cos.shape[-1] // 2
            c, s = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
