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

# `make test` runs two pytest-xdist workers, which share this machine's cores. torch's OpenMP threads (libgomp)
# spin at each barrier while waiting, so an engine run in one worker slowed 4 to 8 times while the other held a
# core; waiting passively, they sleep instead (about 2 times: the cores are shared). libgomp reads this once, when
# torch loads it: set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

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
    """A Client of the router of the module's ``cluster`` fixture (with its API key, where it has one), for the
    module's tests."""
    from splitserve.client import Client

    with Client(cluster.router.address, api_key=getattr(cluster, "api_key", None)) as client:
        yield client


@pytest.fixture(scope="session")
def lora_adapters(model_dir, tmp_path_factory):
    """Two PEFT LoRA adapters of the default model (``tests/lora_helpers.py``), as LoRARequests: "every" on all
    seven projections (rank 8), "attention" on q/k/v/o (rank 4, rsLoRA)."""
    from splitserve.engine.lora import LoRARequest
    from tests.lora_helpers import ATTENTION, EVERY_PROJECTION, make_adapter

    root = tmp_path_factory.mktemp("adapters")
    every = make_adapter(str(model_dir), root / "every", seed=1, targets=EVERY_PROJECTION, std=0.04)
    attention = make_adapter(str(model_dir), root / "attention", seed=2, targets=ATTENTION, rank=4, alpha=8,
                             use_rslora=True)
    return {"every": LoRARequest("every", 1, str(every)), "attention": LoRARequest("attention", 2, str(attention))}


@pytest.fixture(scope="session")
def lora_references(model_dir, prompt_token_ids, lora_adapters):
    """PEFT's greedy continuations (LORA_MAX_TOKENS tokens, float32, unmerged) by adapter name, and transformers'
    under None: of all eight reference prompts for "every" (over a thousand tokens: chunked prefill, the MLP's
    rows whole), of the first six for "attention" and the base model."""
    from tests.lora_helpers import LORA_MAX_TOKENS, peft_greedy
    from tests.reference import hf_greedy

    model = str(model_dir)
    return {
        "every": [peft_greedy(model, lora_adapters["every"].lora_path, ids, LORA_MAX_TOKENS) for ids in prompt_token_ids],
        "attention": [peft_greedy(model, lora_adapters["attention"].lora_path, ids, LORA_MAX_TOKENS)
                      for ids in prompt_token_ids[:6]],
        None: [hf_greedy(model, ids, LORA_MAX_TOKENS) for ids in prompt_token_ids[:6]],
    }


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of the tests' own on a free loopback port, stopped at the end of the session."""
    from splitserve.launcher import LocalCluster

    launcher = LocalCluster(log_dir=tmp_path_factory.mktemp("redis"))
    url = launcher.start_redis()
    yield url
    launcher.redis.stop(5)
