"""Structured outputs without a model: the constraint's checks, its proto form, the gateway's body fields, and the
token bitmask against plain indexing."""

from __future__ import annotations

import re

import pytest
import torch

from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import MAX_CONSTRAINT_CHARS, StructuredOutputsParams
from splitserve.engine.request import Request
from splitserve.engine.sampling import Sampler
from splitserve.engine.structured_output import apply_token_bitmask, fill_token_bitmask
from splitserve.rpc.convert import sampling_params_from_pb, structured_outputs_from_pb, structured_outputs_to_pb
from splitserve.v1 import inference_pb2

CONSTRAINTS = [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "array"}', num_resumed_tokens=4),
    StructuredOutputsParams(json=True),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex="[0-9]+"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='start: "a"+'),
    StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True, disable_additional_properties=True,
                            whitespace_pattern=" ?"),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_the_proto_form_round_trips_and_each_builds(constraint):
    message = structured_outputs_to_pb(constraint)
    assert message.WhichOneof("constraint") == constraint.kind
    assert structured_outputs_from_pb(message) == constraint
    params = sampling_params_from_pb(inference_pb2.SamplingParams(structured_outputs=message))
    assert params.structured_outputs == constraint
    constraint.check()


def test_a_schema_is_kept_as_compact_text_whatever_form_it_came_in():
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type":"object"}'
    assert StructuredOutputsParams(json='{ "type" : "object" }').json == '{"type":"object"}'
    assert SamplingParams(structured_outputs={"json": {"type": "object"}}).structured_outputs.json == \
        '{"type":"object"}'
    assert SamplingParams().structured_outputs is None


@pytest.mark.parametrize("fields, words", [
    ({}, "exactly one"),
    ({"regex": "a", "grammar": 'start: "a"'}, "exactly one"),
    ({"json": "{"}, "not JSON"),
    ({"json": 3}, "an object or a boolean"),
    ({"json": {"x": float("nan")}}, "json must be a JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": "x" * (MAX_CONSTRAINT_CHARS + 1)}, f"at most {MAX_CONSTRAINT_CHARS}"),
    ({"choice": "yes"}, "list of strings"),
    ({"choice": ["a", 3]}, "non-empty strings"),
    ({"choice": ["x" * 40_000, "y" * 40_000]}, "characters in all"),
    ({"regex": "a", "num_resumed_tokens": -1}, "num_resumed_tokens"),
    ({"regex": "a", "num_resumed_tokens": True}, "num_resumed_tokens"),
    ({"json_object": True, "disable_any_whitespace": 1}, "must be true or false"),
    ({"json_object": 1}, "json_object must be true or false"),
    ({"json_object": None}, "exactly one"),
    ({"json_object": True, "whitespace_pattern": ""}, "non-empty string"),
    ({"choice": ["a"], "disable_additional_properties": True}, "shape JSON only"),
])
def test_a_bad_constraint_names_what_is_wrong(fields, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        StructuredOutputsParams(**fields)


def test_a_constraint_that_does_not_build_is_refused_by_its_check():
    for constraint, words in ((StructuredOutputsParams(regex="(a"), "the regex is not valid"),
                              (StructuredOutputsParams(grammar="start: b"), "the grammar is not valid"),
                              (StructuredOutputsParams(grammar="root ::= ("), "grammar is not valid GBNF"),
                              (StructuredOutputsParams(json={"type": "nothing"}), "the json is not valid")):
        with pytest.raises(InvalidRequest, match=words):
            constraint.check()
    assert len(str(pytest.raises(InvalidRequest, StructuredOutputsParams(regex="(" * 5000).check).value)) < 400


def test_a_proto_without_a_constraint_or_with_json_object_false_is_refused():
    with pytest.raises(InvalidRequest, match="without a constraint"):
        structured_outputs_from_pb(inference_pb2.StructuredOutputs(num_resumed_tokens=2))
    with pytest.raises(InvalidRequest, match="must be true"):
        structured_outputs_from_pb(inference_pb2.StructuredOutputs(json_object=False))


def test_the_gateway_reads_response_format_and_structured_outputs():
    pytest.importorskip("starlette")
    from splitserve.gateway import APIError, _structured_outputs

    schema = {"type": "object"}
    assert _structured_outputs({}) is None
    assert _structured_outputs({"response_format": {"type": "text"}}) is None
    assert _structured_outputs({"response_format": {"type": "json_object"}}) == StructuredOutputsParams(
        json_object=True)
    assert _structured_outputs({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}}) == StructuredOutputsParams(json=schema)
    assert _structured_outputs({"structured_outputs": {"choice": ["a"], "regex": None}}) == \
        StructuredOutputsParams(choice=["a"])
    for body, param in (({"response_format": {"type": "yaml"}}, "response_format"),
                        ({"response_format": "json"}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                         "response_format"),
                        ({"structured_outputs": ["json"]}, "structured_outputs"),
                        ({"structured_outputs": {"num_resumed_tokens": 3, "regex": "a"}}, "structured_outputs"),
                        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "text"}},
                         "structured_outputs"),
                        ({"structured_outputs": {"regex": 7}}, "structured_outputs")):
        with pytest.raises(APIError) as refused:
            _structured_outputs(body)
        assert refused.value.status == 400 and refused.value.param == param, body


