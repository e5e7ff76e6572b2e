"""LMCacheKVStore across processes through a real redis-server: KV stored by one process loads bit-exact in
another, into other blocks; prefixes are found by other prompts; two models sharing a Redis never read each
other's KV; every key expires; a process exits within 5 s of close; Redis down neither raises nor hangs;
LMCache logs nothing per store at our default level.

LMCache runs only in worker processes (``python -m tests.integration.test_lmcache``, JSON commands on stdin,
one JSON reply per line on stdout): the test process never imports it, so a missing extra fails these tests
with the install sentence instead of breaking the collection of every tier. The cache is the default model's
layout (30 layers, 3 KV heads, head size 64, float32, blocks of 16 tokens): a 256-token chunk is 11.8 MB.
"""

from __future__ import annotations

import importlib.util
import json
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from splitserve.kvtransfer.layout import KVLayout

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype=torch.float32, block_size=16)
NUM_BLOCKS = 80
SENTINEL = 7.0
# A 32 MiB buffer moves one 11.8 MB chunk at a time: a 1,000-token store waits three times for room.
SMALL_BUFFER = 32 << 20
TTL_SECONDS = 120.0
LONG = torch.randint(0, 49152, (1000,), generator=torch.Generator().manual_seed(1)).tolist()  # 3 chunks + 232
SHORT = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(2)).tolist()  # one partial chunk
# Where the storing process holds each prompt, and the other blocks the reading process loads it into.
STORE_BLOCKS = {"long": list(range(63)), "short": [70, 71, 72]}
LOAD_BLOCKS = {"long": list(range(79, 16, -1)), "short": [3, 0, 5]}
PROMPTS = {"long": LONG, "short": SHORT}


def seeded_cache(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.payload_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(seed))


