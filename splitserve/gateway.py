"""An OpenAI-compatible HTTP gateway in front of a router: ``splitserve gateway --router ADDR``.

``/v1/completions``, ``/v1/chat/completions`` (streaming as server-sent events, with ``usage`` when
``stream_options.include_usage`` asks), ``/v1/responses`` (``splitserve.gateway_responses``), ``/v1/models`` and
``/health``, on Starlette and uvicorn (FastAPI's own
base, without its request models: the bodies are checked here, so every refusal is OpenAI's error shape with a
sentence, never a 422 of field paths). Each prompt of an HTTP request (a completions batch may have several) is
one streamed gRPC call on the router through :class:`splitserve.client.AsyncClient`, the calls side by side, asking
for the request's ``n`` choices (1 by default) at once: the prompt's KV is computed and sent once, and the decode
worker forks it for each choice (as vLLM's parallel sampling, choice i of a seeded request samples with
seed + i); with
``echo`` each completion starts with its prompt (scored with ``logprobs``, ``max_tokens`` 0 for the prompt alone,
as lm-evaluation-harness's loglikelihood asks), from the router's ``prompt_text`` and prompt logprobs; with vLLM's
``return_token_ids`` each choice carries its token ids and its prompt's (the router's ``prompt_token_ids``). The
gateway keeps no state and no secret. The caller's
``Authorization: Bearer`` header is passed on as the router's API key, so the router authenticates as it does
for gRPC clients. A caller that disconnects cancels its calls, and the router aborts their requests on the
workers (their KV blocks freed); a call that fails cancels the request's other choices.

Errors: the router's status codes map to HTTP (INVALID_ARGUMENT 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403,
NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, others 500) with the router's
sentence as the message. A body over ``max_body_bytes`` is refused (413) before it is read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.client import AsyncClient
from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.common.block_hash import check_cache_salt
from splitserve.common.chat import BOTH_TURN_FLAGS, Chat, check_chat_template_kwargs, openai_tools
from splitserve.common.errors import InvalidRequest
from splitserve.common.ids import MAX_ID_LENGTH, check_id
from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.common.tools import tool_call_parser
from splitserve.gateway_reasoning import REASONING_PARSERS, ReasoningReplies, ThinkTagParser, reasoning_parser
from splitserve.gateway_tools import ToolReplies, chat_tools
from splitserve.rpc.metrics import GatewayMetrics, serve_metrics
from splitserve.rpc.tracing import RequestTracer, trace_headers
from splitserve.v1 import inference_pb2

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_CHOICES = 16
# How long the router's model info is reused before it is asked again: the workers' LoRA adapters and reasoning
# parser follow within this time after they register.
MODEL_INFO_TTL_SECONDS = 5.0
# A log probability of minus infinity (a token sampling can never pick) as vLLM's server writes it: JSON has no
# infinities.
LOWEST_LOGPROB = -9999.0
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}
_FINISH = {inference_pb2.FINISH_REASON_STOP: "stop", inference_pb2.FINISH_REASON_LENGTH: "length",
           inference_pb2.FINISH_REASON_ABORT: "abort", inference_pb2.FINISH_REASON_ERROR: "error"}
# OpenAI fields the gateway cannot honour: refused with a sentence rather than silently ignored.
_UNSUPPORTED = {"suffix": "suffix", "functions": "functions (OpenAI's deprecated field; send tools instead)",
                "function_call": "function_call (OpenAI's deprecated field; send tool_choice instead)",
                "audio": "audio output"}
# vLLM's structured output fields before 0.12 (which removed them): refused with their replacement named.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class APIError(Exception):
    """A request the gateway answers with OpenAI's error JSON: ``status`` and a sentence."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_rpc_error(error: grpc.RpcError) -> APIError:
    code = error.code()
    message = error.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in message.lower():
        message = "The gateway cannot reach its splitserve router; retry later."
    return APIError(_HTTP_STATUS.get(code, 500), message, code=code.name.lower())


@dataclass
class GatewayConfig:
    """Where the router is and what the gateway calls the model.

    Attributes:
        router: the router's host:port.
        served_model_name: the model's name in ``/v1/models`` and the ``model`` field requests must name (None:
            the router's model name); any other name gets 404.
        tls: TLS to the router (``splitserve.rpc.tls.TLSConfig``; None: plaintext).
        max_body_bytes: the largest request body read.
        max_choices: the most generations one request may ask for (``n`` for each prompt of a batch; each a
            generation of its own).
        metrics_port: serve Prometheus metrics on this port of the gateway's host (0: a free one; None: none).
        tool_call_parser: how the model writes tool calls (one of ``splitserve.common.tools.TOOL_CALL_PARSERS``),
            which lets chat requests leave the choice of a call to the model (``tool_choice`` "auto"); None: such
            requests are refused, and calls are made only when forced.
        reasoning_parser: splits chat answers' ``<think>`` blocks into the message's ``reasoning`` (one of
            ``splitserve.gateway_reasoning.REASONING_PARSERS``, as vLLM's ``--reasoning-parser``); None: the
            workers' parser when they have one (the router's model info), else answers are content alone.
        otlp_traces_endpoint: export a span of every API call (:class:`_Traced`) to this OTLP/gRPC collector
            (``splitserve.rpc.tracing``; None: no spans of the gateway's own, the caller's trace context passed on).
    """

    router: str
    served_model_name: str | None = None
    tls: object = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_choices: int = MAX_CHOICES
    metrics_port: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    otlp_traces_endpoint: str | None = None


