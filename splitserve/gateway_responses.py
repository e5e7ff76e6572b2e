"""OpenAI's Responses API (``POST /v1/responses``) on the gateway, as vLLM's OpenAI server serves it.

A request is read into the chat request it stands for (``instructions`` a system message first, ``input`` the
messages, ``max_output_tokens`` the limit, ``text.format`` the structured outputs, function ``tools`` and
``tool_choice`` in the chat's nested form), so the gateway's own checks, sampling, tool calls, router calls and
disconnect handling serve it as they serve ``/v1/chat/completions``; only the answer's shape is this module's: a
``response`` object, or its stream of named server-sent events (``event: TYPE`` and ``data: JSON``, numbered by
``sequence_number``, no ``[DONE]``), the field names and the event order those of ``openai.types.responses``.

Function tools are the chat route's (``splitserve.gateway_tools``): a forced call ("required" or a named
function) is a structured outputs constraint, and "auto" needs the gateway's ``--tool-call-parser``. Input takes
``function_call`` items (an assistant message with tool calls; several in a row are one message) and
``function_call_output`` items (a ``tool`` message answering an earlier call), so a client runs the loop call,
output, answer without state. The answer's calls are ``function_call`` items after the reasoning item, if any,
and after the message, which comes only when there is content besides the calls. Streamed, the calls come as the
chat route's stream gives them: a named call's arguments as they are generated, each "required" call as soon as
its object closes, an "auto" answer's calls at its end; each call is ``response.output_item.added`` (empty
arguments), ``response.function_call_arguments.delta`` events, ``response.function_call_arguments.done`` and
``response.output_item.done``.

The gateway keeps no state, so what needs stored responses is refused with 400 and a sentence
(``previous_response_id``, ``background``, ``conversation``); ``store`` is taken and nothing is stored, as vLLM
does by default. Tools the server would run itself (web search, file search, MCP, ...) are refused too.

``include: ["message.output_text.logprobs"]`` (with ``top_logprobs`` alternatives, 0 to 20) gives each token of
the message its log probability, on the output text part and on each text delta event, as vLLM gives them. A
reasoning parser's split or function tools would part the tokens from the text they make, so logprobs are refused
with either (as OpenAI refuses logprobs for its reasoning models).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from splitserve.common.chat import FunctionTool
from splitserve.gateway import APIError, Gateway, _chain, _chat, _chat_logprobs_object, _finish, _request_id
from splitserve.gateway_reasoning import ReasoningReplies
from splitserve.gateway_responses_request import parse_request, under_tool_choice
from splitserve.gateway_tools import ToolReplies
from splitserve.v1 import inference_pb2

logger = logging.getLogger(__name__)

_STATUS = {inference_pb2.FINISH_REASON_STOP: "completed", inference_pb2.FINISH_REASON_LENGTH: "incomplete",
           inference_pb2.FINISH_REASON_ERROR: "failed"}  # anything else (an abort): incomplete, no reason

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
    def new(cls, response_id: str, model: str, echoed: dict) -> ResponseHead:
        hex_id = uuid.uuid4().hex
        return cls(response_id, int(time.time()), model, echoed, f"msg_{hex_id}", f"rs_{hex_id}")

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

    def message(self, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
        """The assistant's message item (one ``output_text`` part, with ``logprobs`` when asked; ``status``
        "in_progress": no part yet)."""
        content = [] if status == "in_progress" else [_output_text(text, logprobs)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def reasoning(self, text: str, status: str = "completed") -> dict:
        """The reasoning item: the think block as one ``reasoning_text`` part, no summary (vLLM's shape)."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content, "status": status}

    def output(self, reasoning: str | None, content: str | None, calls: list[dict] = (),
               logprobs: list | None = None) -> list:
        """The output items: the reasoning item when there is a think block, the message (unless the answer is
        calls alone; ``logprobs`` on its text when asked), then the ``function_call`` items."""
        message = [self.message(content or "", logprobs=logprobs)] if content or not calls else []
        return ([self.reasoning(reasoning)] if reasoning is not None else []) + message + list(calls)


def function_call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    """A ``function_call`` output item (the SDK's ResponseFunctionToolCall) with a fresh ``fc_`` id."""
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def whole_response(head: ResponseHead, text: str, last, reasoning: ReasoningReplies | None,
                   tools: ToolReplies | None = None, logprobs: list | None = None) -> dict:
    """The non-streamed response for a generation's whole ``text`` and its ``last`` router message; with
    ``tools`` (a tool choice other than none) the text after the think block may be calls; ``logprobs`` (the
    router's entries, when asked) go on the message's text."""
    thought, content = reasoning.whole(text) if reasoning is not None else (None, text)
    status, calls = response_status(last), []
    if tools is not None:
        message, _ = tools.message(content or "", _finish(last))
        call_status = _call_status(tools, status)
        content = message["content"]
        calls = [function_call(call["id"], call["function"]["name"], call["function"]["arguments"], call_status)
                 for call in message.get("tool_calls", [])]
    output = head.output(thought, content, calls, text_logprobs(logprobs) if logprobs is not None else None)
    return head.response(status, output, usage_object(last.usage, reasoning), last)


def text_logprobs(entries: list) -> list[dict]:
    """The Responses API's logprobs of text (``openai.types.responses``' Logprob): per token, its text, UTF-8
    bytes, log probability and ``top_logprobs`` alternatives; the chat route's entries."""
    return (_chat_logprobs_object(entries) or {"content": []})["content"]


def response_status(last) -> str:
    """completed (a stop), incomplete (cut by max_output_tokens, or aborted), failed (the workers failed)."""
    return _STATUS.get(last.finish_reason, "incomplete")


def _call_status(tools: ToolReplies, status: str) -> str:
    """A call item's status: a named call's arguments are the whole text, so a response cut short leaves it
    incomplete; "required" and "auto" calls are read whole."""
    return "incomplete" if isinstance(tools.choice, FunctionTool) and status != "completed" else "completed"


def usage_object(usage: inference_pb2.Usage, reasoning: ReasoningReplies | None = None) -> dict:
    """The Responses API's usage, with the details objects the SDK requires; the reasoning tokens are those
    ``reasoning`` counted (0 without a reasoning parser)."""
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning.reasoning_tokens if reasoning is not None else 0}}


