"""Sizing the KV cache of an engine on a GPU from ``gpu_memory_utilization`` (engine/gpu_memory.py), the flags that
set it (``--kv-cache-gb auto``), ``up`` dividing it among the workers that share a GPU, and which KV connectors take
a cache on CUDA. The step run at start to measure activations runs on CPU, and the measurement on a GPU, in
tests/integration/test_engine_device.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from splitserve.cli import add_engine_arguments, engine_options
from splitserve.cli_serve import _engine_flags, _memory_shares, _place_workers
from splitserve.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from splitserve.engine.gpu_memory import gpu_kv_cache_bytes
from splitserve.launcher import gpu_memory_shares

GIB = 1024**3


def test_the_cache_gets_the_share_less_weights_and_activations():
    assert gpu_kv_cache_bytes(80 * GIB, 79 * GIB, 0.9, 2 * GIB, 3 * GIB) == int(80 * GIB * 0.9) - 5 * GIB
    assert gpu_kv_cache_bytes(80 * GIB, 80 * GIB, 1.0, 0, 0) == 80 * GIB


def test_a_share_the_weights_and_activations_fill_is_refused_with_the_figures():
    with pytest.raises(ValueError) as refused:
        gpu_kv_cache_bytes(24 * GIB, 23 * GIB, 0.5, 10 * GIB, 2 * GIB)
    message = str(refused.value)
    assert "gpu_memory_utilization=0.5 gives this engine 12.00 GiB of the GPU's 24.00 GiB" in message
    assert "weights (10.00 GiB)" in message and "activations (2.00 GiB)" in message
    assert message.endswith("raise gpu_memory_utilization, or lower max_num_batched_tokens.")


def test_a_cache_that_other_processes_leave_no_room_for_is_refused():
    # 0.9 of 80 GiB less 2 + 3 GiB is 67 GiB; with 3 GiB of activations to keep, 70 GiB must be free, and 60 are.
    with pytest.raises(ValueError, match=r"only 60.00 GiB of the GPU is free, 3.00 GiB of which the steps need: "
                                         r"other processes \(or other engines in this one\) use the rest"):
        gpu_kv_cache_bytes(80 * GIB, 60 * GIB, 0.9, 2 * GIB, 3 * GIB)
    assert gpu_kv_cache_bytes(80 * GIB, 70 * GIB, 0.9, 2 * GIB, 3 * GIB) == int(80 * GIB * 0.9) - 5 * GIB


@pytest.mark.parametrize("share", [0, -0.1, 1.5, True, "0.5", float("nan")])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a share of the GPU's memory in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=share)


def test_the_defaults_leave_the_size_to_the_device():
    config = EngineConfig()
    assert config.kv_cache_memory_bytes is None and config.gpu_memory_utilization is None
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert DEFAULT_GPU_MEMORY_UTILIZATION == 0.9


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    parser.add_argument("--gpus")
    parser.add_argument("--kv-transfer", default="p2p")
    parser.add_argument("--colocated", type=int, default=0)
    return parser.parse_args(list(flags))


def test_the_flags_map_onto_the_config():
    options = engine_options(_parse())
    assert options["kv_cache_memory_bytes"] is None and options["gpu_memory_utilization"] is None
    options = engine_options(_parse("--kv-cache-gb", "0.5", "--gpu-memory-utilization", "0.7"))
    assert options["kv_cache_memory_bytes"] == GIB // 2 and options["gpu_memory_utilization"] == 0.7
    assert EngineConfig(**options).gpu_memory_utilization == 0.7


def test_up_passes_a_cache_size_on_only_when_given():
    assert "--kv-cache-gb" not in _engine_flags(_parse("--dtype", "float32"), "/models/m")
    flags = _engine_flags(_parse("--dtype", "float32", "--kv-cache-gb", "2"), "/models/m")
    assert flags[flags.index("--kv-cache-gb") + 1] == "2.0"


def test_workers_sharing_a_gpu_share_its_memory():
    assert gpu_memory_shares(["0", "0", "1"], 0.9) == [0.45, 0.45, 0.9]
    assert gpu_memory_shares(["0", "1", "0", "1"], 0.8) == [0.4] * 4
    assert _memory_shares(_parse(), ["0", "0"]) == [DEFAULT_GPU_MEMORY_UTILIZATION / 2] * 2
    assert _memory_shares(_parse("--gpu-memory-utilization", "0.5"), ["0", "1"]) == [0.5, 0.5]
    # A cache of a given size, or workers on the CPU: no share is passed.
    assert _memory_shares(_parse("--kv-cache-gb", "1"), ["0", "0"]) is None
    assert _memory_shares(_parse(), None) is None


def test_up_refuses_a_gpu_share_for_workers_on_the_cpu():
    with pytest.raises(ValueError, match="--gpu-memory-utilization sizes the KV caches of workers on GPUs, but they "
                                         "run on the CPU here"):
        _place_workers(_parse("--device", "cpu", "--gpu-memory-utilization", "0.5"), ["prefill", "decode"])
    assert _place_workers(_parse("--device", "cpu"), ["prefill", "decode"]) is None


@pytest.mark.parametrize(("text", "gib"), [("auto", None), ("AUTO", None), ("2", 2.0), ("0.25", 0.25)])
def test_a_cache_size_may_be_auto(text, gib):
    assert _parse("--kv-cache-gb", text).kv_cache_gb == gib


def test_a_cache_size_that_is_neither_is_refused(capsys):
    with pytest.raises(SystemExit):
        _parse("--kv-cache-gb", "lots")
    assert "expected a number of GiB or auto, got 'lots'" in capsys.readouterr().err


def test_up_on_gpus_places_redis_and_lmcache_workers_in_turn_and_keeps_p2p_pools_apart(monkeypatch):
    # The branch `up` takes where torch finds GPUs, taken here by saying it does: placement only, nothing runs.
    # Redis and LMCache move KV through the host from any GPU, so their workers take the GPUs in turn.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for transfer in ("redis", "lmcache"):
        assert _place_workers(_parse("--kv-transfer", transfer), ["prefill", "prefill", "decode"]) == ["0", "1", "0"]
    assert _place_workers(_parse("--kv-transfer", "p2p"), ["prefill", "prefill", "decode"]) == ["0", "0", "1"]
    assert _place_workers(_parse("--kv-transfer", "p2p"), ["prefill", "decode"]) == ["0", "1"]