@dataclass
class _Reply:
    """What every part of one HTTP answer shares: its id, object kind, model, creation time, and how a choice
    is written (``choice(index, text, finish_reason, logprobs, final)``)."""

    request_id: str
    kind: str
    model: str
    created: int
    choice: Callable[..., dict]
    num_choices: int  # per prompt
    # /v1/completions' echo: each choice's text (and logprobs) starts with its prompt's. With max_tokens 0 (only
    # the prompt is wanted, scored when logprobs are asked) one token is generated and not shown.
    score_only: bool = False
    # vLLM's prompt_logprobs asked for: each completion choice (a chat answer once) gets them in vLLM's shape.
    with_prompt_logprobs: bool = False
    # A chat answer under a reasoning parser: its usage has completion_tokens_details.reasoning_tokens, counted by
    # ``reasoning`` (None: 0, no think block being split off).
    with_reasoning: bool = False
    reasoning: ReasoningReplies | None = None
    # vLLM's return_token_ids: each choice's generated token ids (a stream's chunk its new ones) and the prompt's
    # (on each completion choice, once for a chat: on the answer, a stream's first chunk).
    with_token_ids: bool = False
    # vLLM's echo on a chat: the last message's content when it is the assistant's, before each answer's content.
    chat_echo: str = ""

    def head(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def shown(self, message) -> tuple[str, list]:
        """The text and logprob entries a router message shows the client: the prompt's first when it carries them
        (echo, on the first token's message; the prompt's first token unscored), nothing generated when
        ``score_only``."""
        text, entries = ("", []) if self.score_only else (message.text, list(message.logprobs))
        if not message.prompt_text:
            return text, entries
        prompt_entries = list(message.prompt_logprobs)
        if prompt_entries:
            prompt_entries[0] = _Unscored(prompt_entries[0])
        return message.prompt_text + text, prompt_entries + entries

    def choice_of(self, index: int, text: str, last, logprobs: list, final: bool, text_offset: int = 0) -> dict:
        """Choice ``index``, its finish and vLLM's ``stop_reason`` read off ``last``, its latest router message
        (``text_offset``: where its text starts in the choice's, for the logprobs' offsets)."""
        finish, stop_reason = _finish(last), _stop_reason(last)
        if self.score_only and finish in ("stop", "length"):  # max_tokens 0: the prompt alone, at its length
            finish, stop_reason = "length", None
        return {**self.choice(index, text, finish, logprobs, final, text_offset), "stop_reason": stop_reason}

    def token_ids(self, messages) -> list[int]:
        """The generated token ids ``messages`` carry (none when ``score_only``: the one generated is not shown)."""
        return [] if self.score_only else [token_id for message in messages for token_id in message.token_ids]

    def add_token_ids(self, answer: dict, choice: dict, messages) -> None:
        """vLLM's ``return_token_ids`` fields of one choice's ``messages`` (all of them, or a stream's latest):
        the choice's ``token_ids``, and the prompt's where a message carries them (the choice's own on a completion,
        the ``answer``'s on a chat)."""
        if not self.with_token_ids:
            return
        choice["token_ids"] = self.token_ids(messages)
        prompt_token_ids = [token_id for message in messages for token_id in message.prompt_token_ids]
        if prompt_token_ids:
            (answer if self.kind == "chat.completion" else choice)["prompt_token_ids"] = prompt_token_ids

    def tally(self, index: int, message) -> None:
        """Count choice ``index``'s reasoning tokens in its next router message."""
        if self.reasoning is not None:
            self.reasoning.count(index, message.token_ids)

    def usage_so_far(self, message, started: bool = True) -> dict:
        """vLLM's continuous usage of one choice: its prompt's tokens and the tokens it was sent so far (none
        before it ``started``, or when ``score_only``), read off its latest router message (None: nothing came)."""
        prompt_tokens = message.usage.prompt_tokens if message is not None else 0
        completion_tokens = message.usage.completion_tokens if message is not None and started else 0
        if self.score_only:
            completion_tokens = 0
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def usage(self, usages: list) -> dict:
        """The request's usage (``_usage``), no completion tokens when ``score_only``; under a reasoning parser
        with the reasoning tokens (OpenAI's ``completion_tokens_details``) of the messages :meth:`tally` saw."""
        if self.score_only:
            usages = [inference_pb2.Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens)
                      for usage in usages]
        usage = _usage(usages, self.num_choices)
        if self.with_reasoning:
            reasoning_tokens = self.reasoning.reasoning_tokens if self.reasoning is not None else 0
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


@dataclass
class _Unscored:
    """A prompt's first token in echoed logprobs: named, with no log probability (nothing predicts it)."""

    entry: inference_pb2.PositionLogprobs


