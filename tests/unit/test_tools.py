"""Function calling without a model: chats with tools (OpenAI's shapes, checks, proto form), a tool choice as a
constraint, the calls read back, and the gateway's messages and stream deltas."""

from __future__ import annotations

import json

import llguidance
import pytest

from splitserve.common.chat import MAX_TOOLS, Chat, ChatMessage, FunctionTool, ToolCall
from splitserve.common.errors import InvalidRequest
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.common.tools import (
    HermesToolParser,
    ParsedToolCall,
    RequiredCallsReader,
    required_tool_calls,
    tool_choice_constraint,
    tool_choice_of,
)
from splitserve.gateway_tools import ToolReplies, chat_tools
from splitserve.rpc.convert import chat_from_pb, chat_to_pb
from splitserve.v1 import inference_pb2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


def test_a_chat_with_tools_reads_openai_and_gives_templates_their_shapes():
    chat = Chat.from_openai(CONVERSATION, [WEATHER, TIME])
    assert chat.tools == (FunctionTool("get_weather", "The weather in a city now.",
                                       WEATHER["function"]["parameters"]), FunctionTool("get_time"))
    assert chat.messages[1] == ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                                                             ToolCall("call_2", "get_time", "not json")))
    messages = chat.template_messages()
    # Arguments that parse are an object for the template (vLLM's shape); others stay text.
    assert [call["function"]["arguments"] for call in messages[1]["tool_calls"]] == [{"city": "Paris"}, "not json"]
    assert messages[2] == {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"}
    assert chat.template_tools() == [WEATHER, TIME]
    assert Chat.from_openai([{"role": "user", "content": "Hi"}]).template_tools() is None


def test_a_chat_round_trips_through_its_proto_form():
    chat = Chat.from_openai(CONVERSATION, [WEATHER, TIME], add_generation_prompt=False)
    message = chat_to_pb(chat)
    assert json.loads(message.tools[0].parameters) == WEATHER["function"]["parameters"]
    assert message.tools[1].parameters == ""
    assert chat_from_pb(inference_pb2.ChatPrompt.FromString(message.SerializeToString())) == chat


@pytest.mark.parametrize("messages, tools, words", [
    ([], None, "non-empty list"),
    ([{"content": "x"}], None, "messages[0] must be an object with a role"),
    ([{"role": "user", "content": None}], None, "messages[0].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], None, "only text content parts"),
    ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], None, "messages[0].tool_calls[0] must be"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": "{}"}}]}], None,
     "function.name must be a non-empty string"),
    ([{"role": "user", "content": "x"}], [], "tools must be a non-empty list"),
    ([{"role": "user", "content": "x"}], [{"type": "retrieval"}], "only function tools"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "a b"}}],
     "tools[0].function.name must be 1 to 64 letters"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "x" * 65}}], "1 to 64"),
    ([{"role": "user", "content": "x"}], [TIME, TIME], "Two tools are named 'get_time'"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "parameters must be a JSON Schema object"),
    ([{"role": "user", "content": "x"}],
     [{"type": "function", "function": {"name": f"f{index}"}} for index in range(MAX_TOOLS + 1)], "more than the 128"),
])
def test_malformed_chats_are_refused_naming_where(messages, tools, words):
    with pytest.raises(InvalidRequest, match=None) as refused:
        Chat.from_openai(messages, tools)
    assert words in str(refused.value)


def test_the_router_refuses_tools_from_any_client_that_a_template_should_not_see():
    def prompt(*tools) -> inference_pb2.ChatPrompt:
        return inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(role="user", content="x")], tools=tools)

    for tools, words in (([inference_pb2.Tool(name="f", parameters="[1]")], "tools[0].parameters must be a JSON"),
                         ([inference_pb2.Tool(name="f", parameters="{")], "tools[0].parameters must be a JSON"),
                         ([inference_pb2.Tool(name="")], "1 to 64"),
                         ([inference_pb2.Tool(name="f"), inference_pb2.Tool(name="f")], "Two tools are named"),
                         ([inference_pb2.Tool(name=f"f{index}") for index in range(MAX_TOOLS + 1)], "more than")):
        with pytest.raises(InvalidRequest) as refused:
            chat_from_pb(prompt(*tools))
        assert words in str(refused.value)
    with pytest.raises(InvalidRequest, match="message 0 has no role"):
        chat_from_pb(inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(content="x")]))


def test_tool_choice_defaults_and_refusals():
    tools = Chat.from_openai([{"role": "user", "content": "x"}], [WEATHER, TIME]).tools
    assert tool_choice_of(None, tools) == "auto" and tool_choice_of(None, ()) == "none"
    assert tool_choice_of("none", ()) == "none" and tool_choice_of("required", tools) == "required"
    assert tool_choice_of({"type": "function", "function": {"name": "get_time"}}, tools) == tools[1]
    for choice, words in (("required", "needs tools"), ("sometimes", 'must be "none"'),
                          ({"type": "function", "function": {"name": "get_date"}}, "'get_date', which is not one"),
                          ({"type": "custom", "custom": {"name": "get_time"}}, 'must be "none"')):
        with pytest.raises(InvalidRequest) as refused:
            tool_choice_of(choice, tools if words != "needs tools" else ())
        assert words in str(refused.value)


