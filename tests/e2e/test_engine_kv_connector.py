"""Two engines in one process joined only by their KV connectors (the prefill worker's KVSender, the decode
worker's KVReceiver, over the redis transport and a redis-server of the test's own, and over a p2p pair on
shared memory, the one-GPU protocol, whose blocks the decode side copies straight out of the prefill engine's
cache): the engine hands out each step's completed blocks and loads them into reserved ones by itself, and the
decode engine's greedy tokens equal transformers'."""

from __future__ import annotations

import time

import pytest

from splitserve import LLM, SamplingParams
from splitserve.decode_service.receiver import KVReceiver
from splitserve.engine.kv_connector import KVLoadOutcome, KVTransferParams
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.layout import KVLayout
from splitserve.prefill_service.sender import KVSender
from splitserve.rpc.counters import Counters
from tests.reference import MAX_TOKENS

pytestmark = pytest.mark.timeout(600)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module", params=["redis", "p2p-shared-memory"])
def engines(request, model_dir, redis_url):
    url = redis_url
    # A 128-token step budget: a long prompt prefills in chunks, each step's blocks saved on their own.
    # Engines as a cluster's workers build them: 16-token blocks (the offline LLM's default on CPU is 128).
    prefill = LLM(str(model_dir), num_kv_blocks=160, max_model_len=2048, max_num_batched_tokens=128, block_size=16).engine
    decode = LLM(str(model_dir), num_kv_blocks=160, max_model_len=2048, block_size=16).engine
    layout = KVLayout.from_kv_cache(prefill.model_runner.kv_cache)
    if request.param == "redis":
        out = create_connector("redis", "prefill-e", "fingerprint", layout, url=url)
        into = create_connector("redis", "decode-e", "fingerprint", layout, url=url)
    else:
        # Into shared memory before any step: the plane would move it there on the first send, in place, while the
        # engine may be writing the next chunk's KV (a CUDA cache is exported where it lies).
        prefill.model_runner.kv_cache.share_memory_()
        out = create_connector("p2p", "prefill-e", "fingerprint", layout, cpu_data_plane="shm")
        into = create_connector("p2p", "decode-e", "fingerprint", layout, cpu_data_plane="shm")
    sender, receiver = KVSender(out), KVReceiver(into, Counters())
    prefill.attach_kv_connector(sender)
    decode.attach_kv_connector(receiver)
    receiver.start()
    yield prefill, decode
    receiver.stop()
    out.close()
    into.close()


def run_until(engine, done, timeout: float = 300.0) -> list:
    """Step ``engine`` (which polls its connector first each time) until ``done()``."""
    outputs, deadline = [], time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        stepped = engine.step()
        outputs.extend(stepped)
        if not stepped and not engine.has_work():
            time.sleep(0.01)  # only waiting for the connector
    return outputs


def all_released(engine) -> bool:
    """No request left, and no finished one keeping its blocks for a save."""
    return not engine.has_unfinished_requests() and not engine.scheduler.held


def transfer(prefill, decode, request_id: str, prompt: list[int]) -> list:
    sender, receiver = prefill.kv_transfers.connector, decode.kv_transfers.connector
    receiver.expect(request_id, f"t-{request_id}", len(prompt), timeout_seconds=120)
    request = decode.add_request(request_id, None, GREEDY, prompt_token_ids=prompt,
                                 kv_transfer=KVTransferParams(load=True))
    skip = max(request.num_cached_tokens, 0)  # what the decode engine caches already is not sent
    sending = sender.expect(request_id, f"t-{request_id}", receiver.transport.endpoint(), len(prompt))
    prefill.add_request(request_id, None, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=prompt,
                        kv_transfer=KVTransferParams(save=True, num_skip_tokens=skip))
    run_until(prefill, lambda: all_released(prefill))
    assert sending.succeeded and prefill.free_block_count == prefill.num_kv_blocks
    outputs = run_until(decode, lambda: not decode.has_unfinished_requests())
    assert decode.free_block_count == decode.num_kv_blocks
    return outputs, sending, skip


def test_kv_saved_step_by_step_and_loaded_gives_transformers_tokens(engines, prompt_token_ids, hf_reference):
    prefill, decode = engines
    index = 6  # the 343-token prompt: three 128-token steps
    outputs, sending, skip = transfer(prefill, decode, "long", prompt_token_ids[index])
    assert skip == 0 and sending.num_sends == 3  # full blocks after steps 1 and 2, the rest with the first token
    final = outputs[-1]
    assert final.outputs[0].token_ids == hf_reference[index]
    assert final.metrics.kv_load_outcome == KVLoadOutcome.RECEIVED
    # Only the decode steps ran on the decode engine: its first token came with the KV.
    assert outputs[0].outputs[0].delta_token_ids == [final.outputs[0].token_ids[0]]


def test_a_prefix_the_decode_engine_caches_is_not_sent_again(engines, prompt_token_ids, hf_reference):
    prefill, decode = engines
    index = 6  # the same prompt again: the decode engine's prefix cache holds all but its last block
    outputs, sending, skip = transfer(prefill, decode, "again", prompt_token_ids[index])
    assert skip == len(prompt_token_ids[index]) // 16 * 16 and sending.num_sends == 1
    assert sending.num_sent_blocks == 1
    assert outputs[-1].outputs[0].token_ids == hf_reference[index]
    assert outputs[-1].num_cached_tokens == skip


def test_an_aborted_load_frees_its_blocks_and_later_kv_is_dropped(engines, prompt_token_ids):
    prefill, decode = engines
    prompt = prompt_token_ids[5]
    receiver = decode.kv_transfers.connector
    receiver.expect("dropped", "t-dropped", len(prompt), timeout_seconds=120)
    decode.add_request("dropped", None, GREEDY, prompt_token_ids=prompt, kv_transfer=KVTransferParams(load=True))
    assert decode.abort_request("dropped")
    (output,) = decode.step()
    assert output.finished and output.metrics.kv_load_outcome == KVLoadOutcome.CANCELLED
    assert decode.free_block_count == decode.num_kv_blocks
    sender = prefill.kv_transfers.connector
    sending = sender.expect("dropped", "t-dropped", receiver.transport.endpoint(), len(prompt))
    prefill.add_request("dropped", None, SamplingParams(max_tokens=1), prompt_token_ids=prompt,
                        kv_transfer=KVTransferParams(save=True))
    run_until(prefill, lambda: all_released(prefill))
    assert sending.succeeded  # handed to Redis; the decode side drops it
    time.sleep(0.2)
    assert not decode.has_unfinished_requests() and decode.step() == []
