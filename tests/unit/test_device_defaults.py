"""The step limits an engine takes when none are given, by the device it will run on (as vLLM's: its CPU
platform's on a CPU, its GPU servers' on CUDA), and how the flags and ``up`` leave them to each worker."""

from __future__ import annotations

import argparse

import pytest
import torch

from splitserve.cli import add_engine_arguments, engine_options
from splitserve.cli_serve import _engine_flags
from splitserve.engine.config import DEFAULT_STEP_LIMITS, EngineConfig, likely_device
from splitserve.engine.llm import offline_max_num_batched_tokens


@pytest.mark.parametrize(("device", "seqs", "tokens"), [("cpu", 64, 2048), ("cuda", 256, 8192)])
def test_each_device_has_its_limits(device, seqs, tokens):
    config = EngineConfig(device=device)  # "cuda" is checked against the machine when the engine starts, not here
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (seqs, tokens) == DEFAULT_STEP_LIMITS[device]
    assert offline_max_num_batched_tokens({"device": device}) == 2 * tokens  # the offline LLM: twice a server's


def test_auto_takes_the_limits_of_where_it_will_run():
    assert likely_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert likely_device("cuda") == "cuda"  # a machine without CUDA refuses it at start, with a sentence
    assert (EngineConfig().max_num_seqs, EngineConfig().max_num_batched_tokens) == DEFAULT_STEP_LIMITS[likely_device("auto")]


def test_given_limits_stay_and_the_budget_covers_every_running_request():
    assert EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=512).max_num_batched_tokens == 512
    assert EngineConfig(device="cpu", max_num_seqs=3000).max_num_batched_tokens == 3000
    assert EngineConfig(device="cuda", max_num_batched_tokens=1024).max_num_seqs == 256
    assert offline_max_num_batched_tokens({"device": "cpu", "max_num_seqs": 5000}) == 5000
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\) must be at least max_num_seqs \(256\)"):
        EngineConfig(device="cuda", max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        EngineConfig(max_num_seqs=0)


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_flags_leave_the_limits_to_the_device_unless_given():
    options = engine_options(_parse())
    assert options["max_num_seqs"] is None and options["max_num_batched_tokens"] is None
    flags = _engine_flags(_parse("--dtype", "float32"), "/models/m")
    assert "--max-num-seqs" not in flags and "--max-num-batched-tokens" not in flags
    flags = _engine_flags(_parse("--dtype", "float32", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"),
                          "/models/m")
    assert flags[flags.index("--max-num-seqs") + 1] == "32" and flags[flags.index("--max-num-batched-tokens") + 1] == "1024"
