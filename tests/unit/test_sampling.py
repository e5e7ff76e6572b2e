"""Unit tests for the batched sampler and its logits transforms (CPU, milliseconds)."""

from __future__ import annotations

import math
import random
import re

import numpy
import pytest
import torch

from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.logits_processors import (
    BadWordBans,
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    bad_words_token_ids,
)
from splitserve.engine.logprobs import compute_logprobs
from splitserve.engine.request import Request
from splitserve.engine.sampling import Sampler, SamplerOutput, greedy_token_ids, seeded_generator
from splitserve.engine.top_k_top_p import (
    apply_temperature,
    apply_top_k_top_p_min_p,
    sample_from_probs,
    top_k_mask,
    top_p_mask,
)

EOS = 2
NEG_INF = float("-inf")


def make_request(request_id: str = "r", prompt=(5, 6, 7), output=(), **params) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_ids=frozenset({EOS}),
    )
    for token_id in output:
        request.append_output_token(token_id)
    return request


def random_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))


# Eight tokens with known probabilities, deliberately not in sorted order.
PROBABILITIES = {3: 0.30, 0: 0.25, 6: 0.20, 1: 0.10, 7: 0.08, 4: 0.04, 2: 0.02, 5: 0.01}


def known_logits(num_rows: int) -> torch.Tensor:
    """[num_rows, 8] log-probabilities of PROBABILITIES."""
    row = torch.tensor([math.log(PROBABILITIES[token_id]) for token_id in range(8)])
    return row.repeat(num_rows, 1)


# --- greedy -----------------------------------------------------------------


def test_greedy_fast_path_is_argmax_and_leaves_requests_alone():
    logits = random_logits(4, 50, seed=0).to(torch.bfloat16)
    requests = [make_request(str(row), temperature=0.0) for row in range(4)]
    output = Sampler()(logits, requests)
    assert isinstance(output, SamplerOutput)
    assert output.sampled_token_ids == logits.float().argmax(-1).tolist()
    assert all(isinstance(token_id, int) for token_id in output.sampled_token_ids)
    assert output.logprobs == [None, None, None, None]
    assert all(request.generator is None for request in requests)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_token_ids_are_argmax_ties_and_nans_included(dtype):
    """The first of tied maxima, a NaN as the largest, and whole vocabularies of every batch size the engine sees."""
    nan, inf = float("nan"), float("inf")
    edge = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [2.0, inf, inf, 0.0], [NEG_INF] * 3 + [-1.0],
                         [0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    assert greedy_token_ids(edge).tolist() == edge.argmax(-1).tolist() == [1, 0, 1, 3, 0]
    for rows in (1, 7, 64, 193):
        logits = random_logits(rows, 49152, seed=rows).to(dtype)  # bfloat16 rounding makes ties
        assert torch.equal(greedy_token_ids(logits), logits.argmax(-1))


def test_greedy_rows_go_through_the_cpu_kernels_where_given():
    """With the C++ kernels, float32 greedy rows take their argmax_rows (the same ids as torch.argmax, NaNs, ties and a
    mixed batch's greedy rows included); bfloat16 rows stay with torch, and so does a sampler given no kernels."""
    from splitserve.common.model_info import cache_dir
    from splitserve.kernels import cpu_ops

    assert cpu_ops.available(str(cache_dir())), "the C++ kernels must build on this machine"
    calls = []

    class Counted:
        def argmax_rows(self, logits):
            calls.append(tuple(logits.shape))
            return cpu_ops.argmax_rows(logits)

    nan = float("nan")
    edge = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [NEG_INF] * 3 + [-1.0]])
    assert greedy_token_ids(edge, Counted()).tolist() == [1, 0, 3] and calls == [(3, 4)]
    logits = random_logits(64, 49152, seed=5)
    assert torch.equal(greedy_token_ids(logits, Counted()), logits.argmax(-1))
    assert torch.equal(greedy_token_ids(logits.to(torch.bfloat16), Counted()), logits.to(torch.bfloat16).argmax(-1))
    assert calls == [(3, 4), (64, 49152)]  # bfloat16 went through torch

    def mixed_batch():
        return [make_request("a", temperature=0.0), make_request("b", temperature=1.0, seed=3),
                make_request("c", output=(7,), temperature=0.0, repetition_penalty=1.2)]

    small = random_logits(3, 100, seed=9)
    with_kernels = Sampler(seed=1, kernels=Counted())(small, mixed_batch())
    without = Sampler(seed=1)(small, mixed_batch())
    assert with_kernels.sampled_token_ids == without.sampled_token_ids
    assert calls[-1] == (2, 100)  # the two greedy rows of the mixed batch


