"""Chat conversations with function tools: OpenAI's shapes, checked, and what a chat template is given.

A :class:`Chat` is what the router's ``ChatPrompt`` carries: messages (an assistant's may call tools, a
``tool`` message answers one call) and the function tools the model may call. :meth:`Chat.from_openai` reads
OpenAI's JSON (the gateway's request bodies, the Python clients' dicts) and refuses what is malformed with a
sentence naming where; :meth:`Chat.template_messages` and :meth:`Chat.template_tools` are the arguments of
transformers' ``apply_chat_template``, in the shapes Hugging Face chat templates read: tools as OpenAI's
``{"type": "function", "function": {...}}``, a call's arguments as an object where they parse (as vLLM passes
them: templates write ``tool_call.arguments | tojson``).

The router renders every chat, so it checks a chat that came over gRPC from any language
(:func:`check_tools`) before a template sees it. Whether a call is forced is not the chat's business: a tool
choice becomes a structured outputs constraint (``splitserve.common.tools``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequest

# OpenAI's limits: at most 128 tools a request, names of 1 to 64 letters, digits, underscores and hyphens.
MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A name or id from the network quoted in an error: at most this many characters of it.
_QUOTED = 64
# vLLM's chat_template_kwargs, bounded: a few variables of simple values, named as template variables are.
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_STRING = 1024
_TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# What the renderer sets itself (transformers' apply_chat_template's parameters and the template's own helpers);
# names ending in _token (the tokenizer's special tokens) are refused too.
_RESERVED_TEMPLATE_KWARGS = frozenset((
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now"))


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call (OpenAI's ``tools[].function``).

    Attributes:
        name: 1 to 64 letters, digits, underscores or hyphens.
        description: what it does, for the model ("" for none).
        parameters: its parameters as a JSON Schema object (None: it takes none).
    """

    name: str
    description: str = ""
    parameters: dict | None = None

    @classmethod
    def from_openai(cls, tool, where: str = "tools[0]") -> FunctionTool:
        """A tool from OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}``.

        Raises:
            InvalidRequest: another type, a bad name, a description that is not text, parameters not an object.
        """
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function,
                                                                                                       dict):
            raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{"name": ..., '
                                 '"parameters": {...}}}: only function tools are supported.')
        return cls.from_fields(function, f"{where}.function")

    @classmethod
    def from_fields(cls, fields: dict, where: str) -> FunctionTool:
        """A tool from the ``name``, ``description`` and ``parameters`` of ``fields``: the chat API's ``function``
        object, or a tool as the Responses API writes it (flat); ``where`` names it in errors.

        Raises:
            InvalidRequest: a bad name, a description that is not text, parameters not an object.
        """
        description = fields.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.description must be a string.")
        parameters = fields.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.parameters must be a JSON Schema object.")
        return cls(_tool_name(fields.get("name"), f"{where}.name"), description, parameters or None)

    def to_openai(self) -> dict:
        function = {"name": self.name}
        if self.description:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """An assistant's call of a tool.

    Attributes:
        id: the call's id, which the tool's answer (a ``tool`` message) names.
        name: the function called.
        arguments: its arguments as JSON text.
    """

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatMessage:
    """One message: who speaks and what (``content`` "" when an assistant only calls tools)."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


# Why a chat may not both open a new assistant turn and continue its last message.
BOTH_TURN_FLAGS = ("Set add_generation_prompt or continue_final_message, not both: the prompt either opens a new "
                   "assistant turn or continues its last message.")


@dataclass(frozen=True)
class Chat:
    """A conversation for the model's chat template.

    Attributes:
        messages: oldest first.
        tools: the functions the model may call (shown to it by templates that read ``tools``).
        add_generation_prompt: end with the template's "the assistant answers" marker.
        chat_template_kwargs: more variables for the template by name (vLLM's ``chat_template_kwargs``, such as
            ``{"enable_thinking": False}``), as :func:`check_chat_template_kwargs` allows them.
        continue_final_message: end the prompt inside the last message, which the model then continues (an
            assistant's answer begun for it: transformers' and vLLM's ``continue_final_message``); the
            template's end-of-turn after it is left out. Not with ``add_generation_prompt``.

    Raises:
        InvalidRequest: both ``add_generation_prompt`` and ``continue_final_message``.
    """

    messages: tuple[ChatMessage, ...]
    tools: tuple[FunctionTool, ...] = field(default=())
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest(BOTH_TURN_FLAGS)

    @classmethod
    def from_openai(cls, messages, tools=None, add_generation_prompt: bool = True,
                    chat_template_kwargs=None, continue_final_message: bool = False) -> Chat:
        """A chat from OpenAI's messages (content a string, a list of text parts, or null beside tool calls;
        ``tool_calls`` on assistant messages, ``tool_call_id`` on tool messages), tools and template variables.

        Raises:
            InvalidRequest: no messages, a malformed one, tools :func:`check_tools` refuses, or template variables
                :func:`check_chat_template_kwargs` refuses.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects.")
        parsed_tools = openai_tools(tools)
        return cls(tuple(_openai_message(message, f"messages[{index}]") for index, message in enumerate(messages)),
                   parsed_tools, add_generation_prompt, check_chat_template_kwargs(chat_template_kwargs),
                   continue_final_message)

    def template_messages(self) -> list[dict]:
        """The messages as chat templates read them (each call's arguments an object where they parse)."""
        rendered = []
        for message in self.messages:
            item = {"role": message.role, "content": message.content}
            if message.tool_calls:
                item["tool_calls"] = [{"id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": _parsed_arguments(call)}}
                                      for call in message.tool_calls]
            if message.tool_call_id:
                item["tool_call_id"] = message.tool_call_id
            if message.name:
                item["name"] = message.name
            rendered.append(item)
        return rendered

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape); None without tools."""
        return [tool.to_openai() for tool in self.tools] or None


def check_tools(tools: Sequence[FunctionTool]) -> None:
    """Refuses more than :data:`MAX_TOOLS` tools, a bad name, or two tools of one name.

    Raises:
        InvalidRequest: naming the tool.
    """
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(tools)} tools are more than the {MAX_TOOLS} a request may give.")
    seen = set()
    for index, tool in enumerate(tools):
        _tool_name(tool.name, f"tools[{index}].function.name")
        if tool.name in seen:
            raise InvalidRequest(f"Two tools are named {tool.name!r}: each name must be unique.")
        seen.add(tool.name)


def check_chat_template_kwargs(kwargs) -> dict:
    """vLLM's ``chat_template_kwargs`` (None: none) checked: an object of at most :data:`MAX_TEMPLATE_KWARGS`
    template variables (names of letters, digits and underscores, none the renderer sets itself) whose values are
    booleans, integers, finite numbers or strings of at most :data:`MAX_TEMPLATE_STRING` characters.

    Returns:
        A new dict of them.

    Raises:
        InvalidRequest: naming the variable and what is wrong.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object of template variables.")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"chat_template_kwargs has {len(kwargs)} variables, more than the "
                             f"{MAX_TEMPLATE_KWARGS} a request may give.")
    for name, value in kwargs.items():
        if not isinstance(name, str) or not _TEMPLATE_KWARG_NAME.fullmatch(name):
            raise InvalidRequest(f"chat_template_kwargs: {str(name)[:_QUOTED]!r} is not a template variable's name "
                                 "(1 to 64 letters, digits or underscores, not starting with a digit).")
        if name in _RESERVED_TEMPLATE_KWARGS or name.endswith("_token"):
            raise InvalidRequest(f"chat_template_kwargs may not set {name!r}: the renderer sets it (send messages, "
                                 "tools and the other fields of the request instead).")
        simple = isinstance(value, (bool, str)) or (isinstance(value, int) and -2**63 <= value < 2**63) or (
            isinstance(value, float) and math.isfinite(value))
        if not simple:
            raise InvalidRequest(f"chat_template_kwargs.{name} must be a boolean, an integer, a finite number or a "
                                 "string.")
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_STRING:
            raise InvalidRequest(f"chat_template_kwargs.{name} is {len(value)} characters, more than the "
                                 f"{MAX_TEMPLATE_STRING} a variable may hold.")
    return dict(kwargs)


