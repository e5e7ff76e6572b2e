"""--cuda-graphs, --enforce-eager and --cuda-graph-mode: the engine flags every command shares, mapped onto
EngineConfig.cuda_graphs (True: required, False: never, None: wherever they can run) and cuda_graph_mode, and passed
on by ``up`` to its workers."""

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


@pytest.mark.parametrize(("role", "flags", "cuda_graphs", "mode"), [
    ("prefill", (), None, "piecewise"), ("decode", (), None, None), ("prefill", ("--cuda-graphs",), True, "piecewise"),
    ("decode", ("--enforce-eager",), False, None),
    ("prefill", ("--cuda-graph-mode", "full_and_piecewise"), None, "full_and_piecewise"),
])
def test_a_prefill_worker_captures_only_its_steps_pieces_unless_asked(role, flags, cuda_graphs, mode):
    options = worker_engine_options(role, engine_options(_parse(*flags)))
    assert options["cuda_graphs"] is cuda_graphs and options["cuda_graph_mode"] == mode
    assert EngineConfig(**options).cuda_graph_mode == (mode or "full_and_piecewise")


def test_the_graph_mode_is_checked_and_passed_on():
    with pytest.raises(ValueError, match="cuda_graph_mode must be one of full_and_piecewise, full_decode_only, "
                                         "piecewise"):
        EngineConfig(cuda_graph_mode="full")
    assert "--cuda-graph-mode" not in _engine_flags(_parse("--dtype", "float32"), "/models/m")
    flags = _engine_flags(_parse("--cuda-graph-mode", "full_decode_only"), "/models/m")
    assert flags[flags.index("--cuda-graph-mode") + 1] == "full_decode_only"
