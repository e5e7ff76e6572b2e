"""--cuda-graphs and --enforce-eager: the engine flags every command shares, mapped onto EngineConfig.cuda_graphs
(True: required, False: never, None: wherever they can run), and passed on by ``up`` to its workers."""

from __future__ import annotations

import argparse

import pytest

from splitserve.cli import add_engine_arguments, engine_options
from splitserve.cli_serve import _engine_flags, worker_engine_options
from splitserve.engine.config import EngineConfig


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize(("flags", "cuda_graphs"), [((), None), (("--cuda-graphs",), True), (("--enforce-eager",), False)])
def test_the_flags_map_onto_the_config(flags, cuda_graphs):
    assert engine_options(_parse(*flags))["cuda_graphs"] is cuda_graphs
    assert EngineConfig(**engine_options(_parse(*flags))).cuda_graphs is cuda_graphs


def test_both_flags_at_once_are_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        _parse("--cuda-graphs", "--enforce-eager")
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_the_default_is_auto():
    assert EngineConfig().cuda_graphs is None


@pytest.mark.parametrize("flag", ["--cuda-graphs", "--enforce-eager"])
def test_up_passes_the_flag_to_its_workers(flag):
    args = _parse(flag, "--dtype", "float32")
    workers = _engine_flags(args, "/models/m")
    assert flag in workers and ({"--cuda-graphs", "--enforce-eager"} - {flag}).isdisjoint(workers)
    assert not {"--cuda-graphs", "--enforce-eager"} & set(_engine_flags(_parse("--dtype", "float32"), "/models/m"))


@pytest.mark.parametrize(("role", "flags", "cuda_graphs"), [
    ("prefill", (), False), ("decode", (), None), ("prefill", ("--cuda-graphs",), True),
    ("decode", ("--enforce-eager",), False),
])
def test_a_prefill_worker_captures_nothing_unless_asked(role, flags, cuda_graphs):
    assert worker_engine_options(role, engine_options(_parse(*flags)))["cuda_graphs"] is cuda_graphs
