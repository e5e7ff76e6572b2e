"""Speculative decoding by n-gram prompt lookup (``speculative_config``, ``--speculative-config``), end to end:
greedy output is transformers' whatever the drafts, in fewer steps where the output repeats its context; requests
that ask for logprobs or penalties keep their tokens beside speculating ones, and those that sample speculate
with their seed's tokens whatever the batch; stops and limits land where they would
without drafts; preemption and the torch attention reference hold; and a cluster whose workers speculate streams
transformers' tokens and counts the drafts in its metrics."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.client import Client
from tests.cluster_helpers import all_blocks_free, start_cluster, wait_until
from tests.e2e.test_metrics import metrics_url, scrape, value
from tests.reference import MAX_TOKENS, hf_greedy

pytestmark = pytest.mark.timeout(600)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COPY = [{"role": "user", "content": "Copy this text exactly:\nThe quick brown fox jumps over the lazy dog. The lazy "
         "dog sleeps under the old oak tree. The old oak tree stands on the green hill."}]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=512, max_model_len=2048, speculative_config=SPEC)


@pytest.fixture(scope="module")
def plain(model_dir):
    """The same engine without speculation."""
    return LLM(str(model_dir), num_kv_blocks=512, max_model_len=2048)


@pytest.fixture(scope="module")
def copy_ids(tokenizer):
    return tokenizer.encode(tokenizer.apply_chat_template(COPY, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def token_ids_of(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()


def test_batched_greedy_is_transformers_with_drafts_accepted_and_rejected(llm, prompt_token_ids, hf_reference):
    before = dataclasses.replace(llm.engine.stats)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], GREEDY, use_tqdm=False)
    assert token_ids_of(outputs) == hf_reference
    drafts = llm.engine.stats.num_draft_tokens - before.num_draft_tokens
    accepted = llm.engine.stats.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < drafts, (accepted, drafts)  # both the accepted and the rejected path ran
    assert_all_blocks_free(llm)


def test_copying_takes_fewer_steps_with_transformers_tokens(llm, model_dir, copy_ids, tokenizer):
    steps = llm.engine.stats.num_steps
    (output,) = llm.generate({"prompt_token_ids": copy_ids}, SamplingParams(max_tokens=48, temperature=0.0),
                             use_tqdm=False)
    tokens = output.outputs[0].token_ids
    assert tokens == hf_greedy(str(model_dir), copy_ids, 48)
    assert output.outputs[0].text.startswith("The quick brown fox jumps over the lazy dog.")
    # Measured: its 32 tokens in 8 steps, the prompt's included; one token a step would take 32.
    assert llm.engine.stats.num_steps - steps <= len(tokens) // 2
    assert output.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert_all_blocks_free(llm)


def test_a_step_streams_every_token_it_accepted(llm, copy_ids):
    engine = llm.engine
    engine.add_request("stream", None, SamplingParams(max_tokens=40, temperature=0.0), prompt_token_ids=copy_ids)
    deltas, texts, final = [], [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta_token_ids)
            texts.append(output.outputs[0].delta_text)
            final = output
    assert [token for delta in deltas for token in delta] == final.outputs[0].token_ids
    assert "".join(texts) == final.outputs[0].text
    assert max(len(delta) for delta in deltas) > 1
    assert_all_blocks_free(llm)


def test_stops_and_limits_land_where_they_would_without_drafts(llm, plain, copy_ids, tokenizer):
    (reference,) = plain.generate({"prompt_token_ids": copy_ids}, SamplingParams(max_tokens=48, temperature=0.0),
                                  use_tqdm=False)
    tokens = reference.outputs[0].token_ids
    assert "sleeps" in reference.outputs[0].text
    cases = [
        SamplingParams(max_tokens=7, temperature=0.0),  # inside a run of accepted drafts
        SamplingParams(max_tokens=48, temperature=0.0, stop=["sleeps"]),
        SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[tokens[13]]),
        SamplingParams(max_tokens=48, temperature=0.0, stop=["old oak"], min_tokens=3),
    ]
    prompt = {"prompt_token_ids": copy_ids}
    for params in cases:
        (expected,) = plain.generate(prompt, params, use_tqdm=False)
        (got,) = llm.generate(prompt, params, use_tqdm=False)
        assert (got.outputs[0].token_ids, got.outputs[0].text, got.outputs[0].finish_reason,
                got.outputs[0].stop_reason) == (expected.outputs[0].token_ids, expected.outputs[0].text,
                                                expected.outputs[0].finish_reason, expected.outputs[0].stop_reason)
        assert len(got.outputs[0].token_ids) < len(tokens), params  # each ended early
    assert_all_blocks_free(llm)


def test_requests_that_score_or_are_penalised_keep_their_tokens_beside_speculating_ones(llm, plain, copy_ids):
    """Requests with logprobs and penalties speculate in one batch beside a plain one: each gives the tokens (and
    logprobs) of an engine that does not speculate."""
    prompts = [{"prompt_token_ids": copy_ids}] * 3
    params = [SamplingParams(max_tokens=32, temperature=0.0),
              SamplingParams(max_tokens=32, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=32, temperature=0.7, seed=11, repetition_penalty=1.3)]
    before = llm.engine.stats.num_draft_tokens
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats.num_draft_tokens > before  # the first one speculated
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert token_ids_of(got) == token_ids_of(expected)
    for mine, theirs in zip(got[1].outputs[0].logprobs, expected[1].outputs[0].logprobs):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[token] - theirs[token]) < 1e-4 for token in mine)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("case", ["logprobs", "bias-allowed", "penalties-min_tokens", "bad_words"])
def test_requests_whatever_their_parameters_speculate_with_the_plain_engines_tokens(case, llm, plain, copy_ids):
    """Every row of a speculative step goes through what its own step would apply: logprobs, a logit bias and
    allowed_token_ids alike on every row, penalties, min_tokens and bad words as if the drafts before the row were
    output. Such requests speculate, each accepted token with its own row's logprobs, and give the tokens (and
    logprobs) of an engine that does not speculate, greedy or seeded. (The bad word " lazy dog" is drafted whole
    within a step: only the row after " lazy" banning " dog" keeps the tokens; tests/unit/test_speculative.py
    checks each processor's rows one by one.)"""
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 3}
    params = {
        "logprobs": SamplingParams(max_tokens=40, temperature=0.0, logprobs=3),
        "bias-allowed": SamplingParams(max_tokens=40, **sampled, logprobs=1, logit_bias={copy_ids[-12]: 2.0},
                                       allowed_token_ids=sorted(set(copy_ids))),  # copying stays possible
        "penalties-min_tokens": SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.1,
                                               presence_penalty=0.1, min_tokens=20),
        "bad_words": SamplingParams(max_tokens=40, temperature=0.0, bad_words=[" lazy dog"], repetition_penalty=1.05),
    }[case]
    before = dataclasses.replace(llm.engine.stats)
    (got,) = llm.generate({"prompt_token_ids": copy_ids}, params, use_tqdm=False)
    assert llm.engine.stats.num_accepted_tokens > before.num_accepted_tokens, case  # it speculated
    assert llm.engine.stats.num_steps - before.num_steps < len(got.outputs[0].token_ids)
    (expected,) = plain.generate({"prompt_token_ids": copy_ids}, params, use_tqdm=False)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids, case
    if params.logprobs is not None:
        assert len(got.outputs[0].logprobs) == len(got.outputs[0].token_ids)
        for mine, theirs in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[token] - theirs[token]) < 1e-4 for token in mine)
    if params.allowed_token_ids is not None:
        assert set(got.outputs[0].token_ids) <= set(copy_ids)
    if params.bad_words:  # the copy's " lazy dog" became " lazy dogs" (another token)
        assert "lazy dog." not in got.outputs[0].text and "lazy dogs." in got.outputs[0].text
    assert_all_blocks_free(llm)