def expected_load(source: torch.Tensor, source_blocks, load_blocks, num_tokens: int) -> torch.Tensor:
    """A sentinel-filled cache with positions ``[0, num_tokens)`` copied from ``source``, block by block."""
    expected = torch.full_like(source, SENTINEL)
    for index in range(-(-num_tokens // LAYOUT.block_size)):
        count = min(LAYOUT.block_size, num_tokens - index * LAYOUT.block_size)
        expected[load_blocks[index], :, :, :, :count] = source[source_blocks[index], :, :, :, :count]
    return expected


class StoreProcess:
    """A process holding one LMCacheKVStore: a seeded source cache and a sentinel-filled one to load into."""

    def __init__(self, log_path: Path, **open_arguments) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "tests.integration.test_lmcache"], cwd=REPO,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            self.opened = self.call("open", timeout=60, **open_arguments)
        except BaseException:
            self.kill()
            raise

    def call(self, op: str, timeout: float = 30, **arguments) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"no answer to {op} within {timeout} s; log:\n{self.log()}"
        line = self.process.stdout.readline()
        assert line, f"the process ended during {op}; log:\n{self.log()}"
        reply = json.loads(line)
        assert "error" not in reply, f"{op}: {reply['error']}; log:\n{self.log()}"
        return reply

    def close(self) -> float:
        """Close the store; returns the seconds from the close command to the process's exit."""
        started = time.monotonic()
        self.call("close", timeout=10)
        self.process.wait(timeout=10)
        return time.monotonic() - started

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def lmcache_installed():
    if importlib.util.find_spec("lmcache") is None:
        pytest.fail("LMCache is not installed: pip install 'splitserve[lmcache]' (make install-test does).")


@pytest.fixture(scope="module")
def stored(lmcache_installed, redis_url, tmp_path_factory):
    """Both prompts stored by a process of their own (seed 11), which then waits until Redis holds them and
    closes; the exit time of that process, its reply to open, and its log."""
    fingerprint = f"test-a-{uuid.uuid4().hex[:8]}"
    writer = StoreProcess(tmp_path_factory.mktemp("lmcache") / "writer.log", url=redis_url, fingerprint=fingerprint,
                          seed=11, local_cpu_bytes=SMALL_BUFFER, ttl_seconds=TTL_SECONDS, log_level="INFO")
    try:
        store_seconds = {name: writer.call("store", tokens=PROMPTS[name], blocks=STORE_BLOCKS[name])["seconds"]
                         for name in PROMPTS}
        for tokens in PROMPTS.values():
            assert writer.call("wait_for", tokens=tokens, expected=len(tokens))["found"] == len(tokens)
        exit_seconds = writer.close()
        yield {"fingerprint": fingerprint, "opened": writer.opened, "store_seconds": store_seconds,
               "exit_seconds": exit_seconds, "log": writer.log()}
    finally:
        writer.kill()


@pytest.fixture(scope="module")
def reader(stored, redis_url, tmp_path_factory):
    """Another process with the same fingerprint (seed 12: its own cache differs)."""
    process = StoreProcess(tmp_path_factory.mktemp("lmcache") / "reader.log", url=redis_url,
                           fingerprint=stored["fingerprint"], seed=12, log_level="INFO")
    yield process
    process.kill()


@pytest.mark.parametrize("name", ["long", "short"])
def test_a_prompt_stored_by_one_process_loads_bit_exact_into_other_blocks_of_another(stored, reader, tmp_path, name):
    tokens = PROMPTS[name]
    assert reader.call("lookup", tokens=tokens)["found"] == len(tokens)  # the partial last chunk included
    reply = reader.call("retrieve", tokens=tokens, blocks=LOAD_BLOCKS[name], save=str(tmp_path / "loaded.pt"))
    assert reply["loaded"] == len(tokens)
    loaded = torch.load(tmp_path / "loaded.pt")
    expected = expected_load(seeded_cache(11), STORE_BLOCKS[name], LOAD_BLOCKS[name], len(tokens))
    assert torch.equal(loaded, expected), "the loaded KV differs, or a slot outside the prompt's was written"


def test_stores_return_quickly(stored):
    # The short prompt fits the buffer: no wait for Redis. The long one in a 32 MiB buffer moves in four
    # windows, each waiting for the previous one's writes.
    assert stored["store_seconds"]["short"] < 1.0
    assert stored["store_seconds"]["long"] < 10.0


def test_another_prompt_finds_and_loads_the_stored_prefix(stored, reader, tmp_path):
    other = LONG[:600] + SHORT * 4  # shares 600 tokens: two whole chunks
    assert reader.call("lookup", tokens=other)["found"] == 512
    # A prefix that ends inside a chunk finds the whole chunks before it: the stored partial chunk is keyed by
    # its own tokens, so only the same prompt (or one that ends where it ends) finds it.
    assert reader.call("lookup", tokens=LONG[:600])["found"] == 512
    assert reader.call("lookup", tokens=LONG + SHORT)["found"] == 768
    blocks = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - 39, -1))  # 625 tokens' worth
    reply = reader.call("retrieve", tokens=other, blocks=blocks, save=str(tmp_path / "loaded.pt"))
    assert reply["loaded"] == 512
    expected = expected_load(seeded_cache(11), STORE_BLOCKS["long"], blocks, 512)
    assert torch.equal(torch.load(tmp_path / "loaded.pt"), expected)


def test_a_retrieve_writes_only_the_positions_asked_for(stored, reader, tmp_path):
    # Positions [300, 700): a prefix this worker already has is not written, nor what lies past num_tokens.
    blocks = LOAD_BLOCKS["long"]
    reply = reader.call("retrieve", tokens=LONG, blocks=blocks, num_tokens=700, num_computed_tokens=300,
                        save=str(tmp_path / "loaded.pt"))
    assert reply["loaded"] == 700
    expected = expected_load(seeded_cache(11), STORE_BLOCKS["long"], blocks, 700)
    expected[torch.tensor(blocks[:18])] = SENTINEL  # positions 0..287: whole blocks
    expected[blocks[18], :, :, :, :12] = SENTINEL  # positions 288..299
    assert torch.equal(torch.load(tmp_path / "loaded.pt"), expected)


