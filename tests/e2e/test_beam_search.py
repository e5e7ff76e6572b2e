"""``LLM.beam_search``, vLLM's beam search over the engine, against transformers' ``generate(num_beams=...)`` on
the same weights in float32: the same beams in the same order, each beam's cumulative log probability the sum of
its tokens' own, and nothing left in use; each beam forks the KV of the beam it grew from, so a step computes one
token a beam, and a forked request continues as one whose tokens were all computed."""

from __future__ import annotations

import math

import pytest

from splitserve import LLM
from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.beam_search import BeamSearchParams
from splitserve.engine.request import KVFork
from tests.reference import hf_beams, hf_greedy

WIDTH, MAX_TOKENS = 4, 12


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048)


@pytest.fixture(scope="module")
def llm16(model_dir):
    """16-token blocks (a server's), where beams cross block boundaries every few steps."""
    return LLM(str(model_dir), block_size=16, num_kv_blocks=256, max_model_len=2048)


def test_beams_are_transformers_beams(llm, model_dir, prompt_token_ids):
    prompts = prompt_token_ids[:6]
    outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], BeamSearchParams(WIDTH, MAX_TOKENS))
    tokenizer = llm.get_tokenizer()
    for ids, output in zip(prompts, outputs):
        assert len(output.sequences) == WIDTH
        generated = [beam.tokens[len(ids):] for beam in output.sequences]
        assert generated == hf_beams(str(model_dir), ids, WIDTH, MAX_TOKENS), tokenizer.decode(ids)
        for beam, tokens in zip(output.sequences, generated):
            assert beam.tokens[: len(ids)] == ids and len(beam.logprobs) == len(tokens)
            assert math.isclose(beam.cum_logprob, sum(step[token] for step, token in zip(beam.logprobs, tokens)),
                                abs_tol=1e-9)
            text_tokens = tokens[:-1] if tokens[-1] in llm.engine.eos_token_ids else tokens
            assert beam.text == tokenizer.decode(text_tokens, skip_special_tokens=True)
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks and not llm.engine.has_unfinished_requests()


def test_beams_that_end_early_are_ranked_as_transformers_ranks_them(llm, model_dir):
    # A chat whose answer ends within a few tokens: beams finish at different lengths, scored by their generated
    # length, and the search stops once no live beam can beat the worst finished one (transformers' heuristic).
    tokenizer = llm.get_tokenizer()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one word."}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(chat)["input_ids"]
    (output,) = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(3, 24))
    generated = [beam.tokens[len(ids):] for beam in output.sequences]
    assert all(tokens[-1] in llm.engine.eos_token_ids and len(tokens) < 24 for tokens in generated)
    assert len({len(tokens) for tokens in generated}) > 1
    assert generated == hf_beams(str(model_dir), ids, 3, 24)
    assert not any(beam.text.endswith("<|im_end|>") for beam in output.sequences)


def test_a_text_prompt_and_ignore_eos_and_the_refusals(llm):
    (output,) = llm.beam_search("The capital of France is", BeamSearchParams(2, 3, ignore_eos=True))
    assert [len(beam.tokens) for beam in output.sequences] == [len(llm.get_tokenizer()("The capital of France is")
                                                                   ["input_ids"]) + 3] * 2
    scores = [beam.cum_logprob for beam in output.sequences]
    assert scores == sorted(scores, reverse=True)
    for params, sentence in ((BeamSearchParams(0, 3), "beam_width"), (BeamSearchParams(11, 3), "beam_width"),
                             (BeamSearchParams(2, 0), "max_tokens"), (BeamSearchParams(2, 3, length_penalty="1"),
                                                                      "length_penalty")):
        with pytest.raises(InvalidRequest, match=sentence):
            llm.beam_search("Hi", params)
    with pytest.raises(InvalidRequest, match="must leave room"):
        llm.beam_search({"prompt_token_ids": [17] * 2048}, BeamSearchParams(2, 3))
    # A beam stops at the context's end: max_tokens is cut to the room the longest prompt leaves.
    (near_end,) = llm.beam_search({"prompt_token_ids": [17] * 2046}, BeamSearchParams(2, 8, ignore_eos=True))
    assert {len(beam.tokens) for beam in near_end.sequences} == {2048}
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