class ResponseEvents:
    """One streamed response's server-sent events, numbered in order: ``start()``, ``feed()`` for each router
    message, then ``finish()`` (or ``error()``).

    One item is open at a time, and opening the next closes it: the reasoning item (with a parser, while the
    think block lasts), the message when its first text comes, each call as the tool replies give it (a named
    call stays open while its arguments are generated; a whole call closes at once). The message always comes
    when the answer makes no call.
    """

    def __init__(self, head: ResponseHead, reasoning: ReasoningReplies | None = None,
                 tools: ToolReplies | None = None, logprobs: bool = False) -> None:
        self.head, self.reasoning_parser, self.tools = head, reasoning, tools
        # The message's token logprobs so far, when asked (then neither reasoning nor tools: text is tokens).
        self.logprobs: list[dict] | None = [] if logprobs else None
        self._held_logprobs: list[dict] = []  # of tokens whose text has not come yet
        self.sequence_number = 0
        self.output: list[dict] = []  # the items done, in order: the response's output
        self.reasoning: str | None = None  # the think block so far; None until it starts
        self.text: str | None = None  # the message's text so far; None until the message opens
        self.call: dict | None = None  # the call item open now, its arguments so far
        self.num_calls = 0
        self._open_kind: str | None = None  # "reasoning", "message" or "function_call": the item open now
        self._fed_last = False

    def start(self) -> list[str]:
        response = self.head.response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, message) -> list[str]:
        """The events of one router message's text (held back while it may begin a think tag or a call)."""
        if self.reasoning_parser is not None:
            self.reasoning_parser.count(0, message.token_ids)
        return self._take(message.text, _finish(message), list(message.logprobs))

    def finish(self, last) -> list[str]:
        """The last events: every item done, then ``response.completed`` (or ``response.incomplete``); a failure
        on the workers is an ``error`` event instead."""
        if last.finish_reason == inference_pb2.FINISH_REASON_ERROR:
            return [self.error(_failure(last), "server_error")]
        events = [] if self._fed_last else self._take("", _finish(last) or "abort")  # release what was held
        if not self.num_calls:
            events += self._open_message()
        if self.logprobs is not None:  # tokens whose text never came (cut at a stop string) still count
            self.logprobs, self._held_logprobs = self.logprobs + self._held_logprobs, []
        status = response_status(last)
        events += self._close(_call_status(self.tools, status) if self.tools is not None else "completed")
        response = self.head.response(status, self.output, usage_object(last.usage, self.reasoning_parser), last)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def error(self, message: str, code: str | None) -> str:
        """OpenAI's ``error`` event (the SDK's ResponseErrorEvent): the stream's last."""
        return self._event("error", code=code, message=message, param=None)

    def _take(self, text: str, finish: str | None, entries: list = ()) -> list[str]:
        """The events of the answer's next ``text`` (``finish`` set on its last): its think block's part, then its
        content, then the calls the tool replies read."""
        self._fed_last = finish is not None
        thought, content = (self.reasoning_parser.delta(0, text, finish is not None)
                            if self.reasoning_parser is not None else ("", text))
        calls = []
        if self.tools is not None:
            delta, _ = self.tools.delta(0, content, finish)
            content, calls = delta.get("content", ""), delta.get("tool_calls", [])
        events = []
        if not content and self.logprobs is not None:  # tokens whose text comes later (a possible stop string)
            self._held_logprobs += text_logprobs(entries)
        if thought:
            if self.reasoning is None:
                self.reasoning = ""
                events += self._open("reasoning", self.head.reasoning("", "in_progress"),
                                     {"type": "reasoning_text", "text": ""})
            self.reasoning += thought
            events.append(self._event("response.reasoning_text.delta", **self._place(), delta=thought))
        if content:
            events += self._open_message()
            self.text += content
            logprobs, self._held_logprobs = self._held_logprobs + text_logprobs(entries), []
            if self.logprobs is not None:
                self.logprobs += logprobs
            events.append(self._event("response.output_text.delta", **self._place(), delta=content,
                                      logprobs=logprobs))
        for call in calls:
            events += self._call_events(call)
        return events

    def _call_events(self, call: dict) -> list[str]:
        """A call's events from a chat stream's tool call delta: one with an id starts a call (its item added
        with empty arguments), its arguments are a delta; a call that is not named is whole, and done at once."""
        function = call.get("function", {})
        events = []
        if "id" in call:
            self.call = function_call(call["id"], function["name"], "", "in_progress")
            self.num_calls += 1
            events += self._open("function_call", self.call)
        if function.get("arguments"):
            self.call["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                                      output_index=len(self.output), delta=function["arguments"]))
        if not isinstance(self.tools.choice, FunctionTool):
            events += self._close("completed")
        return events

    def _open(self, kind: str, item: dict, part: dict | None = None) -> list[str]:
        """Close the open item, then add ``item`` (and its first content ``part``) as the next output item."""
        events = self._close("completed")
        self._open_kind = kind
        events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
        if part is not None:
            events.append(self._event("response.content_part.added", **self._place(), part=part))
        return events

    def _open_message(self) -> list[str]:
        if self.text is not None:
            return []
        self.text = ""
        return self._open("message", self.head.message("", "in_progress"), _output_text("", logprobs=[]))

    def _close(self, call_status: str) -> list[str]:
        """The open item's last events (a call item's status ``call_status``); it joins the output."""
        kind, self._open_kind = self._open_kind, None
        if kind is None:
            return []
        index = len(self.output)
        if kind == "function_call":
            item = {**self.call, "status": call_status}
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"])]
        else:
            item = (self.head.reasoning(self.reasoning) if kind == "reasoning"
                    else self.head.message(self.text, logprobs=self.logprobs))
            place = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = ("response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done")
            text = {"text": item["content"][0]["text"]} | (
                {} if kind == "reasoning" else {"logprobs": self.logprobs or []})
            events = [self._event(done, **place, **text),
                      self._event("response.content_part.done", **place, part=item["content"][0])]
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _place(self) -> dict:
        """Where the open reasoning item's or message's text events point: the next output item, first part."""
        item_id = self.head.reasoning_id if self._open_kind == "reasoning" else self.head.message_id
        return {"item_id": item_id, "output_index": len(self.output), "content_index": 0}

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
    params = gateway._params(parsed.chat_body, info, default_max_tokens=info.max_model_len, logprobs=parsed.logprobs)
    if parsed.text_format is not None:
        if params.structured_outputs is not None:
            raise APIError(400, "Send text.format or structured_outputs, not both.", "structured_outputs")
        params = dataclasses.replace(params, structured_outputs=parsed.text_format)
    params, tools = under_tool_choice(gateway, parsed.chat_body, chat, params)
    echoed = {**parsed.echoed, "temperature": params.temperature, "top_p": params.top_p}
    # vLLM's request_id is the response's id as given (resp_ and a random one without it), and its router call's.
    head = ResponseHead.new(_request_id(body, "resp_", 1, verbatim=True), lora_name or gateway._model_name(info),
                            echoed)
    reasoning = gateway.reasoning_replies(info, chat, tools)
    if parsed.logprobs is not None and (reasoning is not None or tools is not None):
        what = "a reasoning parser" if reasoning is not None else "function tools"
        raise APIError(400, f"Logprobs are not available with {what}: the think block or the calls would part the "
                       "tokens from the message's text. Ask /v1/chat/completions, whose logprobs cover every token.",
                       "include")
    calls, streams, firsts = await gateway._start(request, parsed.chat_body, [(chat, 0)], params, head.id, lora_name)
    if not parsed.stream:
        [chunks] = await gateway._collect(request, calls, streams, firsts)
        last = chunks[-1] if chunks else inference_pb2.GenerateStreamResponse()
        if reasoning is not None:
            reasoning.count(0, [token_id for chunk in chunks for token_id in chunk.token_ids])
        logprobs = [entry for chunk in chunks for entry in chunk.logprobs] if parsed.logprobs is not None else None
        return JSONResponse(whole_response(head, "".join(chunk.text for chunk in chunks), last, reasoning, tools,
                                           logprobs))
    events = _stream(ResponseEvents(head, reasoning, tools, parsed.logprobs is not None), calls, firsts[0], streams[0])
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