def test_greedy_takes_argmax_of_penalized_logits():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    request = make_request(temperature=0.0, output=[1], presence_penalty=0.5)
    assert Sampler()(logits, [request]).sampled_token_ids == [2]


def test_top_k_one_equals_greedy_for_random_rows():
    logits = random_logits(6, 300, seed=1)
    requests = [
        make_request(str(row), temperature=1.3, top_k=1, seed=row if row % 2 else None)
        for row in range(6)
    ]
    assert Sampler(seed=3)(logits, requests).sampled_token_ids == logits.argmax(-1).tolist()


def test_top_k_one_filter_keeps_only_the_argmax_even_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    filtered = apply_top_k_top_p_min_p(
        logits, torch.tensor([1, 1]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    )
    assert torch.isfinite(filtered).nonzero().tolist() == [[0, 1], [1, 0]]
    assert filtered[0, 1].item() == 3.0


# --- seeds ------------------------------------------------------------------


def run_seeded_steps(seed_row: int, batch_size: int, sampler_seed: int, num_steps: int = 6) -> list[int]:
    """Sample num_steps tokens for a request with seed 1234 placed at seed_row of a
    batch whose other rows are unseeded, greedy or seeded differently."""
    target = make_request("target", seed=1234, temperature=0.9)
    others = [
        make_request(f"other{row}", temperature=[1.0, 0.0, 0.7][row % 3], seed=[None, None, 77][row % 3])
        for row in range(batch_size - 1)
    ]
    sampler = Sampler(seed=sampler_seed)
    tokens = []
    for step in range(num_steps):
        target_logits = random_logits(1, 64, seed=100 + step)  # the same at every step index
        batch = others[:seed_row] + [target] + others[seed_row:]
        logits = random_logits(batch_size, 64, seed=1000 * batch_size + step)
        logits[seed_row] = target_logits[0]
        sampled = sampler(logits, batch).sampled_token_ids
        for request, token_id in zip(batch, sampled):
            request.append_output_token(token_id)
        tokens.append(sampled[seed_row])
    return tokens


def test_seeded_request_same_tokens_alone_and_in_batch():
    alone = run_seeded_steps(seed_row=0, batch_size=1, sampler_seed=0)
    in_batch = run_seeded_steps(seed_row=2, batch_size=5, sampler_seed=42)
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_seeded_generator_created_once_and_kept():
    request = make_request(seed=9)
    sampler = Sampler()
    sampler(random_logits(1, 32, seed=0), [request])
    generator = request.generator
    assert isinstance(generator, numpy.random.Generator)
    sampler(random_logits(1, 32, seed=1), [request])
    assert request.generator is generator


def test_a_seeded_continuation_draws_past_the_tokens_it_resumes():
    """A continuation of a seeded request (its prompt ending with the 4 tokens sampled before, num_resumed_tokens 4,
    as the router migrates one) samples the undisturbed request's later tokens from the same logits: its stream
    starts past those 4 draws."""
    logits = [random_logits(1, 64, seed=200 + step) for step in range(10)]
    undisturbed = make_request(seed=31, temperature=1.0)
    sampler = Sampler()
    tokens = []
    for step_logits in logits:
        [token_id] = sampler(step_logits, [undisturbed]).sampled_token_ids
        undisturbed.append_output_token(token_id)
        tokens.append(token_id)
    assert len(set(tokens)) > 2  # really sampled
    continuation = make_request(prompt=(5, 6, 7, *tokens[:4]), seed=31, temperature=1.0, num_resumed_tokens=4)
    resumed = [sampler(step_logits, [continuation]).sampled_token_ids[0] for step_logits in logits[4:]]
    assert resumed == tokens[4:]
    fresh = make_request(prompt=(5, 6, 7, *tokens[:4]), seed=31, temperature=1.0)  # without: the stream's start
    assert [sampler(step_logits, [fresh]).sampled_token_ids[0] for step_logits in logits[4:]] != tokens[4:]


@pytest.mark.parametrize("seed, same_low_32_bits", [(-1, 2**63 - 1), (1, 2**32 + 1), (0, -(2**63))])
def test_seeds_differing_above_bit_32_draw_different_numbers(seed, same_low_32_bits):
    def draws(seed: int) -> list[float]:
        generator = seeded_generator(seed)
        return [float(generator.random(dtype=numpy.float32)) for _ in range(4)]

    assert draws(seed) == draws(seed)
    assert draws(seed) != draws(same_low_32_bits)


def test_a_seed_outside_int64_is_refused():
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"^seed must be a 64-bit integer in \[-2\*\*63, 2\*\*63 - 1\], got "):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_float_that_is_not_finite_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {value!r}\.$"):
        SamplingParams(**{field: value})


