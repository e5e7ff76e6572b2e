"""``ModelConfig.from_dict``: what a ``config.json`` of each supported family gives, and the sentences for what the
model code cannot compute (another architecture, a partial rotary that is not half-split, another rope scaling,
another activation)."""

from __future__ import annotations

import pytest

from splitserve.common.model_info import SUPPORTED_MODEL_TYPES, ModelConfig

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(model_type: str, **raw) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "model_type": model_type, **raw})


def test_each_family_takes_its_own_features_only():
    assert set(SUPPORTED_MODEL_TYPES) == {"llama", "mistral", "qwen2", "qwen3", "granite", "phi3"}
    assert _config("qwen3").qk_norm and not _config("qwen2").qk_norm
    assert _config("qwen2").attention_bias and not _config("qwen3").attention_bias
    assert _config("qwen3", attention_bias=True).attention_bias
    granite = _config("granite", embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                      logits_scaling=16)
    assert (granite.embedding_multiplier, granite.attention_multiplier, granite.residual_multiplier,
            granite.logits_scaling) == (12.0, 0.0078125, 0.22, 16.0)
    # The scalars are Granite's: another family's config carrying such keys keeps 1.0 and the usual scale.
    llama = _config("llama", embedding_multiplier=12.0, attention_multiplier=0.5, logits_scaling=16)
    assert (llama.embedding_multiplier, llama.attention_multiplier, llama.logits_scaling) == (1.0, None, 1.0)
    assert _config("granite").attention_multiplier is None
    phi3 = _config("phi3", rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                            "partial_rotary_factor": 1.0})
    assert phi3.architecture == "Phi3ForCausalLM" and "partial_rotary_factor" not in phi3.rope_scaling
    assert phi3.rotary_dim is None
    # Phi-4-mini's: 3/4 of each head rotates, LongRoPE with the original context beside the scaling.
    phi4 = _config("phi3", partial_rotary_factor=0.75, original_max_position_embeddings=4096,
                   rope_scaling={"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})
    assert phi4.rotary_dim == 12 and phi4.rope_scaling["original_max_position_embeddings"] == 4096
    assert _config("phi3", rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [1.0],
                                         "original_max_position_embeddings": 8}).rope_scaling["rope_type"] == "longrope"
    # A base model's checkpoint (embedding models are saved so) is served as its causal LM.
    assert _config("qwen3", architectures=["Qwen3Model"]).architecture == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="Unsupported model architecture BertModel"):
        _config("qwen3", architectures=["BertModel"])


@pytest.mark.parametrize("raw,words", [
    ({"model_type": "gemma"}, "Unsupported model architecture gemma"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.2}, "Unsupported partial_rotary_factor 0.2: it must be "
     "in \\(0, 1\\] and rotate an even number of each head's 16 dimensions"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}},
     "Unsupported partial_rotary_factor 1.5"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope"}}, "longrope scaling needs short_factor and "
     "long_factor lists and original_max_position_embeddings"),
    ({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "Unsupported rope scaling 'dynamic'"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "Unsupported activation 'gelu'"),
])
def test_what_the_model_code_cannot_compute_is_refused_with_a_sentence(raw, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_dict({**BASE, **raw})
