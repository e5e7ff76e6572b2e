"""``SamplingParams(n=...)`` in ``LLM.generate``, vLLM's parallel sampling: a prompt's n completions, the prompt
computed once and its KV forked for the others, each completion exactly the one a request of its own gives (seed
+ i with a seed; transformers' greedy tokens at temperature 0), and nothing left in use."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.client import sampling_params_to_pb
from splitserve.common.errors import InvalidRequest
from tests.reference import hf_greedy


@pytest.fixture(scope="module", params=[16, 128], ids=["16-token blocks", "128-token blocks"])
def llm(model_dir, request):
    return LLM(str(model_dir), block_size=request.param, num_kv_blocks=8192 // request.param, max_model_len=2048)


def computed_tokens(llm: LLM, call):
    stats = llm.engine.stats
    before = stats.num_computed_tokens
    result = call()
    return result, stats.num_computed_tokens - before


def test_seeded_completions_are_their_own_requests_and_the_prompt_is_computed_once(llm, prompt_token_ids):
    ids = [llm.engine.num_kv_blocks % 1000 + 5] + prompt_token_ids[6][:300]  # 301 tokens no other test sent here
    params = SamplingParams(n=4, max_tokens=8, seed=11, temperature=0.8, logprobs=2)
    (output,), computed = computed_tokens(llm, lambda: llm.generate({"prompt_token_ids": ids}, params,
                                                                    use_tqdm=False))
    # The first completion computes the prompt; each other only the prompt's last token, for its own first draw.
    assert computed == len(ids) + 3 + 4 * 7
    assert [completion.index for completion in output.outputs] == [0, 1, 2, 3]
    assert output.prompt_token_ids == ids and output.finished
    singles = llm.generate([{"prompt_token_ids": ids}] * 4,
                           [SamplingParams(max_tokens=8, seed=11 + index, temperature=0.8, logprobs=2)
                            for index in range(4)], use_tqdm=False)
    for completion, single in zip(output.outputs, singles):
        assert completion.token_ids == single.outputs[0].token_ids and completion.text == single.outputs[0].text
        assert [sorted(step) for step in completion.logprobs] == [sorted(step) for step in single.outputs[0].logprobs]
    assert len({tuple(completion.token_ids) for completion in output.outputs}) > 1
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


@pytest.mark.parametrize("max_tokens", [1, 6])  # 1: the first completion ends before the others start
def test_greedy_completions_are_transformers_tokens(llm, model_dir, prompt_token_ids, max_tokens):
    prompts = [prompt_token_ids[5], prompt_token_ids[6][:33], prompt_token_ids[3]]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           [SamplingParams(n=3, max_tokens=max_tokens, temperature=0.0), SamplingParams(
                               n=2, max_tokens=max_tokens, temperature=0.0),
                            SamplingParams(max_tokens=max_tokens, temperature=0.0)], use_tqdm=False)
    assert [len(output.outputs) for output in outputs] == [3, 2, 1]
    for ids, output in zip(prompts, outputs):
        expected = hf_greedy(str(model_dir), ids, 6)[:max_tokens]
        assert [completion.token_ids for completion in output.outputs] == [expected] * len(output.outputs)
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks and not llm.engine.has_unfinished_requests()


def test_n_is_refused_where_one_request_is_one_completion(llm):
    with pytest.raises(InvalidRequest, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequest, match="one completion"):
        llm.engine.add_request("n2", "Hi", SamplingParams(n=2))
    assert sampling_params_to_pb(SamplingParams(n=2)).n == 2  # a stream of the router's takes n (the cluster's test)
    assert not llm.engine.has_unfinished_requests()


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_again(llm, prompt_token_ids):
    ids = [llm.engine.num_kv_blocks % 1000 + 7] + prompt_token_ids[6][:299]  # 300 tokens no other test sent here
    params = SamplingParams(max_tokens=1, temperature=0.0)
    run = lambda: llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)  # noqa: E731
    _, first = computed_tokens(llm, run)
    _, again = computed_tokens(llm, run)
    assert llm.reset_prefix_cache() is True
    _, after_reset = computed_tokens(llm, run)
    size = llm.engine.config.block_size
    assert first == after_reset == 300 and again == 300 - 299 // size * size


def test_completions_that_outgrow_a_small_cache_are_preempted_and_stay_transformers(model_dir, prompt_token_ids):
    # 30 blocks of 16 tokens: four completions of a 300-token prompt share its 18 full blocks, and cannot all grow
    # 40 tokens: one is preempted and recomputed.
    small = LLM(str(model_dir), block_size=16, num_kv_blocks=30, max_model_len=480)
    ids = prompt_token_ids[6][:300]
    (output,) = small.generate({"prompt_token_ids": ids}, SamplingParams(n=4, max_tokens=40, temperature=0.0),
                               use_tqdm=False)
    assert [completion.token_ids for completion in output.outputs] == [hf_greedy(str(model_dir), ids, 40)] * 4
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.free_block_count == small.engine.num_kv_blocks and not small.engine.scheduler.held