def test_large_finite_values_and_integers_pass_where_in_range():
    assert SamplingParams(temperature=3.4e38, repetition_penalty=10**30, top_p=1, min_p=0).temperature == 3.4e38
    with pytest.raises(ValueError, match=r"^presence_penalty must be in \[-2, 2\], got 1000"):
        SamplingParams(presence_penalty=10**400)


def test_different_seeds_give_different_tokens():
    logits_per_step = [random_logits(1, 64, seed=step) for step in range(8)]

    def tokens_for(seed: int) -> list[int]:
        request, sampler = make_request(seed=seed), Sampler()
        return [sampler(logits, [request]).sampled_token_ids[0] for logits in logits_per_step]

    assert tokens_for(1) == tokens_for(1)
    assert tokens_for(1) != tokens_for(2)
    # Seeds equal in their low 32 bits (torch's CPU generator kept only those).
    assert tokens_for(-1) != tokens_for(2**63 - 1)
    assert tokens_for(1) != tokens_for(2**32 + 1)


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(8, 64, seed=5)
    requests = [make_request(str(row)) for row in range(8)]
    first = Sampler(seed=11)(logits, requests).sampled_token_ids
    assert Sampler(seed=11)(logits, requests).sampled_token_ids == first
    assert Sampler(seed=12)(logits, requests).sampled_token_ids != first


# --- penalties and min_tokens -----------------------------------------------


def test_penalties_change_exactly_the_defined_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    original = logits.clone()
    penalized_request = make_request(
        prompt=[0, 1], output=[3, 3, 4],
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
    )
    plain_request = make_request(prompt=[0, 1], output=[3, 3, 4])
    result = apply_penalties(logits, [penalized_request, plain_request])
    # 0, 1: prompt only (repetition only); 3: twice in output; 4: once; 2, 5: absent.
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0]
    assert result[0].tolist() == expected
    assert torch.equal(result[1], original[1])
    assert torch.equal(logits, original)


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    request = make_request(prompt=[0, 1], output=[1, 1, 1], presence_penalty=-1.0, frequency_penalty=1.5)
    assert apply_penalties(logits, [request])[0].tolist() == [0.0, 1.0 - 4.5, 0.0, 0.0]


def test_a_continuations_resumed_prompt_tokens_count_as_generated_for_penalties_and_bad_words():
    """num_resumed_tokens (a migrated stream's continuation): the prompt's last tokens were generated before, so
    presence and frequency penalties count them and a bad word may start in them; earlier prompt tokens stay
    prompt tokens."""
    logits = torch.zeros(1, 6)
    resumed = make_request(prompt=[0, 1, 2, 2], output=[2, 3], presence_penalty=-1.0, frequency_penalty=1.5,
                           num_resumed_tokens=2)
    assert resumed.generated_token_ids == [2, 2, 2, 3] and resumed.output_token_ids == [2, 3]
    assert apply_penalties(logits, [resumed])[0].tolist() == [0.0, 0.0, 1.0 - 4.5, 1.0 - 1.5, 0.0, 0.0]
    fresh = make_request(prompt=[0, 1, 2, 2], output=[2, 3], presence_penalty=-1.0, frequency_penalty=1.5)
    assert apply_penalties(logits, [fresh])[0].tolist() == [0.0, 0.0, 1.0 - 1.5, 1.0 - 1.5, 0.0, 0.0]
    requests = [_with_bad_words(make_request(prompt=[0, 4, 5], num_resumed_tokens=2), (4, 5, 1)),
                _with_bad_words(make_request(prompt=[0, 4, 5], num_resumed_tokens=1), (4, 5, 1))]
    result = apply_bad_words(torch.zeros(2, 6), requests)
    assert result[0, 1] == NEG_INF and result[1].tolist() == [0.0] * 6  # the word's start: resumed, or the prompt's
    with pytest.raises(InvalidRequest, match=r"num_resumed_tokens \(4\) exceeds the prompt's 3 tokens"):
        SamplingParams(num_resumed_tokens=4).check_prompt_length(3)
    with pytest.raises(InvalidRequest, match="num_resumed_tokens must be an integer >= 0"):
        SamplingParams(num_resumed_tokens=-1)


