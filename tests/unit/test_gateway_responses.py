"""The Responses API's pure parts (``splitserve.gateway_responses``): requests read into the chat they stand for,
refusals with the field named, and response objects and event streams that the ``openai`` package's own types
(``openai.types.responses``) accept, in the order and with the numbering the SDK and vLLM use."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.gateway import APIError
from splitserve.gateway_reasoning import Qwen3ReasoningParser, ReasoningReplies
from splitserve.gateway_responses import ResponseEvents, ResponseHead, _stream, parse_request, whole_response
from splitserve.v1 import inference_pb2

EVENTS = TypeAdapter(ResponseStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _message(text: str, finish=inference_pb2.FINISH_REASON_UNSPECIFIED, **usage) -> inference_pb2.GenerateStreamResponse:
    return inference_pb2.GenerateStreamResponse(text=text, finish_reason=finish, usage=inference_pb2.Usage(**usage))


def _head(**echoed) -> ResponseHead:
    return ResponseHead.new("SmolLM2", {**parse_request({"input": "Hi"}).echoed, "temperature": 1.0, "top_p": 1.0,
                                        **echoed})


def _parsed_events(events: list[str]) -> list:
    """Each server-sent event as the SDK's type, after checking its ``event:`` line names its ``type``."""
    parsed = []
    for event in events:
        name_line, data_line, blank = event.split("\n", 2)
        assert name_line.startswith("event: ") and data_line.startswith("data: ") and blank == "\n"
        payload = json.loads(data_line[len("data: "):])
        assert payload["type"] == name_line[len("event: "):]
        parsed.append(EVENTS.validate_python(payload))
    return parsed