class Gateway:
    """The ASGI application (``.app``) and its router client."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client: AsyncClient | None = None
        self._tool_parser = tool_call_parser(config.tool_call_parser) if config.tool_call_parser else None
        self._reasoning_parser = reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        self._model_info: inference_pb2.GetModelInfoResponse | None = None
        self._model_info_time = 0.0  # time.monotonic() of its last fetch
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            *(Route(path, self.scores, methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, self.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),  # names may hold a "/"
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),  # SageMaker's health check, as vLLM serves it
            Route("/invocations", self.invocations, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
        ]
        self.metrics = GatewayMetrics(route.path for route in routes)
        self.tracer = (RequestTracer("splitserve-gateway", config.otlp_traces_endpoint)
                       if config.otlp_traces_endpoint else None)
        app = Starlette(routes=routes, lifespan=self._lifespan,
                        exception_handlers={APIError: lambda request, error: error.response(),
                                            404: _not_found, 405: _not_allowed})
        if self.tracer is not None:
            app = _Traced(app, self.tracer, {route.path for route in routes if "POST" in route.methods})
        self.app = _Measured(app, self.metrics)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        # The channel belongs to the server's event loop: made when it starts, closed when it stops. No key of
        # the gateway's own (api_key=""): each call carries its HTTP caller's, or none.
        self.client = AsyncClient(self.config.router, api_key="", tls=self.config.tls)
        try:
            yield
        finally:
            await self.client.close()
            if self.tracer is not None:
                self.tracer.close()  # the last spans leave

    # ---- endpoints -----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 while the router is ready (its gRPC health for splitserve.v1.Inference: not draining, a decode
        worker serving), 503 with the reason otherwise. Needs no key, as an orchestrator's probe has none."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            check = await health_pb2_grpc.HealthStub(self.client.channel).Check(
                health_pb2.HealthCheckRequest(service="splitserve.v1.Inference"), timeout=5)
        except grpc.RpcError as error:
            return JSONResponse({"status": "unavailable", "reason": from_rpc_error(error).message}, status_code=503)
        if check.status != health_pb2.HealthCheckResponse.SERVING:
            return JSONResponse({"status": "unavailable", "reason": "The router is not ready: no decode worker is "
                                 "serving, or it is draining."}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def invocations(self, request: Request) -> Response:
        """SageMaker's ``/invocations``, as vLLM serves it: the body's fields pick the route, a chat (``messages``), a
        completion (``prompt``), embeddings (``input``), scores (``text_1``) or a rerank (``query``)."""
        body = await self._body(request)
        for field, route in (("messages", self.chat_completions), ("prompt", self.completions),
                             ("input", self.embeddings), ("text_1", self.scores), ("query", self.rerank)):
            if field in body:
                return await route(request)  # which reads the same body again (kept on the request)
        raise APIError(400, "An invocation names its kind by its fields: messages (a chat), prompt (a completion), "
                       "input (embeddings), text_1 and text_2 (scores) or query and documents (a rerank).")

    async def version(self, request: Request) -> Response:
        """vLLM's /version: this gateway's splitserve version (the package's), for deployment checks; needs no key
        and calls nothing."""
        from splitserve import __version__

        return JSONResponse({"version": __version__})

    async def models(self, request: Request) -> Response:
        """The model, then the LoRA adapters the workers serve (as vLLM lists them: ``parent`` the base model)."""
        return JSONResponse({"object": "list", "data": await self._model_cards(request)})

    async def model(self, request: Request) -> Response:
        """OpenAI's model retrieval (``GET /v1/models/{model}``, the ``openai`` package's ``models.retrieve``): the
        model's or an adapter's entry of /v1/models; 404 for any other name."""
        name = request.path_params["model"]
        cards = await self._model_cards(request)
        for card in cards:
            if card["id"] == name:
                return JSONResponse(card)
        raise APIError(404, f"The model {name[:100]!r} does not exist here; this server serves "
                       f"{', '.join(repr(card['id']) for card in cards[:8])} (see /v1/models).", "model",
                       "model_not_found")

    async def _model_cards(self, request: Request) -> list[dict]:
        """/v1/models' entries: the model's, then each LoRA adapter's the workers serve (fetched afresh)."""
        info = await self._info(request, refresh=True)
        base = self._model_name(info)
        entry = {"object": "model", "created": 0, "owned_by": "splitserve", "max_model_len": info.max_model_len}
        return [{"id": base, **entry, "root": base, "parent": None}] + [
            {"id": name, **entry, "root": name, "parent": base} for name in info.lora_names]

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: ``prompt`` (text) or ``messages`` (through the chat template) -> the token ids
        generation would use, their count and the model's context length; with ``return_token_strs`` each token's
        string as the tokenizer spells it."""
        body = await self._body(request)
        info = await self._check_model(request, body)
        if "messages" in body:
            prompt = _chat(body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError(400, "prompt must be a string (or send messages instead).", "prompt")
        with_strings = _flag(body, "return_token_strs")
        try:
            tokenized = await self.client.tokenize_prompt(prompt, api_key=_bearer(request),
                                                          return_token_strs=with_strings,
                                                          add_special_tokens=_optional_flag(body, "add_special_tokens"))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        tokens = list(tokenized.token_ids)
        answer = {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
        if with_strings:  # vLLM's return_token_strs: each token as the tokenizer spells it
            answer["token_strs"] = list(tokenized.token_strs)
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: ``tokens`` (token ids) -> their text, ``prompt``."""
        body = await self._body(request)
        await self._check_model(request, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(token) and token >= 0 for token in tokens):
            raise APIError(400, "tokens must be a list of token ids (non-negative integers).", "tokens")
        if any(token >= 2**32 for token in tokens):
            raise APIError(400, "a token id is outside the vocabulary.", "tokens")
        try:
            text = await self.client.detokenize(tokens, api_key=_bearer(request))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return JSONResponse({"prompt": text})

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        info, lora_name = await self._model_of(request, body)
        prompts = _completion_prompts(body.get("prompt"))
        if _flag(body, "use_beam_search"):
            from splitserve.gateway_beams import beam_search_answer  # it builds on this module's pieces

            return await beam_search_answer(self, request, body, prompts, lora_name, chat=False, default_max_tokens=16)
        echo = _flag(body, "echo")
        score_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
        logprobs = _completion_logprobs(body)
        params = self._params({**body, "max_tokens": 1} if score_only else body, info, default_max_tokens=16,
                              logprobs=logprobs)
        if params.prompt_logprobs is None and echo and logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)  # the prompt scored, as vLLM's echo does
        choice = functools.partial(_completion_choice, as_ids=_flag(body, "return_tokens_as_token_ids"))
        return await self._respond(request, body, prompts, params, "cmpl-", "text_completion", choice,
                                   lora_name, echo=echo, score_only=score_only)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        info, lora_name = await self._model_of(request, body)
        chat = _chat(body)
        if _flag(body, "use_beam_search"):
            from splitserve.gateway_beams import beam_search_answer  # it builds on this module's pieces

            return await beam_search_answer(self, request, body, [chat], lora_name, chat=True,
                                            default_max_tokens=info.max_model_len)
        # vLLM's echo on chats: each answer starts with the last message's content when that is the assistant's (an
        # answer begun for the model, continued with continue_final_message), and is the generated text otherwise.
        last = chat.messages[-1] if chat.messages else None
        echoed = last.content if _flag(body, "echo") and last is not None and last.role == "assistant" else ""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        params = self._params({**body, "max_tokens": max_tokens}, info, default_max_tokens=info.max_model_len,
                              logprobs=_chat_logprobs(body))
        try:
            constraint, tools = chat_tools(body, chat.tools, self._tool_parser, params.structured_outputs)
        except InvalidRequest as error:
            param = "parallel_tool_calls" if str(error).startswith("parallel_tool_calls") else "tool_choice"
            raise APIError(400, str(error), param) from None
        params = dataclasses.replace(params, structured_outputs=constraint)
        reasoning = self.reasoning_replies(info, chat, tools)
        with_reasoning = self.reasoning_parser_of(info) is not None
        choice = functools.partial(_chat_choice, tools=tools, reasoning=reasoning, with_reasoning=with_reasoning,
                                   as_ids=_flag(body, "return_tokens_as_token_ids"))
        return await self._respond(request, body, [chat], params, "chatcmpl-", "chat.completion", choice, lora_name,
                                   reasoning=reasoning, with_reasoning=with_reasoning, chat_echo=echoed)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, as vLLM serves it (``splitserve.gateway_responses``)."""
        from splitserve.gateway_responses import create_response  # it builds on this module's pieces

        return await create_response(self, request)

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings, through the router's Embed (``splitserve.gateway_embeddings``)."""
        from splitserve.gateway_embeddings import create_embeddings  # it builds on this module's pieces

        return await create_embeddings(self, request)

    async def scores(self, request: Request) -> Response:
        """vLLM's scores of text pairs, by their embeddings (``splitserve.gateway_scores``)."""
        from splitserve.gateway_scores import create_scores  # it builds on this module's pieces

        return await create_scores(self, request)

    async def rerank(self, request: Request) -> Response:
        """vLLM's rerank (Jina's and Cohere's shape), by the embeddings (``splitserve.gateway_scores``)."""
        from splitserve.gateway_scores import create_rerank  # it builds on this module's pieces

        return await create_rerank(self, request)

    # ---- one request's generations ----------------------------------------------------------------

    async def _respond(self, request: Request, body: dict, prompts: list, params: SamplingParams, prefix: str,
                       kind: str, choice, lora_name: str, echo: bool = False, score_only: bool = False,
                       reasoning: ReasoningReplies | None = None, with_reasoning: bool = False,
                       chat_echo: str = "") -> Response:
        """Generate ``n`` choices for each of ``prompts`` (choice ``index`` of prompt ``p`` is the answer's choice
        ``p * n + index``, as OpenAI numbers a batch's choices), one router call a prompt, with LoRA adapter
        ``lora_name`` ("": the base model); with ``echo`` each choice starts with its prompt (``_Reply.score_only``);
        ``with_reasoning``: a chat answer under a reasoning parser, ``reasoning`` counting its reasoning tokens;
        ``chat_echo``: the text each chat answer's content starts with."""
        num_choices = _num_choices(body, len(prompts), self.config.max_choices)
        include_usage, continuous_usage = _stream_options(body)
        request_id = _request_id(body, prefix, len(prompts))
        reply = _Reply(request_id, kind, lora_name or self._model_name(self._model_info), int(time.time()), choice,
                       num_choices,
                       score_only, with_prompt_logprobs=body.get("prompt_logprobs") is not None,
                       with_reasoning=with_reasoning, reasoning=reasoning,
                       with_token_ids=_flag(body, "return_token_ids"), chat_echo=chat_echo)
        generations = [(prompt, index) for prompt in prompts for index in range(num_choices)]
        calls, streams, firsts = await self._start(request, body, generations, params, request_id, lora_name, echo)
        if not _flag(body, "stream"):
            return await self._whole(request, calls, streams, firsts, reply)
        events = self._events(calls, streams, firsts, reply, include_usage, continuous_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _start(self, request: Request, body: dict, generations: list, params: SamplingParams | None,
                     request_id: str, lora_name: str, echo: bool = False,
                     beam_search: BeamSearchParams | None = None) -> tuple[list, list, list]:
        """One router call for each prompt of ``generations`` ((prompt, choice index) pairs, a prompt's n choices
        together, in index order), asking for its n choices at once (the cluster computes and sends the prompt's
        KV once and the decode worker forks it for each choice, seeded seed + index as vLLM seeds them), side by
        side (``request_id`` for a single call, ``request_id-N`` for several), with the caller's key and W3C trace
        context and the body's ``priority`` and ``cache_salt``; the choices counted in the metrics' generations.
        With ``beam_search`` each call is a beam search, its choices the beams (``params``: None, or the
        logprobs asked for alone).

        Returns:
            The calls, each choice's stream (gRPC errors as APIError) and each stream's first message (None for an
            empty stream); errors before every first message are raised, all calls cancelled, as HTTP errors.
        """
        api_key, priority, cache_salt = _bearer(request), _priority(body), _cache_salt(body)
        trace, with_token_ids = router_trace(request), _flag(body, "return_token_ids")
        special = _optional_flag(body, "add_special_tokens")
        prompts = [prompt for prompt, index in generations if index == 0]
        num_choices = len(generations) // len(prompts)
        call_params = dataclasses.replace(params, n=num_choices) if beam_search is None else params
        calls = [self.client.generate_stream(prompt, call_params, _call_id(request_id, number, len(prompts)),
                                             api_key=api_key, echo=echo, priority=priority, lora_name=lora_name,
                                             cache_salt=cache_salt, trace=trace,
                                             return_prompt_token_ids=with_token_ids, add_special_tokens=special,
                                             beam_search=beam_search)
                 for number, prompt in enumerate(prompts)]
        self.metrics.generations.inc(len(generations))
        request.state.generations = len(generations)  # on the request's span (_Traced)
        streams = [stream for call in calls for stream in _choices(call, num_choices)]
        firsts = await _all_or_cancel(calls, [_first(stream) for stream in streams])
        return calls, streams, firsts

    @staticmethod
    async def _collect(request: Request, calls: list, streams: list, firsts: list) -> list[list]:
        """Every call's messages, in order; the calls are cancelled if the HTTP client leaves before they end, or
        all of them at the first error."""
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, calls))
        try:
            return await _all_or_cancel(calls, [_rest(first, stream) for first, stream in zip(firsts, streams)])
        finally:
            watcher.cancel()

    async def _whole(self, request: Request, calls: list, streams: list, firsts: list, reply: _Reply) -> Response:
        """The non-streamed answer; the calls are cancelled if the HTTP client leaves before they end."""
        collected = await self._collect(request, calls, streams, firsts)
        choices, usages, prompt_logprobs, answer = [], [], [], {}
        for index, chunks in enumerate(collected):
            last = chunks[-1] if chunks else inference_pb2.GenerateStreamResponse()
            shown = [reply.shown(chunk) for chunk in chunks]
            for chunk in chunks:
                reply.tally(index, chunk)
            text = "".join(text for text, _ in shown)
            logprobs = [entry for _, entries in shown for entry in entries]
            choices.append(reply.choice_of(index, text, last, logprobs, final=True))
            reply.add_token_ids(answer, choices[-1], chunks)
            usages.append(last.usage)
            prompt_logprobs.append(_vllm_prompt_logprobs([entry for chunk in chunks for entry in chunk.prompt_logprobs]))
        answer = {**reply.head(reply.kind), "choices": choices, "usage": reply.usage(usages), **answer}
        for choice in choices if reply.chat_echo else ():
            choice["message"]["content"] = reply.chat_echo + (choice["message"].get("content") or "")
        if reply.with_prompt_logprobs:  # vLLM's: on each completion choice, once for a chat (its one prompt)
            if reply.kind == "chat.completion":
                answer["prompt_logprobs"] = prompt_logprobs[0]
            else:
                for choice, choice_prompt_logprobs in zip(choices, prompt_logprobs):
                    choice["prompt_logprobs"] = choice_prompt_logprobs
        return JSONResponse(answer)

    async def _events(self, calls: list, streams: list, firsts: list, reply: _Reply, include_usage: bool,
                      continuous_usage: bool = False) -> AsyncIterator[str]:
        """Server-sent events: a chunk per router message of any choice (each says its choice's index), in the
        order they come, each choice's finish, the usage if asked, ``[DONE]``; with ``continuous_usage`` every
        chunk carries its choice's usage so far (vLLM's). Starlette stops iterating when the client disconnects;
        the ``finally`` then cancels every call."""
        head = reply.head(f"{reply.kind}.chunk")
        messages: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, first, stream) -> None:
            try:
                async for chunk in _chain([first] if first is not None else [], stream):
                    await messages.put((index, chunk))
            except APIError as error:
                await messages.put((index, error))
            except Exception as error:  # not the router's answer: still the stream's end, never a silent hang
                logger.exception("a choice's stream failed")
                lost = APIError(500, f"The gateway lost a choice's stream ({type(error).__name__}).")
                await messages.put((index, lost))
            else:
                await messages.put((index, None))

        forwarders = [asyncio.ensure_future(forward(index, first, stream))
                      for index, (first, stream) in enumerate(zip(firsts, streams))]
        try:
            if reply.kind == "chat.completion":
                for index in range(len(streams)):
                    chunk = {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
                    if reply.with_token_ids and index == 0 and firsts[0] is not None:  # vLLM's: the first chunk's
                        chunk["prompt_token_ids"] = list(firsts[0].prompt_token_ids)
                    if continuous_usage:
                        chunk["usage"] = reply.usage_so_far(firsts[index], started=False)
                    yield _event(chunk)
                for index in range(len(streams)) if reply.chat_echo else ():  # vLLM's: after every role chunk
                    yield _event({**head, "choices": [{"index": index, "delta": {"content": reply.chat_echo},
                                                       "logprobs": None, "finish_reason": None}]})
            last: list = [None] * len(streams)
            text_offsets = [0] * len(streams)
            running = len(streams)
            while running:
                index, message = await messages.get()
                if message is None:
                    running -= 1
                    continue
                if isinstance(message, APIError):  # after the headers went out: the error as a last event
                    yield _event(error_body(message.status, message.message, code=message.code))
                    return
                last[index] = message
                reply.tally(index, message)
                text, entries = reply.shown(message)
                new_ids = reply.with_token_ids and bool(reply.token_ids([message]))
                if text or message.finish_reason or entries or new_ids:
                    choice = reply.choice_of(index, text, message, entries, False, text_offsets[index])
                    text_offsets[index] += len(text)
                    # Not text a tool call holds back, unless its token ids are asked for (its delta then empty).
                    if choice.get("delta") != {} or choice["finish_reason"] or entries or new_ids:
                        chunk = {**head, "choices": [choice]}
                        if reply.kind != "chat.completion":  # a chat's prompt ids went with its first chunk
                            reply.add_token_ids(chunk, choice, [message])
                        elif reply.with_token_ids:
                            choice["token_ids"] = reply.token_ids([message])
                        if continuous_usage:
                            chunk["usage"] = reply.usage_so_far(message)
                        yield _event(chunk)
            if include_usage and any(chunk is not None for chunk in last):
                usages = [chunk.usage if chunk is not None else inference_pb2.Usage() for chunk in last]
                yield _event({**head, "choices": [], "usage": reply.usage(usages)})
            yield "data: [DONE]\n\n"
        finally:
            for call in calls:
                call.cancel()
            for forwarder in forwarders:
                forwarder.cancel()

    # ---- request checks ---------------------------------------------------------------------

    async def _body(self, request: Request) -> dict:
        """The request's JSON object, checked (read once: kept on the request for a second reader)."""
        kept = getattr(request.state, "json_body", None)
        if kept is not None:
            return kept
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise APIError(413, f"The request body is {int(declared)} bytes, over the limit of "
                           f"{self.config.max_body_bytes}.")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.config.max_body_bytes:
                raise APIError(413, f"The request body is over the limit of {self.config.max_body_bytes} bytes.")
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"The request body is not valid JSON ({error}).") from None
        except RecursionError:  # Python's parser gives up about 1,000 levels down: no request nests so deep
            raise APIError(400, "The request body is nested too deeply.") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.")
        for field, what in _UNSUPPORTED.items():
            if body.get(field):
                raise APIError(400, f"{what} is not supported by this server.", field)
        for field, replacement in _GUIDED_FIELDS.items():
            if body.get(field) is not None:
                raise APIError(400, f"{field} was removed in vLLM 0.12; send structured_outputs: "
                               f'{{"{replacement}": ...}} instead.', field)
        if body.get("best_of") not in (None, 1):
            raise APIError(400, "best_of is not supported (choices are not ranked here): ask for n choices instead.",
                           "best_of")
        request.state.json_body = body
        return body

    def reasoning_parser_of(self, info: inference_pb2.GetModelInfoResponse) -> type[ThinkTagParser] | None:
        """The parser that splits chat answers: the gateway's --reasoning-parser, else the workers' (the router's
        model info says it), else None."""
        return self._reasoning_parser or REASONING_PARSERS.get(info.reasoning_parser)

    def reasoning_replies(self, info: inference_pb2.GetModelInfoResponse, chat: Chat,
                          tools: ToolReplies | None) -> ReasoningReplies | None:
        """What splits a chat answer's think block off (None: nothing to split). A forced call's schema constrains
        the whole answer from its first token, think block included, unless the workers' grammars wait out the
        block (their --reasoning-parser): only then is there reasoning to split off before the call."""
        parser = self.reasoning_parser_of(info)
        if parser is None or (tools is not None and tools.forces_a_call and not info.reasoning_parser):
            return None
        think_tags = (tuple(info.think_start_token_ids), tuple(info.think_end_token_ids))
        return ReasoningReplies(parser, chat.chat_template_kwargs, think_tags)

    async def _info(self, request: Request, refresh: bool = False) -> inference_pb2.GetModelInfoResponse:
        """The router's model info, fetched again once it is MODEL_INFO_TTL_SECONDS old (what the workers serve
        changes as they come and go: their LoRA adapters, their reasoning parser), and with ``refresh`` (a LoRA
        adapter not known yet) once it is a second old."""
        age = time.monotonic() - self._model_info_time
        stale = age >= (1.0 if refresh else MODEL_INFO_TTL_SECONDS)
        if self._model_info is None or stale:
            try:
                self._model_info = await self.client.model_info(api_key=_bearer(request))
            except grpc.RpcError as error:
                raise from_rpc_error(error) from None
            self._model_info_time = time.monotonic()
        return self._model_info

    async def _model_of(self, request: Request, body: dict) -> tuple[inference_pb2.GetModelInfoResponse, str]:
        """The router's model info and the LoRA adapter ``model`` names ("": the model itself, or no ``model``).

        Raises:
            APIError: 404 for a model that is neither the served one nor an adapter a worker serves.
        """
        info = await self._info(request)
        name = body.get("model")
        if name is None or name == self._model_name(info):
            return info, ""
        if isinstance(name, str) and name not in info.lora_names:
            info = await self._info(request, refresh=True)  # an adapter whose workers registered since
        if not isinstance(name, str) or name not in info.lora_names:
            adapters = f" or its LoRA adapters {', '.join(info.lora_names)}" if info.lora_names else ""
            raise APIError(404, f"The model {str(name)[:100]!r} does not exist here; this server serves "
                           f"{self._model_name(info)!r}{adapters} (see /v1/models).", "model", "model_not_found")
        return info, name

    async def _check_model(self, request: Request, body: dict) -> inference_pb2.GetModelInfoResponse:
        return (await self._model_of(request, body))[0]

    def _model_name(self, info: inference_pb2.GetModelInfoResponse | None) -> str:
        return self.config.served_model_name or (info.model_name if info is not None else "")

    @staticmethod
    def _params(body: dict, info, default_max_tokens: int, logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams (OpenAI's defaults, vLLM's extra fields); 400 for a bad value."""
        stop = body.get("stop") or []
        fields = {
            "max_tokens": body.get("max_tokens") if body.get("max_tokens") is not None else default_max_tokens,
            "temperature": body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0,
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "presence_penalty": body.get("presence_penalty") or 0.0,
            "frequency_penalty": body.get("frequency_penalty") or 0.0,
            "seed": body.get("seed"), "stop": [stop] if isinstance(stop, str) else stop, "logprobs": logprobs,
            # vLLM's extensions, as its OpenAI server takes them.
            "top_k": body.get("top_k", -1), "min_p": body.get("min_p", 0.0),
            "repetition_penalty": body.get("repetition_penalty", 1.0), "ignore_eos": body.get("ignore_eos", False),
            "min_tokens": body.get("min_tokens", 0), "stop_token_ids": body.get("stop_token_ids") or [],
            "logit_bias": _logit_bias(body.get("logit_bias")),
            "include_stop_str_in_output": body.get("include_stop_str_in_output") or False,
            "allowed_token_ids": body.get("allowed_token_ids"), "bad_words": body.get("bad_words") or [],
            "truncate_prompt_tokens": body.get("truncate_prompt_tokens"),
            "skip_special_tokens": _flag(body, "skip_special_tokens", default=True),
            "prompt_logprobs": _prompt_logprobs(body),
            "structured_outputs": _structured_outputs(body),
        }
        try:
            return SamplingParams(**fields)
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error)) from None


class _Measured:
    """ASGI middleware: each HTTP request's route, status and duration into ``metrics`` (the status as the
    response's headers carried it; the duration until its last body message, a stream's last event, is sent, and
    recorded before that message goes out, so a client holding its whole answer finds it counted)."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.metrics.route(scope["path"])
        status = "500"  # unless the application sends its headers
        started = time.monotonic()
        recorded = False

        def record() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                self.metrics.in_flight.dec()
                self.metrics.duration.labels(route).observe(time.monotonic() - started)
                self.metrics.requests.labels(route, status).inc()

        async def send_measured(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                record()  # before the last byte goes out, so a client that has its answer sees it counted
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_measured)
        finally:
            record()  # an application that never finished its response (an error, a client that left)