def _matches(params: StructuredOutputsParams, text: str) -> bool:
    """Whether llguidance's grammar for ``params`` takes ``text`` whole (byte by byte, no tokenizer)."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = llguidance.LLMatcher(tokenizer, params.to_grammar())
    ok = matcher.consume_tokens(list(text.encode("utf-8")))
    return bool(ok) and matcher.is_accepting() and not matcher.is_error()


class _ByteTokenizer:
    """A 256-token vocabulary, one byte each, and an end-of-sequence token: enough for llguidance to match text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([index]) for index in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def test_forced_calls_are_json_schemas_over_the_tools_parameters():
    tools = Chat.from_openai([{"role": "user", "content": "x"}], [WEATHER, TIME]).tools
    assert tool_choice_constraint("none", tools) is None and tool_choice_constraint("auto", tools) is None
    named = tool_choice_constraint(tools[0], tools)
    assert json.loads(named.json) == WEATHER["function"]["parameters"]
    assert json.loads(tool_choice_constraint(tools[1], tools).json) == {"type": "object", "properties": {},
                                                                          "additionalProperties": False}
    required = tool_choice_constraint("required", tools)
    schema = json.loads(required.json)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"],
                                                                                         ["get_time"]]
    assert _matches(required, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                              '{"name": "get_time", "parameters": {}}]')
    assert not _matches(required, '[{"name": "get_weather", "parameters": {}}]')  # city is required
    assert not _matches(required, '[{"name": "get_date", "parameters": {}}]')
    assert not _matches(required, "[]")
    assert not _matches(required, '[{"name": "get_time", "parameters": {}, "description": "now"}]')  # closed items
    assert not _matches(required, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')  # it takes none
    single = tool_choice_constraint("required", tools, parallel_tool_calls=False)
    assert json.loads(single.json)["maxItems"] == 1
    assert not _matches(single, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')


def test_required_merges_the_tools_definitions_and_refuses_a_clash():
    def tool(name, definition):
        return FunctionTool(name, parameters={"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                                              "$defs": {"P": definition}})

    same = tool_choice_constraint("required", (tool("a", {"type": "integer"}), tool("b", {"type": "integer"})))
    schema = json.loads(same.json)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert all("$defs" not in item["properties"]["parameters"] for item in schema["items"]["anyOf"])
    assert _matches(same, '[{"name": "b", "parameters": {"p": 3}}]')
    with pytest.raises(InvalidRequest, match="define \\$defs 'P' differently"):
        tool_choice_constraint("required", (tool("a", {"type": "integer"}), tool("b", {"type": "string"})))


def test_a_forced_call_over_too_large_a_schema_is_refused_naming_the_tools():
    tools = tuple(FunctionTool(f"tool_{index}", parameters={"type": "object", "properties": {
        f"parameter_{number}": {"type": "string", "description": "x" * 100} for number in range(8)}})
                  for index in range(64))
    with pytest.raises(InvalidRequest) as refused:
        tool_choice_constraint("required", tools)
    assert str(refused.value).startswith("tool_choice forces calls through the schema of a call of any of the tools")
    assert "at most 65536 are allowed" in str(refused.value)


def test_required_answers_read_back_as_calls_whole_or_as_they_close():
    assert required_tool_calls('[{"name": "f", "parameters": {"x": "é"}}, {"name": "g", "parameters": {}}]') == (
        [ParsedToolCall("f", '{"x": "é"}'), ParsedToolCall("g", "{}")], True)
    # Brackets and escaped quotes inside strings are text, not structure.
    assert required_tool_calls('[{"name": "f", "parameters": {"x": "a]}\\"{[\\\\"}}]') == (
        [ParsedToolCall("f", '{"x": "a]}\\"{[\\\\"}')], True)
    # Cut short by max_tokens: the calls already whole, the array not closed.
    assert required_tool_calls('[{"name": "f", "parameters": {}}, {"name": "g", "par') == (
        [ParsedToolCall("f", "{}")], False)
    for text, complete in (('[{"name": "f", "parameters": {"x"', False), ("[]", True), ("[1]", True),
                           ('[{"parameters": {}}]', True)):
        assert required_tool_calls(text) == ([], complete), text
    reader = RequiredCallsReader()
    text = '[{"name": "f", "parameters": {"a": [1, {"b": 2}]}}, {"name": "g", "parameters": {}}]'
    pieces = [reader.feed(text[start:start + 7]) for start in range(0, len(text), 7)]
    assert [call.name for piece in pieces for call in piece] == ["f", "g"] and reader.complete
    assert [index for index, piece in enumerate(pieces) if piece] == [7, 11]  # each as soon as its object closed


def test_hermes_calls_are_read_from_the_text():
    parser = HermesToolParser()
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert parser.parse(text) == ("Let me look.\n", [ParsedToolCall("get_weather", '{"city": "Paris"}'),
                                                     ParsedToolCall("get_time", "{}")])
    assert parser.parse("No call here.") == ("No call here.", [])
    unfinished = '<tool_call>{"name": "get_time", "arguments": {}}'  # max_tokens before the closing tag
    assert parser.parse(unfinished) == ("", [ParsedToolCall("get_time", "{}")])
    for broken in ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                   '<tool_call>{"name": "f", "arguments": "x"}</tool_call>'):
        assert parser.parse(broken) == (broken, [])
    # Streamed: everything that cannot be the start of a call goes out at once.
    assert parser.safe_prefix_length("Hello <tool") == len("Hello ")
    assert parser.safe_prefix_length("Hello <") == len("Hello ")
    assert parser.safe_prefix_length("a < b") == len("a < b")
    assert parser.safe_prefix_length("x<tool_call>{") == 1


def _stream(replies: ToolReplies, pieces: list[str], finish: str) -> tuple[list[dict], str]:
    deltas = [replies.delta(0, piece, None) for piece in pieces] + [replies.delta(0, "", finish)]
    return [delta for delta, _ in deltas if delta], deltas[-1][1]


def test_a_named_call_streams_its_arguments_and_its_answer_is_one_call():
    tool = FunctionTool("get_weather")
    message, finish = ToolReplies(tool, None).message('{"city": "Paris"}', "stop")
    assert message["content"] is None and finish == "stop"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    deltas, finish = _stream(ToolReplies(tool, None), ['{"city"', "", ': "Paris"}'], "stop")
    assert finish == "stop"
    first, second = (delta["tool_calls"][0] for delta in deltas)
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert second == {"index": 0, "function": {"arguments": ': "Paris"}'}}


def test_required_calls_stream_as_each_closes_with_finish_tool_calls():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Paris"}}]'
    message, finish = ToolReplies("required", None).message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [call["function"] for call in message["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    replies = ToolReplies("required", HermesToolParser())  # the gateway's auto parser plays no part here
    first, _ = replies.delta(0, text[:44], None)
    assert [call["function"]["name"] for call in first["tool_calls"]] == ["get_time"]
    assert first["tool_calls"][0]["index"] == 0 and first["tool_calls"][0]["id"].startswith("call_")
    assert replies.delta(0, text[44:60], None) == ({}, None)
    last, finish = replies.delta(0, text[60:], "stop")
    assert finish == "tool_calls" and last["tool_calls"][0]["index"] == 1
    assert last["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # Cut short by max_tokens after one call: that call, finish length; before any: the text as content.
    cut = text[:60]
    message, finish = ToolReplies("required", None).message(cut, "length")
    assert finish == "length" and [call["function"]["name"] for call in message["tool_calls"]] == ["get_time"]
    deltas, finish = _stream(ToolReplies("required", None), [cut[:30], cut[30:]], "length")
    assert finish == "length" and [call["function"]["name"] for delta in deltas for call in delta["tool_calls"]] == [
        "get_time"]
    early = text[:12]
    assert ToolReplies("required", None).message(early, "length") == ({"role": "assistant", "content": early},
                                                                      "length")
    assert _stream(ToolReplies("required", None), [early], "length") == ([{"content": early}], "length")


def test_auto_streams_content_and_holds_back_what_may_be_a_call():
    parser = HermesToolParser()
    pieces = ["Sure", ". <to", "ol_call>", '{"name": "get_time", ', '"arguments": {}}', "</tool_call>"]
    deltas, finish = _stream(ToolReplies("auto", parser), pieces, "stop")
    assert finish == "tool_calls"
    assert [delta.get("content") for delta in deltas[:-1]] == ["Sure", ". "]
    assert deltas[-1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    # A "<" that never becomes a call goes out when it cannot, or at the end.
    deltas, finish = _stream(ToolReplies("auto", parser), ["1 <", "2", " and <to"], "length")
    assert "".join(delta["content"] for delta in deltas) == "1 <2 and <to" and finish == "length"
    message, finish = ToolReplies("auto", parser).message("Just text.", "stop")
    assert message == {"role": "assistant", "content": "Just text."} and finish == "stop"


def test_the_request_fields_become_a_constraint_or_a_refusal():
    tools = Chat.from_openai([{"role": "user", "content": "x"}], [WEATHER, TIME]).tools
    own = StructuredOutputsParams(regex="[a-z]+")
    assert chat_tools({}, (), None, own) == (own, None)
    assert chat_tools({"tool_choice": "none"}, tools, None, own) == (own, None)
    constraint, replies = chat_tools({"tool_choice": "required", "parallel_tool_calls": False}, tools, None, None)
    assert json.loads(constraint.json)["maxItems"] == 1 and replies.choice == "required"
    constraint, replies = chat_tools({"tool_choice": "auto"}, tools, HermesToolParser(), own)
    assert constraint == own and replies.choice == "auto"  # a constraint may shape an "auto" answer
    for body, constraint, words in (({}, None, "--enable-auto-tool-choice"),
                                    ({"tool_choice": "required"}, own, "not both"),
                                    ({"tool_choice": "required", "parallel_tool_calls": 1}, None, "true or false")):
        with pytest.raises(InvalidRequest) as refused:
            chat_tools(body, tools, None, constraint)
        assert words in str(refused.value)