def test_a_string_input_with_instructions_is_a_system_message_then_the_user():
    parsed = parse_request({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
                            "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 4, "stop": ["."], "store": True})
    assert parsed.chat_body == {
        "model": "m", "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 4, "stop": ["."], "max_tokens": 7,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "chat_template_kwargs": None}
    assert not parsed.stream and parsed.text_format is None
    assert parsed.echoed["instructions"] == "Be brief." and parsed.echoed["max_output_tokens"] == 7


def test_message_items_take_string_and_text_part_contents_and_developer_is_system():
    parsed = parse_request({"input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                         {"type": "input_text", "text": "2+2?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"role": "user", "content": "Sure?"}], "stream": True})
    assert parsed.chat_body["messages"] == [
        {"role": "system", "content": "Rules."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
    assert parsed.stream and parsed.chat_body["max_tokens"] is None


def test_text_format_and_reasoning_effort_map_onto_the_gateways_own_fields():
    schema = parse_request({"input": "x", "text": {"format": {"type": "json_schema", "name": "city",
                                                              "schema": SCHEMA, "strict": True}}})
    assert schema.text_format == StructuredOutputsParams(json=SCHEMA)
    assert parse_request({"input": "x", "text": {"format": {"type": "json_object"}}}).text_format == \
        StructuredOutputsParams(json_object=True)
    assert parse_request({"input": "x", "text": {"format": {"type": "text"}}}).text_format is None
    effort = parse_request({"input": "x", "reasoning": {"effort": "low"},
                            "chat_template_kwargs": {"enable_thinking": False}})
    assert effort.chat_body["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "low"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "keeps no state"),
    ({"input": "x", "background": True}, "background", "keeps no state"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "keeps no state"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "not supported"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "auto or none"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
    ({"input": "x", "instructions": 3}, "instructions", "string"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format", "json_schema"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format", "json_object"),
    ({"input": "x", "text": "json"}, "text", "object"),
    ({}, "input", "string or a non-empty list"),
    ({"input": []}, "input", "string or a non-empty list"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input", "function_call_output"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input", "input_image"),
])
def test_refused_fields_get_400_naming_them(body, param, words):
    with pytest.raises(APIError) as refused:
        parse_request(body)
    assert refused.value.status == 400 and refused.value.param == param and words in refused.value.message


def test_defaults_store_and_empty_fields_are_taken():
    parsed = parse_request({"input": "x", "store": True, "tools": [], "include": [], "background": False,
                            "top_logprobs": 0, "tool_choice": "auto", "truncation": "disabled", "metadata": {"a": "b"}})
    assert parsed.echoed["metadata"] == {"a": "b"} and parsed.echoed["tools"] == []


def test_a_whole_response_is_the_sdks_response_with_usage_and_one_message():
    head = _head()
    answer = whole_response(head, "Paris.", _message("", inference_pb2.FINISH_REASON_STOP, prompt_tokens=9,
                                                     completion_tokens=3, cached_tokens=2), None)
    response = Response.model_validate(answer)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "Paris." and response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_") and message.content[0].annotations == []
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (9, 3, 12)
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.temperature == 1.0 and response.tools == [] and response.tool_choice == "auto"


def test_a_response_cut_by_length_is_incomplete_and_a_failed_one_says_why():
    cut = Response.model_validate(whole_response(_head(), "Par", _message("", inference_pb2.FINISH_REASON_LENGTH), None))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    last = _message("", inference_pb2.FINISH_REASON_ERROR)
    last.error_message = "a worker died"
    failed = Response.model_validate(whole_response(_head(), "Par", last, None))
    assert failed.status == "failed" and "a worker died" in failed.error.message


def test_a_think_block_is_a_reasoning_item_before_the_message():
    reasoning = ReasoningReplies(Qwen3ReasoningParser)
    answer = whole_response(_head(), "<think>France.</think>\n\nParis.", _message("", inference_pb2.FINISH_REASON_STOP),
                            reasoning)
    response = Response.model_validate(answer)
    thought, message = response.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert [part.text for part in thought.content] == ["France."] and thought.content[0].type == "reasoning_text"
    assert response.output_text == "\n\nParis."


def test_events_come_in_the_sdks_order_numbered_and_add_up_to_the_text():
    events = ResponseEvents(_head())
    raw = events.start()
    for piece in ("The", " capital", ""):
        raw += events.feed(_message(piece))
    last = _message(" is", inference_pb2.FINISH_REASON_LENGTH, prompt_tokens=5, completion_tokens=3)
    raw += events.feed(last) + events.finish(last)
    parsed = _parsed_events(raw)
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    deltas = [event for event in parsed if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == "The capital is" == parsed[7].text
    assert {(event.item_id, event.output_index, event.content_index) for event in deltas} == {
        (parsed[2].item.id, 0, 0)}
    final = parsed[-1].response
    assert final.status == "incomplete" and final.output_text == "The capital is" and final.usage.total_tokens == 8
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []


def test_a_stream_with_a_think_block_closes_the_reasoning_item_before_the_message():
    events = ResponseEvents(_head(), ReasoningReplies(Qwen3ReasoningParser))
    raw = events.start()
    for piece in ("<think>Fra", "nce.</thi", "nk>\n\nPar"):
        raw += events.feed(_message(piece))
    last = _message("is.", inference_pb2.FINISH_REASON_STOP)
    raw += events.feed(last) + events.finish(last)
    parsed = _parsed_events(raw)
    kinds = [event.type for event in parsed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    reasoning = "".join(event.delta for event in parsed if event.type == "response.reasoning_text.delta")
    text = "".join(event.delta for event in parsed if event.type == "response.output_text.delta")
    assert (reasoning, text) == ("France.", "\n\nParis.")
    final = parsed[-1]
    assert final.type == "response.completed" and [item.type for item in final.response.output] == [
        "reasoning", "message"]
    assert {event.output_index for event in parsed if event.type == "response.output_text.delta"} == {1}


def test_an_error_event_is_the_sdks_and_ends_a_failed_stream():
    events = ResponseEvents(_head())
    raw = events.start() + events.feed(_message("Par"))
    failed = _message("", inference_pb2.FINISH_REASON_ERROR)
    failed.error_message = "a worker died"
    raw += events.finish(failed)
    parsed = _parsed_events(raw)
    assert parsed[-1].type == "error" and "a worker died" in parsed[-1].message
    assert parsed[-1].sequence_number == len(parsed) - 1 and parsed[-1].code == "server_error"


def test_a_router_error_mid_stream_ends_it_with_an_error_event():
    """What ``_chunks`` raises for a gRPC error after the first message (the router's status as an APIError):
    the stream's last event is the SDK's error event with the router's sentence, and the stream ends."""

    async def router_messages():
        yield _message(" capital")
        raise APIError(503, "The router lost its decode worker.", code="unavailable")

    async def events() -> list[str]:
        return [event async for event in _stream(ResponseEvents(_head()), [], _message("The"), router_messages())]

    parsed = _parsed_events(asyncio.run(events()))
    assert [event.type for event in parsed][-3:] == ["response.output_text.delta", "response.output_text.delta",
                                                     "error"]
    assert (parsed[-1].message, parsed[-1].code) == ("The router lost its decode worker.", "unavailable")
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
