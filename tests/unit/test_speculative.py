"""Speculative decoding by n-gram prompt lookup: the lookup, the acceptance rule, the config, and the scheduler's
plans with drafts (exact token counts and blocks)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from splitserve.cli import add_engine_arguments, engine_options
from splitserve.cli_serve import _engine_flags
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.logits_processors import BadWordBans
from splitserve.engine.request import Request
from splitserve.engine.sampling import Sampler
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.speculative import SpeculativeConfig, accepted_tokens, propose_ngram

# ---- the lookup -----------------------------------------------------------------------------------------------

def test_the_first_earlier_occurrence_of_the_suffix_gives_the_drafts():
    # suffix [1, 2] occurs at 0 (then 3, 4, 1) and at 4 (then 9, 8, 1): the first wins, as vLLM's
    assert propose_ngram([1, 2, 3, 4, 1, 2, 9, 8, 1, 2], 2, 2, 3) == [3, 4, 1]


def test_the_longest_suffix_is_looked_up_first():
    # [5, 1, 2] occurred once (then 9, 5); [1, 2] first occurred before 7
    tokens = [1, 2, 7, 5, 1, 2, 9, 5, 1, 2]
    assert propose_ngram(tokens, 2, 3, 2) == [9, 5]
    assert propose_ngram(tokens, 2, 2, 2) == [7, 5]


def test_drafts_stop_at_the_end_of_the_text():
    assert propose_ngram([4, 4, 4], 1, 1, 5) == [4, 4]
    assert propose_ngram([3, 6, 3], 1, 3, 5) == [6, 3]


def test_no_drafts_without_an_earlier_occurrence():
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []
    assert propose_ngram([1, 1], 2, 3, 4) == []  # shorter than min_n + 1
    assert propose_ngram([], 1, 1, 4) == []


def test_the_suffix_never_matches_itself():
    assert propose_ngram([8, 9], 1, 2, 3) == []


# ---- acceptance ----------------------------------------------------------------------------------------------

def test_tokens_are_accepted_up_to_and_with_the_first_that_differs():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all drafts and the bonus
    assert accepted_tokens([5, 6, 7], [5, 1, 7, 8]) == [5, 1]
    assert accepted_tokens([5, 6, 7], [2, 6, 7, 8]) == [2]
    assert accepted_tokens([], [3]) == [3]


# ---- the config ----------------------------------------------------------------------------------------------

def test_the_config_takes_vllms_json_and_fills_the_lookup_bounds_as_vllm():
    assert SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(
        "ngram", 4, 5, 5)
    assert SpeculativeConfig.of({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert SpeculativeConfig.of({"num_speculative_tokens": 2, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    config = SpeculativeConfig.of({"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    assert SpeculativeConfig.of(config.to_json()) == config
    assert json.loads(config.to_json())["num_speculative_tokens"] == 3
    assert SpeculativeConfig.of(None) is None


@pytest.mark.parametrize("value, words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "draft models are not supported"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer from 1 to 32, got 0"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min (4) must be at most prompt_lookup_max (2)"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_max": 1000}', "prompt_lookup_max must be an integer from 1 to 64"),
    ('{"num_speculative_tokens": 2, "model": "draft"}', "does not take 'model'"),
    ('{"num_speculative_tokens": 2,', "is not valid JSON"),
    ('[1, 2]', "must be a JSON object, got list"),
])
def test_a_bad_config_is_refused_with_a_sentence(value, words):
    with pytest.raises(ValueError) as raised:
        SpeculativeConfig.of(value)
    assert words in str(raised.value)


def _step_by_step(logits, make_request):
    """The tokens sampling ``logits``' rows one step at a time gives a fresh request (each appended to its output)."""
    request, tokens = make_request(), []
    for row in range(logits.shape[0]):
        [token] = Sampler()(logits[row : row + 1], [request]).sampled_token_ids
        request.append_output_token(token)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("params", [
    {"temperature": 0.0, "frequency_penalty": 2.0},
    {"temperature": 0.0, "repetition_penalty": 3.0},
    {"temperature": 0.2, "presence_penalty": 2.0, "seed": 4},
    {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": [3]},
    {"temperature": 0.0, "bad_words": ["x"]},
], ids=["frequency", "repetition", "presence-seeded", "min_tokens", "bad_words"])
def test_each_row_sees_the_drafts_before_it_as_output(params):
    """Penalties, min_tokens and bad words read the output: row i of a step is processed as if drafts 0..i-1 were
    output already (``RowAfterDrafts``), so a step whose drafts are the step-by-step tokens accepts every one, and
    one whose draft differs ends there with the step-by-step token. Every row prefers token 3, then token 9
    (penalised, token 3 gives way after its first time; under min_tokens 3 is a stop token until 3 tokens are out;
    the bad word is 3 twice)."""
    logits = torch.full((5, 12), -2.0)
    logits[:, 3], logits[:, 9], logits[:, 5] = 5.0, 4.0, 3.0

    def make_request():
        request = Request("r", [1], SamplingParams(max_tokens=8, **params))
        if "bad_words" in params:
            request.bad_word_bans = BadWordBans([(3, 3)])
        return request

    expected = _step_by_step(logits, make_request)
    assert len(set(expected)) > 1  # the processors changed the choice somewhere
    assert Sampler().verify_drafts(logits, make_request(), expected[:4]) == expected
    wrong = expected[:1] + [(expected[1] + 1) % 12] + expected[2:4]
    assert Sampler().verify_drafts(logits, make_request(), wrong) == expected[:2]


# ---- verification ----------------------------------------------------------------------------------------------

def _rows(*distributions):
    return torch.log(torch.tensor(distributions, dtype=torch.float32))  # [rows, vocab]; log 0 = -inf


def test_greedy_verification_takes_the_rows_argmax():
    logits = _rows([0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6])
    request = Request("g", [1], SamplingParams(max_tokens=8, temperature=0.0))
    assert Sampler().verify_drafts(logits, request, [1, 0]) == [1, 0, 2]
    assert Sampler().verify_drafts(logits, request, [1, 2]) == [1, 0]
    assert Sampler().verify_drafts(logits, request, [2, 0]) == [1]


def test_sampled_drafts_keep_every_tokens_distribution():
    """Drafts [1, 1] against rows p0, p1, p2: the first token is distributed as p0, the second (after an accepted
    draft) as p1, the third as p2, as sampling one step at a time would give them."""
    p0, p1, p2 = [0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]
    logits = _rows(p0, p1, p2)
    sampler = Sampler(seed=1)
    request = Request("s", [1], SamplingParams(max_tokens=8, temperature=1.0))
    runs = [sampler.verify_drafts(logits, request, [1, 1]) for _ in range(10_000)]

    def frequencies(tokens):
        return [tokens.count(token) / len(tokens) for token in range(4)]

    for got, expected in zip(frequencies([run[0] for run in runs]), p0):
        assert abs(got - expected) < 0.02
    after_one = [run[1] for run in runs if run[0] == 1]  # the first draft accepted: its only way to be 1
    for got, expected in zip(frequencies(after_one), p1):
        assert abs(got - expected) < 0.04
    after_two = [run[2] for run in runs if run[:2] == [1, 1]]
    for got, expected in zip(frequencies(after_two), p2):
        assert abs(got - expected) < 0.05
    assert all(len(run) == 1 for run in runs if run[0] != 1)  # a refusal ends the step


def test_sampled_verification_honours_the_filters_and_the_seed():
    logits = _rows([0.5, 0.3, 0.2], [0.4, 0.4, 0.2])
    top_k = Request("k", [1], SamplingParams(max_tokens=8, temperature=1.0, top_k=2))
    assert {Sampler(seed=2).verify_drafts(logits, top_k, [2])[0] for _ in range(200)} <= {0, 1}

    def tokens(seed):
        request = Request("seeded", [1], SamplingParams(max_tokens=8, temperature=1.0, seed=seed))
        sampler = Sampler(seed=len(str(seed)))  # the sampler's own stream is not used by a seeded request
        return [sampler.verify_drafts(logits, request, [0]) for _ in range(50)]

    assert tokens(7) == tokens(7) and tokens(7) != tokens(8)


def test_allowed_tokens_and_a_logit_bias_apply_to_every_row_and_each_token_gets_its_rows_logprobs():
    logits = _rows([0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6])
    biased = Request("b", [1], SamplingParams(max_tokens=8, temperature=0.0, logit_bias={2: 1.5}, logprobs=1))
    # Row 0's argmax becomes 2 with the bias (log 0.2 + 1.5 > log 0.7): draft 1 refused there.
    assert Sampler().verify_drafts(logits, biased, [1, 0]) == [2]
    allowed = Request("a", [1], SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[0, 2]))
    assert Sampler().verify_drafts(logits, allowed, [2, 0]) == [2, 0, 2]
    entries = Sampler.draft_logprobs(logits, biased, [2])
    assert entries[0].keys() == {1, 2} and abs(entries[0][2] - math.log(0.2)) < 1e-6  # raw logits, as a step
    assert Sampler.draft_logprobs(logits, allowed, [2, 0, 2]) == [None, None, None]  # none asked for