def test_each_beam_forks_its_parent_s_kv_and_computes_one_token_a_step(llm16, model_dir, prompt_token_ids):
    prompts = prompt_token_ids[:6]
    stats = llm16.engine.stats
    computed, generated = stats.num_computed_tokens, stats.num_generated_tokens
    outputs = llm16.beam_search([{"prompt_token_ids": ids} for ids in prompts], BeamSearchParams(WIDTH, MAX_TOKENS))
    for ids, output in zip(prompts, outputs):
        assert [beam.tokens[len(ids):] for beam in output.sequences] == hf_beams(str(model_dir), ids, WIDTH,
                                                                                  MAX_TOKENS)
    # Every step's request generated one token; after the first step's (the prompts) each computed only its last
    # token, whatever the block its parent's tokens ended in (recomputing them took about 8 a beam a step).
    num_step_requests = stats.num_generated_tokens - generated
    assert num_step_requests > len(prompts) * WIDTH * 2
    assert stats.num_computed_tokens - computed <= sum(map(len, prompts)) + num_step_requests - len(prompts)
    assert llm16.engine.free_block_count == llm16.engine.num_kv_blocks


@pytest.mark.parametrize("length", [32, 33, 47])  # on a block boundary, one past, one before the next
def test_a_forked_request_continues_as_if_it_had_computed_its_tokens(llm16, model_dir, prompt_token_ids, length):
    ids = prompt_token_ids[6][: length + 1]
    engine = llm16.engine
    engine.add_request("parent", prompt_token_ids=ids[:length], sampling_params=SamplingParams(max_tokens=1),
                       keep_kv=True)
    llm16._run(["parent"], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = hf_greedy(str(model_dir), ids, 6)
    # The first copies the parent's partial block, the second takes it, the third (after) shares the full blocks.
    for request_id, take_tail in (("copying", False), ("taking", True), ("after", False)):
        engine.add_request(request_id, prompt_token_ids=ids, sampling_params=params,
                           kv_fork=KVFork("parent", take_tail))
    copying, taking, after = llm16._run(["copying", "taking", "after"], use_tqdm=False)
    assert copying.outputs[0].token_ids == taking.outputs[0].token_ids == after.outputs[0].token_ids == expected
    assert copying.num_cached_tokens == taking.num_cached_tokens == length
    assert after.num_cached_tokens == length // 16 * 16
    assert engine.release_kv("parent") and not engine.release_kv("copying")
    assert engine.free_block_count == engine.num_kv_blocks


def test_a_cache_too_small_for_every_hold_frees_the_oldest_and_the_beams_stay_transformers(model_dir,
                                                                                           prompt_token_ids):
    # 30 blocks of 16 tokens: a step's 24 beams and the 24 they grew from cannot all hold theirs. Nothing could start
    # for want of blocks; the oldest holds are freed (their forks compute what they lose) instead of the search
    # waiting on them forever.
    small = LLM(str(model_dir), block_size=16, num_kv_blocks=30, max_model_len=480)
    prompts = prompt_token_ids[:6]
    outputs = small.beam_search([{"prompt_token_ids": ids} for ids in prompts], BeamSearchParams(WIDTH, MAX_TOKENS))
    for ids, output in zip(prompts, outputs):
        assert [beam.tokens[len(ids):] for beam in output.sequences] == hf_beams(str(model_dir), ids, WIDTH,
                                                                                  MAX_TOKENS)
    assert small.engine.scheduler.num_dropped_fork_holds > 0
    assert small.engine.free_block_count == small.engine.num_kv_blocks and not small.engine.scheduler.held