class _Traced:
    """ASGI middleware: a server span of each API call (a POST to one of ``paths``), named as OpenTelemetry's HTTP
    convention names them ("POST /v1/chat/completions"), from the request's arrival to its last body message (a
    stream's last event), with its method, route, status and the choices asked of the router (``splitserve.generations``); ERROR for
    a 5xx status or a response left unfinished (the client went away). It is the child of the caller's span where
    the request's headers carry W3C trace context, and the router calls made for it carry its own
    (:func:`router_trace`), so the router's spans are its children."""

    def __init__(self, app, tracer: RequestTracer, paths: set[str]) -> None:
        self.app, self.tracer, self.paths = app, tracer, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
        route = scope["path"]
        span = self.tracer.start_span(f"POST {route}", headers)
        state = scope.setdefault("state", {})
        state["trace"] = self.tracer.headers(span)
        status, ended = None, False

        def end(finished: bool) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            error = (f"HTTP {status}" if status is not None and status >= 500
                     else None if finished else "the response did not finish (the client went away)")
            self.tracer.end(span, {"http.request.method": "POST", "http.route": route,
                                   "http.response.status_code": status,
                                   "splitserve.generations": state.get("generations")}, error)

        async def send_traced(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                end(finished=True)
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        finally:
            end(finished=False)


def router_trace(request: Request) -> tuple[tuple[str, str], ...]:
    """The W3C trace context to send with the router calls made for ``request``: its span's (:class:`_Traced`)
    where the gateway traces, else the caller's own headers, so the router's spans join the caller's trace."""
    return request.scope.get("state", {}).get("trace") or trace_headers(request.headers.items())


def _bearer(request: Request) -> str | None:
    """The caller's API key (``Authorization: Bearer KEY``), passed on to the router; None without one."""
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer "):
        return None
    return header[len("Bearer "):].strip() or None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(logit_bias) -> dict[int, float]:
    """OpenAI's logit_bias (a JSON object: token ids, as strings, to biases) with int keys; SamplingParams checks
    the values and the router the ids against the vocabulary."""
    if logit_bias is None:
        return {}
    if not isinstance(logit_bias, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to biases in [-100, 100].", "logit_bias")
    converted = {}
    for token_id, bias in logit_bias.items():
        if not (isinstance(token_id, str) and token_id.isascii() and token_id.isdigit()) or len(token_id) > 10:
            raise APIError(400, f"logit_bias keys must be token ids, got {token_id[:32]!r}.", "logit_bias")
        converted[int(token_id)] = bias
    return converted


def _num_choices(body: dict, num_prompts: int, max_choices: int) -> int:
    """The request's ``n``: how many choices (generations of the same prompt) it asks for per prompt; n times the
    prompts of a batch may not exceed ``max_choices``."""
    num_choices = body.get("n")
    if num_choices is None:
        num_choices = 1
    if not _is_int(num_choices) or not 1 <= num_choices <= max_choices:
        raise APIError(400, f"n must be an integer from 1 to {max_choices} (the choices generated for one request).",
                       "n")
    if num_choices * num_prompts > max_choices:
        raise APIError(400, f"{num_prompts} prompts x n={num_choices} asks for {num_choices * num_prompts} "
                       f"generations; one request may ask for at most {max_choices}.", "n")
    return num_choices


def _completion_prompts(prompt) -> list:
    """/v1/completions' prompt as a list of prompts, each a string or a list of token ids: a string, token ids,
    or a batch (a list of either)."""
    single = _one_prompt(prompt)
    if single is not None:
        return [single]
    batch = [_one_prompt(item) for item in prompt] if isinstance(prompt, list) else []
    if not batch or any(item is None for item in batch):
        raise APIError(400, "prompt must be a non-empty string, a list of token ids, or a batch: a list of "
                       "non-empty strings or of lists of token ids.", "prompt")
    return batch


def _one_prompt(prompt) -> str | list[int] | None:
    """One prompt: a non-empty string, or a non-empty list of token ids (as ints); None for anything else."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        if any(not 0 <= token < 2**32 for token in prompt):  # the proto's uint32; the router checks the vocabulary
            raise APIError(400, "a token id in the prompt is outside the vocabulary (token ids are integers from 0).", "prompt")
        return [int(token) for token in prompt]
    return None


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true or false) and ``top_logprobs`` (alternatives per token) as SamplingParams.logprobs:
    None without logprobs, else the number of alternatives."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise APIError(400, "logprobs must be true or false on /v1/chat/completions (top_logprobs says how many "
                       "alternatives each token gets).", "logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}.", "top_logprobs")
        if top > 0 and not logprobs:  # 0 without logprobs is harmless, as vLLM takes it
            raise APIError(400, "top_logprobs needs logprobs set to true.", "top_logprobs")
    return (top or 0) if logprobs else None


def _structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (text, json_object, json_schema) or vLLM's ``structured_outputs`` (json, regex,
    choice, grammar, json_object) as the request's constraint; None for plain text. 400 for a bad value or both."""
    response_format, vllm_fields = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and vllm_fields is not None:
        raise APIError(400, "Send response_format or structured_outputs, not both.", "structured_outputs")
    try:
        if vllm_fields is not None:
            if not isinstance(vllm_fields, dict):
                raise APIError(400, "structured_outputs must be an object with one of json, regex, choice, grammar "
                               "and json_object.", "structured_outputs")
            unknown = sorted(set(vllm_fields) - StructuredOutputsParams.FIELDS)
            if unknown or "num_resumed_tokens" in vllm_fields:
                name = unknown[0] if unknown else "num_resumed_tokens"
                raise APIError(400, f"structured_outputs.{str(name)[:64]} is not supported here; use one of json, "
                               "regex, choice, grammar and json_object.", "structured_outputs")
            return StructuredOutputsParams(**{name: value for name, value in vllm_fields.items() if value is not None})
        return _response_format(response_format)
    except InvalidRequest as error:
        raise APIError(400, str(error), "response_format" if vllm_fields is None else "structured_outputs") from None


def _response_format(response_format) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = response_format.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), (dict, bool)):
            raise APIError(400, 'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}.',
                           "response_format")
        return StructuredOutputsParams(json=schema["schema"])
    raise APIError(400, "response_format must be an object whose type is text, json_object or json_schema.",
                   "response_format")


