"""The gateway's reasoning parsers (``splitserve.gateway_reasoning``): whole answers split as vLLM's
``deepseek_r1`` and ``qwen3`` parsers split them, and streams that add up to the whole answer's split however
the text is cut into deltas (a tag split across deltas is held, then released)."""

from __future__ import annotations

import random

import pytest

from splitserve.common.chat import FunctionTool
from splitserve.common.reasoning import REASONING_PARSER_NAMES
from splitserve.common.tools import tool_call_parser
from splitserve.gateway import _chat_choice
from splitserve.gateway_reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningReplies,
    reasoning_parser,
)
from splitserve.gateway_tools import ToolReplies

# text -> its split by deepseek_r1, and by qwen3 with thinking on (the template's default)
SPLITS = {
    "<think>Paris is in France.</think>\n\nParis.": ("Paris is in France.", "\n\nParis."),
    # DeepSeek-R1's template writes <think> into the prompt: its answer starts inside the block.
    "Paris is in France.</think>Paris.": ("Paris is in France.", "Paris."),
    "Just the answer.": ("Just the answer.", None),
    # The end tag never came (max_tokens): all reasoning.
    "<think>still thinking": ("still thinking", None),
    "<think></think>": ("", None),
    "<think></think>\n\nNo thought.": ("", "\n\nNo thought."),
    "": ("", None),
    # Almost tags: only the whole tag counts.
    "<thin>k</thin></think><": ("<thin>k</thin>", "<"),
    "<think>a < b and b </thinks> c</think>so <think> stays": ("a < b and b </thinks> c", "so <think> stays"),
    " <think>x</think>y": (" <think>x", "y"),
    "<": ("<", None),
    "<think": ("<think", None),
    "<think>x</think": ("x</think", None),
}
PARSERS = (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
# Qwen3 with thinking turned off (Qwen3's template then writes an empty think block into the prompt): all content.
THINKING_OFF = {"enable_thinking": False}


@pytest.mark.parametrize("text", SPLITS)
@pytest.mark.parametrize("parser", PARSERS, ids=lambda parser: parser.name)
def test_a_whole_answer_splits_as_vllm_splits_it(parser, text):
    assert parser.split(text) == SPLITS[text]
    assert parser.split(text, {"enable_thinking": True}) == SPLITS[text]


@pytest.mark.parametrize("text", SPLITS)
def test_qwen3_with_thinking_off_is_all_content(text):
    assert Qwen3ReasoningParser.split(text, THINKING_OFF) == (None, text or None)
    assert Qwen3ReasoningParser.split(text, {"enable_thinking": 0}) == (None, text or None)
    # DeepSeek-R1's parser reads no template variable.
    assert DeepSeekR1ReasoningParser.split(text, THINKING_OFF) == SPLITS[text]


def _streamed(parser, pieces: list[str], chat_template_kwargs=None) -> tuple[str | None, str | None]:
    """The whole answer's (reasoning, content) from a stream of ``pieces``, as a client adds up the deltas."""
    stream = parser(chat_template_kwargs)
    released = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    reasoning = "".join(part for part, _ in released)
    return (reasoning if stream.has_reasoning else None), "".join(part for _, part in released) or None


def _cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("text", SPLITS)
@pytest.mark.parametrize("parser,kwargs", [(DeepSeekR1ReasoningParser, None), (Qwen3ReasoningParser, None),
                                           (Qwen3ReasoningParser, THINKING_OFF)],
                         ids=["deepseek_r1", "qwen3", "qwen3-thinking-off"])
def test_every_cut_of_a_stream_adds_up_to_the_whole_split(parser, kwargs, text):
    expected = parser.split(text, kwargs)
    assert _streamed(parser, [text], kwargs) == expected
    assert _streamed(parser, list(text) or [""], kwargs) == expected  # one character a delta
    for cut in range(len(text) + 1):  # every two-piece cut, empty pieces included
        assert _streamed(parser, [text[:cut], text[cut:]], kwargs) == expected, cut
    rng = random.Random(text)
    for _ in range(50):
        assert _streamed(parser, _cuts(text, rng), kwargs) == expected


def test_a_held_tag_start_is_released_once_it_is_not_a_tag():
    stream = Qwen3ReasoningParser()
    assert stream.feed("<th") == ("", "")  # could still be <think>
    assert stream.feed("ink>Hmm </th") == ("Hmm ", "")  # "</th" could be </think>
    assert stream.feed("e end") == ("</the end", "")
    assert stream.feed("</think>\n") == ("", "\n")
    assert stream.feed("Done") == ("", "Done")
    assert stream.finish() == ("", "")
    plain = Qwen3ReasoningParser(THINKING_OFF)
    assert plain.feed("<th") == ("", "<th") and plain.finish() == ("", "")
    unopened = DeepSeekR1ReasoningParser()
    assert unopened.feed("<b") == ("<b", "") and unopened.finish() == ("", "")


def test_stream_deltas_carry_reasoning_and_content_for_each_choice():
    """Through the gateway's chat choice: reasoning deltas, then content; two choices keep their own state; the
    whole answer's message has the field, null when there is no think block (qwen3 with thinking off)."""
    replies = ReasoningReplies(DeepSeekR1ReasoningParser)
    deltas = [_chat_choice(index, text, finish, [], False, reasoning=replies, with_reasoning=True)["delta"]
              for index, text, finish in ((0, "<think>one", None), (1, "two</th", None), (0, "</think>A", None),
                                          (1, "ink>B", "stop"), (0, "", "stop"))]
    assert deltas == [{"reasoning": "one"}, {"reasoning": "two"}, {"content": "A"}, {"content": "B"}, {}]
    whole = _chat_choice(0, "<think>one</think>A", "stop", [], True, reasoning=ReasoningReplies(Qwen3ReasoningParser),
                         with_reasoning=True)["message"]
    assert whole == {"role": "assistant", "content": "A", "reasoning": "one"}
    plain = _chat_choice(0, "A", "stop", [], True, reasoning=ReasoningReplies(Qwen3ReasoningParser, THINKING_OFF),
                         with_reasoning=True)["message"]
    assert plain == {"role": "assistant", "content": "A", "reasoning": None}
    assert _chat_choice(0, "A", "stop", [], True)["message"] == {"role": "assistant", "content": "A"}


def test_tool_calls_are_read_out_of_the_content_alone():
    """A <tool_call> block inside the think block is reasoning, not a call; one after it is a call (whole and
    streamed, the stream's content before it going out as it comes)."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"<think>maybe {call}?</think>Calling.{call}"
    tools = ToolReplies("auto", tool_call_parser("hermes"))
    choice = _chat_choice(0, text, "stop", [], True, tools=tools, reasoning=ReasoningReplies(Qwen3ReasoningParser),
                          with_reasoning=True)
    message = choice["message"]
    assert message["reasoning"] == f"maybe {call}?" and message["content"] == "Calling."
    assert [tool_call["function"]["name"] for tool_call in message["tool_calls"]] == ["get_time"]
    assert choice["finish_reason"] == "tool_calls"
    replies, streamed = ReasoningReplies(Qwen3ReasoningParser), []
    for number, piece in enumerate(text[start:start + 5] for start in range(0, len(text), 5)):
        final = number == (len(text) - 1) // 5
        streamed.append(_chat_choice(0, piece, "stop" if final else None, [], False, tools=tools,
                                     reasoning=replies, with_reasoning=True))
    assert "".join(part["delta"].get("reasoning", "") for part in streamed) == message["reasoning"]
    assert "".join(part["delta"].get("content") or "" for part in streamed) == "Calling."
    [[streamed_call]] = [part["delta"]["tool_calls"] for part in streamed if "tool_calls" in part["delta"]]
    assert streamed_call["function"] == message["tool_calls"][0]["function"]
    assert streamed[-1]["finish_reason"] == "tool_calls"
    # A forced call is JSON from its first token: the gateway does not split it (ToolReplies.forces_a_call).
    assert ToolReplies(FunctionTool("get_time"), None).forces_a_call and ToolReplies("required", None).forces_a_call
    assert not tools.forces_a_call


def test_the_registry_names_vllms_parsers_and_refuses_others():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES  # the engines' --reasoning-parser takes the same
    assert reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="Unknown reasoning parser 'granite': choose one of deepseek_r1, qwen3."):
        reasoning_parser("granite")


def test_each_choices_reasoning_tokens_are_counted_and_summed():
    """The usage's reasoning tokens: each choice's think block in token ids, the tags left out; none with
    thinking turned off (qwen3), and none counted without the router's tags."""
    start, end = (5,), (6, 7)
    replies = ReasoningReplies(Qwen3ReasoningParser, None, (start, end))
    replies.count(0, [5, 1, 1])
    replies.count(1, [1, 6, 7, 2])
    replies.count(0, [1, 6])
    assert replies.reasoning_tokens == 4 + 1  # choice 0's 6 may begin </think>: reasoning until it does
    replies.count(0, [7, 9, 9])
    assert replies.reasoning_tokens == 3 + 1
    off = ReasoningReplies(Qwen3ReasoningParser, {"enable_thinking": False}, (start, end))
    off.count(0, [1, 6, 7])
    assert off.reasoning_tokens == 0
    for tags in (None, ((), end)):
        untagged = ReasoningReplies(DeepSeekR1ReasoningParser, None, tags)
        untagged.count(0, [1, 2])
        assert untagged.reasoning_tokens == 0
