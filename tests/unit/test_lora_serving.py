"""LoRA adapters in a cluster, without processes: the names workers serve them under, ``--lora-modules`` through the
command line and ``up``, a worker's configuration, the router's registry of who serves what, and the dispatcher
sending a request naming an adapter only to workers that serve it."""

from __future__ import annotations

import argparse
import json

import pytest

from splitserve.cli import add_engine_arguments, engine_options
from splitserve.cli_serve import _add_lora_modules_argument, _engine_flags
from splitserve.common.errors import InvalidRequest
from splitserve.common.lora_names import MAX_LORA_MODULES, check_lora_name, parse_lora_modules
from splitserve.common.types import WorkerRole
from splitserve.engine.config import EngineConfig
from splitserve.router.config import RouterConfig
from splitserve.router.dispatch import Dispatcher, RouterRequest
from splitserve.router.frontend import Prompt
from splitserve.router.policies import RoundRobin
from splitserve.router.registry import WorkerRegistry
from splitserve.router.registry_servicer import checked_lora_names
from splitserve.router.worker import KVCacheLayout
from splitserve.rpc.worker_config import WorkerConfig
from splitserve.v1 import inference_pb2, worker_pb2
from tests.unit.test_router_dispatch import FINISHED, FakeChannels, FakeDecodeCall

LAYOUT = KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype="float32", block_size=16)


@pytest.mark.parametrize("name", ["a", "sql-v2", "A.b_c-9", "x" * 64])
def test_names_of_letters_digits_dots_dashes_and_underscores_are_taken(name):
    assert check_lora_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 65, ".hidden", "-flag", "../etc", "a/b", "a b", "naïve", 7, None])
def test_other_names_are_refused_with_what_a_name_must_be(name):
    with pytest.raises(InvalidRequest, match=r"1 to 64 characters from \[A-Za-z0-9._-\]"):
        check_lora_name(name)


def test_lora_modules_are_name_path_pairs():
    assert parse_lora_modules(["sql=/adapters/sql", "chat=rel/chat=v2"]) == {"sql": "/adapters/sql",
                                                                            "chat": "rel/chat=v2"}
    for items, message in ((["sql"], "NAME=PATH pairs"), (["sql="], "NAME=PATH pairs"), (["a/b=/x"], "characters"),
                           (["sql=/a", "sql=/b"], "named twice"),
                           ([f"a{index}=/x" for index in range(MAX_LORA_MODULES + 1)], "at most 64")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(items)


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    _add_lora_modules_argument(parser)
    return parser.parse_args(list(flags))


def test_lora_modules_turn_lora_on_and_stay_loaded():
    options = engine_options(_parse("--lora-modules", "a=/x", "b=/y", "c=/z"))
    assert options["enable_lora"] and options["max_loras"] == 1 and options["max_cpu_loras"] == 3
    config = EngineConfig(**options)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 1, 16, 3)
    plain = EngineConfig(**engine_options(_parse()))
    assert not plain.enable_lora and plain.max_cpu_loras == 1


def test_engine_lora_limits_are_checked():
    with pytest.raises(ValueError, match="max_cpu_loras \\(1\\) must be at least max_loras \\(2\\)"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="not captured in CUDA graphs"):
        EngineConfig(enable_lora=True, cuda_graphs=True)


def test_up_passes_its_adapters_to_every_worker_by_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    monkeypatch.chdir(tmp_path)
    flags = _engine_flags(_parse("--lora-modules", "sql=sql", "--max-loras", "2", "--dtype", "float32"), "/m")
    assert flags[flags.index("--lora-modules") + 1:] == [f"sql={tmp_path / 'sql'}"]
    assert flags[flags.index("--max-loras") + 1] == "2" and "--enable-lora" in flags
    assert "--enable-lora" not in _engine_flags(_parse("--dtype", "float32"), "/m")
    with pytest.raises(ValueError, match="--lora-modules chat=chat: no adapter_config.json there"):
        _engine_flags(_parse("--lora-modules", "chat=chat", "--dtype", "float32"), "/m")


def test_a_worker_configuration_with_adapters_needs_lora_and_takes_any_connector():
    lora = EngineConfig(enable_lora=True)
    assert WorkerConfig(lora_modules={"sql": "/a"}, engine=lora).lora_modules == {"sql": "/a"}
    with pytest.raises(ValueError, match="needs an engine with enable_lora"):
        WorkerConfig(lora_modules={"sql": "/a"})
    with pytest.raises(InvalidRequest, match="characters"):
        WorkerConfig(lora_modules={"../sql": "/a"}, engine=lora)
    # LMCache keeps each adapter's KV under its own tag (lora_cache_tag): every connector takes adapters.
    WorkerConfig(role="decode", kv_transfer="lmcache", kv_address="redis://127.0.0.1:1/0", engine=lora)
    WorkerConfig(role="both", kv_transfer="lmcache", engine=lora)


def test_a_registration_names_at_most_64_valid_adapters():
    assert checked_lora_names(["b", "a"]) == frozenset({"a", "b"})
    with pytest.raises(InvalidRequest, match="at most 64 LoRA adapters"):
        checked_lora_names([f"a{index}" for index in range(65)])
    with pytest.raises(InvalidRequest, match="characters"):
        checked_lora_names(["ok", "not ok"])


@pytest.fixture
def registry():
    """A prefill worker serving nothing, decode-1 serving "sql", decode-2 serving "sql" and "chat"."""
    registry = WorkerRegistry(model_fingerprint="m")
    for role, address, names in ((WorkerRole.PREFILL, "p:1", ()), (WorkerRole.DECODE, "d:1", ("sql",)),
                                 (WorkerRole.DECODE, "d:2", ("sql", "chat"))):
        registry.register(role, address, kv_endpoint=worker_pb2.KVEndpoint(address=address + "0"),
                          model_fingerprint="m", kv_layout=LAYOUT, worker_id=f"{role.name.lower()}-{address[-1]}",
                          lora_names=frozenset(names))
    return registry


def test_the_registry_lists_what_the_decode_pool_serves(registry):
    assert registry.lora_names() == ["chat", "sql"]
    assert registry.get("decode-2").serves("chat") and not registry.get("decode-1").serves("chat")
    assert all(worker.serves("") for worker in registry.routable(WorkerRole.DECODE))
    registry.deregister(registry.get("decode-2").lease_id)
    assert registry.lora_names() == ["sql"]


def _dispatch(registry, lora_name: str) -> list[tuple[str, worker_pb2.DecodeRequest]]:
    channels = FakeChannels()
    channels.decode_calls.append(FakeDecodeCall([FINISHED]))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=7))
    dispatcher = Dispatcher(RouterConfig(prefill_attempts=1), registry, RoundRobin(), RoundRobin(), channels)
    request = RouterRequest("r1", Prompt(list(range(40)), None), inference_pb2.SamplingParams(), lora_name=lora_name)
    assert list(dispatcher.run(request, lambda: None)) == [FINISHED]
    return channels.decode_requests


def test_a_request_for_an_adapter_goes_only_to_a_decode_worker_that_serves_it_and_prefills_there(registry):
    """The prefill worker serves no adapter: the decode worker that serves "chat" prefills the prompt itself."""
    [(address, request)] = _dispatch(registry, "chat")
    assert address == "d:2" and request.lora_name == "chat" and request.prefill_locally


def test_a_request_for_the_base_model_may_go_anywhere_with_a_remote_prefill(registry):
    [(address, request)] = _dispatch(registry, "")
    assert address == "d:1" and request.lora_name == "" and not request.prefill_locally