def test_sampling_requests_speculate_and_their_seed_holds_whatever_the_batch(llm, copy_ids, prompt_token_ids):
    """A seeded request that samples verifies drafts by speculative sampling (``Sampler.verify_drafts``, whose
    distributions tests/unit/test_speculative.py checks); its tokens depend on its seed alone, not on the batch."""
    seeded = SamplingParams(max_tokens=40, temperature=0.3, seed=1234)
    before = dataclasses.replace(llm.engine.stats)
    (alone,) = llm.generate({"prompt_token_ids": copy_ids}, seeded, use_tqdm=False)
    assert llm.engine.stats.num_accepted_tokens > before.num_accepted_tokens
    assert llm.engine.stats.num_steps - before.num_steps < len(alone.outputs[0].token_ids)
    batch = llm.generate([{"prompt_token_ids": ids} for ids in (prompt_token_ids[3], copy_ids, prompt_token_ids[6])],
                         [SamplingParams(max_tokens=40, temperature=0.9, seed=5), seeded, GREEDY], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_a_seeded_request_samples_the_tokens_it_samples_without_speculation(llm, plain, copy_ids):
    """A sampling request draws one number a token it gets, drafted or not (``Sampler.verify_drafts``): a seeded
    request's tokens are the ones it samples on an engine that does not speculate, and a continuation after tokens
    generated while speculating (``num_resumed_tokens``, as the router migrates a stream) samples the rest of them.
    (top_k 20: over the whole vocabulary the logits' rounding in a step of several rows, against one row a step,
    may move a token to its neighbour in the vocabulary now and then.)"""
    before = dataclasses.replace(llm.engine.stats)
    for seed in (1234, 99, 5):
        params = SamplingParams(max_tokens=48, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
        (speculating,) = llm.generate({"prompt_token_ids": copy_ids}, params, use_tqdm=False)
        (alone,) = plain.generate({"prompt_token_ids": copy_ids}, params, use_tqdm=False)
        tokens = speculating.outputs[0].token_ids
        assert tokens == alone.outputs[0].token_ids, seed
        resumed = dataclasses.replace(params, max_tokens=48 - 20, num_resumed_tokens=20)
        (rest,) = llm.generate({"prompt_token_ids": copy_ids + tokens[:20]}, resumed, use_tqdm=False)
        assert rest.outputs[0].token_ids == tokens[20:], seed
    accepted = llm.engine.stats.num_accepted_tokens - before.num_accepted_tokens
    drafts = llm.engine.stats.num_draft_tokens - before.num_draft_tokens
    assert 0 < accepted < drafts, (accepted, drafts)  # drafts taken and drafts refused
    assert_all_blocks_free(llm)


def test_disable_by_batch_size_drafts_only_for_smaller_batches(model_dir, copy_ids):
    llm = LLM(str(model_dir), num_kv_blocks=128, max_model_len=2048,
              speculative_config={**SPEC, "disable_by_batch_size": 2})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": copy_ids}] * 2, params, use_tqdm=False)
    assert llm.engine.stats.num_draft_tokens == 0  # two running from the first step to the last
    (alone,) = llm.generate({"prompt_token_ids": copy_ids}, params, use_tqdm=False)
    assert llm.engine.stats.num_accepted_tokens > 0
    assert together[0].outputs[0].token_ids == together[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_preemption_with_drafts_through_the_torch_reference(model_dir, prompt_token_ids, hf_reference):
    # 100 blocks of 16 tokens: the 1,111-token prompt alone takes 71, so requests are preempted, drafts held.
    llm = LLM(str(model_dir), num_kv_blocks=100, max_model_len=1500, max_num_batched_tokens=256,
              enable_prefix_caching=False, attention_backend="torch", speculative_config=SPEC)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], GREEDY, use_tqdm=False)
    assert token_ids_of(outputs) == hf_reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats.num_accepted_tokens > 0
    assert_all_blocks_free(llm)


def test_a_speculating_cluster_streams_transformers_tokens_and_counts_its_drafts(tmp_path, model_dir, copy_ids,
                                                                                 prompt_token_ids, hf_reference,
                                                                                 plain):
    cluster = start_cluster("p2p", tmp_path, worker_args=["--speculative-config", json.dumps(SPEC),
                                                          "--metrics-port", "0"])
    try:
        decode = next(worker for worker in cluster.workers if worker.name.startswith("decode"))
        url = metrics_url(decode)
        with Client(cluster.router.address) as client:
            chunks = list(client.generate_stream(copy_ids, SamplingParams(max_tokens=48, temperature=0.0),
                                                 timeout=120))
            assert [token for chunk in chunks for token in chunk.token_ids] == hf_greedy(str(model_dir), copy_ids, 48)
            for ids, reference in list(zip(prompt_token_ids, hf_reference))[1:6]:
                assert list(client.generate(ids, GREEDY, timeout=120).token_ids) == reference
            # With logprobs too: a message of several accepted tokens carries each one's, the plain engine's.
            scored = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
            chunks = list(client.generate_stream(copy_ids, scored, timeout=120))
            assert any(len(chunk.token_ids) > 1 for chunk in chunks)  # drafts accepted
            (expected,) = plain.generate({"prompt_token_ids": copy_ids}, scored, use_tqdm=False)
            positions = [position for chunk in chunks for position in chunk.logprobs]
            assert [p.sampled.token_id for p in positions] == expected.outputs[0].token_ids
            for position, theirs in zip(positions, expected.outputs[0].logprobs):
                assert abs(position.sampled.logprob - theirs[position.sampled.token_id]) < 1e-3
                assert [top.token_id for top in position.top] == list(theirs)[:2]
            samples = scrape(url)
            accepted = value(samples, "splitserve_worker_spec_decode_accepted_tokens_total", role="decode")
            drafts = value(samples, "splitserve_worker_spec_decode_draft_tokens_total", role="decode")
            assert 0 < accepted <= drafts
            wait_until(lambda: all_blocks_free(client), 30, message="every block free on both workers")
    finally:
        cluster.stop()


# ---- structured outputs ---------------------------------------------------------------------------

COPY_JSON = [{"role": "user", "content": 'Answer in JSON with the field "text" holding this text, copied exactly: '
              "The quick brown fox jumps over the lazy dog. The lazy dog sleeps under the old oak tree. The old "
              "oak tree stands on the green hill."}]
TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}}, "required": ["text"],
               "additionalProperties": False}