def test_penalties_ignore_out_of_range_token_ids():
    logits = torch.ones(1, 4)
    request = make_request(prompt=[9, -1], output=[7], repetition_penalty=2.0, presence_penalty=1.0)
    assert apply_penalties(logits, [request]).tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 8)
    requests = [
        make_request("short", output=[4], min_tokens=2, stop_token_ids=[5]),
        make_request("long-enough", output=[4, 4], min_tokens=2, stop_token_ids=[5]),
        make_request("ignore-eos", output=[], min_tokens=1, stop_token_ids=[6], ignore_eos=True),
        make_request("no-minimum", output=[], stop_token_ids=[5]),
    ]
    result = apply_min_tokens(logits, requests)
    assert (result == NEG_INF).nonzero().tolist() == [[0, EOS], [0, 5], [2, 6]]
    assert torch.equal(logits, torch.zeros(4, 8))


def test_min_tokens_steers_greedy_away_from_eos():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.0, 8.0]])
    request = make_request(temperature=0.0, min_tokens=1, stop_token_ids=[5])
    assert Sampler()(logits, [request]).sampled_token_ids == [1]
    request.append_output_token(1)
    assert Sampler()(logits, [request]).sampled_token_ids == [EOS]


# --- logit bias --------------------------------------------------------------


def test_logit_bias_adds_exactly_each_rows_biases():
    logits = torch.zeros(3, 6)
    requests = [make_request("a", logit_bias={1: -100.0, 4: 2.5}), make_request("b"),
                make_request("c", logit_bias={0: 100.0, 9: 5.0})]  # 9 is outside this vocabulary: ignored
    result = apply_logit_bias(logits, requests)
    assert result.tolist() == [[0.0, -100.0, 0.0, 0.0, 2.5, 0.0], [0.0] * 6, [100.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert torch.equal(logits, torch.zeros(3, 6))
    assert apply_logit_bias(logits, [make_request("d")] * 3) is logits


def test_logit_bias_steers_greedy_and_sampling_before_penalties_but_not_logprobs():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 8.0]])
    banned = make_request(temperature=0.0, logit_bias={2: -100.0}, logprobs=1)
    output = Sampler()(logits, [banned])
    assert output.sampled_token_ids == [4]  # not the plain argmax: the greedy fast path does not skip the bias
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert output.logprobs[0] == {2: pytest.approx(raw[2].item()), 4: pytest.approx(raw[4].item())}
    forced = make_request(temperature=1.0, seed=3, logit_bias={3: 100.0})
    assert [Sampler()(logits, [forced]).sampled_token_ids[0] for _ in range(5)] == [3] * 5
    # The bias comes first, then the repetition penalty divides the biased logit (vLLM's order): 12 / 2 < 9.
    penalized = make_request(prompt=[0], temperature=0.0, logit_bias={0: 12.0}, repetition_penalty=2.0)
    assert Sampler()(logits, [penalized]).sampled_token_ids == [2]


@pytest.mark.parametrize("logit_bias, words", [
    ({-1: 1.0}, "non-negative token ids"), ({"7": 1.0}, "non-negative token ids"), ({1: 100.5}, "[-100, 100]"),
    ({1: float("nan")}, "[-100, 100]"), ({1: True}, "[-100, 100]"), ({i: 0.0 for i in range(1025)}, "at most 1024"),
    ([1, 2], "must map token ids"),
])
def test_a_bad_logit_bias_is_refused_with_the_reason(logit_bias, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        SamplingParams(logit_bias=logit_bias)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias={9: 1.0}).check_vocabulary(10)
    with pytest.raises(InvalidRequest, match=re.escape("token id 10 is outside the vocabulary [0, 10)")):
        SamplingParams(logit_bias={3: 1.0, 10: 1.0}).check_vocabulary(10)


