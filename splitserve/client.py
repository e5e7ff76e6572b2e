"""A small Python client for a splitserve router (the Inference service).

    from splitserve import Client, SamplingParams
    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate_stream("The capital of France is", SamplingParams(temperature=0)):
            print(chunk.text, end="")

Clients in other languages are generated from ``protos/splitserve/v1/inference.proto``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import grpc

from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.common.chat import Chat
from splitserve.common.sampling_params import SamplingParams
from splitserve.rpc.auth import API_KEY_ENV, AUTHORIZATION_HEADER, BEARER_PREFIX, with_api_key
from splitserve.rpc.convert import beam_search_to_pb, chat_to_pb, structured_outputs_to_pb
from splitserve.rpc.tls import TLSConfig, open_channel
from splitserve.v1 import inference_pb2, inference_pb2_grpc

_STATUS_COLUMNS = ("pool", "worker", "address", "state", "running", "waiting", "remote KV", "queued tokens",
                   "free KV blocks", "in flight", "heartbeat")


class ClusterStatus:
    """A ``GetClusterStatusResponse`` that prints as a table, one row per worker; every proto field reads
    through (``status.pools``), and ``response`` is the message itself."""

    def __init__(self, response: inference_pb2.GetClusterStatusResponse) -> None:
        self.response = response

    def __getattr__(self, name: str):
        return getattr(self.response, name)

    def __str__(self) -> str:
        rows = [_STATUS_COLUMNS]
        for pool in self.response.pools:
            for worker in pool.workers:
                load = worker.load
                rows.append((
                    _enum_label(inference_pb2.WorkerRole, pool.role, "WORKER_ROLE_"), worker.worker_id, worker.address,
                    _enum_label(inference_pb2.WorkerState, worker.state, "WORKER_STATE_"),
                    str(load.num_running_requests), str(load.num_waiting_requests),
                    str(load.num_waiting_for_remote_kvs_requests), str(load.num_queued_prefill_tokens),
                    f"{load.num_free_kv_blocks}/{load.num_total_kv_blocks} ({1 - load.kv_block_usage:.0%})",
                    str(worker.num_router_in_flight_requests), f"{worker.seconds_since_heartbeat:.1f} s ago",
                ))
        if len(rows) == 1:
            return "No workers registered."
        widths = [max(len(row[column]) for row in rows) for column in range(len(_STATUS_COLUMNS))]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)

    def __repr__(self) -> str:
        return f"ClusterStatus({sum(len(pool.workers) for pool in self.response.pools)} workers)"


def _enum_label(enum, value: int, prefix: str) -> str:
    """``WORKER_ROLE_PREFILL`` -> ``prefill``."""
    return enum.Name(value).removeprefix(prefix).lower()


def sampling_params_to_pb(params: SamplingParams | None) -> inference_pb2.SamplingParams:
    """The proto form of the engine's SamplingParams (every field set explicitly)."""
    if params is None:
        return inference_pb2.SamplingParams()
    message = inference_pb2.SamplingParams(
        n=params.n,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, skip_special_tokens=params.skip_special_tokens,
        logit_bias=params.logit_bias, include_stop_str_in_output=params.include_stop_str_in_output,
        allowed_token_ids=params.allowed_token_ids or [], bad_words=params.bad_words,
        num_resumed_tokens=params.num_resumed_tokens,
    )
    if params.max_tokens is not None:
        message.max_tokens = params.max_tokens
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    if params.truncate_prompt_tokens is not None:
        message.truncate_prompt_tokens = params.truncate_prompt_tokens
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(structured_outputs_to_pb(params.structured_outputs))
    return message


def chat_prompt(chat) -> inference_pb2.ChatPrompt:
    """A :class:`~splitserve.common.chat.Chat`, or OpenAI's chat messages (dicts), as the router's ChatPrompt.

    Raises:
        InvalidRequest: malformed messages (``Chat.from_openai``).
    """
    return chat_to_pb(chat if isinstance(chat, Chat) else Chat.from_openai(chat))


