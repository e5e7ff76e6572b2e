"""ModelConfig: the few facts of a Hugging Face ``config.json`` the engine needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# model_type -> the architecture name Hugging Face gives it.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for EOS ids).

        Raises:
            ValueError: the architecture or rope scaling is not supported.
        """
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        generation = {}
        if (model_dir / "generation_config.json").is_file():
            generation = json.loads((model_dir / "generation_config.json").read_text())
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        model_type = raw.get("model_type", "")
        architectures = raw.get("architectures") or []
        supported = set(SUPPORTED_MODEL_TYPES.values())
        architecture = next((name for name in architectures if name in supported), None)
        if architecture is None and not architectures:
            architecture = SUPPORTED_MODEL_TYPES.get(model_type)
        if architecture is None or model_type not in SUPPORTED_MODEL_TYPES:
            found = ", ".join(architectures) or model_type or "unknown"
            raise ValueError(
                f"Unsupported model architecture {found}: splitserve runs the Llama family "
                f"({', '.join(sorted(supported))}; model_type {', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _rope_parameters(raw)
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in the config.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 4 bytes per value (scale for other dtypes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model computes exactly (sliding window included)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _rope_parameters(raw: dict) -> tuple[float, dict]:
    # transformers 5 writes "rope_parameters"; older configs have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling.update(params)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope scaling {rope_type!r}: splitserve supports {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _sliding_window(raw: dict) -> int | None:
    if raw.get("use_sliding_window") is False:
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _eos_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    # generation_config.json wins, as in transformers' generate().
    source = generation.get("eos_token_id")
    if source is None:
        source = raw.get("eos_token_id")
    if source is None:
        return ()
    return tuple(int(token_id) for token_id in (source if isinstance(source, list) else [source]))