def test_two_models_sharing_a_redis_never_read_each_other(stored, reader, redis_url, tmp_path):
    other_model = StoreProcess(tmp_path / "other.log", url=redis_url, fingerprint=f"test-b-{uuid.uuid4().hex[:8]}",
                               seed=13, log_level="INFO")
    try:
        assert other_model.call("lookup", tokens=LONG)["found"] == 0
        reply = other_model.call("retrieve", tokens=LONG, blocks=LOAD_BLOCKS["long"], num_tokens=len(LONG),
                                 save=str(tmp_path / "nothing.pt"))
        assert reply["loaded"] == 0
        assert bool((torch.load(tmp_path / "nothing.pt") == SENTINEL).all())
        # The same tokens stored under the other model: each model still loads its own KV.
        other_model.call("store", tokens=LONG, blocks=STORE_BLOCKS["long"])
        assert other_model.call("wait_for", tokens=LONG, expected=len(LONG))["found"] == len(LONG)
        other_model.call("retrieve", tokens=LONG, blocks=LOAD_BLOCKS["long"], save=str(tmp_path / "b.pt"))
        reader.call("retrieve", tokens=LONG, blocks=LOAD_BLOCKS["long"], save=str(tmp_path / "a.pt"))
        for path, seed in (("b.pt", 13), ("a.pt", 11)):
            expected = expected_load(seeded_cache(seed), STORE_BLOCKS["long"], LOAD_BLOCKS["long"], len(LONG))
            assert torch.equal(torch.load(tmp_path / path), expected), f"{path} holds another model's KV"
    finally:
        other_model.kill()


def test_every_key_carries_the_fingerprint_and_a_ttl(stored, redis_url):
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"splitserve:lmcache:{stored['fingerprint']}@*"))
    # Two keys (bytes, metadata) per chunk: four chunks of the long prompt, one of the short one.
    assert len(keys) == 10, keys
    ttls = [client.pttl(key) for key in keys]
    assert all(0 < ttl <= TTL_SECONDS * 1000 for ttl in ttls), ttls


def test_kv_stored_under_a_tag_is_found_under_that_tag_only(stored, reader, redis_url, tmp_path):
    """A LoRA adapter's KV goes under its tag (``lora_cache_tag``): the same tokens under the base model (the
    writer's, seed 11), under the tag (the reader's cache, seed 12) and under another tag are three things."""
    tag, other = "sql.0123abcd", "chat.0123abcd"
    assert reader.call("lookup", tokens=LONG, tag=tag)["found"] == 0  # the base model's KV is not the adapter's
    reader.call("store", tokens=LONG, blocks=STORE_BLOCKS["long"], tag=tag)
    assert reader.call("wait_for", tokens=LONG, expected=len(LONG), tag=tag)["found"] == len(LONG)
    assert reader.call("lookup", tokens=LONG, tag=other)["found"] == 0
    assert reader.call("lookup", tokens=LONG[:600], tag=tag)["found"] == 512  # prefixes too, under the tag
    for loaded_tag, seed in ((tag, 12), (None, 11)):
        reply = reader.call("retrieve", tokens=LONG, blocks=LOAD_BLOCKS["long"], save=str(tmp_path / "kv.pt"),
                            tag=loaded_tag)
        assert reply["loaded"] == len(LONG)
        expected = expected_load(seeded_cache(seed), STORE_BLOCKS["long"], LOAD_BLOCKS["long"], len(LONG))
        assert torch.equal(torch.load(tmp_path / "kv.pt"), expected), f"tag {loaded_tag} loaded another's KV"
    keys = list(redis.Redis.from_url(redis_url).scan_iter(match=f"splitserve:lmcache:{stored['fingerprint']}@*"))
    assert sum(f"@lora%{tag}".encode() in key for key in keys) == 8  # bytes and metadata of four chunks
    for bad in ("a@b", "a%b", "", "x" * 129):
        assert "1 to 128 characters" in reader.call("refusal", tag=bad)["refused"]


def test_a_process_exits_within_5_s_of_close(stored):
    assert stored["exit_seconds"] < 5.0


def test_the_store_leaves_the_start_method_and_turns_telemetry_off(stored):
    opened = stored["opened"]
    assert opened["start_method_after"] == opened["start_method_before"] == "fork"
    assert opened["track_usage"] == "false"