def generate_request(prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     echo: bool = False, priority: int = 0, lora_name: str = "", cache_salt: str | None = None,
                     return_prompt_token_ids: bool = False, add_special_tokens: bool | None = None,
                     beam_search: BeamSearchParams | None = None):
    """A GenerateRequest for a text prompt, a list of token ids, or a chat (a ``Chat``, or a list of OpenAI message
    dicts, tool calls and answers included: ``chat_prompt``); with ``echo``
    the first token's message carries the prompt's text, with ``return_prompt_token_ids`` its token ids;
    ``priority`` orders it on workers that serve by priority
    (lower first); ``lora_name`` runs it with that LoRA adapter of the workers ("": the base model); ``cache_salt``
    keeps its prompt's cached KV apart from other salts' (GenerateRequest.cache_salt); ``add_special_tokens``: whether
    the tokenizer adds its special tokens to a text or rendered chat (None: the router's default, GenerateRequest's);
    ``beam_search``: search with beams instead of sampling (its ``max_tokens`` and ``ignore_eos`` are the request's;
    ``params`` then give ``logprobs`` alone, or are None), streamed as ``beam_width`` completions, best first."""
    if beam_search is not None:
        logprobs = params.logprobs if params is not None else None
        plain = SamplingParams(max_tokens=beam_search.max_tokens, ignore_eos=beam_search.ignore_eos,
                               temperature=0.0, logprobs=logprobs)
        if params is not None and params != dataclasses.replace(plain, max_tokens=params.max_tokens,
                                                                ignore_eos=params.ignore_eos,
                                                                temperature=params.temperature):
            raise ValueError("A beam search takes its max_tokens and ignore_eos from its BeamSearchParams: give "
                             "SamplingParams with logprobs alone, or none.")
        params = plain
    request = inference_pb2.GenerateRequest(sampling_params=sampling_params_to_pb(params), echo=echo,
                                            priority=priority, lora_name=lora_name, cache_salt=cache_salt,
                                            return_prompt_token_ids=return_prompt_token_ids,
                                            add_special_tokens=add_special_tokens)
    if request_id is not None:
        request.request_id = request_id
    if beam_search is not None:
        request.beam_search.CopyFrom(beam_search_to_pb(beam_search))
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Chat) or (prompt and isinstance(prompt[0], dict)):
        request.chat.CopyFrom(chat_prompt(prompt))
    else:
        request.token_ids.ids.extend(int(token) for token in prompt)
    return request


def embed_request(prompt, normalize: bool = True, dimensions: int | None = None, lora_name: str = "",
                  request_id: str | None = None, truncate_prompt_tokens: int | None = None,
                  cache_salt: str | None = None, priority: int = 0,
                  add_special_tokens: bool | None = None) -> inference_pb2.EmbedRequest:
    """An EmbedRequest for a text prompt, a list of token ids, or a chat (as :func:`generate_request`'s);
    ``dimensions``: keep only the first this-many values (None: all); ``normalize``: to unit L2 norm, after the cut;
    ``truncate_prompt_tokens``: embed only the prompt's last this-many tokens (-1: max_model_len); ``priority`` as
    :func:`generate_request`'s, as is ``add_special_tokens``."""
    request = inference_pb2.EmbedRequest(normalize=normalize, dimensions=dimensions or 0, lora_name=lora_name,
                                         cache_salt=cache_salt, priority=priority,
                                         add_special_tokens=add_special_tokens)
    if request_id is not None:
        request.request_id = request_id
    if truncate_prompt_tokens is not None:
        request.truncate_prompt_tokens = truncate_prompt_tokens
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Chat) or (prompt and isinstance(prompt[0], dict)):
        request.chat.CopyFrom(chat_prompt(prompt))
    else:
        request.token_ids.SetInParent()  # an empty list too: the router says the prompt is empty
        request.token_ids.ids.extend(int(token) for token in prompt)
    return request


