"""Rotary position embeddings: the cos/sin tables (default, linear, llama3, YaRN and LongRoPE scaling) and applying
them, to whole heads or to their leading ``rotary_dim`` dimensions (a partial rotary).

Every scaling is in the tables alone (the kernels rotate by whatever cos/sin they are given): its inverse
frequencies, and YaRN's or LongRoPE's attention factor, which multiplies cos and sin as transformers applies it.
``apply_rotary`` is the plain-torch reference of ``cpu_ops.rotary_``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from splitserve.common.model_info import ModelConfig


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, built once.

    With LongRoPE whose original context is shorter than ``max_positions`` the tables hold two rows a position:
    the first ``max_positions`` rows rotate with the short factors below the original context and the long ones
    from it on; the next ``max_positions`` (from ``long_offset``) with the long factors throughout, for a request
    longer than the original context (:func:`long_rope_context`; ``Request.rotate_long``), as transformers'
    ``generate`` rotates such a sequence. A position's row is ``position + long_offset`` for those requests.
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_factor = _inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [positions, rotary_dim / 2]
        original = long_rope_context(config)
        self.long_offset = 0
        if original is not None:
            # The long factors from the original context on (transformers switches a whole forward pass to them
            # once its last position is past it: the same rotation for each token decoded past it).
            long_inv_freq, _ = _longrope_frequencies(config, long=True)
            long_freqs = positions[:, None] * long_inv_freq[None, :]
            freqs[original:] = long_freqs[original:]
            if original < max_positions:
                freqs, self.long_offset = torch.cat((freqs, long_freqs)), max_positions
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, over_heads: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions ([tokens]), looked up once per step: each [tokens, 1, head_dim], to
        broadcast over the heads in :func:`apply_rotary`, or with ``over_heads`` False [tokens, head_dim], as the
        kernels' ``rotary_`` takes them."""
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        return (cos.unsqueeze(1), sin.unsqueeze(1)) if over_heads else (cos, sin)


def long_rope_context(config: ModelConfig) -> int | None:
    """A LongRoPE model's original context (``ModelConfig.long_rope_context``); None for any other rotary."""
    return config.long_rope_context


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ([rotary_dim / 2]) and the factor cos and sin are multiplied by (1 but for YaRN and
    longrope); longrope's are its short factors' (the long ones: :func:`_longrope_frequencies`)."""
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    elif rope_type == "yarn":
        return _yarn_frequencies(config, scaling)
    elif rope_type == "longrope":
        return _longrope_frequencies(config, long=False)
    return inv_freq, 1.0


def _longrope_frequencies(config: ModelConfig, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini), as transformers computes it: each frequency divided by its own factor, the
    short ones within the original context and the long ones past it; cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original)), factor the extended context over the original unless given."""
    scaling = config.rope_scaling
    dim = config.rotary_dim or config.head_dim
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"longrope's {'long' if long else 'short'}_factor has {factors.numel()} values; the rotary "
                         f"dimensions need {dim // 2}.")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * config.rope_theta ** shape), float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(config: ModelConfig, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: each frequency's share of interpolation (divided by
    ``factor``) ramps from none for the fast dimensions (more than ``beta_fast`` turns over the original context)
    to all for the slow ones (fewer than ``beta_slow``), and cos/sin are scaled by the attention factor."""
    dim, base = config.rotary_dim or config.head_dim, config.rope_theta
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(turns: float) -> float:  # the dimension that turns ``turns`` times over the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # each dimension's share kept as it is
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


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
