"""The engine hooks the workers use: held KV (prefill role), recompute and fail (decode role), seeded handover."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.kv_connector import KVTransferParams
from splitserve.engine.request import RequestStatus


@pytest.fixture(scope="module")
def engines(model_dir):
    # Engines as a cluster's workers build them: 16-token blocks (the offline LLM's default on CPU is 128).
    prefill = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, block_size=16)
    decode = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, block_size=16)
    return prefill.engine, decode.engine


def run(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def prompt_ids(engine, text="The quick brown fox jumps over the lazy dog because it wants to"):
    return engine.tokenize(text)


def test_held_kv_outlives_the_request_until_released(engines):
    prefill, _ = engines
    prompt = prompt_ids(prefill)
    prefill.add_request("held", None, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=prompt,
                        kv_transfer=KVTransferParams(save=True))
    (output,) = run(prefill)
    assert output.finished and output.outputs[0].finish_reason == "length"
    held = prefill.block_ids("held")
    assert len(held) == -(-len(prompt) // 16)
    assert prefill.free_block_count == prefill.num_kv_blocks - len(held)
    assert not prefill.has_unfinished_requests()
    assert prefill.release_kv("held") is True
    assert prefill.release_kv("held") is False
    assert prefill.free_block_count == prefill.num_kv_blocks


def test_aborted_request_with_hold_frees_at_once(engines):
    prefill, _ = engines
    prefill.add_request("gone", None, SamplingParams(max_tokens=1), prompt_token_ids=prompt_ids(prefill),
                        kv_transfer=KVTransferParams(save=True))
    assert prefill.abort_request("gone")
    run(prefill)
    assert prefill.free_block_count == prefill.num_kv_blocks
    assert prefill.release_kv("gone") is False


def _copy_kv(source, source_id, target, target_id):
    source_blocks = torch.tensor(source.block_ids(source_id))
    target_blocks = torch.tensor(target.block_ids(target_id))
    target.model_runner.kv_cache[target_blocks] = source.model_runner.kv_cache[source_blocks]


def test_seeded_sampling_continues_across_the_handover(engines):
    """Prefill samples the first token, decode the rest: same tokens as one engine doing both."""
    prefill, decode = engines
    prompt = prompt_ids(prefill)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    decode.add_request("whole", None, params, prompt_token_ids=prompt)
    expected = run(decode)[-1].outputs[0].token_ids

    first_params = SamplingParams(max_tokens=1, temperature=0.9, top_p=0.95, seed=1234)
    prefill.add_request("p", None, first_params, prompt_token_ids=prompt, kv_transfer=KVTransferParams(save=True))
    first_token = run(prefill)[-1].outputs[0].token_ids[0]
    decode.add_request("d", None, params, prompt_token_ids=prompt, kv_transfer=KVTransferParams(load=True))
    _copy_kv(prefill, "p", decode, "d")
    prefill.release_kv("p")
    decode.finish_remote_kv("d", first_token_id=first_token)
    tokens = run(decode)[-1].outputs[0].token_ids
    assert tokens == expected
    assert decode.free_block_count == decode.num_kv_blocks
    assert prefill.free_block_count == prefill.num_kv_blocks


def test_recompute_after_giving_up_on_remote_kv(engines):
    _, decode = engines
    prompt = prompt_ids(decode, "The quick brown fox jumps over the lazy dog because it wants to see what lies "
                                "beyond the old stone wall")
    assert 16 < len(prompt) < 32
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    decode.add_request("local", None, greedy, prompt_token_ids=prompt)
    expected = run(decode)[-1].outputs[0].token_ids
    request = decode.add_request("late", None, greedy, prompt_token_ids=prompt, kv_transfer=KVTransferParams(load=True))
    # The first full block is in this engine's prefix cache from "local": taken as it is, not awaited.
    assert request.num_cached_tokens == 16
    # Garbage in the blocks awaiting KV (a partial transfer) must not matter: that part is recomputed.
    decode.model_runner.kv_cache[torch.tensor(decode.block_ids("late")[1:])] = 7.0
    decode.recompute_remote_kv("late")
    assert request.status == RequestStatus.WAITING
    assert run(decode)[-1].outputs[0].token_ids == expected
    assert decode.free_block_count == decode.num_kv_blocks
    with pytest.raises(KeyError):
        decode.recompute_remote_kv("late")


def test_fail_request_while_waiting_for_kv(engines):
    _, decode = engines
    decode.add_request("failing", None, SamplingParams(max_tokens=8), prompt_token_ids=prompt_ids(decode),
                       kv_transfer=KVTransferParams(load=True))
    assert decode.free_block_count < decode.num_kv_blocks
    assert decode.fail_request("failing", "The prompt's KV did not arrive.")
    (output,) = run(decode)
    assert output.finished and output.outputs[0].finish_reason == "error"
    assert output.outputs[0].stop_reason == "The prompt's KV did not arrive."
    assert decode.free_block_count == decode.num_kv_blocks
    assert decode.fail_request("failing", "again") is False


def test_load_reports_queues_and_blocks(engines):
    _, decode = engines
    decode.add_request("queued", None, SamplingParams(max_tokens=2), prompt_token_ids=list(range(1, 40)))
    decode.add_request("remote", None, SamplingParams(max_tokens=2), prompt_token_ids=list(range(1, 20)),
                       kv_transfer=KVTransferParams(load=True))
    load = decode.load()
    assert (load.num_waiting_requests, load.num_waiting_for_remote_kvs_requests, load.num_running_requests) == (1, 1, 0)
    assert load.num_queued_prefill_tokens == 39
    assert load.num_free_kv_blocks == decode.num_kv_blocks - 2  # the remote request's 19 tokens hold 2 blocks
    decode.abort_request("queued")
    decode.abort_request("remote")
    run(decode)
    assert decode.load().num_free_kv_blocks == decode.num_kv_blocks