def _priority(body: dict) -> int:
    """vLLM's ``priority`` (lower first, on workers that serve by priority; 0 when absent)."""
    priority = body.get("priority")
    if priority is None:
        return 0
    if not _is_int(priority) or not -2**31 <= priority < 2**31:
        raise APIError(400, "priority must be an integer (a signed 32-bit one; lower is served first).", "priority")
    return int(priority)


def _cache_salt(body: dict) -> str | None:
    """vLLM's ``cache_salt``: the prompt's cached KV is shared only with requests that send the same salt."""
    try:
        return check_cache_salt(body.get("cache_salt"))
    except InvalidRequest as error:
        raise APIError(400, str(error), "cache_salt") from None


def _request_id(body: dict, prefix: str, num_calls: int, verbatim: bool = False) -> str:
    """The answer's id: ``prefix`` (``cmpl-``, ...) and vLLM's ``request_id`` field, or a random one when it is
    absent; ``verbatim``: the field alone, as vLLM's Responses API takes it. Each router call is given it, ``-N``
    after it when the request makes several (``num_calls``, :func:`_call_id`), so a gRPC ``Abort`` by that id ends
    the call and the router's and workers' logs and spans name it. 400 for a value the router would refuse, with
    room left for the prefix and the suffix."""
    chosen = body.get("request_id")
    if chosen is None:
        return f"{prefix}{uuid.uuid4().hex}"
    if not isinstance(chosen, str):
        raise APIError(400, "request_id must be a string.", "request_id")
    head = "" if verbatim else prefix
    try:
        check_id(chosen, "request_id", MAX_ID_LENGTH - len(head) - len(_call_id("", num_calls - 1, num_calls)))
    except InvalidRequest as error:
        raise APIError(400, str(error), "request_id") from None
    return f"{head}{chosen}"