def test_the_bitmask_leaves_exactly_the_allowed_tokens_on_its_rows():
    generator = torch.Generator().manual_seed(0)
    vocab_size = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(4, vocab_size, generator=generator)
    allowed = [torch.randperm(vocab_size, generator=generator)[:count].tolist() for count in (1, 37)]
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            bitmask[row, token // 32] |= (1 << (token % 32)) if token % 32 != 31 else -(1 << 31)
    masked = apply_token_bitmask(logits, [3, 1], bitmask)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    for row, tokens in zip([3, 1], allowed):
        expected = torch.full((vocab_size,), float("-inf"))
        expected[tokens] = logits[row, tokens]
        assert torch.equal(masked[row], expected)
    assert apply_token_bitmask(logits, [], bitmask[:0]) is logits
    # A vocabulary wider than the mask's words (logits padded past the tokenizer): the rest is not allowed.
    wide = apply_token_bitmask(torch.zeros(1, 130), [0], torch.full((1, 4), -1, dtype=torch.int32))
    assert torch.isinf(wide[0, 128:]).all() and not torch.isinf(wide[0, :128]).any()


class _OnlyToken:
    """A stand-in grammar state allowing one token (the sampler's side of GrammarMatcher)."""

    def __init__(self, token: int, active: bool = True) -> None:
        self.token = token
        self.active = active  # False: waiting out a think block

    def fill_bitmask(self, words: torch.Tensor) -> None:
        words.zero_()
        words[self.token // 32] = 1 << (self.token % 32)


def test_the_sampler_takes_the_grammar_over_greedy_and_random_rows_and_leaves_logprobs_raw():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    requests = [Request(str(row), [1, 2], SamplingParams(temperature=temperature, seed=5, logprobs=1))
                for row, temperature in enumerate((0.0, 1.0, 0.0))]
    requests[0].grammar, requests[1].grammar = _OnlyToken(40), _OnlyToken(7)
    output = Sampler()(logits, requests)
    assert output.sampled_token_ids[:2] == [40, 7]
    assert output.sampled_token_ids[2] == int(logits[2].argmax())
    raw = torch.log_softmax(logits[0], -1)
    assert output.logprobs[0][40] == pytest.approx(raw[40].item(), abs=1e-6)
    # A grammar waiting out its request's think block masks nothing: the row is the model's own argmax.
    for request in requests:
        request.grammar = _OnlyToken(40, active=False)
    assert 40 not in (int(logits[0].argmax()), int(logits[2].argmax()))  # else the mask would not show
    output = Sampler()(logits[[0, 2]], [requests[0], requests[2]])
    assert output.sampled_token_ids == [int(logits[0].argmax()), int(logits[2].argmax())]


class _Nothing:
    """A grammar state in error: it allows no token."""

    active = True

    def fill_bitmask(self, words: torch.Tensor) -> None:
        words.zero_()


def test_a_grammar_allowing_nothing_leaves_its_row_unmasked_and_the_batch_sampled():
    """Its token is then refused by the grammar (the engine ends that request with an error); the other rows, greedy
    and random, are sampled as ever, and no probability is NaN."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    requests = [Request(str(row), [1, 2], SamplingParams(temperature=temperature, seed=9))
                for row, temperature in enumerate((1.0, 0.0, 1.0))]
    requests[0].grammar, requests[2].grammar = _Nothing(), _OnlyToken(11)
    bitmask = fill_token_bitmask([_Nothing(), _OnlyToken(11)], 2)
    assert bitmask[0].tolist() == [-1, -1] and bitmask[1].tolist() == [1 << 11, 0]
    sampled = Sampler()(logits, requests).sampled_token_ids
    assert 0 <= sampled[0] < 64 and sampled[1] == int(logits[1].argmax()) and sampled[2] == 11


def test_additional_properties_are_closed_on_every_object_schema_that_leaves_them_open():
    from splitserve.common.structured_outputs import _without_additional_properties

    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"additionalProperties": True,
                                                                           "properties": {}}},
              "anyOf": [{"properties": {"c": {}}}, {"type": "string"}], "$defs": {"d": {"type": "object"}}}
    closed = _without_additional_properties(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True  # said otherwise: kept
    assert closed["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in closed["anyOf"][1]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    # A property named "properties" is a property, not a schema keyword; enum values and defaults are data.
    named = _without_additional_properties({"type": "object", "properties": {"properties": {"type": "string"}},
                                            "default": {"properties": {}}, "enum": [{"type": "object"}]})
    assert named["properties"] == {"properties": {"type": "string"}}
    assert named["default"] == {"properties": {}} and named["enum"] == [{"type": "object"}]
