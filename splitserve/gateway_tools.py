"""The gateway's tool calls: a chat request's ``tools`` and ``tool_choice``, and its answers' ``tool_calls``.

:func:`chat_tools` reads the request (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``) into the
chat's tools, the constraint that forces a call (``splitserve.common.tools``) and a :class:`ToolReplies` that
writes each choice's message or stream deltas as OpenAI does: a forced call's text is its ``tool_calls``
(``finish_reason`` "tool_calls" for "required", "stop" for a named function, as OpenAI and vLLM say), and with
``"auto"`` the parser finds the calls. Streamed, a named call's arguments go out as they are generated, each
"required" call as soon as its object closes, and an "auto" answer's content as it comes (only a tail that could
begin a call waits), its calls at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.chat import FunctionTool
from splitserve.common.errors import InvalidRequest
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.common.tools import (
    HermesToolParser,
    ParsedToolCall,
    RequiredCallsReader,
    new_tool_call_id,
    required_tool_calls,
    tool_choice_constraint,
    tool_choice_of,
)


@dataclass
class _ChoiceState:
    """One streamed choice: its text so far, how much of it went out as content, its named call's id, and a
    "required" answer's reader with the count of calls sent."""

    text: str = ""
    num_sent: int = 0
    call_id: str = field(default_factory=new_tool_call_id)
    header_sent: bool = False
    reader: RequiredCallsReader = field(default_factory=RequiredCallsReader)
    num_calls: int = 0


class ToolReplies:
    """Writes a chat's choices under a tool choice: ``message`` for a whole answer, ``delta`` for a stream.

    Args:
        choice: ``"auto"``, ``"required"`` or the named tool (``tool_choice_of``).
        parser: reads calls out of an ``"auto"`` answer.
    """

    def __init__(self, choice: str | FunctionTool, parser: HermesToolParser | None) -> None:
        self.choice, self.parser = choice, parser
        self._states: dict[int, _ChoiceState] = {}

    @property
    def forces_a_call(self) -> bool:
        """The answer is calls generated under their schema ("required" or a named function), never free text."""
        return self.choice == "required" or isinstance(self.choice, FunctionTool)

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole answer's message and finish reason."""
        content, calls, finish = self._read(text, finish)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": new_tool_call_id(), "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in calls]
        return message, finish

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The stream's delta for choice ``index``'s next ``text`` (``finish`` set on its last)."""
        state = self._states.setdefault(index, _ChoiceState())
        state.text += text
        if isinstance(self.choice, FunctionTool):  # the text is the arguments: each piece streams as it comes
            if not text and (state.header_sent or finish is None):
                return {}, finish
            call = {"index": 0, "function": {"arguments": text}}
            if not state.header_sent:
                call.update(id=state.call_id, type="function")
                call["function"] = {"name": self.choice.name, "arguments": text}
                state.header_sent = True
            return {"tool_calls": [call]}, finish
        if self.choice == "required":
            return self._required_delta(state, text, finish)
        if finish is None:  # content that cannot start a call goes out now; a call waits for the end
            return self._content_delta(state, self.parser.safe_prefix_length(state.text)), None
        content, calls, finish = self._read(state.text, finish)
        delta = self._content_delta(state, len(content or ""))
        if calls:
            delta["tool_calls"] = _call_deltas(calls, 0)
        return delta, finish

    def _required_delta(self, state: _ChoiceState, text: str, finish: str | None) -> tuple[dict, str | None]:
        """Each call as soon as its object closes; at the end, an answer that made no call is content."""
        calls = state.reader.feed(text)
        delta = {"tool_calls": _call_deltas(calls, state.num_calls)} if calls else {}
        state.num_calls += len(calls)
        if finish is not None:
            if not state.num_calls:
                delta = self._content_delta(state, len(state.text))
            elif state.reader.complete and finish == "stop":
                finish = "tool_calls"
        return delta, finish

    def _content_delta(self, state: _ChoiceState, shown: int) -> dict:
        if shown <= state.num_sent:
            return {}
        delta = {"content": state.text[state.num_sent:shown]}
        state.num_sent = shown
        return delta

    def _read(self, text: str, finish: str | None) -> tuple[str | None, list[ParsedToolCall], str | None]:
        """(content, calls, finish reason) of a whole answer."""
        if isinstance(self.choice, FunctionTool):
            return None, [ParsedToolCall(self.choice.name, text)], finish
        if self.choice == "required":
            calls, complete = required_tool_calls(text)
            if not calls:  # cut short (max_tokens) before a call was whole: the text as it is
                return text, [], finish
            return None, calls, "tool_calls" if complete and finish == "stop" else finish
        content, calls = self.parser.parse(text)
        if not calls:
            return text, [], finish
        return content or None, calls, "tool_calls"


def chat_tools(body: dict, tools: tuple[FunctionTool, ...], parser: HermesToolParser | None,
               constraint: StructuredOutputsParams | None) -> tuple[StructuredOutputsParams | None, ToolReplies | None]:
    """The request's constraint and its tool replies (None when no tool may be called: ``tool_choice`` "none", or
    no tools). ``constraint`` is the request's own structured outputs, if any.

    Raises:
        InvalidRequest: a bad ``tool_choice`` or ``parallel_tool_calls``, "auto" without a parser (the gateway's
            ``--enable-auto-tool-choice``), or a forced call beside structured outputs of the request's own.
    """
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false.")
    choice = tool_choice_of(body.get("tool_choice"), tools)
    if choice == "none":
        return constraint, None
    if choice == "auto" and parser is None:
        raise InvalidRequest('"auto" tool choice needs the gateway started with --enable-auto-tool-choice and '
                             '--tool-call-parser; ask with tool_choice "required", a named function or "none" '
                             'instead.')
    forced = tool_choice_constraint(choice, tools, parallel is not False)
    if forced is not None and constraint is not None:
        raise InvalidRequest("Send structured outputs (response_format, structured_outputs) or a tool_choice that "
                             "forces a call, not both.")
    return forced or constraint, ToolReplies(choice, parser)


def _call_deltas(calls: list[ParsedToolCall], first_index: int) -> list[dict]:
    """Stream deltas of whole calls, numbered from ``first_index``."""
    return [{"index": index, "id": new_tool_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for index, call in enumerate(calls, first_index)]
