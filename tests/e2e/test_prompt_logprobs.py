"""End to end: prompt logprobs (vLLM's ``prompt_logprobs``) equal transformers' log-softmax over the prompt, whatever
the engine's chunking, preemption and prefix cache."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.kv_connector import KVTransferParams
from splitserve.engine.model_runner import _prompt_rows
from splitserve.engine.request import Request
from tests.e2e.test_llm_correctness import assert_all_blocks_free
from tests.reference import hf_prompt_logprobs

# float32 through different kernels (chunked, paged, C++ or torch) against transformers' one forward pass.
TOLERANCE = 2e-4
NUM_TOP = 3


def assert_matches_transformers(model_dir, token_ids: list[int], prompt_logprobs, num_top: int,
                                ranks: list | None = None) -> None:
    """One entry per prompt token, None first; each holds the prompt's token and the ``num_top`` most likely
    tokens (most likely first), with transformers' values; with ``ranks``, each prompt token's rank is
    transformers' (how many tokens are at least as likely, within the tolerance)."""
    reference = hf_prompt_logprobs(str(model_dir), tuple(token_ids))
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None
    if ranks is not None:
        assert len(ranks) == len(token_ids) and ranks[0] is None
    for position in range(1, len(token_ids)):
        entry, row = prompt_logprobs[position], reference[position - 1]
        token = token_ids[position]
        assert abs(entry[token] - row[token].item()) < TOLERANCE, (position, entry[token], row[token].item())
        if ranks is not None:
            value = row[token].item()
            most, least = (row >= value - TOLERANCE).sum().item(), (row >= value + TOLERANCE).sum().item()
            assert least <= ranks[position] <= most, (position, ranks[position], least, most)
        top_values = row.topk(num_top).values.tolist()
        ours = list(entry.values())[:num_top]
        assert ours == sorted(ours, reverse=True)
        assert ours == pytest.approx(top_values, abs=TOLERANCE)
        for token_id, value in entry.items():
            assert abs(value - row[token_id].item()) < TOLERANCE
        assert len(entry) in (num_top, num_top + 1)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=512, max_model_len=2048)


def test_prompt_logprobs_match_transformers_beside_requests_without_them(llm, model_dir, prompt_token_ids):
    prompts = prompt_token_ids[1:7]
    asking = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=NUM_TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    # A plain request for each prompt first: their blocks enter the prefix cache.
    first = llm.generate([{"prompt_token_ids": ids} for ids in prompts], plain, use_tqdm=False)
    assert all(output.prompt_logprobs is None for output in first)
    # Then both kinds side by side: the plain ones hit the cache, the asking ones compute every position.
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts for _ in (0, 1)],
                           [params for _ in prompts for params in (asking, plain)], use_tqdm=False)
    for ids, reference, (asked, other) in zip(prompts, first, zip(outputs[0::2], outputs[1::2])):
        assert asked.num_cached_tokens == 0
        assert_matches_transformers(model_dir, ids, asked.prompt_logprobs, NUM_TOP, asked.prompt_ranks)
        # The prompt's logprobs change nothing generated.
        assert asked.outputs[0].token_ids == other.outputs[0].token_ids == reference.outputs[0].token_ids
        assert other.prompt_logprobs is None
    assert outputs[-1].num_cached_tokens > 0
    assert_all_blocks_free(llm)


def test_zero_top_gives_the_prompt_tokens_alone_and_one_token_has_no_entry(llm, model_dir, prompt_token_ids):
    ids = prompt_token_ids[5]
    (output,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)
    assert [list(entry) for entry in output.prompt_logprobs[1:]] == [[token] for token in ids[1:]]
    assert_matches_transformers(model_dir, ids, output.prompt_logprobs, 0)
    (single,) = llm.generate({"prompt_token_ids": [ids[0]]}, SamplingParams(max_tokens=2, prompt_logprobs=5),
                             use_tqdm=False)
    assert single.prompt_logprobs == [None] and len(single.outputs[0].token_ids) == 2


def test_small_chunks_and_torch_attention(model_dir, prompt_token_ids):
    # 33-token steps over 16-token blocks: chunks end anywhere in a block, and decodes share their steps.
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048, max_num_batched_tokens=33, max_num_seqs=8, block_size=16,
              attention_backend="torch")
    prompts = prompt_token_ids[2:7]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert_matches_transformers(model_dir, ids, output.prompt_logprobs, 2)
    assert_all_blocks_free(llm)


def test_a_request_preempted_mid_prompt_records_each_position_once(model_dir, prompt_token_ids):
    # 30 blocks x 16 tokens: the 200-token request runs first and decodes (up to 19 blocks); the 343-token
    # one comes in 63-token chunks beside it and runs out of blocks part way through its prompt, is preempted
    # with some of its entries recorded, and is recomputed from its first token once the other has finished.
    llm = LLM(str(model_dir), num_kv_blocks=30, max_model_len=480, max_num_batched_tokens=64, block_size=16)
    prompts = [prompt_token_ids[6][:200], prompt_token_ids[6]]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, prompt_logprobs=1),
                           use_tqdm=False)
    assert outputs[1].metrics.num_preemptions > 0
    for ids, output in zip(prompts, outputs):
        assert output.outputs[0].finish_reason == "length"
        assert_matches_transformers(model_dir, ids, output.prompt_logprobs, 1, output.prompt_ranks)
    assert_all_blocks_free(llm)


def test_prompt_rows_skip_what_is_recorded_and_the_last_prompt_token(model_dir):
    params = SamplingParams(prompt_logprobs=0)
    request = Request("r", list(range(10, 20)), params)
    assert request.prompt_logprobs == [None] and request.wants_prompt_logprobs
    # A one-token chunk at position 3 (a decode row) scores token 4.
    request.prompt_logprobs.extend({} for _ in range(3))  # entries 1-3 recorded
    assert _prompt_rows(request, 5, 3, 1) == [(request, 5, 3)]
    # A recompute from position 0 scores only what is missing; the last prompt position scores no prompt token.
    assert _prompt_rows(request, 0, 0, 10) == [(request, row, row) for row in range(3, 9)]
    request.prompt_logprobs.extend({} for _ in range(6))
    assert not request.wants_prompt_logprobs and _prompt_rows(request, 0, 0, 12) == []
    assert _prompt_rows(Request("plain", [1, 2, 3], SamplingParams()), 0, 0, 3) == []


def test_refusals(llm):
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer in \\[0, 20\\]"):
            SamplingParams(prompt_logprobs=bad)
    SamplingParams(prompt_logprobs=20).check_prompt_length(24966)  # 524,286 entries: the most one response holds
    with pytest.raises(ValueError, match="asks for 524307 log probabilities; one response holds at most 524288"):
        SamplingParams(prompt_logprobs=20).check_prompt_length(24967)
    with pytest.raises(ValueError, match="prompt_logprobs needs the prompt computed here"):
        llm.engine.add_request("remote", None, SamplingParams(prompt_logprobs=1), prompt_token_ids=[1, 2, 3],
                               kv_transfer=KVTransferParams(load=True))
    assert_all_blocks_free(llm)
