"""EngineLoop: requests from many threads into one engine thread, with aborts and errors."""

from __future__ import annotations

import threading

import pytest

from splitserve import LLM, SamplingParams
from splitserve.common.errors import Cancelled
from splitserve.decode_service.beam_search import LoopBeamSteps
from splitserve.engine.beam_search import BeamSearchParams, beam_candidates, beam_search
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


def _completions(outputs) -> dict[int, list]:
    """A stream's outputs by completion index, in order."""
    by_index: dict[int, list] = {}
    for output in outputs:
        by_index.setdefault(output.outputs[0].index, []).append(output)
    return by_index


@pytest.fixture(scope="module")
def greedy_output(llm):
    """PROMPTS[4] greedily, offline (before a loop drives the engine)."""
    return llm.generate(PROMPTS[4], GREEDY, use_tqdm=False)[0]


def test_n_completions_come_on_one_stream_and_fork_the_prompt(llm, greedy_output, loop):
    params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
    stream = loop.submit("par", PROMPTS[4], params)
    by_index = _completions(list(stream))
    expected = greedy_output
    assert sorted(by_index) == [0, 1, 2]
    for outputs in by_index.values():
        assert [output.finished for output in outputs].count(True) == 1 and outputs[-1].finished
        assert [token for output in outputs for token in output.outputs[0].delta_token_ids] == \
            expected.outputs[0].token_ids
    prompt_length = len(expected.prompt_token_ids)
    # The others took the first one's KV of all but the prompt's last token.
    assert [by_index[index][-1].num_cached_tokens for index in (1, 2)] == [prompt_length - 1] * 2


def test_forks_wait_for_a_first_completion_whose_kv_is_remote(llm, loop):
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 40))
    stream = loop.submit("remote", None, params, prompt_token_ids=prompt, kv_transfer=KVTransferParams(load=True))
    stream.wait_accepted(10)
    for _ in range(3):  # steps pass (the loop polls the connector) and no fork computes the prompt for itself
        assert not loop.call(lambda engine: engine.started_or_finished("remote/1") or
                             engine.started_or_finished("remote/2"))
    loop.post(lambda engine: engine.recompute_remote_kv("remote"))
    by_index = _completions(list(stream))
    assert sorted(by_index) == [0, 1, 2]
    assert [by_index[index][-1].num_cached_tokens for index in (1, 2)] == [len(prompt) - 1] * 2
    tokens = [by_index[index][-1].outputs[0].token_ids for index in range(3)]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 4


def test_abort_ends_every_completion_and_a_refused_one_leaves_none_queued(llm, loop):
    stream = loop.submit("many", PROMPTS[5], SamplingParams(n=3, temperature=0, max_tokens=400, ignore_eos=True))
    stream.get(timeout=60)
    loop.abort("many")
    finals = [output for output in stream if output.finished]
    assert len(finals) == 3 and {output.outputs[0].finish_reason for output in finals} == {"abort"}
    # A completion's engine id taken by another request: the whole request is refused, none of it left queued.
    other = loop.submit("taken/1", PROMPTS[6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    refused = loop.submit("taken", PROMPTS[7], SamplingParams(n=2, temperature=0, max_tokens=30))
    with pytest.raises(ValueError, match="already in use"):
        refused.wait_accepted(60)
    assert list(other)[-1].outputs[0].finish_reason == "length"
    assert loop.call(lambda engine: not engine.has_unfinished_requests())


@pytest.fixture(scope="module")
def offline_beams(llm):
    """PROMPTS[8]'s 3 beams of 6 tokens by LLM.beam_search (before a loop drives the engine)."""
    return llm.beam_search([PROMPTS[8]], BeamSearchParams(beam_width=3, max_tokens=6))[0]


def test_a_beam_search_stepped_through_the_loop_is_llm_beam_searchs(llm, offline_beams, loop):
    """decode_service's steps: the prompt held by a one-token request, each step forking the beams it grew from,
    from another thread than the engine's; the same beams as the offline search, and nothing left held."""
    prompt = llm.get_tokenizer().encode(PROMPTS[8])
    root = loop.submit("search", None, SamplingParams(max_tokens=1, temperature=0), prompt, keep_kv=True)
    assert list(root)[-1].finished
    steps = LoopBeamSteps(loop, "search", "search", prompt, beam_candidates(3, llm.engine.eos_token_ids), {})
    try:
        [output] = beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6), steps,
                               llm.engine.eos_token_ids, lambda ids: llm.get_tokenizer().decode(ids))
    finally:
        steps.release()
    assert [beam.tokens for beam in output.sequences] == [beam.tokens for beam in offline_beams.sequences]
    assert loop.call(lambda engine: engine.free_block_count) == llm.engine.num_kv_blocks


def test_a_cancelled_beam_search_ends_its_step_and_frees_its_blocks(llm, loop):
    prompt = llm.get_tokenizer().encode(PROMPTS[9])
    root = loop.submit("cut", None, SamplingParams(max_tokens=1, temperature=0), prompt, keep_kv=True)
    list(root)
    steps = LoopBeamSteps(loop, "cut", "cut", prompt, beam_candidates(4, llm.engine.eos_token_ids), {})
    failure: list[BaseException] = []

    def search() -> None:
        try:
            beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=300, ignore_eos=True), steps,
                        llm.engine.eos_token_ids, str)
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=search)
    thread.start()
    import time

    time.sleep(0.5)
    steps.cancel()
    thread.join(60)
    steps.release()
    assert not thread.is_alive() and failure and isinstance(failure[0], Cancelled)
    assert loop.call(lambda engine: engine.free_block_count) == llm.engine.num_kv_blocks