def openai_tools(tools) -> tuple[FunctionTool, ...]:
    """OpenAI's ``tools`` (None: none) as FunctionTools, checked (:func:`check_tools`).

    Raises:
        InvalidRequest: not a non-empty list, a tool that is not a function, or what check_tools refuses.
    """
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)) or not tools:
        raise InvalidRequest("tools must be a non-empty list of function tools (leave it out for none).")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(tools)} tools are more than the {MAX_TOOLS} a request may give.")
    parsed = tuple(tool if isinstance(tool, FunctionTool) else FunctionTool.from_openai(tool, f"tools[{index}]")
                   for index, tool in enumerate(tools))
    check_tools(parsed)
    return parsed


def _openai_message(message, where: str) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
        raise InvalidRequest(f"{where} must be an object with a role and a content.")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise InvalidRequest(f"{where}: only text content parts are supported.")
        content = "".join(str(part.get("text", "")) for part in content)
    calls = _openai_tool_calls(message.get("tool_calls"), where)
    if content is None and (calls or message["role"] == "assistant"):
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts.")
    tool_call_id, name = message.get("tool_call_id") or "", message.get("name") or ""
    if not isinstance(tool_call_id, str) or not isinstance(name, str):
        raise InvalidRequest(f"{where}: tool_call_id and name must be strings.")
    return ChatMessage(message["role"], content, calls, tool_call_id, name)


def _openai_tool_calls(calls, where: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, (list, tuple)):
        raise InvalidRequest(f"{where}.tool_calls must be a list of function calls.")
    parsed = []
    for index, call in enumerate(calls):
        if isinstance(call, ToolCall):
            parsed.append(call)
            continue
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise InvalidRequest(f'{where}.tool_calls[{index}] must be {{"id": ..., "type": "function", '
                                 '"function": {"name": ..., "arguments": ...}}.')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):  # some clients send the object itself
            arguments = json.dumps(arguments)
        call_id = call.get("id") or ""
        if not isinstance(arguments, str) or not isinstance(call_id, str):
            raise InvalidRequest(f"{where}.tool_calls[{index}]: id and function.arguments must be strings.")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.tool_calls[{index}].function.name must be a non-empty string.")
        parsed.append(ToolCall(call_id, name, arguments))
    return tuple(parsed)


def _tool_name(name, where: str) -> str:
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        shown = repr(name[:_QUOTED]) if isinstance(name, str) else type(name).__name__
        raise InvalidRequest(f"{where} must be 1 to 64 letters, digits, underscores or hyphens, got {shown}.")
    return name


def _parsed_arguments(call: ToolCall):
    """The call's arguments as an object when they are a JSON object; as the text otherwise."""
    try:
        parsed = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return call.arguments
    return parsed if isinstance(parsed, dict) else call.arguments