# --- allowed tokens and bad words ----------------------------------------------


def test_allowed_token_ids_leave_only_those_tokens_on_their_rows():
    logits = torch.arange(12.0).reshape(2, 6)
    requests = [make_request("a", allowed_token_ids=[1, 3, 40]), make_request("b")]  # 40: outside, ignored
    result = apply_allowed_token_ids(logits, requests)
    assert result[0].tolist() == [NEG_INF, 1.0, NEG_INF, 3.0, NEG_INF, NEG_INF]
    assert torch.equal(result[1], logits[1]) and torch.equal(logits, torch.arange(12.0).reshape(2, 6))
    assert apply_allowed_token_ids(logits, [make_request("c")] * 2) is logits
    greedy = make_request(temperature=0.0, allowed_token_ids=[0, 2])
    sampled = make_request(temperature=1.0, seed=5, allowed_token_ids=[4])
    assert Sampler()(logits[:1], [greedy]).sampled_token_ids == [2]  # the fast path does not skip it
    assert [Sampler()(logits[:1], [sampled]).sampled_token_ids[0] for _ in range(4)] == [4] * 4


def _with_bad_words(request: Request, *sequences) -> Request:
    request.bad_word_bans = BadWordBans([tuple(sequence) for sequence in sequences])
    return request


def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_the_rest():
    logits = torch.zeros(4, 8)
    requests = [_with_bad_words(make_request("a", output=[1, 3]), (3, 5), (4,), (2, 3, 6)),
                _with_bad_words(make_request("b", output=[]), (3, 5), (7, 1, 2)),  # too short for either prefix
                _with_bad_words(make_request("c", prompt=[3]), (3, 5)),  # the prompt's end is no output
                make_request("d", output=[3])]
    result = apply_bad_words(logits, requests)
    banned = [[column for column in range(8) if result[row, column] == NEG_INF] for row in range(4)]
    assert banned == [[4, 5], [], [], []]
    assert torch.equal(logits, torch.zeros(4, 8)) and apply_bad_words(logits, requests[1:]) is logits
    greedy = _with_bad_words(make_request(temperature=0.0, output=[6]), (6, 7))
    assert Sampler()(torch.arange(8.0).unsqueeze(0), [greedy]).sampled_token_ids == [6]


class _CharacterTokenizer:
    """One token per character (its code point), a space folded into the next character's token (+1000) as
    byte-level BPE folds it into a word's first token; "#" after a space stays two tokens."""

    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False
        ids, space = [], False
        for character in text:
            if character == " " and not space:
                space = True
                continue
            if space and character != "#":
                ids.append(1000 + ord(character))
            else:
                ids += [ord(" ")] if space else []
                ids.append(ord(character))
            space = False
        return ids + ([ord(" ")] if space else [])