def test_the_default_log_level_shows_no_lmcache_line_per_store(stored, redis_url, tmp_path):
    lmcache_lines = [line for line in stored["log"].splitlines() if " lmcache." in line or "LMCache INFO" in line]
    assert lmcache_lines == []
    # At DEBUG, LMCache's per-store lines come through our handler (so the check above can fail).
    fingerprint = f"test-debug-{uuid.uuid4().hex[:8]}"
    debug = StoreProcess(tmp_path / "debug.log", url=redis_url, fingerprint=fingerprint, seed=11, log_level="DEBUG")
    try:
        debug.call("store", tokens=LONG, blocks=STORE_BLOCKS["long"])
        assert debug.close() < 5.0  # with its writes still in flight: they land first
        assert len(list(redis.Redis.from_url(redis_url).scan_iter(match=f"splitserve:lmcache:{fingerprint}@*"))) == 8
        assert any(" lmcache." in line and "Stored" in line for line in debug.log().splitlines()), debug.log()
    finally:
        debug.kill()


def test_redis_down_neither_raises_nor_hangs(lmcache_installed, tmp_path):
    from splitserve.launcher import LocalCluster

    launcher = LocalCluster(log_dir=tmp_path)
    url = launcher.start_redis()
    worker = StoreProcess(tmp_path / "worker.log", url=url, fingerprint="test-down", seed=11, log_level="INFO")
    try:
        worker.call("store", tokens=LONG, blocks=STORE_BLOCKS["long"])
        assert worker.call("wait_for", tokens=LONG, expected=len(LONG))["found"] == len(LONG)
        launcher.redis.kill()
        for _ in range(3):
            assert worker.call("store", tokens=LONG, blocks=STORE_BLOCKS["long"], timeout=10)["seconds"] < 3.0
        reply = worker.call("lookup", tokens=LONG, timeout=10)
        assert reply["found"] == 0 and reply["seconds"] < 3.0
        reply = worker.call("retrieve", tokens=LONG, blocks=LOAD_BLOCKS["long"], num_tokens=len(LONG),
                            save=str(tmp_path / "nothing.pt"), timeout=10)
        assert reply["loaded"] == 0 and reply["seconds"] < 3.0
        assert bool((torch.load(tmp_path / "nothing.pt") == SENTINEL).all())
        assert worker.log().count("LMCache cannot reach Redis") == 1, worker.log()
        assert worker.close() < 5.0
    finally:
        worker.kill()
        launcher.redis.kill()


def test_a_password_protected_redis_works_and_the_password_is_never_logged(lmcache_installed, tmp_path):
    from splitserve.launcher import free_port

    password = f"secret-{uuid.uuid4().hex}"
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--requirepass", password], stdout=subprocess.DEVNULL)
    worker = None
    try:
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        worker = StoreProcess(tmp_path / "worker.log", url=url, fingerprint="test-password", seed=11,
                              log_level="DEBUG", password=password)
        worker.call("store", tokens=SHORT, blocks=STORE_BLOCKS["short"])
        assert worker.call("wait_for", tokens=SHORT, expected=len(SHORT))["found"] == len(SHORT)
        worker.close()
        assert " lmcache." in worker.log() and password not in worker.log()
    finally:
        if worker is not None:
            worker.kill()
        server.kill()
        server.wait(10)