def test_a_grammar_speculates_with_each_row_masked_as_its_own_step_would_be(llm, plain, model_dir, tokenizer):
    """Under a JSON schema a request drafts what its grammar takes, and row i of the step is masked after drafts
    0..i-1: greedy tokens are transformers' under the same grammar and the engine's without drafts, in fewer
    steps (drafts accepted), beside a plain request in the same batch. With a short maxLength the drafts (the
    text's next words) stop where the string must close, and only the mask of the row after them makes the model
    close it there."""
    from splitserve.common.structured_outputs import StructuredOutputsParams
    from tests.reference import hf_greedy_constrained

    ids = tokenizer.encode(tokenizer.apply_chat_template(COPY_JSON, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    eos = sorted(llm.engine.eos_token_ids)
    for max_length in (200, 30):
        constraint = StructuredOutputsParams(json={**TEXT_SCHEMA, "properties": {"text": {
            "type": "string", "maxLength": max_length}}})
        params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=constraint)
        before = dataclasses.replace(llm.engine.stats)
        outputs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids}], [params, GREEDY],
                               use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == hf_greedy_constrained(str(model_dir), ids, 80,
                                                                        constraint.to_grammar(), eos), max_length
        assert outputs[0].outputs[0].token_ids == plain.generate([{"prompt_token_ids": ids}], params,
                                                                 use_tqdm=False)[0].outputs[0].token_ids
        assert outputs[1].outputs[0].token_ids == plain.generate([{"prompt_token_ids": ids}], GREEDY,
                                                                 use_tqdm=False)[0].outputs[0].token_ids
        assert outputs[0].outputs[0].finish_reason == "stop"
        assert len(json.loads(outputs[0].outputs[0].text)["text"]) <= max_length
        assert llm.engine.stats.num_accepted_tokens - before.num_accepted_tokens > 5  # the copied text was drafted
    assert_all_blocks_free(llm)


