"""The Responses API's pure parts (``splitserve.gateway_responses``): requests read into the chat they stand for,
refusals with the field named, and response objects and event streams that the ``openai`` package's own types
(``openai.types.responses``) accept, in the order and with the numbering the SDK and vLLM use."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent
from pydantic import TypeAdapter

from splitserve.common.chat import Chat, FunctionTool
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.common.tools import tool_choice_constraint
from splitserve.gateway import APIError, Gateway, GatewayConfig, _chat
from splitserve.gateway_reasoning import Qwen3ReasoningParser, ReasoningReplies
from splitserve.gateway_responses import (
    ResponseEvents,
    ResponseHead,
    _stream,
    whole_response,
)
from splitserve.gateway_responses_request import parse_request, under_tool_choice
from splitserve.v1 import inference_pb2

EVENTS = TypeAdapter(ResponseStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# Function tools as the Responses API writes them (flat), and as the chat API does (nested).
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city.",
           "parameters": SCHEMA, "strict": True}
CLOCK = {"type": "function", "name": "get_time"}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city.",
                                                "parameters": SCHEMA}},
              {"type": "function", "function": {"name": "get_time"}}]
ASKED = "What is the weather in Paris?"


def _message(text: str, finish=inference_pb2.FINISH_REASON_UNSPECIFIED, **usage) -> inference_pb2.GenerateStreamResponse:
    return inference_pb2.GenerateStreamResponse(text=text, finish_reason=finish, usage=inference_pb2.Usage(**usage))


def _head(**echoed) -> ResponseHead:
    return ResponseHead.new("resp_1", "SmolLM2",
                            {**parse_request({"input": "Hi"}).echoed, "temperature": 1.0, "top_p": 1.0, **echoed})


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
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "'reasoning.encrypted_content' is not "
     "supported: only 'message.output_text.logprobs'"),
    ({"input": "x", "include": "message.output_text.logprobs"}, "include", "list of strings"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "0 to 20"),
    ({"input": "x", "top_logprobs": True}, "top_logprobs", "0 to 20"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
    ({"input": "x", "instructions": 3}, "instructions", "string"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format", "json_schema"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format", "json_object"),
    ({"input": "x", "text": "json"}, "text", "object"),
    ({}, "input", "string or a non-empty list"),
    ({"input": []}, "input", "string or a non-empty list"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "input[0] is of type 'item_reference'"),
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


# ---- function tools ------------------------------------------------------------------------------------------


def test_flat_function_tools_and_tool_choice_are_the_chats_nested_ones():
    parsed = parse_request({"input": ASKED, "tools": [WEATHER, CLOCK], "parallel_tool_calls": False,
                            "tool_choice": {"type": "function", "name": "get_weather"}})
    assert parsed.chat_body["tools"] == CHAT_TOOLS
    assert parsed.chat_body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert parsed.chat_body["parallel_tool_calls"] is False
    assert parsed.echoed["tools"] == [WEATHER, {"type": "function", "name": "get_time", "description": None,
                                                "parameters": None, "strict": None}]
    assert parsed.echoed["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert parsed.echoed["parallel_tool_calls"] is False
    assert _chat(parsed.chat_body) == Chat.from_openai([{"role": "user", "content": ASKED}], CHAT_TOOLS)
    for choice in ("auto", "none", "required"):
        assert parse_request({"input": "x", "tools": [CLOCK], "tool_choice": choice}).chat_body["tool_choice"] == choice
    # "auto" is the default, with tools or without: without them it is not the chat's tool_choice.
    assert "tool_choice" not in parse_request({"input": "x", "tool_choice": "auto"}).chat_body
    assert "tools" not in parse_request({"input": "x", "tools": []}).chat_body


def test_function_call_items_and_their_outputs_are_the_chats_tool_calls_and_tool_messages():
    """The loop call, output, answer sent back whole: consecutive calls (and the text before them) are one
    assistant message, each output a tool message; the same Chat as the chat route's messages make."""
    parsed = parse_request({"tools": [WEATHER, CLOCK], "input": [
        {"role": "user", "content": ASKED},
        # An earlier answer's reasoning item, as input += response.output sends it back: dropped.
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "The user wants the weather."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"celsius": 21}'},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "9:00"}]}]})
    chat_messages = [
        {"role": "user", "content": ASKED},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "9:00"}]
    assert parsed.chat_body["messages"] == chat_messages
    assert _chat(parsed.chat_body) == Chat.from_openai(chat_messages, CHAT_TOOLS)
    alone = parse_request({"input": [{"type": "function_call", "call_id": "c", "name": "get_time", "arguments": ""},
                                     {"type": "function_call_output", "call_id": "c", "output": ""}]})
    assert alone.chat_body["messages"] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c", "content": ""}]


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0] is a tool of type 'web_search', which is not supported"),
    ({"tools": [WEATHER, {"type": "mcp", "server_label": "s"}]}, "tools", "tools[1] is a tool of type 'mcp'"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "'file_search'"),
    ({"tools": [{"type": "code_interpreter", "container": "auto"}]}, "tools", "'code_interpreter'"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools", "'computer_use_preview'"),
    ({"tools": [{"name": "f"}]}, "tools", "tools[0] is a tool without a type"),
    ({"tools": {"type": "function", "name": "f"}}, "tools", "must be a list"),
    ({"tools": [{"type": "function", "name": "get weather"}]}, "tools", "tools[0].name must be 1 to 64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools[0].name must be"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools", "tools[0].parameters must be"),
    ({"tools": [{"type": "function", "name": "f", "description": 3}]}, "tools", "tools[0].description must be"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools", "tools[0].strict must be true"),
    ({"tools": [CLOCK, CLOCK]}, "tools", "Two tools are named 'get_time'"),
    ({"tools": [CLOCK] * 129}, "tools", "129 tools are more than the 128"),
    ({"tools": [CLOCK], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "tool_choice of type 'web_search_preview' is not supported"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function"}}, "tool_choice", "needs the name"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "needs the name"),
    ({"tools": [CLOCK], "tool_choice": "always"}, "tool_choice", '"auto", "none", "required" or'),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input[0].call_id must be a string of 1 to 128"),
    ({"input": [{**CALL, "call_id": "c" * 129}]}, "input", "call_id must be a string of 1 to 128"),
    ({"input": [{**CALL, "arguments": {"city": "Paris"}}]}, "input", "input[0].arguments must be a string"),
    ({"input": [{**CALL, "name": 3}]}, "input", "input[0].name must be the function's name"),
    ({"input": [{**CALL, "name": "f" * 65}]}, "input", "1 to 64 characters"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]}, "input",
     "input[0] is the function_call_output of call_id 'call_1', which no function_call item before it has"),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "call_2", "output": "1"}]}, "input",
     "call_id 'call_2'"),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "call_1", "output": 1}]}, "input",
     "input[1].output must be a string"),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "call_1",
                       "output": [{"type": "input_image", "image_url": "u"}]}]}, "input", "'input_image'"),
    ({"input": [CALL, "x"]}, "input", "input[1] must be an object"),
])
def test_bad_tools_tool_choices_and_call_items_get_400_naming_the_field(body, param, words):
    with pytest.raises(APIError) as refused:
        parse_request({"input": "x", **body})
    assert refused.value.status == 400 and refused.value.param == param and words in refused.value.message
    assert refused.value.message.endswith(".")


