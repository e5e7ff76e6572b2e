"""Shared fixtures: the real default model, converted once per cache folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir():
    """Path to the default model (SmolLM2-135M-Instruct, float32 safetensors)."""
    from splitserve.engine.model_store import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