def _call_id(request_id: str, number: int, num_calls: int) -> str:
    """The id of a request's router call ``number`` of ``num_calls``: the request's own for a single call,
    ``request_id-N`` for each of several."""
    return request_id if num_calls == 1 else f"{request_id}-{number}"


def _flag(body: dict, name: str, default: bool = False) -> bool:
    """A true-or-false field (absent or null: ``default``); 400 for anything else."""
    value = _optional_flag(body, name)
    return default if value is None else value


def _optional_flag(body: dict, name: str) -> bool | None:
    """A true-or-false field, None when absent or null; 400 for anything else."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false.", name)
    return value


def _stream_options(body: dict) -> tuple[bool, bool]:
    """OpenAI's ``stream_options``: whether the stream ends with the request's usage (``include_usage``) and, with
    vLLM's ``continuous_usage_stats`` beside it, every chunk carries its choice's usage so far. Only with
    ``stream``, as OpenAI and vLLM take it; other fields (OpenAI's ``include_obfuscation``) are ignored."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise APIError(400, 'stream_options must be an object, such as {"include_usage": true}.', "stream_options")
    if not _flag(body, "stream"):
        raise APIError(400, "stream_options is only allowed when stream is true.", "stream_options")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise APIError(400, f"stream_options.{name} must be true or false.", "stream_options")
        flags.append(bool(options.get(name)))
    include_usage, continuous = flags
    return include_usage, include_usage and continuous  # vLLM's continuous usage needs include_usage too


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's ``prompt_logprobs`` (the prompt's tokens scored, with this many alternatives), whole answers only."""
    value = body.get("prompt_logprobs")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be an integer from 0 to {MAX_LOGPROBS}.", "prompt_logprobs")
    if _flag(body, "stream"):
        raise APIError(400, "prompt_logprobs are not available with stream; ask without streaming.",
                       "prompt_logprobs")
    return value


def _completion_logprobs(body: dict) -> int | None:
    logprobs = body.get("logprobs")
    if logprobs is None:
        return None
    if not _is_int(logprobs) or logprobs < 0:
        raise APIError(400, "logprobs must be a non-negative integer on /v1/completions.", "logprobs")
    return logprobs


def _chat(body: dict) -> Chat:
    """The request's ``messages`` (text content, or a list of text parts, joined; tool calls and tool answers),
    ``tools`` and vLLM's ``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message`` as a
    Chat; 400 naming the field for malformed ones."""
    try:
        tools = openai_tools(body.get("tools"))
    except InvalidRequest as error:
        raise APIError(400, str(error), "tools") from None
    try:
        kwargs = check_chat_template_kwargs(body.get("chat_template_kwargs"))
    except InvalidRequest as error:
        raise APIError(400, str(error), "chat_template_kwargs") from None
    continue_final_message = body.get("continue_final_message", False)
    # vLLM refuses continue_final_message beside its default add_generation_prompt true unless the request sets
    # that false; here leaving add_generation_prompt out is enough.
    add_generation_prompt = body.get("add_generation_prompt", continue_final_message is not True)
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise APIError(400, f"{name} must be true or false.", name)
    if add_generation_prompt and continue_final_message:
        raise APIError(400, BOTH_TURN_FLAGS, "continue_final_message")
    try:
        return Chat.from_openai(body.get("messages"), tools or None, add_generation_prompt, kwargs,
                                continue_final_message)
    except InvalidRequest as error:
        raise APIError(400, str(error), "messages") from None


async def _chunks(call) -> AsyncIterator:
    """The call's messages; a gRPC error becomes the gateway's APIError."""
    try:
        async for chunk in call:
            yield chunk
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error) from None


def _choices(call, num_choices: int) -> list[AsyncIterator]:
    """The messages of each of a router call's ``num_choices`` choices (by their ``index``), as streams of their
    own; a gRPC error becomes the gateway's APIError, and ends every choice's stream. One task reads the call,
    started by the first stream read, ending with the call."""
    if num_choices == 1:
        return [_chunks(call)]
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(num_choices)]
    reader: list[asyncio.Future] = []

    async def read() -> None:
        try:
            async for chunk in _chunks(call):
                if chunk.index >= num_choices:
                    raise APIError(502, f"The router sent choice {chunk.index} of a request for {num_choices}.")
                queues[chunk.index].put_nowait(chunk)
            ends: list = [None] * num_choices
        except (APIError, asyncio.CancelledError) as error:
            ends = [error] * num_choices
        except Exception as error:  # not the router's answer: still every choice's end, never a silent hang
            logger.exception("reading a router call's choices failed")
            ends = [APIError(500, f"The gateway lost a request's choices ({type(error).__name__}).")] * num_choices
        for queue, end in zip(queues, ends):
            queue.put_nowait(end)

    async def choice(index: int) -> AsyncIterator:
        if not reader:
            reader.append(asyncio.ensure_future(read()))
        while (item := await queues[index].get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    return [choice(index) for index in range(num_choices)]


async def _first(stream: AsyncIterator):
    """A stream's first message (None if it ends at once)."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def _rest(first, stream: AsyncIterator) -> list:
    """A stream's messages, ``first`` (unless None) and all that follow it."""
    return ([first] if first is not None else []) + [chunk async for chunk in stream]