def test_draft_masks_are_the_masks_of_one_step_at_a_time_and_leave_the_grammar_as_it_was(llm, tokenizer):
    from splitserve.common.structured_outputs import StructuredOutputsParams
    from splitserve.engine.structured_output import fill_token_bitmask

    constraint = StructuredOutputsParams(json=TEXT_SCHEMA)
    grammar = llm.engine.structured_outputs.matcher(constraint, [1, 2, 3])
    stepped = llm.engine.structured_outputs.matcher(constraint, [1, 2, 3])
    num_words = -(-llm.engine.model_config.vocab_size // 32)
    answer = tokenizer.encode('{"text": "The quick brown fox"}', add_special_tokens=False)
    masks = grammar.draft_bitmask(answer[:5], num_words)
    assert masks.shape == (6, num_words)
    for row in range(6):
        assert torch.equal(masks[row], fill_token_bitmask([stepped], num_words)[0]), row
        if row < 5:
            assert stepped.accept(answer[row])
    assert torch.equal(grammar.draft_bitmask([], num_words)[0], masks[0])  # rolled back: the first state again
    assert grammar.draftable(answer) == answer
    refused = tokenizer.encode("[", add_special_tokens=False)
    assert grammar.draftable([*answer[:3], *refused, *answer[3:]]) == answer[:3]  # cut at the first it refuses
    assert grammar.draftable([]) == []


def test_a_seeded_sampling_request_under_a_grammar_speculates_with_its_seeds_tokens_whatever_the_batch(
        llm, tokenizer, prompt_token_ids):
    from splitserve.common.structured_outputs import StructuredOutputsParams

    ids = tokenizer.encode(tokenizer.apply_chat_template(COPY_JSON, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    params = SamplingParams(max_tokens=80, temperature=0.7, seed=11,
                            structured_outputs=StructuredOutputsParams(json=TEXT_SCHEMA))
    alone = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    batch = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": prompt_token_ids[2]}], [params, GREEDY],
                         use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == batch.token_ids
    if alone.finish_reason == "stop":
        assert json.loads(alone.text).keys() == {"text"}
    assert_all_blocks_free(llm)