def test_a_seeded_request_draws_the_tokens_it_draws_without_drafts():
    """A seeded request takes one uniform number a token, drafted or not: whatever the drafts, a speculative step's
    tokens are the ones sampling the rows one at a time draws, and the stream after it goes on as step by step."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3)) * 2  # [rows, vocab]

    def seeded():
        return Request("s", [1], SamplingParams(max_tokens=8, temperature=1.0, top_k=30, seed=11))

    step_by_step, stepping = [], seeded()
    for row in range(5):
        [token] = Sampler()(logits[row : row + 1], [stepping]).sampled_token_ids
        step_by_step.append(token)
    assert len(set(step_by_step)) > 2  # really sampled
    assert Sampler().verify_drafts(logits, seeded(), step_by_step[:4]) == step_by_step  # every draft taken
    for wrong in range(4):  # draft `wrong` is not the token its row draws: the step ends with the row's own token
        drafts = step_by_step[:wrong] + [(step_by_step[wrong] + 1) % 50] + step_by_step[wrong + 1 : 4]
        request = seeded()
        assert Sampler().verify_drafts(logits, request, drafts) == step_by_step[: wrong + 1]
        later = [Sampler()(logits[row : row + 1], [request]).sampled_token_ids[0] for row in range(wrong + 1, 5)]
        assert later == step_by_step[wrong + 1 :]  # no number was drawn for the drafts not reached


# ---- the scheduler's plans -------------------------------------------------------------------------------------

def make_scheduler(num_blocks=16, block_size=4, budget=16, drafts=3, disable_at=None):
    config = SpeculativeConfig("ngram", drafts, 1, 2, disable_at)
    return Scheduler(KVCacheManager(num_blocks, block_size, enable_caching=False), 4, budget, proposer=config.propose,
                     disable_speculation_at=config.disable_by_batch_size)


def greedy(request_id, prompt, max_tokens=20, **params):
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   max_output_tokens=max_tokens)


def step(scheduler, targets):
    """Schedule; every request's rows give the tokens in ``targets[request_id]`` (as a model would), of which the
    accepted ones are appended; returns the plan."""
    output = scheduler.schedule()
    plan = [(item.request.request_id, item.num_new_tokens, list(item.spec_token_ids)) for item in output.scheduled]
    for item in output.scheduled:
        if item.sample:
            rows = targets[item.request.request_id][: len(item.spec_token_ids) + 1]
            accepted = accepted_tokens(item.spec_token_ids, rows)
            item.num_rejected = len(item.spec_token_ids) + 1 - len(accepted)
    scheduler.update_after_step(output)
    for item in output.scheduled:
        if item.sample:
            rows = targets[item.request.request_id][: len(item.spec_token_ids) + 1]
            for token in accepted_tokens(item.spec_token_ids, rows):
                item.request.append_output_token(token)
    return plan


def test_a_decode_verifies_its_drafts_and_counts_only_the_accepted_kv():
    scheduler = make_scheduler()
    request = greedy("a", [1, 2, 3, 4, 1])
    scheduler.add_request(request)
    assert step(scheduler, {"a": [2]}) == [("a", 5, [])]  # the prompt: no drafts
    # tokens [1 2 3 4 1 2]: suffix [1, 2] occurred before 3, 4, 1
    assert step(scheduler, {"a": [3, 4, 9, 7]}) == [("a", 4, [3, 4, 1])]
    # the row after 4 gave 9, not the draft 1: 3, 4, 9 appended; the KV of positions 5-7 (2, 3, 4) kept
    assert request.output_token_ids == [2, 3, 4, 9]
    assert request.num_computed_tokens == 8
    assert request.num_tokens == 9
    # no earlier 4, 9 or 9: one token
    assert step(scheduler, {"a": [6]}) == [("a", 1, [])]
    assert request.num_computed_tokens == 9


def test_drafts_fit_the_budget_and_the_output_limit():
    scheduler = make_scheduler(budget=6, drafts=8)
    a = greedy("a", [1, 2, 1], max_tokens=3)
    b = greedy("b", [5, 5, 5])
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert step(scheduler, {"a": [2], "b": [5]}) == [("a", 3, []), ("b", 3, [])]
    # a: 1 more output token allowed after this step's own, so 1 draft; b: the 2 tokens after the first [5, 5]
    assert step(scheduler, {"a": [1, 2], "b": [5, 5, 5]}) == [("a", 2, [1]), ("b", 3, [5, 5])]
    assert b.output_token_ids == [5, 5, 5, 5]
    assert a.num_output_tokens == 3  # its limit: the scheduler never drafts past it
    # a, at its limit (the engine would have finished it), takes its token alone; b's drafts get the rest of the budget (6 - 1 - b's own token)
    assert step(scheduler, {"a": [3], "b": [5] * 5}) == [("a", 1, []), ("b", 5, [5, 5, 5, 5])]


def test_drafts_are_dropped_before_anything_is_preempted_for_them():
    # 3 blocks of 4: a prompt of 7 and its first token fill 2; drafts would need a third
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    request = greedy("a", [1, 2, 1, 2, 1, 2, 1])
    other = greedy("b", [9, 9, 9])
    scheduler.add_request(request)
    scheduler.add_request(other)
    assert step(scheduler, {"a": [2], "b": [8]}) == [("a", 7, []), ("b", 3, [])]
    assert scheduler.kv_cache.free_block_count == 0
    assert step(scheduler, {"a": [1], "b": [7]}) == [("a", 1, []), ("b", 1, [])]
    assert not scheduler.num_preemptions


def test_requests_with_penalties_or_logprobs_speculate_too():
    scheduler = make_scheduler()
    penalised = greedy("p", [1, 2, 1], repetition_penalty=1.2)
    scored = greedy("l", [1, 2, 1], logprobs=1)
    sampled = Request("s", [1, 2, 1], SamplingParams(max_tokens=8, temperature=0.7, seed=1), max_output_tokens=8)
    for request in (penalised, scored, sampled):
        scheduler.add_request(request)
    step(scheduler, {"p": [2], "l": [2], "s": [2]})
    rows = [1, 2, 1]
    assert step(scheduler, {"p": rows, "l": rows, "s": rows}) == [("p", 3, [1, 2]), ("l", 3, [1, 2]), ("s", 3, [1, 2])]


# ---- the flag -------------------------------------------------------------------------------------------------

def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_flag_maps_onto_the_config_and_up_passes_it_to_its_workers():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    args = _parse("--speculative-config", text, "--dtype", "float32")
    config = EngineConfig(**engine_options(args)).speculative_config
    assert config == SpeculativeConfig("ngram", 3, 4, 4)
    workers = _engine_flags(args, "/models/m")
    assert SpeculativeConfig.of(workers[workers.index("--speculative-config") + 1]) == config
    assert "--speculative-config" not in _engine_flags(_parse("--dtype", "float32"), "/models/m")
    assert EngineConfig(**engine_options(_parse())).speculative_config is None


def test_a_bad_flag_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as stop:
        _parse("--speculative-config", '{"num_speculative_tokens": 4, "model": "x"}')
    error = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --speculative-config: speculative_config does not take 'model'" in error


def test_no_drafts_in_a_step_that_starts_with_disable_by_batch_size_requests_running():
    scheduler = make_scheduler(disable_at=2)
    a, b = greedy("a", [1, 2, 1]), greedy("b", [3, 4, 3])
    scheduler.add_request(a)
    assert step(scheduler, {"a": [2]}) == [("a", 3, [])]
    scheduler.add_request(b)  # joins in the step where a drafts (one running request when it starts)
    assert step(scheduler, {"a": [1, 2, 9], "b": [4]}) == [("a", 3, [1, 2]), ("b", 3, [])]
    # two running now: one token each, though both have drafts to offer
    assert step(scheduler, {"a": [7], "b": [3]}) == [("a", 1, []), ("b", 1, [])]
    assert SpeculativeConfig.of({"num_speculative_tokens": 2, "disable_by_batch_size": 4}).disable_by_batch_size == 4
    with pytest.raises(ValueError, match="disable_by_batch_size must be an integer from 1"):
        SpeculativeConfig.of({"num_speculative_tokens": 2, "disable_by_batch_size": 0})
