"""Function calling: a tool choice as a structured outputs constraint, and tool calls read back from the text.

OpenAI's ``tool_choice`` asks for one of four things, done as vLLM does them:

- ``"none"``: plain text; the tools are still shown to the model by its chat template.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that function's
  arguments, constrained by its parameters' JSON schema (:func:`tool_choice_constraint`); the whole text is the
  call's arguments.
- ``"required"``: the output is a JSON array of one or more ``{"name": ..., "parameters": {...}}``, each item
  one of the tools (``anyOf`` over them; at most one item with ``parallel_tool_calls`` false), read back by
  :func:`required_tool_calls`. Unlike vLLM's schema, an item takes no other key, and a tool declared without
  parameters takes ``{}`` only: vLLM leaves both open, and a small model fills them with keys of its own (a
  "description" of the weather, hundreds of tokens long).
- ``"auto"``: the model decides, and a parser for its own format finds the calls in its text. The one parser
  here is ``hermes`` (:class:`HermesToolParser`): calls written ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, the format of Hermes, Qwen 2.5 and 3, and SmolLM3, and of the ChatML tools template shipped in
  ``examples/``.

Nothing here imports torch or gRPC: the gateway calls it, and so can any Python caller of the router.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.chat import FunctionTool
from splitserve.common.errors import InvalidRequest
from splitserve.common.structured_outputs import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ParsedToolCall:
    """A call read from the model's text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def new_tool_call_id() -> str:
    """A fresh call id, as OpenAI writes them: ``call_`` and 24 characters."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_choice_of(tool_choice, tools: Sequence[FunctionTool]) -> str | FunctionTool:
    """OpenAI's ``tool_choice`` checked against the tools: ``"none"``, ``"auto"``, ``"required"`` or the named
    tool. Unset, it is ``"auto"`` when there are tools and ``"none"`` when there are none (OpenAI's defaults).

    Raises:
        InvalidRequest: another value, a choice other than none without tools, or a name none of them has.
    """
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice == "none":
        return "none"
    if not tools:
        raise InvalidRequest("tool_choice needs tools: give the functions the model may call.")
    if tool_choice in ("auto", "required"):
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice_kind(tool_choice) != "function" or not isinstance(name, str):
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}.')
    named = next((tool for tool in tools if tool.name == name), None)
    if named is None:
        raise InvalidRequest(f"tool_choice names {name[:64]!r}, which is not one of the tools.")
    return named


def tool_choice_kind(tool_choice) -> str | None:
    return tool_choice.get("type", "function") if isinstance(tool_choice, dict) else None


def tool_choice_constraint(choice: str | FunctionTool, tools: Sequence[FunctionTool],
                           parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The structured outputs constraint that makes the model call tools as ``choice`` (from
    :func:`tool_choice_of`) asks; None for ``"none"`` and ``"auto"``, which leave the text free.

    Raises:
        InvalidRequest: two tools define one ``$defs`` name differently ("required" puts every tool's
            definitions in one schema).
    """
    if isinstance(choice, FunctionTool):
        return _schema_constraint(_parameters_schema(choice.parameters), f"{choice.name}'s parameters")
    if choice != "required":
        return None
    definitions: dict = {}
    items = []
    for tool in tools:
        parameters = dict(_parameters_schema(tool.parameters))
        for name, schema in (parameters.pop("$defs", None) or {}).items():
            if definitions.setdefault(name, schema) != schema:
                raise InvalidRequest(f"Two tools define $defs {name[:64]!r} differently; one schema holds them all.")
        items.append({"properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return _schema_constraint(schema, "the schema of a call of any of the tools")


class RequiredCallsReader:
    """Reads a ``"required"`` answer (a JSON array of ``{"name", "parameters"}`` objects) as it is generated: each
    call once its object closes, so a stream sends every call as soon as it is whole.

    The grammar makes the text a JSON array's prefix; the reader still checks each object it closes (a name that
    is a string), and :attr:`complete` says whether the array closed.
    """

    def __init__(self) -> None:
        self.text = ""
        self.complete = False
        self._depth = 0
        self._in_string = self._escaped = False
        self._item_start = -1

    def feed(self, text: str) -> list[ParsedToolCall]:
        """The calls whose objects ``text`` (the answer's next piece) closes."""
        calls = []
        offset = len(self.text)
        self.text += text
        for position, character in enumerate(text, offset):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif character == "\\":
                    self._escaped = True
                elif character == '"':
                    self._in_string = False
            elif character == '"':
                self._in_string = True
            elif character in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item_start = position
            elif character in "]}":
                self._depth -= 1
                if self._depth == 1 and self._item_start >= 0:
                    call = _required_item(self.text[self._item_start:position + 1])
                    if call is not None:
                        calls.append(call)
                    self._item_start = -1
                elif self._depth == 0:
                    self.complete = True
        return calls


def required_tool_calls(text: str) -> tuple[list[ParsedToolCall], bool]:
    """The calls of a whole ``"required"`` answer, and whether its array closed (an answer cut off by max_tokens
    keeps the calls it finished)."""
    reader = RequiredCallsReader()
    calls = reader.feed(text)
    return calls, reader.complete


def _required_item(text: str) -> ParsedToolCall | None:
    """One item of a "required" answer as a call (its parameters as compact JSON text, as vLLM writes them)."""
    try:
        item = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    return ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))


class HermesToolParser:
    """Tool calls written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes' format).

    :meth:`parse` reads a whole answer: the text before the first call is its content, each block a call. An
    answer whose blocks do not all parse is content whole, with no call, as vLLM's parser leaves it.
    """

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls) of a whole answer."""
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = json.loads(block.strip())
            except (ValueError, RecursionError):
                return text, []
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments,
                                                                                                      dict):
                return text, []
            calls.append(ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        return text[:start], calls

    def safe_prefix_length(self, text: str) -> int:
        """How much of a streamed answer so far is surely content: all of it before a ``<tool_call>`` tag, or
        before a tail that could still become one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        for length in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-length:]):
                return len(text) - length
        return len(text)


def tool_call_parser(name: str) -> HermesToolParser:
    """The parser called ``name`` (one of :data:`TOOL_CALL_PARSERS`)."""
    if name != "hermes":
        raise ValueError(f"Unknown tool call parser {name!r}; choose from {', '.join(TOOL_CALL_PARSERS)}.")
    return HermesToolParser()


def _schema_constraint(schema: dict, what: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except InvalidRequest as error:  # too large, say: the sentence names the tools, not a "json" the caller never sent
        raise InvalidRequest(f"tool_choice forces calls through {what}, which is refused: {error}") from None


def _parameters_schema(parameters: dict | None) -> dict:
    """A tool's parameters as the schema its arguments must match: ``{}`` when it declares none (vLLM allows any
    object there, and a small model fills it with keys of its own)."""
    return parameters if parameters else {"type": "object", "properties": {}, "additionalProperties": False}
