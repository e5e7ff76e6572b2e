"""The Responses API's request (``POST /v1/responses``) read into the chat request it stands for.

``instructions`` become a system message first, ``input`` the messages (text, and the ``function_call`` and
``function_call_output`` items of a tool loop), ``max_output_tokens`` the limit, ``text.format`` the structured
outputs, and function ``tools`` and ``tool_choice`` the chat's nested form; what needs stored state, or tools the
server would run itself, is refused with 400 naming the field. ``splitserve.gateway_responses`` writes the answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from splitserve.common.chat import MAX_TOOLS, Chat, FunctionTool, openai_tools
from splitserve.common.errors import InvalidRequest
from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.gateway import APIError, Gateway, _flag, _is_int
from splitserve.gateway_tools import ToolReplies, chat_tools

# Fields refused when set, with the sentence that says why.
_REFUSED = {
    "previous_response_id": "previous_response_id needs responses stored on the server, and this gateway keeps no "
    "state: send the whole conversation as input instead.",
    "previous_response": "previous_response is not supported: send the whole conversation as input instead.",
    "conversation": "conversation needs conversations stored on the server, and this gateway keeps no state: send "
    "the whole conversation as input instead.",
    "background": "background needs responses stored on the server, and this gateway keeps no state (nor does vLLM "
    "without VLLM_ENABLE_RESPONSES_API_STORE).",
    "prompt": "prompt (a stored prompt template) is not supported, as in vLLM: send instructions and input.",
}
# What ``include`` may ask for: the message's token logprobs (nothing else is produced here: no encrypted reasoning,
# no server-side tool outputs).
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# vLLM's fields on its ResponsesRequest beyond OpenAI's (sampling, priority, cache salt), taken as chats take them.
_VLLM_SAMPLING = ("top_k", "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias", "priority",
                  "structured_outputs", "cache_salt")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# A quoted client string (a type, an id) in an error: at most this many characters of it.
_QUOTED = 64
# The longest call_id taken on a function_call or function_call_output item.
MAX_CALL_ID = 128


@dataclass
class ResponsesRequest:
    """A /v1/responses body read into what the gateway serves.

    Attributes:
        chat_body: the same request as a /v1/chat/completions body (``messages``, ``tools``, ``tool_choice``,
            ``max_tokens``, sampling), which the gateway's checks and sampling read.
        text_format: ``text.format``'s constraint (json_schema, json_object); None for plain text.
        stream: whether the answer is a stream of events.
        echoed: the request's fields that every response object repeats, as vLLM repeats them.
        logprobs: with ``include`` message.output_text.logprobs, the alternatives each token gets (``top_logprobs``,
            0 by default); None: no logprobs.
    """

    chat_body: dict
    text_format: StructuredOutputsParams | None
    stream: bool
    echoed: dict = field(default_factory=dict)
    logprobs: int | None = None


def parse_request(body: dict) -> ResponsesRequest:
    """Read a /v1/responses body; 400 naming the field for one that is malformed or refused."""
    for name, sentence in _REFUSED.items():
        if body.get(name):
            raise APIError(400, sentence, name)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, 'truncation must be "disabled": the gateway never cuts a conversation to fit.',
                       "truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string.", "instructions")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and (not _is_int(max_output_tokens) or max_output_tokens < 1):
        raise APIError(400, "max_output_tokens must be a positive integer.", "max_output_tokens")
    tools, echoed_tools = _tools(body.get("tools"))
    chat_body = {name: body[name] for name in ("model", "temperature", "top_p", *_VLLM_SAMPLING) if name in body}
    chat_body.update(messages=_messages(instructions, body.get("input")), max_tokens=max_output_tokens,
                     chat_template_kwargs=_template_kwargs(body))
    chat_body.update(_chat_tool_fields(body, tools))
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise APIError(400, "text must be an object, such as {\"format\": {\"type\": \"json_schema\", ...}}.", "text")
    parallel = body.get("parallel_tool_calls")
    echoed = {
        "instructions": instructions, "metadata": body.get("metadata"),
        "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
        "tool_choice": body.get("tool_choice") or "auto", "tools": echoed_tools, "background": False,
        "max_output_tokens": max_output_tokens, "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": None, "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto", "text": {"format": {"type": "text"}, **(text or {})},
        "truncation": "disabled", "user": body.get("user"),
    }
    logprobs, top = _logprobs(body)
    echoed["top_logprobs"] = top
    return ResponsesRequest(chat_body, _text_format((text or {}).get("format")), _flag(body, "stream"), echoed,
                            logprobs)


def _logprobs(body: dict) -> tuple[int | None, int | None]:
    """``include`` and ``top_logprobs``: (the alternatives per token when the message's logprobs are included, else
    None; ``top_logprobs`` as given). As vLLM reads them, logprobs come only when ``include`` asks for them."""
    include, top = body.get("include"), body.get("top_logprobs")
    if include is not None and (not isinstance(include, list) or not all(isinstance(item, str) for item in include)):
        raise APIError(400, "include must be a list of strings.", "include")
    for item in include or []:
        if item != LOGPROBS_INCLUDE:
            raise APIError(400, f"include {item[:_QUOTED]!r} is not supported: only {LOGPROBS_INCLUDE!r} is (this "
                           "gateway runs no tools and keeps no encrypted reasoning).", "include")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise APIError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}.", "top_logprobs")
    return ((top or 0) if LOGPROBS_INCLUDE in (include or []) else None), top


def _tools(tools) -> tuple[list[dict] | None, list[dict]]:
    """The request's function tools, flat as the Responses API writes them (``{"type": "function", "name",
    "description", "parameters", "strict"}``): (the chat's nested form, or None for none; the response's echo).
    Any other type of tool is refused: the gateway runs no tool of its own."""
    if tools is None or tools == []:
        return None, []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools.", "tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"{len(tools)} tools are more than the {MAX_TOOLS} a request may give.", "tools")
    parsed, echoed = [], []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            shown = f"of type {kind[:_QUOTED]!r}" if isinstance(kind, str) else "without a type"
            raise APIError(400, f"tools[{index}] is a tool {shown}, which is not supported: the gateway runs no tools "
                           'of its own; send function tools ({"type": "function", "name": ..., "parameters": {...}}).',
                           "tools")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise APIError(400, f"tools[{index}].strict must be true or false.", "tools")
        try:
            parsed.append(FunctionTool.from_fields(tool, f"tools[{index}]"))
        except InvalidRequest as error:
            raise APIError(400, str(error), "tools") from None
        echoed.append({"type": "function", "name": tool["name"], "description": tool.get("description"),
                       "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    try:
        return [tool.to_openai() for tool in openai_tools(parsed)], echoed
    except InvalidRequest as error:  # two tools of one name
        raise APIError(400, str(error), "tools") from None


def _chat_tool_fields(body: dict, tools: list[dict] | None) -> dict:
    """The chat's ``tools``, ``tool_choice`` (``{"type": "function", "name"}`` nested as the chat writes it) and
    ``parallel_tool_calls``, as far as the request sets them; "auto" without tools is the default and left out."""
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict):
        kind = tool_choice.get("type")
        if kind != "function":
            shown = f"of type {kind[:_QUOTED]!r}" if isinstance(kind, str) else "without a type"
            raise APIError(400, f"A tool_choice {shown} is not supported: only function tools are.", "tool_choice")
        if not isinstance(tool_choice.get("name"), str):
            raise APIError(400, 'tool_choice {"type": "function"} needs the name of one of the tools.', "tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    elif tool_choice not in (None, "auto", "none", "required"):
        raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}.',
                       "tool_choice")
    fields = {"tools": tools, "tool_choice": None if tool_choice == "auto" and not tools else tool_choice,
              "parallel_tool_calls": body.get("parallel_tool_calls")}
    return {name: value for name, value in fields.items() if value is not None}


def _messages(instructions: str | None, input_) -> list[dict]:
    """The chat's messages: ``instructions`` as a system message first, then ``input`` (a string: one user
    message; or items: messages, each ``role`` and ``content`` a string or a list of text parts, the model's
    earlier ``function_call`` items and the caller's ``function_call_output`` items answering them; the model's
    earlier ``reasoning`` items are dropped)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input_, str):
        return [*messages, {"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise APIError(400, "input must be a string or a non-empty list of message items.", "input")
    call_ids: set[str] = set()
    for index, item in enumerate(input_):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object: a message (role and content), a function_call or a "
                           "function_call_output.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None:
                raise APIError(400, f"{where}: an input message's role must be user, assistant, system or developer.",
                               "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            call_ids.add(call["id"])
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, or calls beside it
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _call_id(item, where)
            if call_id not in call_ids:
                raise APIError(400, f"{where} is the function_call_output of call_id {call_id[:_QUOTED]!r}, which no "
                               "function_call item before it has: send the call, then its output.", "input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier answer's thought (input += response.output): dropped, as reasoning models'
            # templates drop earlier turns' think blocks
        else:
            raise APIError(400, f"{where} is of type {str(kind)[:_QUOTED]!r}, which is not supported: only messages, "
                           "reasoning, function_call and function_call_output items are.", "input")
    return messages


def _function_call(item: dict, where: str) -> dict:
    """A ``function_call`` input item as the chat's tool call."""
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise APIError(400, f"{where}.name must be the function's name, a string of 1 to 64 characters.", "input")
    if not isinstance(arguments, str):
        raise APIError(400, f"{where}.arguments must be a string: the call's arguments as JSON text.", "input")
    return {"id": _call_id(item, where), "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_id(item: dict, where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= MAX_CALL_ID:
        raise APIError(400, f"{where}.call_id must be a string of 1 to {MAX_CALL_ID} characters.", "input")
    return call_id


def _text_of(content, where: str) -> str:
    """A message's content or a call's output: a string, or its text parts (``input_text``, an assistant's
    ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: content parts of type {str(kind)[:_QUOTED]!r} are not supported: only "
                               "input_text and output_text parts (with their text) are.", "input")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where} must be a string or a non-empty list of input_text parts.", "input")


def _template_kwargs(body: dict) -> dict | None:
    """vLLM's chat_template_kwargs, with ``reasoning.effort`` as ``reasoning_effort`` (as vLLM renders it)."""
    kwargs = body.get("chat_template_kwargs")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise APIError(400, "reasoning must be an object, such as {\"effort\": \"low\"}.", "reasoning")
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return kwargs
    if not isinstance(kwargs, (dict, type(None))):
        return kwargs  # the gateway's check refuses it with its sentence
    return {**(kwargs or {}), "reasoning_effort": effort}


def _text_format(text_format) -> StructuredOutputsParams | None:
    """``text.format`` as a constraint: json_schema (``{"type", "name", "schema", "strict"}``, flat as the
    Responses API writes it) or json_object; None for text."""
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if text_format is None or kind == "text":
        return None
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema" and isinstance(text_format.get("schema"), (dict, bool)):
            return StructuredOutputsParams(json=text_format["schema"])
    except InvalidRequest as error:
        raise APIError(400, str(error), "text.format") from None
    raise APIError(400, 'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                   '"name": ..., "schema": {...}}.', "text.format")


# ---- the answer --------------------------------------------------------------------------------


def under_tool_choice(gateway: Gateway, chat_body: dict, chat: Chat,
                       params: SamplingParams) -> tuple[SamplingParams, ToolReplies | None]:
    """The sampling parameters with the constraint a forced call needs, and the tool replies that read the answer
    (None: no call may be made), as the chat route reads its ``tool_choice``; 400 naming the field."""
    if chat_body.get("tool_choice") not in (None, "auto", "none") and params.structured_outputs is not None:
        raise APIError(400, "Send text.format (or structured_outputs) or a tool_choice that forces a call, not both.",
                       "tool_choice")
    try:
        constraint, tools = chat_tools(chat_body, chat.tools, gateway._tool_parser, params.structured_outputs)
    except InvalidRequest as error:
        param = "parallel_tool_calls" if str(error).startswith("parallel_tool_calls") else "tool_choice"
        raise APIError(400, str(error), param) from None
    return dataclasses.replace(params, structured_outputs=constraint), tools
