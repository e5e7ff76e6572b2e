"""Rotary position embeddings: the cos/sin tables (default, linear and llama3 scaling) and applying them.

``apply_rotary`` is the plain-torch reference of ``cpu_ops.rotary_``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from splitserve.common.model_info import ModelConfig


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, built once."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, over_heads: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions ([tokens]), looked up once per step: each [tokens, 1, head_dim], to
        broadcast over the heads in :func:`apply_rotary`, or with ``over_heads`` False [tokens, head_dim], as the
        kernels' ``rotary_`` takes them."""
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        return (cos.unsqueeze(1), sin.unsqueeze(1)) if over_heads else (cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