class Client:
    """A connection to a router. Calls raise ``grpc.RpcError`` with the router's status and message.

    Args:
        address: the router's host:port.
        timeout: default deadline of each call, in seconds (None: none).
        api_key: sent as ``authorization: Bearer <key>`` metadata on every call (None: ``$SPLITSERVE_API_KEY``,
            else no key; a router without API keys accepts any call). Kept out of ``repr`` and logs.
        tls: connect over TLS (``splitserve.rpc.tls.TLSConfig``): the router's certificate verified against
            ``tls.ca_file``, and ``tls.cert_file`` presented as this client's certificate when given (a router
            with mutual TLS requires one). None: plaintext. A failed handshake surfaces as UNAVAILABLE.
    """

    def __init__(self, address: str, timeout: float | None = None, api_key: str | None = None,
                 tls: TLSConfig | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.tls = tls
        self.channel = open_channel(address, tls)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.stub = inference_pb2_grpc.InferenceStub(with_api_key(self.channel, key))

    def __repr__(self) -> str:
        return f"Client({self.address!r}, tls={self.tls is not None})"

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout)

    def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                 timeout: float | None = None, echo: bool = False, priority: int = 0,
                 lora_name: str = "", cache_salt: str | None = None, return_prompt_token_ids: bool = False,
                 add_special_tokens: bool | None = None) -> inference_pb2.GenerateResponse:
        request = generate_request(prompt, params, request_id, echo, priority, lora_name, cache_salt,
                                   return_prompt_token_ids, add_special_tokens)
        return self.stub.Generate(request, timeout=timeout or self.timeout)

    def generate_stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                        timeout: float | None = None, echo: bool = False, priority: int = 0,
                        lora_name: str = "", cache_salt: str | None = None, return_prompt_token_ids: bool = False,
                        add_special_tokens: bool | None = None, beam_search: BeamSearchParams | None = None
                        ) -> Iterator[inference_pb2.GenerateStreamResponse]:
        """The streamed chunks (of each completion: ``index``); cancel early with ``.cancel()`` on the returned
        call. ``beam_search`` as :func:`generate_request`'s."""
        request = generate_request(prompt, params, request_id, echo, priority, lora_name, cache_salt,
                                   return_prompt_token_ids, add_special_tokens, beam_search)
        return self.stub.GenerateStream(request, timeout=timeout or self.timeout)

    def embed(self, prompt, normalize: bool = True, dimensions: int | None = None, lora_name: str = "",
              request_id: str | None = None, timeout: float | None = None,
              truncate_prompt_tokens: int | None = None, cache_salt: str | None = None,
              priority: int = 0) -> list[float]:
        """The prompt's embedding (Embed): its last token's final hidden state, its first ``dimensions`` values
        (None: all), of unit length unless ``normalize`` is False; ``lora_name`` embeds with that adapter;
        ``truncate_prompt_tokens`` embeds only the prompt's last tokens; ``cache_salt`` and ``priority`` as
        :func:`generate_request`."""
        request = embed_request(prompt, normalize, dimensions, lora_name, request_id, truncate_prompt_tokens,
                                cache_salt, priority)
        return list(self.stub.Embed(request, timeout=timeout or self.timeout).embedding)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(inference_pb2.AbortRequest(request_id=request_id), timeout=10).found

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(inference_pb2.TokenizeRequest(text=text), timeout=30).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        request = inference_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=30).text

    def model_info(self) -> inference_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)

    def cluster_status(self) -> ClusterStatus:
        """The router's view of its workers; ``print`` shows it as a table, fields read as the proto's."""
        return ClusterStatus(self.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=10))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of :class:`Client` (``grpc.aio``), for event-loop programs such as the HTTP gateway.

        async with AsyncClient("127.0.0.1:50051") as client:
            async for chunk in client.generate_stream("The capital of France is", SamplingParams(temperature=0)):
                print(chunk.text, end="")

    Args: as :class:`Client`'s. Each call may also name its own ``api_key`` (the gateway passes on the one its
    HTTP caller sent); without one, the client's is sent.
    """

    def __init__(self, address: str, timeout: float | None = None, api_key: str | None = None,
                 tls: TLSConfig | None = None) -> None:
        from splitserve.rpc.tls import CHANNEL_OPTIONS, SERVER_NAME_OPTION

        self.address = address
        self.timeout = timeout
        self.tls = tls
        if tls is None:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            options = [*CHANNEL_OPTIONS, *([(SERVER_NAME_OPTION, tls.server_name)] if tls.server_name else [])]
            self.channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)

    def __repr__(self) -> str:
        return f"AsyncClient({self.address!r}, tls={self.tls is not None})"

    def _metadata(self, api_key: str | None) -> tuple[tuple[str, str], ...]:
        key = api_key or self._api_key
        return ((AUTHORIZATION_HEADER, BEARER_PREFIX + key),) if key else ()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       timeout: float | None = None, api_key: str | None = None,
                       echo: bool = False, priority: int = 0, lora_name: str = "",
                       cache_salt: str | None = None, return_prompt_token_ids: bool = False) -> inference_pb2.GenerateResponse:
        request = generate_request(prompt, params, request_id, echo, priority, lora_name, cache_salt,
                                   return_prompt_token_ids)
        return await self.stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata(api_key))

    def generate_stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                        timeout: float | None = None, api_key: str | None = None, echo: bool = False,
                        priority: int = 0, lora_name: str = "", cache_salt: str | None = None,
                        trace: tuple[tuple[str, str], ...] = (), return_prompt_token_ids: bool = False,
                        add_special_tokens: bool | None = None, beam_search: BeamSearchParams | None = None):
        """The call, an async iterator of the streamed chunks; ``.cancel()`` on it ends the request on the
        workers (its blocks freed). ``trace``: W3C trace context (``traceparent``, ``tracestate``) to send, so the
        router's span of the request joins the caller's trace; ``beam_search`` as :func:`generate_request`'s."""
        request = generate_request(prompt, params, request_id, echo, priority, lora_name, cache_salt,
                                   return_prompt_token_ids, add_special_tokens, beam_search)
        return self.stub.GenerateStream(request, timeout=timeout or self.timeout,
                                        metadata=self._metadata(api_key) + tuple(trace))

    async def embed(self, prompt, normalize: bool = True, dimensions: int | None = None, lora_name: str = "",
                    request_id: str | None = None, timeout: float | None = None,
                    api_key: str | None = None, truncate_prompt_tokens: int | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    trace: tuple[tuple[str, str], ...] = (),
                    add_special_tokens: bool | None = None) -> inference_pb2.EmbedResponse:
        """The Embed response (its ``embedding`` and ``prompt_tokens``), as :meth:`Client.embed` asks; ``trace``
        as :meth:`generate_stream`'s, ``add_special_tokens`` as :func:`generate_request`'s."""
        request = embed_request(prompt, normalize, dimensions, lora_name, request_id, truncate_prompt_tokens,
                                cache_salt, priority, add_special_tokens)
        return await self.stub.Embed(request, timeout=timeout or self.timeout,
                                     metadata=self._metadata(api_key) + tuple(trace))

    async def abort(self, request_id: str, api_key: str | None = None) -> bool:
        response = await self.stub.Abort(inference_pb2.AbortRequest(request_id=request_id), timeout=10,
                                         metadata=self._metadata(api_key))
        return response.found

    async def tokenize(self, text: str, api_key: str | None = None) -> list[int]:
        return list((await self.tokenize_prompt(text, api_key)).token_ids)

    async def tokenize_prompt(self, prompt, api_key: str | None = None, return_token_strs: bool = False,
                              add_special_tokens: bool | None = None) -> inference_pb2.TokenizeResponse:
        """Tokenize text, or chat messages (a list of {"role", "content"}) through the model's chat template; with
        ``return_token_strs`` each token's string too (``token_strs``); ``add_special_tokens`` as
        :func:`generate_request`'s."""
        request = inference_pb2.TokenizeRequest(return_token_strs=return_token_strs,
                                                add_special_tokens=add_special_tokens)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.chat.CopyFrom(chat_prompt(prompt))
        return await self.stub.Tokenize(request, timeout=30, metadata=self._metadata(api_key))

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False,
                         api_key: str | None = None) -> str:
        request = inference_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request, timeout=30, metadata=self._metadata(api_key))).text

    async def model_info(self, api_key: str | None = None) -> inference_pb2.GetModelInfoResponse:
        return await self.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10,
                                            metadata=self._metadata(api_key))

    async def cluster_status(self, api_key: str | None = None) -> ClusterStatus:
        return ClusterStatus(await self.stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=10,
                                                              metadata=self._metadata(api_key)))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