async def _all_or_cancel(calls: list, awaitables: list) -> list:
    """Every awaitable's result, in order. At the first error, every call is cancelled (the other choices of a
    failed request end on the workers too), the other awaitables are waited for, and the error is raised."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for call in calls:
            call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def side_by_side(request: Request, coroutines: list) -> list:
    """The results of a request's unary router calls, run side by side, in order; all cancelled at the first
    failure (its gRPC status raised as an HTTP error) or when the HTTP caller leaves."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, tasks))
    try:
        return await asyncio.gather(*tasks)
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _cancel_on_disconnect(request: Request, calls: list) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
    logger.info("HTTP client left; cancelling its request")
    for call in calls:
        call.cancel()


def _finish(chunk) -> str | None:
    return _FINISH.get(chunk.finish_reason)


def _stop_reason(chunk) -> str | int | None:
    """What ended a request that finished with "stop", as vLLM's server says it: the stop string or the stop token
    id that matched; None for the end-of-sequence token, another finish, or a message before the last."""
    kind = chunk.WhichOneof("stop_reason")
    return getattr(chunk, kind) if kind is not None else None


def _usage(usages: list, num_choices: int) -> dict:
    """The usage of a request's choices, ``num_choices`` a prompt in order: each prompt counted once (its choices
    share it; its cached tokens are its first choice's), the completion tokens of all."""
    firsts = usages[::num_choices]
    prompt_tokens = sum(usage.prompt_tokens for usage in firsts)
    completion_tokens = sum(usage.completion_tokens for usage in usages)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(usage.cached_tokens for usage in firsts)}}