def test_a_long_type_or_call_id_is_quoted_64_characters_at_most():
    for body in ({"tools": [{"type": "t" * 10_000}]}, {"tools": [CLOCK], "tool_choice": {"type": "t" * 10_000}},
                 {"input": [{"type": "t" * 10_000}]},
                 {"input": [{"type": "function_call_output", "call_id": "t" * 128, "output": ""}]}):
        with pytest.raises(APIError) as refused:
            parse_request({"input": "x", **body})
        assert "t" * 64 in refused.value.message and "t" * 65 not in refused.value.message


def _tool_request(**body) -> tuple[ResponseHead, SamplingParams, object]:
    """A request with the weather and clock tools read as the route reads it, on a gateway with the hermes
    parser: its head, its sampling parameters under the tool choice, and its tool replies."""
    parsed = parse_request({"input": ASKED, "tools": [WEATHER, CLOCK], **body})
    gateway = Gateway(GatewayConfig("127.0.0.1:1", tool_call_parser="hermes"))
    params, tools = under_tool_choice(gateway, parsed.chat_body, _chat(parsed.chat_body), SamplingParams())
    return _head(**parsed.echoed), params, tools


def test_a_forced_call_is_the_chats_constraint_and_auto_needs_the_parser():
    named = FunctionTool("get_weather", "The weather now in a city.", SCHEMA)
    clock = FunctionTool("get_time")
    _, params, tools = _tool_request(tool_choice={"type": "function", "name": "get_weather"})
    assert params.structured_outputs == tool_choice_constraint(named, [named, clock]) and tools.forces_a_call
    _, params, tools = _tool_request(tool_choice="required", parallel_tool_calls=False)
    assert params.structured_outputs == tool_choice_constraint("required", [named, clock], parallel_tool_calls=False)
    _, params, tools = _tool_request()
    assert params.structured_outputs is None and tools.choice == "auto"
    assert _tool_request(tool_choice="none")[2] is None
    for body, gateway, param, words in (
            ({"tool_choice": {"type": "function", "name": "get_date"}}, "hermes", "tool_choice",
             "'get_date', which is not one of the tools"),
            ({"tools": None, "tool_choice": "required"}, "hermes", "tool_choice", "needs tools"),
            ({"parallel_tool_calls": "yes"}, "hermes", "parallel_tool_calls", "true or false"),
            ({"tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "hermes", "tool_choice",
             "not both"),
            ({}, None, "tool_choice", "--enable-auto-tool-choice")):
        parsed = parse_request({"input": ASKED, "tools": [WEATHER, CLOCK], **body})
        params = SamplingParams(structured_outputs=parsed.text_format)
        with pytest.raises(APIError) as refused:
            under_tool_choice(Gateway(GatewayConfig("127.0.0.1:1", tool_call_parser=gateway)), parsed.chat_body,
                               _chat(parsed.chat_body), params)
        assert refused.value.status == 400 and refused.value.param == param and words in refused.value.message


def _calls(response: Response) -> list[tuple[str, str]]:
    """The response's calls as (name, arguments), after checking each is the SDK's ResponseFunctionToolCall with
    OpenAI's ids."""
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert isinstance(call, ResponseFunctionToolCall) and call.id.startswith("fc_")
        assert call.call_id.startswith("call_") and len(call.call_id) == 29
    assert len({call.id for call in calls}) == len({call.call_id for call in calls}) == len(calls)
    return [(call.name, call.arguments) for call in calls]


STOP = inference_pb2.FINISH_REASON_STOP
NAMED = {"tool_choice": {"type": "function", "name": "get_weather"}}
TWO_CALLS = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
HERMES = 'Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_named_call_is_one_function_call_item_and_the_request_echoed():
    head, _, tools = _tool_request(**NAMED)
    response = Response.model_validate(whole_response(head, '{"city": "Paris"}', _message("", STOP), None, tools))
    assert response.status == "completed" and _calls(response) == [("get_weather", '{"city": "Paris"}')]
    assert [item.type for item in response.output] == ["function_call"] and response.output[0].status == "completed"
    assert response.output_text == ""
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"] and response.tools[0].strict
    assert response.tools[0].parameters == SCHEMA and response.tool_choice.name == "get_weather"
    cut = Response.model_validate(whole_response(head, '{"city": "Par', _message("", inference_pb2.FINISH_REASON_LENGTH),
                                                 None, tools))
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    assert cut.output[0].arguments == '{"city": "Par'


def test_required_calls_are_function_call_items_in_order():
    head, _, tools = _tool_request(tool_choice="required")
    response = Response.model_validate(whole_response(head, TWO_CALLS, _message("", STOP), None, tools))
    assert _calls(response) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    assert response.tool_choice == "required"
    # Cut short before a call was whole: no call, the JSON so far is the message.
    cut = Response.model_validate(whole_response(head, '[{"name": "get_w', _message(
        "", inference_pb2.FINISH_REASON_LENGTH), None, tools))
    assert _calls(cut) == [] and cut.output_text == '[{"name": "get_w'


def test_an_auto_answer_is_its_content_then_the_hermes_calls():
    head, _, tools = _tool_request()
    response = Response.model_validate(whole_response(head, HERMES, _message("", STOP), None, tools))
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Looking.\n" and _calls(response) == [("get_weather", '{"city": "Paris"}')]
    plain = Response.model_validate(whole_response(head, "Sunny.", _message("", STOP), None, tools))
    assert [item.type for item in plain.output] == ["message"] and plain.output_text == "Sunny."


def test_a_think_block_is_a_reasoning_item_before_the_call():
    head, _, tools = _tool_request()
    text = "<think>Weather.</think>" + HERMES[len("Looking.\n"):]
    response = Response.model_validate(whole_response(head, text, _message("", STOP),
                                                      ReasoningReplies(Qwen3ReasoningParser), tools))
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == "Weather." and _calls(response) == [
        ("get_weather", '{"city": "Paris"}')]


def _streamed(pieces: list[str], tools, reasoning=None, finish=STOP, head=None) -> list:
    """The events of ``pieces`` streamed (the last with ``finish``), parsed as the SDK's, numbered from 0."""
    events = ResponseEvents(head or _head(), reasoning, tools)
    raw = events.start()
    for piece in pieces[:-1]:
        raw += events.feed(_message(piece))
    last = _message(pieces[-1], finish, prompt_tokens=5, completion_tokens=7)
    raw += events.feed(last) + events.finish(last)
    parsed = _parsed_events(raw)
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    # The SDK's own stream accumulator (client.responses.stream) takes them: it raises on an item changed between
    # added and done, a delta before its item, an item left unfinished.
    state = ResponseStreamState(input_tools=[WEATHER, CLOCK], text_format=omit)
    accumulated = [sdk_event for event in parsed for sdk_event in state.handle_event(event)]
    for done in (event for event in parsed if event.type == "response.function_call_arguments.done"):
        snapshots = [event.snapshot for event in accumulated
                     if event.type == "response.function_call_arguments.delta" and event.item_id == done.item_id]
        assert snapshots[-1:] == ([done.arguments] if done.arguments else [])
    return parsed


CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def _check_calls(parsed: list, whole: Response) -> None:
    """Each call's events point at its item, its deltas add up to its arguments, and the last event's response
    has the calls of the whole response (its ids fresh)."""
    added = [event for event in parsed if event.type == "response.output_item.added"]
    for event in added:
        if event.item.type == "function_call":
            assert (event.item.status, event.item.arguments) == ("in_progress", "")
            mine = [other for other in parsed if getattr(other, "item_id", None) == event.item.id]
            assert {other.output_index for other in mine} == {event.output_index}
            done = next(other for other in parsed if other.type == "response.output_item.done"
                        and other.item.id == event.item.id)
            assert "".join(other.delta for other in mine if other.type.endswith(".delta")) == done.item.arguments
            assert mine[-1].type == "response.function_call_arguments.done"
            assert mine[-1].arguments == done.item.arguments and done.item.call_id == event.item.call_id
            assert parsed[-1].response.output[event.output_index] == done.item
    assert _calls(parsed[-1].response) == _calls(whole)
    assert [item.type for item in parsed[-1].response.output] == [item.type for item in whole.output]
    assert parsed[-1].response.output_text == whole.output_text


def test_a_named_calls_arguments_stream_as_they_come():
    head, _, tools = _tool_request(**NAMED)
    parsed = _streamed(['{"city"', ': "Par', 'is"}', ""], tools, head=head)
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * 3, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [event.delta for event in parsed[3:6]] == ['{"city"', ': "Par', 'is"}']
    assert parsed[-1].response.output[0].status == "completed" and parsed[-1].response.tool_choice.name == "get_weather"
    _, _, whole_tools = _tool_request(**NAMED)
    _check_calls(parsed, Response.model_validate(whole_response(head, '{"city": "Paris"}', _message("", STOP), None,
                                                                 whole_tools)))
    cut = _streamed(['{"city"', ': "Par'], _tool_request(**NAMED)[2], finish=inference_pb2.FINISH_REASON_LENGTH)
    assert cut[-1].type == "response.incomplete" and cut[-1].response.output[0].status == "incomplete"


def test_each_required_call_is_done_as_soon_as_its_object_closes():
    head, _, tools = _tool_request(tool_choice="required")
    first, second = TWO_CALLS[:TWO_CALLS.index(", {")], TWO_CALLS[TWO_CALLS.index(", {"):-1]
    parsed = _streamed([first[:20], first[20:], second, "]"], tools, head=head)
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress", *CALL_EVENTS, *CALL_EVENTS, "response.completed"]
    assert parsed[5].item.name == "get_weather" and parsed[6].item.name == "get_time"
    _, _, whole_tools = _tool_request(tool_choice="required")
    _check_calls(parsed, Response.model_validate(whole_response(head, TWO_CALLS, _message("", STOP), None,
                                                                whole_tools)))


def test_an_auto_answers_content_streams_then_its_calls_come_at_the_end():
    head, _, tools = _tool_request()
    pieces = ["Looking.", "\n<tool", HERMES[len("Looking.\n<tool"):]]
    parsed = _streamed(pieces, tools, head=head)
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", *CALL_EVENTS, "response.completed"]
    assert [event.delta for event in parsed[4:6]] == ["Looking.", "\n"]
    assert (parsed[2].item.type, parsed[2].output_index, parsed[9].output_index) == ("message", 0, 1)
    _, _, whole_tools = _tool_request()
    _check_calls(parsed, Response.model_validate(whole_response(head, HERMES, _message("", STOP), None, whole_tools)))
    plain = _streamed(["Sun", "ny."], _tool_request()[2])
    assert [event.type for event in plain][2:-1] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]


