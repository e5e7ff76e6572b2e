"""Rotary tables under YaRN scaling: the inverse frequencies and the cos/sin factor equal transformers' own
(``ROPE_INIT_FUNCTIONS["yarn"]``) for Qwen2.5's config and for configs that set every option, and the context a
YaRN config allows is its original one times its factor, as vLLM derives it."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.model_info import ModelConfig
from splitserve.engine.models.rotary_embedding import RotaryEmbedding, _inverse_frequencies, long_rope_context

SMALL = {"vocab_size": 100, "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "rope_theta": 1e6}

YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},  # Qwen2.5's
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},  # DeepSeek's attention factor from two mscales
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.5,
     "truncate": False},
    {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096},  # factor <= 1: no mscale
]


@pytest.mark.parametrize("scaling", YARN, ids=lambda scaling: f"factor {scaling['factor']}")
def test_yarn_frequencies_and_attention_factor_are_transformers(scaling):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**SMALL, "model_type": "qwen2", "rope_scaling": dict(scaling)}
    reference = Qwen2Config(**{key: value for key, value in raw.items() if key != "model_type"})
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    config = ModelConfig.from_dict(raw)
    inv_freq, factor = _inverse_frequencies(config)
    torch.testing.assert_close(inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    tables = RotaryEmbedding(config, 8)
    cos, sin = tables.tables(torch.arange(8), torch.float32, over_heads=False)
    emb = torch.arange(8, dtype=torch.float32)[:, None] * expected_inv_freq[None, :]
    torch.testing.assert_close(cos, torch.cat((emb, emb), -1).cos() * expected_factor)
    torch.testing.assert_close(sin, torch.cat((emb, emb), -1).sin() * expected_factor)


def test_a_yarn_context_is_the_original_times_the_factor():
    qwen = ModelConfig.from_dict({**SMALL, "model_type": "qwen2", "max_position_embeddings": 32768,
                                  "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32768}})
    assert qwen.max_model_len == 131072
    # A config whose max_position_embeddings is the extended context already, its factor left to be derived.
    derived = ModelConfig.from_dict({**SMALL, "model_type": "qwen2", "max_position_embeddings": 16384,
                                     "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}})
    assert derived.max_model_len == 16384
    assert _inverse_frequencies(derived)[1] == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)


def test_longrope_tables_are_transformers_short_then_long_with_a_partial_rotary():
    """Phi-4-mini's shape of config: 3/4 of each head rotates, LongRoPE's short factors within the original context
    and its long ones past it (transformers' frequencies for a pass whose last position is within it, and past it),
    both scaled by its attention factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, original = 64, 32
    rotary_dim = head_dim * 3 // 4
    short = [1.0 + 0.05 * i for i in range(rotary_dim // 2)]
    long = [1.5 + 0.5 * i for i in range(rotary_dim // 2)]
    raw = {**SMALL, "model_type": "phi3", "max_position_embeddings": 256, "partial_rotary_factor": 0.75,
           "original_max_position_embeddings": original,
           "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}}
    reference = Phi3Config(**{key: value for key, value in raw.items() if key != "model_type"})
    short_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](reference, "cpu")
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](reference, "cpu", seq_len=original + 1)
    config = ModelConfig.from_dict(raw)
    assert config.rotary_dim == rotary_dim
    inv_freq, factor = _inverse_frequencies(config)
    torch.testing.assert_close(inv_freq, short_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor) and factor > 1
    positions = torch.arange(64)
    cos, sin = RotaryEmbedding(config, 64).tables(positions, torch.float32, over_heads=False)
    assert cos.shape == (64, rotary_dim)
    expected = torch.where((positions < original)[:, None], positions[:, None] * short_inv_freq,
                           positions[:, None] * long_inv_freq)
    torch.testing.assert_close(cos, torch.cat((expected, expected), -1).cos() * expected_factor)
    torch.testing.assert_close(sin, torch.cat((expected, expected), -1).sin() * expected_factor)
    # A request whose prompt passes the original context reads the rows past long_offset: the long factors at every
    # position, as transformers' frequencies for a pass past it.
    tables = RotaryEmbedding(config, 64)
    assert tables.long_offset == 64 and long_rope_context(config) == original
    cos, sin = tables.tables(positions + tables.long_offset, torch.float32, over_heads=False)
    expected = positions[:, None] * long_inv_freq
    torch.testing.assert_close(cos, torch.cat((expected, expected), -1).cos() * expected_factor)
    torch.testing.assert_close(sin, torch.cat((expected, expected), -1).sin() * expected_factor)
    assert RotaryEmbedding(config, original).long_offset == 0  # a context within the original needs no long rows
    with pytest.raises(ValueError, match="longrope's short_factor has 3 values; the rotary dimensions need 24"):
        _inverse_frequencies(ModelConfig.from_dict({**raw, "rope_scaling": {**raw["rope_scaling"],
                                                                             "short_factor": [1.0] * 3}}))
