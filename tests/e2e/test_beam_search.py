"""``LLM.beam_search``, vLLM's beam search over the engine, against transformers' ``generate(num_beams=...)`` on
the same weights in float32: the same beams in the same order, each beam's cumulative log probability the sum of
its tokens' own, and nothing left in use."""

from __future__ import annotations

import math

import pytest

from splitserve import LLM
from splitserve.common.errors import InvalidRequest
from splitserve.engine.beam_search import BeamSearchParams
from tests.reference import hf_beams

WIDTH, MAX_TOKENS = 4, 12


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048)


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
