"""The cluster with ``--kv-transfer lmcache``: a router, one prefill and one decode worker, and a private
redis-server on a free loopback port as LMCache's backend. The prefill worker stores each prompt's KV in
LMCache; the decode worker waits until Redis holds it, loads it into its reserved blocks and recomputes only
the last prompt token. Greedy outputs must be token-identical to transformers on the reference prompts, from a
couple of tokens to one of over a thousand (several 256-token chunks and a partial one), and to PEFT's with a LoRA
adapter, whose KV LMCache keeps under the adapter's own tag.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from tests.cluster_helpers import (
    all_blocks_free,
    check_two_completions_take_one_transfer,
    start_cluster,
    stream_tokens,
    wait_until,
    worker_status,
)
from tests.reference import MAX_TOKENS

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
CHUNK_SIZE = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, lora_adapters):
    modules = [f"{name}={adapter.lora_path}" for name, adapter in lora_adapters.items()]
    cluster = start_cluster("lmcache", tmp_path_factory.mktemp("lmcache-cluster"),
                            worker_args=["--lora-modules", *modules, "--max-loras", "2"])
    yield cluster
    cluster.stop()


def test_lmcache_kv_transfer_is_token_identical_to_transformers(cluster, prompt_token_ids, hf_reference):
    longest = max(prompt_token_ids, key=len)
    assert len(longest) > 1000 and len(longest) % CHUNK_SIZE, "the long prompt must end inside a chunk"
    prefill = next(p for p in cluster.workers if p.name.startswith("prefill"))
    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    assert cluster.redis is not None and cluster.redis_url.startswith("redis://127.0.0.1:")
    status = worker_status(decode.address, "decode")
    assert status.kv_endpoint.address == cluster.redis_url  # an LMCACHE endpoint naming the Redis
    with Client(cluster.router.address) as client:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda ids: stream_tokens(client, ids, MAX_TOKENS)[0], prompt_token_ids))
        assert results == hf_reference
        # Every prompt's KV was loaded from LMCache, none recomputed or prefilled by the decode worker.
        counters = worker_status(decode.address, "decode").counters
        assert counters.num_kv_transfers_received == len(prompt_token_ids)
        assert counters.num_kv_recomputes == 0 and counters.num_local_prefills == 0
        assert counters.num_kv_bytes > 0
        loaded = re.findall(r"request=\S+ transfer=\S+ KV of (\d+) tokens loaded from LMCache \(", decode.log())
        assert len(loaded) == len(prompt_token_ids), decode.log()[-3000:]
        assert worker_status(prefill.address, "prefill").counters.num_kv_transfers_sent == len(prompt_token_ids)
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")
    # The whole long prompt is in Redis (its partial chunk too): keys of five chunks, each with a TTL.
    server = redis.Redis.from_url(cluster.redis_url)
    try:
        keys = list(server.scan_iter(match="splitserve:lmcache:*"))
        assert keys, "LMCache wrote nothing to Redis"
        ttls = [server.pttl(key) for key in keys]
        assert all(0 < ttl <= 600_000 for ttl in ttls), ttls
    finally:
        server.close()


def test_n_completions_load_the_prompt_from_lmcache_once(cluster, prompt_token_ids, hf_reference):
    """Two greedy completions of the 343-token prompt through LMCache: one load on the
    decode worker, forked for the second completion; both transformers' continuation."""
    check_two_completions_take_one_transfer(cluster, prompt_token_ids[6], MAX_TOKENS, hf_reference[6])


