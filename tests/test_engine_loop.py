"""EngineLoop: requests from many threads into one engine thread, with aborts and errors."""

from __future__ import annotations

import threading

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.engine_loop import EngineLoop

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
