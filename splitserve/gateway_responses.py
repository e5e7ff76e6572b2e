"""OpenAI's Responses API (``POST /v1/responses``) on the gateway, as vLLM's OpenAI server serves it.

A request is read into the chat request it stands for (``instructions`` a system message first, ``input`` the
messages, ``max_output_tokens`` the limit, ``text.format`` the structured outputs), so the gateway's own checks,
sampling, router calls and disconnect handling serve it as they serve ``/v1/chat/completions``; only the answer's
shape is this module's: a ``response`` object, or its stream of named server-sent events (``event: TYPE`` and
``data: JSON``, numbered by ``sequence_number``, no ``[DONE]``), the field names and the event order those of
``openai.types.responses``.

The gateway keeps no state, so what needs stored responses is refused with 400 and a sentence
(``previous_response_id``, ``background``, ``conversation``); ``store`` is taken and nothing is stored, as vLLM
does by default. Tools, ``include`` and ``top_logprobs`` are refused too (not in this slice).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from splitserve.common.errors import InvalidRequest
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.gateway import APIError, Gateway, _chain, _chat, _flag, _is_int
from splitserve.gateway_reasoning import ReasoningReplies
from splitserve.v1 import inference_pb2

logger = logging.getLogger(__name__)

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
    "tools": "tools are not supported on /v1/responses yet: use /v1/chat/completions for function calls.",
    "include": "include is not supported on /v1/responses yet (no logprobs, encrypted reasoning or tool outputs).",
    "top_logprobs": "top_logprobs is not supported on /v1/responses yet.",
}
# vLLM's sampling fields on its ResponsesRequest beyond OpenAI's, taken as chat requests take them.
_VLLM_SAMPLING = ("top_k", "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias", "priority",
                  "structured_outputs")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_STATUS = {inference_pb2.FINISH_REASON_STOP: "completed", inference_pb2.FINISH_REASON_LENGTH: "incomplete",
           inference_pb2.FINISH_REASON_ERROR: "failed"}  # anything else (an abort): incomplete, no reason


@dataclass
class ResponsesRequest:
    """A /v1/responses body read into what the gateway serves.

    Attributes:
        chat_body: the same request as a /v1/chat/completions body (``messages``, ``max_tokens``, sampling),
            which the gateway's checks and sampling read.
        text_format: ``text.format``'s constraint (json_schema, json_object); None for plain text.
        stream: whether the answer is a stream of events.
        echoed: the request's fields that every response object repeats, as vLLM repeats them.
    """

    chat_body: dict
    text_format: StructuredOutputsParams | None
    stream: bool
    echoed: dict = field(default_factory=dict)


def parse_request(body: dict) -> ResponsesRequest:
    """Read a /v1/responses body; 400 naming the field for one that is malformed or refused."""
    for name, sentence in _REFUSED.items():
        if body.get(name):
            raise APIError(400, sentence, name)
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise APIError(400, "tool_choice must be auto or none: tools are not supported on /v1/responses yet.",
                       "tool_choice")
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, 'truncation must be "disabled": the gateway never cuts a conversation to fit.',
                       "truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string.", "instructions")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and (not _is_int(max_output_tokens) or max_output_tokens < 1):
        raise APIError(400, "max_output_tokens must be a positive integer.", "max_output_tokens")
    chat_body = {name: body[name] for name in ("model", "temperature", "top_p", *_VLLM_SAMPLING) if name in body}
    chat_body.update(messages=_messages(instructions, body.get("input")), max_tokens=max_output_tokens,
                     chat_template_kwargs=_template_kwargs(body))
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise APIError(400, "text must be an object, such as {\"format\": {\"type\": \"json_schema\", ...}}.", "text")
    echoed = {
        "instructions": instructions, "metadata": body.get("metadata"), "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice") or "auto", "tools": [], "background": False,
        "max_output_tokens": max_output_tokens, "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": None, "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto", "text": {"format": {"type": "text"}, **(text or {})},
        "top_logprobs": None, "truncation": "disabled", "user": body.get("user"),
    }
    return ResponsesRequest(chat_body, _text_format((text or {}).get("format")), _flag(body, "stream"), echoed)


def _messages(instructions: str | None, input_) -> list[dict]:
    """The chat's messages: ``instructions`` as a system message first, then ``input`` (a string: one user
    message; or message items, each ``role`` and ``content`` a string or a list of text parts)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input_, str):
        return [*messages, {"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise APIError(400, "input must be a string or a non-empty list of message items.", "input")
    for item in input_:
        if not isinstance(item, dict):
            raise APIError(400, "each input item must be an object (a message with role and content).", "input")
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(400, f"input items of type {str(kind)[:64]!r} are not supported: only messages (role "
                           "and content) are.", "input")
        role = _ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
        if role is None:
            raise APIError(400, "an input message's role must be user, assistant, system or developer.", "input")
        messages.append({"role": role, "content": _text_of(item.get("content"))})
    return messages


def _text_of(content) -> str:
    """A message's content: a string, or its text parts (``input_text``, an assistant's ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise APIError(400, f"content parts of type {str(kind)[:64]!r} are not supported: only input_text "
                               "and output_text parts (with their text) are.", "input")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, "an input message's content must be a string or a non-empty list of input_text parts.",
                   "input")


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


@dataclass
class ResponseHead:
    """What every form of one response shares: its ids, model, creation time and the request's echoed fields."""

    id: str
    created_at: int
    model: str
    echoed: dict
    message_id: str = ""
    reasoning_id: str = ""

    @classmethod
    def new(cls, model: str, echoed: dict) -> ResponseHead:
        hex_id = uuid.uuid4().hex
        return cls(f"resp_{hex_id}", int(time.time()), model, echoed, f"msg_{hex_id}", f"rs_{hex_id}")

    def response(self, status: str, output: list, usage: dict | None = None, last=None) -> dict:
        """The response object; ``last`` (the router's last message) gives an incomplete one its reason and a
        failed one its error."""
        answer = {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                  "status": status, "output": output, "usage": usage, "incomplete_details": None, "error": None,
                  **self.echoed}
        if status == "incomplete":
            length = last is not None and last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
            answer["incomplete_details"] = {"reason": "max_output_tokens" if length else None}
        elif status == "failed":
            answer["error"] = {"code": "server_error", "message": _failure(last)}
        return answer

    def message(self, text: str, status: str = "completed") -> dict:
        """The assistant's message item (one ``output_text`` part; ``status`` "in_progress": no part yet)."""
        content = [] if status == "in_progress" else [_output_text(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def reasoning(self, text: str, status: str = "completed") -> dict:
        """The reasoning item: the think block as one ``reasoning_text`` part, no summary (vLLM's shape)."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content, "status": status}

    def output(self, reasoning: str | None, content: str | None) -> list:
        """The output items: the reasoning item when there is a think block, then the message."""
        return ([self.reasoning(reasoning)] if reasoning is not None else []) + [self.message(content or "")]


def whole_response(head: ResponseHead, text: str, last, reasoning: ReasoningReplies | None) -> dict:
    """The non-streamed response for a generation's whole ``text`` and its ``last`` router message."""
    thought, content = reasoning.whole(text) if reasoning is not None else (None, text)
    return head.response(response_status(last), head.output(thought, content), usage_object(last.usage), last)


def response_status(last) -> str:
    """completed (a stop), incomplete (cut by max_output_tokens, or aborted), failed (the workers failed)."""
    return _STATUS.get(last.finish_reason, "incomplete")


def usage_object(usage: inference_pb2.Usage) -> dict:
    """The Responses API's usage, with the details objects the SDK requires (no reasoning tokens counted)."""
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseEvents:
    """One streamed response's server-sent events, numbered in order: ``start()``, ``feed()`` for each router
    message, then ``finish()`` (or ``error()``). Items open when their first text comes: the reasoning item (with
    a parser, while the think block lasts), then the message, which always comes."""

    def __init__(self, head: ResponseHead, reasoning: ReasoningReplies | None = None) -> None:
        self.head, self.reasoning_parser = head, reasoning
        self.sequence_number = 0
        self.reasoning: str | None = None  # the think block so far; None until it starts
        self.text: str | None = None  # the message's text so far; None until the message opens
        self.reasoning_done = False

    def start(self) -> list[str]:
        response = self.head.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, message) -> list[str]:
        """The events of one router message's text (held back while it may begin a think tag)."""
        final = message.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
        thought, content = (self.reasoning_parser.delta(0, message.text, final) if self.reasoning_parser is not None
                            else ("", message.text))
        events = []
        if thought:
            if self.reasoning is None:
                self.reasoning = ""
                events += self._open(self.head.reasoning("", "in_progress"), {"type": "reasoning_text", "text": ""},
                                     self._reasoning_place())
            self.reasoning += thought
            events.append(self._event("response.reasoning_text.delta", **self._reasoning_place(), delta=thought))
        if content:
            events += self._open_message()
            self.text += content
            events.append(self._event("response.output_text.delta", **self._message_place(), delta=content,
                                      logprobs=[]))
        return events

    def finish(self, last) -> list[str]:
        """The last events: every item done, then ``response.completed`` (or ``response.incomplete``); a failure
        on the workers is an ``error`` event instead."""
        if last.finish_reason == inference_pb2.FINISH_REASON_ERROR:
            return [self.error(_failure(last), "server_error")]
        events = self._close_reasoning() + self._open_message()
        part = _output_text(self.text)
        place = self._message_place()
        events += [self._event("response.output_text.done", **place, text=self.text, logprobs=[]),
                   self._event("response.content_part.done", **place, part=part),
                   self._event("response.output_item.done", output_index=place["output_index"],
                               item=self.head.message(self.text))]
        status = response_status(last)
        response = self.head.response(status, self.head.output(self.reasoning, self.text),
                                      usage_object(last.usage), last)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def error(self, message: str, code: str | None) -> str:
        """OpenAI's ``error`` event (the SDK's ResponseErrorEvent): the stream's last."""
        return self._event("error", code=code, message=message, param=None)

    def _open(self, item: dict, part: dict, place: dict) -> list[str]:
        return [self._event("response.output_item.added", output_index=place["output_index"], item=item),
                self._event("response.content_part.added", **place, part=part)]

    def _open_message(self) -> list[str]:
        if self.text is not None:
            return []
        events = self._close_reasoning()
        self.text = ""
        return events + self._open(self.head.message("", "in_progress"), _output_text("", logprobs=[]),
                                   self._message_place())

    def _close_reasoning(self) -> list[str]:
        if self.reasoning is None or self.reasoning_done:
            return []
        self.reasoning_done = True
        place = self._reasoning_place()
        return [self._event("response.reasoning_text.done", **place, text=self.reasoning),
                self._event("response.content_part.done", **place,
                            part={"type": "reasoning_text", "text": self.reasoning}),
                self._event("response.output_item.done", output_index=0, item=self.head.reasoning(self.reasoning))]

    def _reasoning_place(self) -> dict:
        """Where the reasoning item's events point: it is always the first item."""
        return {"item_id": self.head.reasoning_id, "output_index": 0, "content_index": 0}

    def _message_place(self) -> dict:
        """Where the message's events point: after the reasoning item, when there is one."""
        return {"item_id": self.head.message_id, "output_index": 0 if self.reasoning is None else 1,
                "content_index": 0}

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


def _output_text(text: str, logprobs: list | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return part if logprobs is None else {**part, "logprobs": logprobs}


def _failure(last) -> str:
    detail = last.error_message if last is not None and last.error_message else "the workers failed it"
    return f"The response failed after it started: {detail}."


# ---- the route --------------------------------------------------------------------------------


async def create_response(gateway: Gateway, request: Request) -> Response:
    """``POST /v1/responses``: one generation of the request's chat through the router, answered whole or as
    events; the caller leaving cancels it on the workers."""
    body = await gateway._body(request)
    parsed = parse_request(body)
    info, lora_name = await gateway._model_of(request, body)
    try:
        chat = _chat(parsed.chat_body)
    except APIError as error:
        raise APIError(error.status, error.message, "input" if error.param == "messages" else error.param) from None
    params = gateway._params(parsed.chat_body, info, default_max_tokens=info.max_model_len)
    if parsed.text_format is not None:
        if params.structured_outputs is not None:
            raise APIError(400, "Send text.format or structured_outputs, not both.", "structured_outputs")
        params = dataclasses.replace(params, structured_outputs=parsed.text_format)
    echoed = {**parsed.echoed, "temperature": params.temperature, "top_p": params.top_p}
    head = ResponseHead.new(lora_name or gateway._model_name(info), echoed)
    reasoning = (ReasoningReplies(gateway._reasoning_parser, chat.chat_template_kwargs)
                 if gateway._reasoning_parser is not None else None)
    calls, streams, firsts = await gateway._start(request, parsed.chat_body, [(chat, 0)], params, head.id, lora_name)
    if not parsed.stream:
        [chunks] = await gateway._collect(request, calls, streams, firsts)
        last = chunks[-1] if chunks else inference_pb2.GenerateStreamResponse()
        return JSONResponse(whole_response(head, "".join(chunk.text for chunk in chunks), last, reasoning))
    events = _stream(ResponseEvents(head, reasoning), calls, firsts[0], streams[0])
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(events: ResponseEvents, calls: list, first, stream: AsyncIterator) -> AsyncIterator[str]:
    """The response's events as the router's messages come. Starlette stops iterating when the caller leaves; the
    ``finally`` then cancels the call, and the workers free its blocks. A failure ends the stream with an
    ``error`` event, never a hang."""
    try:
        for event in events.start():
            yield event
        last = inference_pb2.GenerateStreamResponse()
        async for message in _chain([first] if first is not None else [], stream):
            last = message
            for event in events.feed(message):
                yield event
        for event in events.finish(last):
            yield event
    except APIError as error:
        yield events.error(error.message, error.code)
    except Exception as error:  # not the router's answer: still the stream's end, never a silent hang
        logger.exception("a response's stream failed")
        yield events.error(f"The gateway lost the response's stream ({type(error).__name__}).", "server_error")
    finally:
        for call in calls:
            call.cancel()
