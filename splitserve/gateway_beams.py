"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``, through the router.

The search is ``LLM.beam_search``'s (``splitserve.engine.beam_search``: its beams transformers'), run on one decode
worker (the router's ``GenerateRequest.beam_search``, ``decode_service/beam_search.py``): one streamed router call a
prompt, side by side, the prompt computed and its KV sent once, each step's beams forking the KV of the beams they
grew from, with no call a step. ``n`` is the beam width (1 to 10) and the answer's ``n`` choices of a prompt are its
best beams, best first; ``max_tokens`` (``max_completion_tokens`` on chats), vLLM's ``length_penalty`` and
``ignore_eos`` shape the search; the prompts times ``n`` are at most ``--max-choices``. A choice's
``finish_reason`` is ``stop`` when its beam ended with the end-of-sequence token, ``length`` otherwise; the usage
counts each prompt once and every returned beam's tokens. ``logprobs`` (``logprobs`` and ``top_logprobs`` on chats)
give each beam's tokens' log probabilities and, of the candidates each step scored, the best (at most 2 x ``n``).
Not streamed, and not with ``echo``, tools or structured outputs (400 naming the field). ``model`` (a LoRA adapter too), ``priority``, ``cache_salt`` and
``request_id`` apply to every call.
"""

from __future__ import annotations

import math
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.v1 import inference_pb2

# Fields a beam search answer cannot give, and the sentence that says why.
_REFUSED = {
    "stream": "Beam search answers are not streamed: the best beams are known only at the end.",
    "echo": "echo is not taken with beam search.",
    "tools": "tools are not taken with beam search.",
    "response_format": "response_format is not taken with beam search.",
    "structured_outputs": "structured_outputs are not taken with beam search.",
}


async def beam_search_answer(gateway, request: Request, body: dict, prompts: list, lora_name: str, chat: bool,
                             default_max_tokens: int) -> Response:
    """The answer of a completion (each of ``prompts``) or a chat (one rendered ``Chat``) by beam search."""
    from splitserve.gateway import (
        APIError,
        _chat_logprobs,
        _chat_logprobs_object,
        _completion_logprobs,
        _finish,
        _flag,
        _openai_logprobs,
        _request_id,
    )

    for field, sentence in _REFUSED.items():
        if body.get(field) not in (None, False, 0, []):
            raise APIError(400, sentence, field)
    width = body.get("n", 1) if body.get("n") is not None else 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    length_penalty = body.get("length_penalty", 1.0)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not math.isfinite(length_penalty):
        raise APIError(400, "length_penalty must be a number.", "length_penalty")
    params = BeamSearchParams(width, default_max_tokens if max_tokens is None else max_tokens,
                              ignore_eos=_flag(body, "ignore_eos"), length_penalty=float(length_penalty))
    try:
        params.check()
    except ValueError as error:
        raise APIError(400, str(error), "n" if "beam_width" in str(error) else "max_tokens") from None
    num_logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    if num_logprobs is not None and num_logprobs > 2 * params.beam_width:
        raise APIError(400, f"{'top_logprobs' if chat else 'logprobs'} is at most 2 x n ({2 * params.beam_width}) "
                       "with beam search: the candidates each step scores.", "top_logprobs" if chat else "logprobs")
    if len(prompts) * params.beam_width > gateway.config.max_choices:
        raise APIError(400, f"{len(prompts)} prompts of {params.beam_width} beams each ask for more choices than "
                       f"the {gateway.config.max_choices} one request may (the gateway's --max-choices).", "n")
    info = await gateway._info(request)
    request_id = _request_id(body, "chatcmpl-" if chat else "cmpl-", len(prompts))
    width = params.beam_width
    generations = [(prompt, index) for prompt in prompts for index in range(width)]
    logprobs = SamplingParams(logprobs=num_logprobs) if num_logprobs is not None else None
    calls, streams, firsts = await gateway._start(request, body, generations, logprobs, request_id, lora_name,
                                                  beam_search=params)
    collected = await gateway._collect(request, calls, streams, firsts)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for number, chunks in enumerate(collected):
        last = chunks[-1]
        text = "".join(chunk.text for chunk in chunks)
        if last.finish_reason == inference_pb2.FINISH_REASON_ERROR:  # the prompt's KV failed: no beam
            raise APIError(500, last.error_message)
        finish = _finish(last)
        entries = [entry for chunk in chunks for entry in chunk.logprobs] if num_logprobs is not None else []
        if chat:
            choices.append({"index": number, "message": {"role": "assistant", "content": text},
                            "logprobs": _chat_logprobs_object(entries), "finish_reason": finish, "stop_reason": None})
        else:
            choices.append({"index": number, "text": text, "logprobs": _openai_logprobs(entries),
                            "finish_reason": finish, "stop_reason": None})
        if number % width == 0:  # a prompt's beams share it
            prompt_tokens += last.usage.prompt_tokens
        completion_tokens += last.usage.completion_tokens
    return JSONResponse({
        "id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": lora_name or gateway._model_name(info), "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })
