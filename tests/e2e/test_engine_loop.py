"""EngineLoop: requests from many threads into one engine thread, with aborts and errors."""

from __future__ import annotations

import threading

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.kv_connector import KVTransferParams

PROMPTS = [f"Question {index}: what is {index} plus {index}?" for index in range(12)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=256, max_model_len=512)


@pytest.fixture
def loop(llm):
    loop = EngineLoop(llm.engine).start()
    yield loop
    loop.stop()
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


def test_concurrent_submissions_give_the_offline_tokens(llm, loop):
    results: dict[int, list[int]] = {}

    def client(indices):
        for index in indices:
            stream = loop.submit(f"c{index}", PROMPTS[index], GREEDY)
            outputs = list(stream)
            assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
            assert [token for output in outputs for token in output.outputs[0].delta_token_ids] == outputs[-1].outputs[0].token_ids
            results[index] = outputs[-1].outputs[0].token_ids

    threads = [threading.Thread(target=client, args=(range(start, 12, 4),)) for start in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    loop.call(lambda engine: None)  # the loop is alive and answering
    loop.stop()
    expected = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [results[index] for index in range(12)] == expected


def test_abort_from_another_thread_ends_the_stream_and_frees_blocks(llm, loop):
    stream = loop.submit("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    first = stream.get(timeout=60)
    assert not first.finished
    threading.Thread(target=loop.abort, args=("long",)).start()
    final = [output for output in stream][-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 400
    assert loop.call(lambda engine: engine.free_block_count) == llm.engine.num_kv_blocks


def test_bad_requests_are_refused_and_the_loop_goes_on(llm, loop):
    with pytest.raises(ValueError, match="empty"):
        loop.submit("empty", None, GREEDY, prompt_token_ids=[])
    first = loop.submit("same", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    duplicate = loop.submit("same", PROMPTS[2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        duplicate.get(timeout=60)
    assert list(first)[-1].outputs[0].finish_reason == "length"


def test_stop_aborts_unfinished_requests(llm):
    loop = EngineLoop(llm.engine).start()
    stream = loop.submit("left", PROMPTS[3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    stream.get(timeout=60)
    loop.stop()
    assert [output for output in stream][-1].outputs[0].finish_reason == "abort"
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


def test_waiting_for_remote_kv_does_not_spin_the_loop(llm, loop):
    """A request parked in WAITING_FOR_REMOTE_KVS leaves the loop idle (no busy stepping that would starve the
    KV receiver of the GIL and the machine of a core), and a posted command still moves it on at once."""
    import time

    stream = loop.submit("parked", None, GREEDY, prompt_token_ids=list(range(1, 40)), kv_transfer=KVTransferParams(load=True))
    stream.wait_accepted(10)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    time.sleep(0.6)
    cpu_used = time.process_time() - cpu_before
    assert time.monotonic() - wall_before >= 0.6
    assert cpu_used < 0.2, f"the loop used {cpu_used:.2f} s of CPU in 0.6 s while nothing could run"
    loop.post(lambda engine: engine.recompute_remote_kv("parked"))
    outputs = list(stream)
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
