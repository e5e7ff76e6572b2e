"""OpenAI's ``/v1/embeddings`` in the gateway, as vLLM serves it for a decoder-only model: each input's
embedding from the router's ``Embed`` (its last token's final hidden state, normalized; engine/pooling.py).

``input`` is a string, a list of token ids, or a batch (a list of either), at most ``--max-choices`` inputs a
request, embedded side by side (one ``Embed`` call each; all cancelled at the first failure or when the caller
leaves). vLLM's ``messages`` in place of ``input`` embeds one chat, rendered through the chat template as the chat
route renders it (``tools``, ``chat_template_kwargs`` and ``continue_final_message`` alike) but without the
assistant's opening unless ``add_generation_prompt`` is true (vLLM's default for embeddings). ``encoding_format``
``float`` gives lists of numbers, ``base64`` the little-endian float32 bytes in base64 (what the ``openai``
package asks for by default, and decodes); ``dimensions`` keeps the first values (Matryoshka; the workers refuse
more than the model's hidden size); vLLM's ``normalize`` false gives the raw vector; vLLM's
``truncate_prompt_tokens`` embeds only the last tokens of each input; vLLM's ``cache_salt`` keeps the inputs'
cached KV among requests with the same salt, and vLLM's ``priority`` orders them on workers serving by priority, as
on the other routes. ``model`` may name a LoRA adapter, and vLLM's ``request_id`` names the request, as on the
other routes. ``user`` is taken and ignored (OpenAI's). The usage counts the prompt tokens, and in
``prompt_tokens_details.cached_tokens`` those found in a worker's prefix cache (vLLM's, OpenAI's chat field).
"""

from __future__ import annotations

import base64
import struct
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def create_embeddings(gateway, request: Request) -> Response:
    """The ``/v1/embeddings`` answer for ``request`` through ``gateway``'s router client."""
    from splitserve.gateway import APIError, _chat, _completion_prompts, _request_id

    body = await gateway._body(request)
    info, lora_name = await gateway._model_of(request, body)
    if body.get("messages") is not None:
        if body.get("input") is not None:
            raise APIError(400, "Send input or messages, not both.", "messages")
        # vLLM's embeddings of a chat leave the assistant's opening out unless asked for.
        inputs = [_chat({**body, "add_generation_prompt": body.get("add_generation_prompt", False)})]
    else:
        try:
            inputs = _completion_prompts(body.get("input"))
        except APIError as error:  # the completions route's sentence, about this route's field
            raise APIError(400, error.message.replace("prompt", "input"), "input") from None
    check_input_count(gateway, len(inputs), "input", "input holds {count} prompts")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise APIError(400, "encoding_format must be 'float' or 'base64'.", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise APIError(400, "dimensions must be a positive integer.", "dimensions")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise APIError(400, "normalize must be true or false.", "normalize")
    options = embed_options(body)
    request_id = _request_id(body, "embd-", len(inputs))
    answers = await embed_all(gateway, request, inputs, request_id, lora_name, options, normalize, dimensions)
    prompt_tokens = sum(answer.prompt_tokens for answer in answers)
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": lora_name or gateway._model_name(info),
        "data": [{"object": "embedding", "index": index, "embedding": _encoded(answer.embedding, encoding)}
                 for index, answer in enumerate(answers)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "prompt_tokens_details": {"cached_tokens": sum(answer.cached_tokens for answer in answers)}},
    })


def check_input_count(gateway, count: int, field: str, what: str) -> None:
    """Refuse more inputs than ``--max-choices`` (each one ``Embed`` call): ``what`` says what the request holds,
    ``{count}`` standing for the number."""
    from splitserve.gateway import APIError

    limit = gateway.config.max_choices
    if count > limit:
        raise APIError(400, f"{what.format(count=count)}; one request may embed at most {limit} (the gateway's "
                       f"--max-choices).", field)


def embed_options(body: dict) -> dict:
    """The request fields every embedding call of a request takes (checked): vLLM's ``truncate_prompt_tokens``,
    ``cache_salt``, ``priority`` and ``add_special_tokens``, as ``AsyncClient.embed``'s keyword arguments."""
    from splitserve.gateway import APIError, _cache_salt, _optional_flag, _priority

    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int)
                                 or not (truncate == -1 or 1 <= truncate < 2**31)):
        raise APIError(400, "truncate_prompt_tokens must be -1 (the model's context length) or an integer >= 1.",
                       "truncate_prompt_tokens")
    return {"truncate_prompt_tokens": truncate, "cache_salt": _cache_salt(body), "priority": _priority(body),
            "add_special_tokens": _optional_flag(body, "add_special_tokens")}


async def embed_all(gateway, request: Request, inputs: list, request_id: str, lora_name: str | None, options: dict,
                    normalize: bool = True, dimensions: int | None = None) -> list:
    """Each input's ``EmbedResponse``, in order: one router ``Embed`` call each, side by side (``side_by_side``)."""
    from splitserve.gateway import _bearer, _call_id, router_trace, side_by_side

    api_key, trace = _bearer(request), router_trace(request)
    gateway.metrics.generations.inc(len(inputs))
    request.state.generations = len(inputs)  # on the request's span
    return await side_by_side(request, [gateway.client.embed(
        prompt, normalize, dimensions, lora_name, _call_id(request_id, number, len(inputs)),
        api_key=api_key, trace=trace, **options) for number, prompt in enumerate(inputs)])


def _encoded(embedding, encoding: str) -> list[float] | str:
    values = list(embedding)
    if encoding == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
