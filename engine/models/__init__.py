"""Model code for the Llama family, and loading it from a Hugging Face directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from splitserve.common.model_info import SUPPORTED_MODEL_TYPES, ModelConfig
from splitserve.engine.models.llama import LlamaForCausalLM, uninitialised_weights
from splitserve.engine.models.packed_linear import can_pack_linear_weights

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES", "load_model", "iterate_safetensors"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def iterate_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every ``*.safetensors`` file in the directory, by name."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors weights in {model_dir}: splitserve loads safetensors checkpoints only."
        )
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_model(model_dir: str | Path, dtype: str, max_positions: int, device: str = "cpu") -> LlamaForCausalLM:
    """Build the model for ``config.json`` and load its safetensors weights in ``dtype``, on ``device`` ("cpu" or
    "cuda": loaded on the host, then moved once; oneDNN's weight packing is for CPU only)."""
    config = ModelConfig.from_model_dir(model_dir)
    torch_dtype = _DTYPES[dtype]
    with uninitialised_weights():  # every weight is the checkpoint's
        model = LlamaForCausalLM(config, max_positions)
    model.to(torch_dtype)
    model.model.rotary.float()
    model.load_weights(iterate_safetensors(model_dir))
    if device != "cpu":
        model.to(device)
    elif can_pack_linear_weights(torch_dtype):
        model.pack_linear_weights()
    model.eval()
    model.requires_grad_(False)
    return model