def _completion_choice(index: int, text: str, finish: str | None, logprobs: list, final: bool,
                       text_offset: int = 0, as_ids: bool = False) -> dict:
    """A completion choice (``as_ids``: vLLM's ``return_tokens_as_token_ids``, :func:`_token_name`)."""
    return {"index": index, "text": text, "logprobs": _openai_logprobs(logprobs, text_offset, as_ids),
            "finish_reason": finish}


def _chat_choice(index: int, text: str, finish: str | None, logprobs: list, final: bool,
                 text_offset: int = 0, tools: ToolReplies | None = None, reasoning: ReasoningReplies | None = None,
                 with_reasoning: bool = False, as_ids: bool = False) -> dict:
    """A chat choice: its message (``final``) or its stream delta; with ``tools`` (a tool choice other than none)
    the text may be tool calls; with ``reasoning`` its think block is the message's ``reasoning`` (the gateway's
    ``--reasoning-parser``: ``with_reasoning``, every message has the field, null when there is none) and only the
    rest is content, read for tool calls; ``as_ids``: the logprobs name tokens by id (:func:`_token_name`)."""
    if final:
        thought, content = reasoning.whole(text) if reasoning is not None else (None, text)
        message, finish = (tools.message(content or "", finish) if tools is not None
                           else ({"role": "assistant", "content": content}, finish))
        if with_reasoning:
            message["reasoning"], message["content"] = thought, message["content"] or None
        return {"index": index, "message": message, "logprobs": _chat_logprobs_object(logprobs, as_ids),
                "finish_reason": finish}
    thought = ""
    if reasoning is not None:
        thought, text = reasoning.delta(index, text, final=finish is not None)
    if tools is not None:
        delta, finish = tools.delta(index, text, finish)
    else:
        delta = {"content": text} if text else {}
    if thought:
        delta = {"reasoning": thought, **delta}
    return {"index": index, "delta": delta, "logprobs": _chat_logprobs_object(logprobs, as_ids),
            "finish_reason": finish}


def _logprob(entry) -> float:
    return max(entry.logprob, LOWEST_LOGPROB)


def _token_name(token, as_ids: bool) -> str:
    """How logprobs name a token: its text, or with vLLM's ``return_tokens_as_token_ids`` ``"token_id:N"`` (so a
    client gets the exact ids, which texts cannot give where several tokens share one, or one is part of a
    character)."""
    return f"token_id:{token.token_id}" if as_ids else token.text


def _openai_logprobs(entries: list, text_offset: int = 0, as_ids: bool = False) -> dict | None:
    """The legacy completions logprobs object from the router's per-position logprobs (an echoed prompt's first
    token ``_Unscored``: its logprob and alternatives null, as OpenAI writes them); each token's ``text_offset``
    is where its text starts, counting from ``text_offset`` (in the text, also when tokens are named by id)."""
    if not entries:
        return None
    sampled = [(entry.entry if isinstance(entry, _Unscored) else entry).sampled for entry in entries]
    offsets = [text_offset]
    for token in sampled[:-1]:
        offsets.append(offsets[-1] + len(token.text))
    return {
        "tokens": [_token_name(token, as_ids) for token in sampled],
        "token_logprobs": [None if isinstance(entry, _Unscored) else _logprob(entry.sampled) for entry in entries],
        "top_logprobs": [None if isinstance(entry, _Unscored)
                         else {_token_name(top, as_ids): _logprob(top) for top in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def _vllm_prompt_logprobs(positions: list) -> list | None:
    """vLLM's prompt_logprobs from the router's: null for the first token, then per token {token id: {logprob,
    rank, decoded_token}} for the prompt's token and its alternatives (token ids as JSON's string keys)."""
    if not positions:
        return None

    def entry(token) -> dict:
        return {"logprob": _logprob(token), "rank": token.rank, "decoded_token": token.text}

    def tokens(position) -> dict:  # the prompt's token first, with its own rank (vLLM's order)
        scored = {str(position.sampled.token_id): entry(position.sampled)}
        return {**scored, **{str(top.token_id): entry(top) for top in position.top
                             if str(top.token_id) not in scored}}

    return [None] + [tokens(position) for position in positions[1:]]


def _chat_logprobs_object(entries: list, as_ids: bool = False) -> dict | None:
    """Chat's logprobs object (``content``: each generated token with its UTF-8 bytes, its log probability and
    its ``top_logprobs`` alternatives) from the router's per-position logprobs; ``as_ids``: each token named by id
    (:func:`_token_name`), its bytes still its text's."""
    if not entries:
        return None

    def token(entry) -> dict:
        return {"token": _token_name(entry, as_ids), "logprob": _logprob(entry),
                "bytes": list(entry.text.encode("utf-8"))}

    return {"content": [{**token(entry.sampled), "top_logprobs": [token(top) for top in entry.top]}
                        for entry in entries], "refusal": None}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _not_found(request: Request, error) -> Response:
    return APIError(404, f"No route {request.url.path[:200]}: this server offers /v1/completions, "
                    "/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/score, /v1/rerank, /v1/models, /tokenize, "
                    "/detokenize, /health and /version.").response()


async def _not_allowed(request: Request, error) -> Response:
    return APIError(405, f"{request.method} is not allowed on {request.url.path[:200]}.").response()


def run_gateway(config: GatewayConfig, host: str, port: int, log_level: str = "info") -> int:
    """Serve the gateway with uvicorn until SIGINT/SIGTERM; prints ``READY http://host:port`` once it listens."""
    import uvicorn

    gateway = Gateway(config)
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = serve_metrics(gateway.metrics.registry, host, config.metrics_port)
    server = uvicorn.Server(uvicorn.Config(gateway.app, host=host, port=port, log_level=log_level.lower(),
                                           access_log=False, lifespan="on"))

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()
            print(f"READY http://{host}:{bound[1]} gateway", flush=True)
        await task

    try:
        asyncio.run(serve())
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0 if server.started else 1