def test_the_indexed_bans_are_every_word_checked_against_the_outputs_end():
    """BadWordBans looks words up by the output's last token: the same bans as checking every word in full."""
    rng = random.Random(4)
    for _ in range(300):
        sequences = [tuple(rng.choices(range(5), k=rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        output = rng.choices(range(5), k=rng.randint(0, 8))
        expected = sorted(sequence[-1] for sequence in sequences
                          if len(sequence) - 1 <= len(output)
                          and output[len(output) - len(sequence) + 1:] == list(sequence[:-1]))
        assert sorted(BadWordBans(sequences).banned(output)) == expected, (sequences, output)


def test_bad_words_are_tokenized_alone_and_after_a_space():
    tokenizer = _CharacterTokenizer()
    assert bad_words_token_ids(tokenizer, ["ab", "  ab", "#x"]) == [
        (97, 98), (1097, 98),  # alone and after a space; the same word twice (leading spaces dropped) once
        (35, 120),  # after a space "#" is a space token before the word's own: nothing more to ban
    ]
    with pytest.raises(InvalidRequest, match="is no token at all"):
        bad_words_token_ids(type("Empty", (), {"encode": lambda self, text, add_special_tokens: []})(), ["ab"])


@pytest.mark.parametrize("fields, words", [
    ({"allowed_token_ids": []}, "at least one token id"), ({"allowed_token_ids": [1, -2]}, "non-negative token ids"),
    ({"allowed_token_ids": [1, True]}, "non-negative token ids"), ({"allowed_token_ids": 5}, "a list of token ids"),
    ({"allowed_token_ids": list(range(262145))}, "at most 262144"),
    ({"bad_words": ["ok", " "]}, "not empty or only spaces"), ({"bad_words": [3]}, "not empty or only spaces"),
    ({"bad_words": {"a": 1}}, "a list of strings"), ({"bad_words": ["w"] * 257}, "at most 256 are allowed"),
    ({"bad_words": ["w" * 257]}, "257 characters; at most 256"),
    ({"include_stop_str_in_output": "yes"}, "must be true or false"),
])
def test_bad_allowed_token_ids_and_bad_words_are_refused_with_the_reason(fields, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        SamplingParams(**fields)


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_is_checked():
    ids = list(range(10))
    assert SamplingParams(truncate_prompt_tokens=3).truncated(ids, 8) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=-1).truncated(ids, 8) == ids[2:]  # -1: max_model_len
    assert SamplingParams(truncate_prompt_tokens=20).truncated(ids, 8) == ids == SamplingParams().truncated(ids, 8)
    for value in (0, -2, 1.5, True, 2**31):
        with pytest.raises(InvalidRequest, match="truncate_prompt_tokens must be -1"):
            SamplingParams(truncate_prompt_tokens=value)


def test_allowed_token_ids_are_checked_against_the_vocabulary():
    assert SamplingParams(allowed_token_ids=(9,), bad_words="one").bad_words == ["one"]
    SamplingParams(allowed_token_ids=[9]).check_vocabulary(10)
    with pytest.raises(InvalidRequest, match=re.escape("allowed_token_ids token id 10 is outside the vocabulary")):
        SamplingParams(allowed_token_ids=[3, 10]).check_vocabulary(10)


# --- temperature, top-k, top-p, min-p ---------------------------------------


def test_apply_temperature_divides_each_row_by_its_own():
    logits = torch.tensor([[1.0, -2.0], [3.0, 6.0]])
    assert apply_temperature(logits, torch.tensor([0.5, 3.0])).tolist() == [[2.0, -4.0], [1.0, 2.0]]


@pytest.mark.parametrize(
    "top_k, top_p, min_p, kept",
    [
        (-1, 1.0, 0.0, {3, 0, 6, 1, 7, 4, 2, 5}),
        (3, 1.0, 0.0, {3, 0, 6}),
        (-1, 0.5, 0.0, {3, 0}),  # 0.30 < 0.5 <= 0.55
        (-1, 0.6, 0.0, {3, 0, 6}),
        (-1, 1.0, 0.3, {3, 0, 6, 1}),  # keep p >= 0.09
        # top-k 5 keeps 0.93 of the mass; top-p 0.9 of that keeps 4 tokens;
        # min-p 0.4 then drops 0.10 (< 0.4 * 0.30).
        (5, 0.9, 0.4, {3, 0, 6}),
    ],
)
def test_filters_keep_the_right_set(top_k, top_p, min_p, kept):
    logits = known_logits(1)
    vocab_size = logits.shape[-1]
    filtered = apply_top_k_top_p_min_p(
        logits,
        torch.tensor([top_k if top_k > 0 else vocab_size]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    assert set(torch.isfinite(filtered[0]).nonzero().flatten().tolist()) == kept
    finite = torch.isfinite(filtered)
    assert torch.equal(filtered[finite], logits[finite])  # kept logits are untouched

    # Sampling many times with a seeded generator never leaves that set.
    requests = [make_request(str(row), top_k=top_k, top_p=top_p, min_p=min_p) for row in range(3000)]
    sampled = Sampler(seed=4)(known_logits(3000), requests).sampled_token_ids
    assert set(sampled) == kept


def test_filters_are_per_row():
    logits = known_logits(3)
    filtered = apply_top_k_top_p_min_p(
        logits, torch.tensor([2, 8, 8]), torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0.0, 0.0, 0.5])
    )
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in filtered]
    assert kept == [{3, 0}, {3, 0}, {3, 0, 6}]


def reference_top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Plain full-sort top-p: keep a token when better-ranked tokens hold less than p."""
    sorted_probs, sorted_token_ids = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
    return torch.zeros_like(keep_sorted).scatter_(1, sorted_token_ids, keep_sorted)


def test_top_p_mask_matches_full_sort_reference():
    # Peaked rows (cut-off among the first candidates) and flat rows (whole-row fallback).
    logits = torch.cat([random_logits(3, 5000, seed=7) * 4, random_logits(3, 5000, seed=8) * 0.1])
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.3, 0.9, 0.99, 0.3, 0.9, 0.99])
    keep = top_p_mask(probs, top_p)
    assert torch.equal(keep, reference_top_p_mask(probs, top_p))
    num_kept = keep.sum(dim=-1).tolist()
    assert num_kept[1] < 1024 < num_kept[4]  # both paths were taken


def test_top_p_mask_on_a_uniform_row_keeps_exactly_p_of_it():
    probs = torch.full((1, 2048), 1 / 2048)  # prefix sums are exact in float32
    assert top_p_mask(probs, torch.tensor([0.75])).sum().item() == 1536


def test_top_k_mask_keeps_exactly_k_lowest_ids_first_on_ties():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    keep = top_k_mask(logits, torch.tensor([2, 3]))
    assert keep.tolist() == [[False, True, True, False, False], [True, True, True, False, False]]


def test_sample_from_probs_inverts_the_cumulative_distribution():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 4 + [[2.0, 0.0, 0.0, 2.0]])  # last row unnormalized
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.999999, 0.6])
    assert sample_from_probs(probs, uniforms).tolist() == [1, 1, 3, 3, 3]


def test_sampled_frequencies_match_the_probabilities():
    num_draws = 4000
    requests = [make_request(str(row)) for row in range(num_draws)]
    sampled = Sampler(seed=8)(known_logits(num_draws), requests).sampled_token_ids
    for token_id, probability in PROBABILITIES.items():
        assert sampled.count(token_id) / num_draws == pytest.approx(probability, abs=0.03)


def test_temperature_sharpens_the_distribution():
    num_draws = 3000
    requests = [make_request(str(row), temperature=0.25) for row in range(num_draws)]
    sampled = Sampler(seed=8)(known_logits(num_draws), requests).sampled_token_ids
    # p^4 renormalized: token 3 has 0.3^4 / sum(p^4) = 0.55.
    expected = 0.30**4 / sum(p**4 for p in PROBABILITIES.values())
    assert sampled.count(3) / num_draws == pytest.approx(expected, abs=0.03)


# --- logprobs ---------------------------------------------------------------


def test_logprobs_are_raw_top_n_plus_sampled_token():
    logits = random_logits(3, 40, seed=2)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    top_two = raw_logprobs[0].topk(2).indices.tolist()
    # Row 0: greedy, but a strong repetition penalty on its top two tokens makes it
    # sample a third one; logprobs still come from the raw logits.
    requests = [
        make_request("penalized", prompt=top_two, temperature=0.0, repetition_penalty=1e6, logprobs=2),
        make_request("only-sampled", temperature=0.0, logprobs=0),
        make_request("none", temperature=0.0),
    ]
    output = Sampler()(logits, requests)
    sampled = output.sampled_token_ids
    assert sampled[0] not in top_two
    assert list(output.logprobs[0]) == top_two + [sampled[0]]
    for token_id, logprob in output.logprobs[0].items():
        assert logprob == pytest.approx(raw_logprobs[0, token_id].item(), abs=1e-6)
    assert sampled[1] == logits[1].argmax().item()
    expected_logprob = raw_logprobs[1, sampled[1]].item()
    assert output.logprobs[1] == {sampled[1]: pytest.approx(expected_logprob, abs=1e-6)}
    assert output.logprobs[2] is None


def test_logprobs_of_sampled_top_token_are_not_duplicated():
    logits = random_logits(1, 40, seed=3)
    result = compute_logprobs(logits, [make_request(logprobs=5)], [int(logits[0].argmax())])
    assert len(result[0]) == 5
    assert list(result[0])[0] == int(logits[0].argmax())


def test_sampler_does_not_modify_its_input():
    logits = random_logits(2, 16, seed=6)
    original = logits.clone()
    requests = [
        make_request("a", output=[1, 2], repetition_penalty=1.5, min_tokens=5, top_p=0.8, seed=1),
        make_request("b", output=[3], frequency_penalty=1.0, temperature=0.0),
    ]
    Sampler()(logits, requests)
    assert torch.equal(logits, original)