def test_a_streamed_think_block_is_done_before_the_call_is_added():
    head, _, tools = _tool_request()
    call = HERMES[len("Looking.\n"):]
    parsed = _streamed(["<think>Wea", "ther.</think>" + call[:15], call[15:]], tools,
                       ReasoningReplies(Qwen3ReasoningParser), head=head)
    assert [event.type for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done", *CALL_EVENTS, "response.completed"]
    assert parsed[9].output_index == 1 and parsed[6].text == "Weather."
    _, _, whole_tools = _tool_request()
    _check_calls(parsed, Response.model_validate(whole_response(
        head, "<think>Weather.</think>" + call, _message("", STOP), ReasoningReplies(Qwen3ReasoningParser),
        whole_tools)))


def test_a_required_answer_cut_before_a_call_streams_as_a_message():
    parsed = _streamed(['[{"name"', ': "get_w'], _tool_request(tool_choice="required")[2],
                       finish=inference_pb2.FINISH_REASON_LENGTH)
    assert [event.type for event in parsed][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert parsed[-1].response.output_text == '[{"name": "get_w'


# ---- logprobs ----------------------------------------------------------------------------------------


def _scored(text: str, *entries: tuple[int, str, float]) -> inference_pb2.GenerateStreamResponse:
    """A router message of ``text`` whose tokens are ``entries`` (id, text, logprob), each with one alternative."""
    message = _message(text)
    for token_id, token, logprob in entries:
        message.logprobs.add(sampled=inference_pb2.TokenLogprob(token_id=token_id, text=token, logprob=logprob),
                             top=[inference_pb2.TokenLogprob(token_id=9, text="!", logprob=-3.0)])
    return message


def test_logprobs_come_when_include_asks_with_top_logprobs_alternatives():
    assert parse_request({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 3}).logprobs == 3
    assert parse_request({"input": "x", "include": ["message.output_text.logprobs"]}).logprobs == 0
    plain = parse_request({"input": "x", "top_logprobs": 3})  # as vLLM: alternatives alone give no logprobs
    assert plain.logprobs is None and plain.echoed["top_logprobs"] == 3
    assert parse_request({"input": "x"}).echoed["top_logprobs"] is None


def test_a_whole_responses_text_carries_its_tokens_logprobs():
    chunks = [_scored(" Paris", (1, " Par", -0.5), (2, "is", -0.25)), _scored(".", (3, ".", -1.0))]
    last = _message("", inference_pb2.FINISH_REASON_STOP, prompt_tokens=4, completion_tokens=3)
    entries = [entry for chunk in chunks for entry in chunk.logprobs]
    response = Response.model_validate(whole_response(_head(), " Paris.", last, None, None, entries))
    [part] = response.output[0].content
    assert [(item.token, item.logprob, item.bytes) for item in part.logprobs] == [
        (" Par", -0.5, list(b" Par")), ("is", -0.25, list(b"is")), (".", -1.0, [46])]
    assert [[(top.token, top.logprob) for top in item.top_logprobs] for item in part.logprobs] == [[("!", -3.0)]] * 3
    assert "".join(item.token for item in part.logprobs) == response.output_text
    assert whole_response(_head(), " Paris.", last, None)["output"][0]["content"][0].get("logprobs") is None


def test_streamed_deltas_carry_their_tokens_logprobs_and_the_done_events_all_of_them():
    events = ResponseEvents(_head(), logprobs=True)
    raw = events.start()
    raw += events.feed(_scored(" Par", (1, " Par", -0.5)))
    raw += events.feed(_scored("", (2, "is", -0.25)))  # its text held back (it might start a stop string)
    last = _scored("is.", (3, ".", -1.0))
    last.finish_reason = inference_pb2.FINISH_REASON_STOP
    raw += events.feed(last) + events.finish(last)
    parsed = _parsed_events(raw)
    deltas = [event for event in parsed if event.type == "response.output_text.delta"]
    assert [(event.delta, [item.token for item in event.logprobs]) for event in deltas] == [
        (" Par", [" Par"]), ("is.", ["is", "."])]
    done = next(event for event in parsed if event.type == "response.output_text.done")
    assert [item.logprob for item in done.logprobs] == [-0.5, -0.25, -1.0]
    final = parsed[-1].response.output[0].content[0]
    assert [item.token for item in final.logprobs] == [" Par", "is", "."]
    assert [top.token for top in final.logprobs[0].top_logprobs] == ["!"]
