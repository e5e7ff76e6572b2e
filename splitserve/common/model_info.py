"""What the router and the workers both know about a model, read from its directory without loading it.

* :class:`ModelConfig`: the few facts of a Hugging Face ``config.json`` the engine
  and the router need (vocabulary, context length, shapes, EOS ids).
* :func:`find_model_dir`: the directory for ``--model``, or the default model's
  converted directory; never converts (``splitserve.engine.model_store`` does).
* :func:`model_fingerprint`: a short id of the exact weights and dtype served.

Plain Python: reading JSON and a few file headers, no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last into a converted directory: its presence means the conversion finished.
COMPLETE_MARKER = "splitserve-converted.json"

# model_type -> the architecture name Hugging Face gives it.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


# ---- config.json ------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """The facts of a model's ``config.json`` (and ``generation_config.json``) that splitserve uses."""

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
    # The leading dimensions of each head that rotary rotates (Phi-4-mini's partial_rotary_factor 0.75: 96 of 128);
    # None: all of head_dim.
    rotary_dim: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Qwen3: each head's query and key pass through an RMSNorm over head_dim (q_norm, k_norm) before rotary.
    qk_norm: bool = False
    # Granite's scalars (1.0 and None elsewhere): embeddings times embedding_multiplier, attention scores times
    # attention_multiplier (None: head_dim ** -0.5), each layer's attention and MLP outputs times
    # residual_multiplier before the residual add, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
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
        if architecture is None:  # a base model (embedding models are saved so): served as its causal LM
            bases = {name.removesuffix("ForCausalLM") + "Model": name for name in supported}
            architecture = next((bases[name] for name in architectures if name in bases), None)
        if architecture is None and not architectures:
            architecture = SUPPORTED_MODEL_TYPES.get(model_type)
        if architecture is None or model_type not in SUPPORTED_MODEL_TYPES:
            found = ", ".join(architectures) or model_type or "unknown"
            raise ValueError(
                f"Unsupported model architecture {found}: splitserve runs the Llama family "
                f"({', '.join(sorted(supported))}; model_type {', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling, partial = _rope_parameters(raw)
        activation = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if activation != "silu":
            raise ValueError(f"Unsupported activation {str(activation)[:32]!r}: splitserve's MLP is SiLU-and-multiply.")
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rotary_dim=_rotary_dim(head_dim, partial),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Qwen2 always has q/k/v biases; Llama, Mistral and Qwen3 say so in the config.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw),
            qk_norm=model_type == "qwen3",
            **_granite_scalars(raw, model_type),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 4 bytes per value (scale for other dtypes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    @property
    def long_rope_context(self) -> int | None:
        """A LongRoPE model's original context: a request longer than it takes the long factors at every position
        (``RotaryEmbedding.long_offset``) and chains its blocks from a root of its own
        (``block_hash.long_rope_root_hash``); None for any other rotary."""
        if self.rope_scaling.get("rope_type") != "longrope":
            return None
        return int(self.rope_scaling["original_max_position_embeddings"])

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model computes exactly (sliding window included). With YaRN, the original
        context times its factor, as vLLM derives it (Qwen2.5's configs keep the original 32,768 as
        max_position_embeddings and say factor 4 for 131,072)."""
        longest = self.max_position_embeddings
        if self.rope_scaling.get("rope_type") == "yarn" and self.rope_scaling.get("factor"):
            original = self.rope_scaling.get("original_max_position_embeddings") or longest
            longest = int(original * self.rope_scaling["factor"])
        if self.sliding_window:
            return min(longest, self.sliding_window)
        return longest


def _rope_parameters(raw: dict) -> tuple[float, dict, float]:
    # transformers 5 writes "rope_parameters"; older configs have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling.update(params)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first configs' name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope scaling {str(rope_type)[:32]!r}: splitserve supports {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if rope_type == "longrope":  # Phi-3's configs keep the original context beside the scaling
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if not all(isinstance(scaling.get(name), list) for name in ("short_factor", "long_factor")) \
                or not scaling["original_max_position_embeddings"]:
            raise ValueError("longrope scaling needs short_factor and long_factor lists and "
                             "original_max_position_embeddings.")
    partial = scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    scaling["rope_type"] = rope_type
    return float(theta), scaling, float(partial)


def _rotary_dim(head_dim: int, partial: float) -> int | None:
    """How many leading dimensions of each head rotary rotates (None: all), from the partial rotary factor."""
    if partial == 1.0:
        return None
    rotary_dim = int(head_dim * partial)
    if not 0 < partial < 1 or rotary_dim % 2:
        raise ValueError(f"Unsupported partial_rotary_factor {partial!r}: it must be in (0, 1] and rotate an even "
                         f"number of each head's {head_dim} dimensions.")
    return rotary_dim


def _granite_scalars(raw: dict, model_type: str) -> dict:
    if model_type != "granite":
        return {}
    attention = raw.get("attention_multiplier")
    return {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "attention_multiplier": None if attention is None else float(attention),
            "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
            "logits_scaling": float(raw.get("logits_scaling", 1.0))}


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


# ---- where models are ----------------------------------------------------------------


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The cache folder: the argument, else ``$SPLITSERVE_CACHE``, else ``~/.cache/splitserve``."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get("SPLITSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "splitserve"


def read_cached_json(path: Path) -> object | None:
    """What a JSON file kept in the cache folder holds, or None: none yet, unreadable, or cut short."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_cached_json(path: Path, value: object) -> bool:
    """Keep ``value`` as JSON at ``path``, written beside it and renamed into place, so that a reader finds the
    old file or the new one, never a part. False where the folder cannot be written: a read-only cache only costs
    the next process the work again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(value))
        os.replace(partial, path)
    except OSError:
        return False
    return True


def keep_newest(folder: Path, count: int, keep: Path) -> None:
    """Remove the entries of ``folder`` (files, or folders with what they hold) written longest ago, so that
    ``count`` remain, ``keep`` always among them; another process removing them at the same time is no error."""
    try:
        entries = [(path.stat().st_mtime, path) for path in folder.iterdir() if path != keep]
    except OSError:
        return
    for _, path in sorted(entries)[:max(0, len(entries) + 1 - count)]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def default_model_dir(cache: str | os.PathLike | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir(cache) / "models" / DEFAULT_MODEL_NAME


def is_default_model(model: str | os.PathLike | None) -> bool:
    """Whether a ``--model`` value names the default model (None, "", "default" or its name)."""
    return model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME)


def is_prepared(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a finished conversion of the default model."""
    return (model_dir / COMPLETE_MARKER).is_file() and (model_dir / "config.json").is_file()


def find_model_dir(model: str | os.PathLike | None, cache: str | os.PathLike | None = None) -> Path:
    """The model directory for ``--model``: the given path, or the default model's converted directory.

    Converts nothing, so it is safe in processes that must not load model code
    (the router); ``splitserve.engine.model_store.resolve_model`` converts the
    default model on first use instead.

    Raises:
        FileNotFoundError: the default model is not converted yet (run ``splitserve
            prepare-model``), or the path is not a directory with a config.json.
    """
    if is_default_model(model):
        path = default_model_dir(cache)
        if not is_prepared(path):
            raise FileNotFoundError(
                f"The default model {DEFAULT_MODEL_NAME} is not prepared in {path}: run `splitserve "
                "prepare-model` once (it converts the GGUF file), or pass --model DIR."
            )
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"Model directory {path} does not exist. splitserve loads local Hugging Face "
            "directories only (config.json, *.safetensors, tokenizer files); omit --model "
            "to use the default model."
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory.")
    return path


def has_weights(model_dir: str | os.PathLike) -> bool:
    """Whether the directory holds safetensors weights (a tokenizer-and-config-only directory does not)."""
    return any(Path(model_dir).glob("*.safetensors"))


def model_fingerprint(model_dir: str | os.PathLike, dtype: str) -> str:
    """A short id of the exact weights and dtype a worker serves, equal across processes.

    Hashes config.json, each safetensors file's name, size and header (tensor
    names, shapes, offsets) and 64 KiB samples spread over its data: enough to
    tell two checkpoints apart without reading hundreds of MB at start-up.
    Prefill and decode workers exchange KV only when their fingerprints match.
    """
    digest = hashlib.sha256(dtype.encode())
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(min(header_length, 16 * 1024 * 1024)))
            for index in range(16):
                handle.seek(size * index // 16)
                digest.update(handle.read(64 * 1024))
    return digest.hexdigest()[:16]
