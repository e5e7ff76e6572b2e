"""The adapters a worker serves by name (``splitserve.rpc.lora_catalog``): its --lora-modules, and the adapters of its
--lora-dir found while it runs, each read and checked in full (the engine's own loader, on tiny real checkpoints)
before it is served; one that goes or changes is served no more. The router's side: heartbeats replace a worker's
adapter names."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from splitserve.common.errors import InvalidRequest, NotFound
from splitserve.common.lora_names import MAX_LORA_MODULES
from splitserve.engine.lora import load_adapter
from splitserve.rpc.lora_catalog import LoRACatalog
from tests.unit.test_lora import CONFIG, SHAPES, _valid_q, lora_pairs, write_adapter, write_pairs


def check(request) -> None:
    load_adapter(request, CONFIG.num_hidden_layers, SHAPES, 8, torch.float32)


def adapter(directory, seed: int = 1):
    return write_pairs(directory, lora_pairs({(0, "q_proj"): 2, (1, "down_proj"): 2}, seed=seed))


def catalog(tmp_path, modules=None, **kwargs) -> LoRACatalog:
    lora_dir = tmp_path / "lora-dir"
    lora_dir.mkdir(exist_ok=True)
    return LoRACatalog(modules or {}, str(lora_dir), check=check, **kwargs)


def test_lora_modules_are_served_in_their_order_with_ids_from_one(tmp_path):
    served = LoRACatalog({"sql": str(adapter(tmp_path / "sql")), "chat": str(adapter(tmp_path / "chat", 2))})
    assert served.names() == ["sql", "chat"]
    assert [(r.lora_name, r.lora_int_id) for r in served.fixed_requests] == [("sql", 1), ("chat", 2)]
    assert served.request("chat").lora_path == str(tmp_path / "chat")
    assert served.request("") is None
    with pytest.raises(NotFound, match=r"serves no LoRA adapter 'other' \(it serves sql, chat\)"):
        served.request("other")
    with pytest.raises(InvalidRequest, match="1 to 64 characters"):
        served.request("../sql")
    assert served.start() is served and served.scan() == ["sql", "chat"]  # no directory: nothing to look at


def test_an_adapter_put_in_the_directory_is_served_after_its_check_and_others_are_skipped(tmp_path):
    served = catalog(tmp_path, {"sql": str(adapter(tmp_path / "sql"))})
    lora_dir = tmp_path / "lora-dir"
    assert served.scan() == ["sql"]
    adapter(lora_dir / "late")
    adapter(lora_dir / ".incoming")  # hidden: being copied
    adapter(lora_dir / "-dash")  # not a name
    adapter(lora_dir / "sql", seed=3)  # a --lora-modules name: that one stays
    (lora_dir / "notes").write_text("a file, not an adapter")
    assert served.scan() == ["sql", "late"]
    late = served.request("late")
    assert (late.lora_int_id, late.lora_path) == (2, str(lora_dir / "late"))
    assert served.request("sql").lora_path == str(tmp_path / "sql")


def test_a_bad_adapter_is_not_served_until_its_files_change(tmp_path, caplog):
    served = catalog(tmp_path)
    lora_dir = tmp_path / "lora-dir"
    bad = write_adapter(lora_dir / "half", _valid_q(rank=16))  # above max_lora_rank 8
    assert served.scan() == []
    assert "Not serving LoRA adapter half from --lora-dir" in caplog.text and "rank 16" in caplog.text
    caplog.clear()
    assert served.scan() == []
    assert "half" not in caplog.text  # checked once per version of its files
    write_adapter(bad, _valid_q(rank=2))
    os.utime(bad / "adapter_model.safetensors", ns=(1, 1))  # a new stamp even within the clock's resolution
    assert served.scan() == ["half"]
    with pytest.raises(NotFound):
        catalog(tmp_path).request("half")  # a new catalog: served after its first scan only


def test_an_adapter_that_goes_is_served_no_more_and_back_unchanged_is_served_again(tmp_path):
    served = catalog(tmp_path)
    lora_dir = tmp_path / "lora-dir"
    adapter(lora_dir / "a")
    adapter(lora_dir / "b", seed=2)
    assert served.scan() == ["a", "b"]
    first = served.request("a")
    shutil.move(lora_dir / "a", tmp_path / "parked")
    assert served.scan() == ["b"]
    with pytest.raises(NotFound, match=r"\(it serves b\)"):
        served.request("a")
    shutil.move(tmp_path / "parked", lora_dir / "a")
    assert served.scan() == ["b", "a"]
    assert served.request("a") == first  # the same id and path: the engine takes it as the adapter it had


def test_an_adapter_whose_files_change_after_it_was_served_is_served_no_more(tmp_path, caplog):
    served = catalog(tmp_path)
    lora_dir = tmp_path / "lora-dir"
    adapter(lora_dir / "a")
    assert served.scan() == ["a"]
    adapter(lora_dir / "a", seed=5)
    os.utime(lora_dir / "a" / "adapter_model.safetensors", ns=(2, 2))
    assert served.scan() == []
    assert "LoRA adapter a changed on disk after this worker served it" in caplog.text
    shutil.rmtree(lora_dir / "a")
    adapter(lora_dir / "a")  # even as it was: its name's cached KV may be the other's by now
    assert served.scan() == []


def test_a_worker_serves_at_most_64_adapters_in_all(tmp_path, caplog):
    served = catalog(tmp_path, {"fixed": str(adapter(tmp_path / "fixed"))})
    lora_dir = tmp_path / "lora-dir"
    adapter(lora_dir / "a00")
    for index in range(1, MAX_LORA_MODULES + 1):
        shutil.copytree(lora_dir / "a00", lora_dir / f"a{index:02d}")
    names = served.scan()
    assert names == ["fixed", *(f"a{index:02d}" for index in range(MAX_LORA_MODULES - 1))]
    assert f"--lora-dir holds {MAX_LORA_MODULES + 1} adapters; a worker serves at most {MAX_LORA_MODULES}" in caplog.text
    assert len({served.request(name).lora_int_id for name in names}) == MAX_LORA_MODULES


def test_the_catalog_looks_at_its_directory_at_start_and_then_on_its_own_thread(tmp_path):
    lora_dir = tmp_path / "lora-dir"
    adapter(lora_dir / "early")
    served = catalog(tmp_path, scan_seconds=0.05).start()
    try:
        assert served.names() == ["early"]  # before the first registration
        adapter(tmp_path / ".staging")
        (tmp_path / ".staging").rename(lora_dir / "late")
        deadline = time.monotonic() + 10
        while "late" not in served.names() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert served.names() == ["early", "late"]
    finally:
        served.stop()
    assert not served._thread.is_alive()


def test_an_unreadable_directory_serves_nothing_from_it_and_says_so(tmp_path, caplog):
    served = catalog(tmp_path, {"fixed": str(adapter(tmp_path / "fixed"))})
    adapter(tmp_path / "lora-dir" / "a")
    assert served.scan() == ["fixed", "a"]
    shutil.rmtree(tmp_path / "lora-dir")
    assert served.scan() == ["fixed"]
    assert "Cannot read --lora-dir" in caplog.text


# ---- the router ----------------------------------------------------------------


def test_a_heartbeat_that_says_its_adapters_replaces_them_and_one_that_does_not_keeps_them():
    from splitserve.common.load import WorkerLoad
    from splitserve.common.types import WorkerRole, WorkerState
    from splitserve.router.registry import WorkerRegistry
    from splitserve.router.registry_servicer import RegistryServicer
    from splitserve.v1 import worker_pb2
    from tests.unit.test_lora_serving import LAYOUT

    registry = WorkerRegistry(model_fingerprint="m")
    servicer = RegistryServicer(registry)
    lease = registry.register(WorkerRole.DECODE, "d:1", kv_endpoint=worker_pb2.KVEndpoint(address="d:10"),
                              model_fingerprint="m", kv_layout=LAYOUT, worker_id="decode-1",
                              lora_names=frozenset({"sql"})).lease_id
    servicer.Heartbeat(worker_pb2.HeartbeatRequest(lease_id=lease, state=WorkerState.SERVING.value), None)
    assert registry.lora_names() == ["sql"]
    heartbeat = worker_pb2.HeartbeatRequest(lease_id=lease, state=WorkerState.SERVING.value)
    heartbeat.lora_names.names.extend(["sql", "late"])
    servicer.Heartbeat(heartbeat, None)
    assert registry.lora_names() == ["late", "sql"]
    heartbeat.lora_names.ClearField("names")
    assert heartbeat.HasField("lora_names")  # said, and empty: none
    servicer.Heartbeat(heartbeat, None)
    assert registry.lora_names() == []
    registry.heartbeat(lease, WorkerLoad(), WorkerState.SERVING, lora_names=frozenset({"x"}))
    assert registry.lora_names() == ["x"]
    heartbeat.lora_names.names.append("../x")
    with pytest.raises(InvalidRequest, match="characters"):
        servicer.Heartbeat(heartbeat, None)
    assert registry.lora_names() == ["x"]  # a bad heartbeat changes nothing


# ---- the flags -------------------------------------------------------------------


def test_lora_dir_turns_lora_on_and_up_passes_it_to_every_worker_by_absolute_path(tmp_path, monkeypatch):
    from splitserve.cli import engine_options
    from splitserve.cli_serve import _engine_flags
    from splitserve.engine.config import EngineConfig
    from splitserve.rpc.worker_config import WorkerConfig
    from tests.unit.test_lora_serving import _parse

    (tmp_path / "adapters").mkdir()
    monkeypatch.chdir(tmp_path)
    assert engine_options(_parse("--lora-dir", "adapters"))["enable_lora"]
    flags = _engine_flags(_parse("--lora-dir", "adapters", "--dtype", "float32"), "/m")
    assert flags[flags.index("--lora-dir") + 1] == str(tmp_path / "adapters") and "--enable-lora" in flags
    with pytest.raises(ValueError, match="--lora-dir nowhere: no such directory"):
        _engine_flags(_parse("--lora-dir", "nowhere", "--dtype", "float32"), "/m")
    assert WorkerConfig(lora_dir="adapters", engine=EngineConfig(enable_lora=True)).lora_dir == "adapters"
    with pytest.raises(ValueError, match="lora_dir needs an engine with enable_lora"):
        WorkerConfig(lora_dir="adapters")
    with pytest.raises(ValueError, match="--lora-dir nowhere: no such directory"):
        WorkerConfig(lora_dir="nowhere", engine=EngineConfig(enable_lora=True))


# ---- the adapter's tag outside the engine (LMCache) ----------------------------------


def test_an_adapters_cache_tag_is_its_name_and_a_digest_of_its_files(tmp_path):
    from splitserve.engine.lora import LoRARequest, lora_cache_tag

    first = adapter(tmp_path / "one")
    shutil.copytree(first, tmp_path / "copy")
    other = adapter(tmp_path / "two", seed=2)
    tag = lora_cache_tag(LoRARequest("sql", 1, str(first)))
    assert lora_cache_tag(None) is None
    assert tag.startswith("sql.") and len(tag) == 4 + 32
    assert lora_cache_tag(LoRARequest("sql", 7, str(tmp_path / "copy"))) == tag  # the same files elsewhere
    assert lora_cache_tag(LoRARequest("chat", 1, str(first))) != tag  # another name
    assert lora_cache_tag(LoRARequest("sql", 2, str(other))) not in (tag, None)  # other weights
    assert lora_cache_tag(LoRARequest("a b/c", 3, str(first))).startswith("a_b_c.")  # only key-safe characters
    with pytest.raises(InvalidRequest, match="'gone': its files cannot be read"):
        lora_cache_tag(LoRARequest("gone", 4, str(tmp_path / "nowhere")))


def test_a_static_workers_polled_adapters_replace_its_own():
    from splitserve.common.load import WorkerLoad
    from splitserve.common.types import WorkerRole, WorkerState
    from splitserve.router.registry import WorkerRegistry
    from splitserve.v1 import worker_pb2

    registry = WorkerRegistry()
    worker = registry.add_static(WorkerRole.DECODE, "d:1", kv_endpoint=worker_pb2.KVEndpoint(address="d:2"),
                                 lora_names=frozenset({"sql"}))
    assert registry.lora_names() == ["sql"] and registry.get(worker.worker_id).serves("sql")
    registry.update_static(worker.worker_id, WorkerLoad(), WorkerState.SERVING, lora_names=frozenset({"late"}))
    assert registry.lora_names() == ["late"]
    registry.update_static(worker.worker_id, WorkerLoad(), WorkerState.SERVING)  # not said: kept
    assert registry.lora_names() == ["late"]