def test_without_lmcache_the_import_says_how_to_install():
    code = ("import sys; sys.modules['lmcache'] = None\n"
            "try:\n    import splitserve.kvtransfer.lmcache_connector\n"
            "except ImportError as error:\n    print(error)\nelse:\n    print('imported')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "pip install 'splitserve[lmcache]'" in result.stdout, result.stdout + result.stderr


_COPY_CHECK = """
import sys, torch
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.lmcache_gpu_connector import BlockMajorGPUConnector, slot_mapping

class Chunk:  # an LMCache memory object as the connector sees it: a host tensor
    def __init__(self, shape):
        self.tensor = torch.zeros(shape)

device = sys.argv[1]
layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=4, dtype=torch.float32, block_size=4)
cache = torch.randn(layout.payload_shape(10), generator=torch.Generator().manual_seed(5)).to(device)
connector = BlockMajorGPUConnector(layout)
blocks = [7, 2, 9]
slots = slot_mapping(blocks, 10, 4, device)
chunk = Chunk(connector.get_shape(6))
connector.from_gpu(chunk, 4, 10, kvcaches=cache, slot_mapping=slots)  # positions 4..9: blocks 2 and 9
host = cache.cpu()
for position in range(4, 10):
    row = host[blocks[position // 4], :, :, :, position % 4]  # [layers, 2, heads, head_size]
    assert torch.equal(chunk.tensor[:, :, position - 4], row.permute(1, 0, 2, 3).reshape(2, 3, 8)), position
target = torch.zeros_like(cache)
skip_first = slot_mapping([1, 0, 3], 9, 4, device, first_position=5, length=10)  # positions 5..8 only
connector.to_gpu(chunk, 4, 10, kvcaches=target, slot_mapping=skip_first)
written = (target.cpu() != 0).any(dim=(1, 2, 3, 5))  # [blocks, block_size]
assert written.nonzero().tolist() == [[0, 1], [0, 2], [0, 3], [3, 0]], written.nonzero().tolist()
assert torch.equal(target.cpu()[3, :, :, :, 0], host[9, :, :, :, 0])
print("ok")
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_copy_between_cache_and_chunks_is_exact_on_each_device(lmcache_installed, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (the same code runs there: see the module docstring of the connector)")
    result = subprocess.run([sys.executable, "-c", _COPY_CHECK, device], capture_output=True, text=True,
                            timeout=90, cwd=REPO)
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr


# ---- the worker process ------------------------------------------------------------------------


def _serve() -> None:
    """Answer JSON commands from stdin, one reply line each, until ``close``."""
    state = {}
    for line in sys.stdin:
        command = json.loads(line)
        started = time.monotonic()
        try:
            reply = _HANDLERS[command.pop("op")](state, **command)
        except Exception as error:  # reported to the test, which fails with it
            reply = {"error": f"{type(error).__name__}: {error}"}
        reply.setdefault("seconds", time.monotonic() - started)
        print(json.dumps(reply), flush=True)
        if "closed" in reply:
            return


def _open(state, url, fingerprint, seed, log_level, local_cpu_bytes=64 << 20, ttl_seconds=600.0, password=None):
    import multiprocessing
    import os

    from splitserve.common.log_fields import configure_logging

    configure_logging(log_level)
    multiprocessing.set_start_method("fork", force=True)
    before = multiprocessing.get_start_method()
    from splitserve.kvtransfer.lmcache_connector import LMCacheKVStore
    from splitserve.kvtransfer.redis_access import RedisAccess

    state["store"] = LMCacheKVStore(url, fingerprint, LAYOUT, local_cpu_bytes=local_cpu_bytes,
                                    ttl_seconds=ttl_seconds, redis_access=RedisAccess(password=password))
    state["source"] = seeded_cache(seed)
    state["target"] = torch.full_like(state["source"], SENTINEL)
    return {"start_method_before": before, "start_method_after": multiprocessing.get_start_method(),
            "track_usage": os.environ.get("LMCACHE_TRACK_USAGE")}


def _store(state, tokens, blocks, tag=None):
    state["store"].store(tokens, state["source"], blocks, tag=tag)
    return {}


def _wait_for(state, tokens, expected, timeout=20.0, tag=None):
    deadline = time.monotonic() + timeout
    while (found := state["store"].lookup(tokens, tag)) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"found": found}


def _lookup(state, tokens, tag=None):
    return {"found": state["store"].lookup(tokens, tag)}


def _retrieve(state, tokens, blocks, save, num_tokens=None, num_computed_tokens=0, tag=None):
    state["target"].fill_(SENTINEL)
    loaded = state["store"].retrieve(tokens, state["target"], blocks, num_tokens,
                                     num_computed_tokens=num_computed_tokens, tag=tag)
    torch.save(state["target"], save)
    return {"loaded": loaded}


def _refusal(state, tag):
    try:
        state["store"].lookup(LONG, tag)
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def _close(state):
    state["store"].close()
    return {"closed": True}


_HANDLERS = {"open": _open, "store": _store, "wait_for": _wait_for, "lookup": _lookup, "retrieve": _retrieve,
             "refusal": _refusal, "close": _close}

if __name__ == "__main__":
    _serve()