def test_an_adapters_kv_goes_under_its_own_tag_and_gives_pefts_tokens(cluster, prompt_token_ids, lora_references):
    """After the base model's KV of every prompt is in LMCache (the test above), the same prompts under adapter
    "every": had LMCache keyed them by tokens alone, the decode worker would load the base model's KV. Then the
    base model again, whose KV must not be the adapter's."""
    from tests.lora_helpers import LORA_MAX_TOKENS

    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    before = worker_status(decode.address, "decode").counters
    indices = [1, max(range(len(prompt_token_ids)), key=lambda i: len(prompt_token_ids[i]))]  # short, longest
    with Client(cluster.router.address) as client:
        for index in indices:
            chunks = list(client.generate_stream(prompt_token_ids[index], SamplingParams(
                max_tokens=LORA_MAX_TOKENS, temperature=0.0), lora_name="every", timeout=300))
            assert [t for chunk in chunks for t in chunk.token_ids] == lora_references["every"][index], index
        chunks = list(client.generate_stream(prompt_token_ids[1], SamplingParams(max_tokens=LORA_MAX_TOKENS,
                                                                                  temperature=0.0), timeout=300))
        assert [t for chunk in chunks for t in chunk.token_ids] == lora_references[None][1]
        after = worker_status(decode.address, "decode").counters
        assert after.num_kv_transfers_received - before.num_kv_transfers_received == 3
        assert after.num_kv_recomputes == before.num_kv_recomputes and after.num_local_prefills == 0
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")
    keys = [key.decode() for key in redis.Redis.from_url(cluster.redis_url).scan_iter(match="*@lora%every.*")]
    assert keys and all(re.search(r"@lora%every\.[0-9a-f]{32}", key) for key in keys), keys[:4]


def test_a_prompt_lmcache_never_holds_is_recomputed_after_the_kv_timeout(cluster, tokenizer, model_dir):
    from splitserve.rpc.tls import open_channel
    from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
    from tests.reference import hf_greedy

    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    prompt = tokenizer.encode("No prefill worker computed this prompt about the rivers of Patagonia:")
    before = worker_status(decode.address, "decode").counters
    request = worker_pb2.DecodeRequest(
        request_id="lmcache-never-stored", transfer_id="lmcache-never-stored-transfer", prompt_token_ids=prompt,
        sampling_params=inference_pb2.SamplingParams(max_tokens=8, temperature=0.0), kv_timeout_seconds=1.0)
    started = time.monotonic()
    with open_channel(decode.address, None) as channel:
        messages = list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60))
    assert messages[0].state == worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS
    last = messages[-1]
    assert last.kv_recomputed and last.kv_wait_seconds >= 1.0 and time.monotonic() - started >= 1.0
    assert [token for message in messages for token in message.token_ids] == hf_greedy(str(model_dir), prompt, 8)
    after = worker_status(decode.address, "decode").counters
    assert after.num_kv_recomputes == before.num_kv_recomputes + 1
    assert after.num_kv_transfers_received == before.num_kv_transfers_received
    assert "LMCache did not hold the prompt's KV" in decode.log()


def test_a_request_cancelled_while_waiting_for_lmcache_frees_its_blocks(cluster, tokenizer):
    from splitserve.rpc.tls import open_channel
    from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    prompt = tokenizer.encode("A prompt nobody stores, cancelled while the decode worker polls LMCache. " * 20)
    request = worker_pb2.DecodeRequest(
        request_id="lmcache-cancelled", transfer_id="lmcache-cancelled-transfer", prompt_token_ids=prompt,
        sampling_params=inference_pb2.SamplingParams(max_tokens=8, temperature=0.0), kv_timeout_seconds=60.0)
    with open_channel(decode.address, None) as channel:
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60)
        assert next(call).state == worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS
        load = worker_status(decode.address, "decode").status.load
        assert load.num_free_kv_blocks <= load.num_total_kv_blocks - len(prompt) // 16  # its blocks are reserved
        call.cancel()
    with Client(cluster.router.address) as client:
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the cancel")


def test_an_idle_decode_worker_exits_within_5_s_of_sigterm(cluster):
    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    started = time.monotonic()
    decode.terminate()
    code = decode.popen.wait(15)
    seconds = time.monotonic() - started
    assert code == 0, decode.log()[-3000:]
    assert seconds < 5.0, f"the decode worker took {seconds:.1f} s to exit"


_WITHOUT_LMCACHE = ("import sys; sys.modules['lmcache'] = None\n"
                    "from splitserve.cli import main\n"
                    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.parametrize("command", [["decode", "--kv-transfer", "lmcache", "--kv-address", "redis://127.0.0.1:1/0"],
                                     ["up", "--kv-transfer", "lmcache", "--port", "0"]])
def test_without_the_extra_lmcache_fails_at_start_saying_how_to_install(command, model_dir):
    result = subprocess.run([sys.executable, "-c", _WITHOUT_LMCACHE, *command, "--model", str(model_dir)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pip install 'splitserve[lmcache]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
