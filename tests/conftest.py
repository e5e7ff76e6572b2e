"""Shared fixtures (the real default model, converted once per cache folder) and the test tiers.

Tiers are folders, and each folder's tests carry its marker:

- ``tests/unit``: no processes, no model weights (tiny random tensors at most); under a minute.
- ``tests/integration``: real processes, sockets and a real redis-server; compiled kernels; the tokenizer.
- ``tests/e2e``: the real model, offline and through whole clusters, token-identical to transformers.
- ``tests/faults``: whole clusters under injected faults (processes killed or stopped, Redis and the router
  restarted, bad KV payloads, abort storms); every request ends right and nothing is left behind.

``pytest -m unit`` (``make test-unit``) runs one tier; ``make test`` runs them all.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run only through its interpreter, which must be chosen before triton is first
# imported (its language functions are wrapped at import): set here, before any test module can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TIERS = ("unit", "integration", "e2e", "faults")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}.")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def model_dir():
    """Path to the default model (SmolLM2-135M-Instruct, float32 safetensors)."""
    from splitserve.engine.model_store import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def prompt_token_ids(tokenizer):
    """The eight reference prompts (a few tokens to over a thousand), tokenized."""
    from tests.reference import PROMPTS

    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="session")
def hf_reference(model_dir, prompt_token_ids):
    """transformers' greedy continuation of each reference prompt (float32), computed once per session."""
    from tests.reference import MAX_TOKENS, hf_greedy

    return [hf_greedy(str(model_dir), ids, MAX_TOKENS) for ids in prompt_token_ids]


@pytest.fixture(scope="module")
def client(cluster):
    """A Client of the router of the module's ``cluster`` fixture, for the module's tests."""
    from splitserve.client import Client

    with Client(cluster.router.address) as client:
        yield client


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of the tests' own on a free loopback port, stopped at the end of the session."""
    from splitserve.launcher import LocalCluster

    launcher = LocalCluster(log_dir=tmp_path_factory.mktemp("redis"))
    url = launcher.start_redis()
    yield url
    launcher.redis.stop(5)
