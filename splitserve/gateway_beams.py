"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``, through the router.

The search is ``LLM.beam_search``'s (``splitserve.engine.beam_search``: its beams transformers'), stepped here as
vLLM's OpenAI server steps its own: each step asks the router for one token of every live beam, side by side (one
``Generate`` call each, greedy, with the top ``2 * n`` log probabilities), and the beams' KV is shared through the
workers' prefix caches. ``n`` is the beam width (1 to 10) and the answer's ``n`` choices are the best beams, best
first; ``max_tokens`` (``max_completion_tokens`` on chats), vLLM's ``length_penalty`` and ``ignore_eos`` shape the
search; the prompts times ``n`` are at most ``--max-choices``. A choice's ``finish_reason`` is ``stop`` when its beam ended with the end-of-sequence token, ``length``
otherwise; the usage counts the prompt once and every returned beam's tokens. Not streamed, and not with
``logprobs``, ``echo``, tools or structured outputs (400 naming the field). ``model`` (a LoRA adapter too),
``priority``, ``cache_salt`` and ``request_id`` apply to every call.
"""

from __future__ import annotations

import dataclasses
import math
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.beam_search import BeamSearchParams, beam_search_steps, generated_tokens

# Fields a beam search answer cannot give, and the sentence that says why.
_REFUSED = {
    "stream": "Beam search answers are not streamed: the best beams are known only at the end.",
    "logprobs": "logprobs are not given with beam search.",
    "top_logprobs": "top_logprobs are not given with beam search.",
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
        _bearer,
        _cache_salt,
        _flag,
        _optional_flag,
        _priority,
        _request_id,
        side_by_side,
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
    if len(prompts) * params.beam_width > gateway.config.max_choices:  # the calls of a step, side by side
        raise APIError(400, f"{len(prompts)} prompts of {params.beam_width} beams each make more calls a step than "
                       f"the {gateway.config.max_choices} one request may (the gateway's --max-choices).", "n")
    info = await gateway._info(request)
    api_key, priority, cache_salt = _bearer(request), _priority(body), _cache_salt(body)
    request_id = _request_id(body, "chatcmpl-" if chat else "cmpl-", 2)  # several calls: each id gets a number
    calls = 0
    special = _optional_flag(body, "add_special_tokens")
    tokenized = await side_by_side(request, [
        gateway.client.tokenize_prompt(prompt, api_key=api_key, add_special_tokens=special) for prompt in prompts])
    token_ids = [list(answer.token_ids) for answer in tokenized]
    room = info.max_model_len - max(len(ids) for ids in token_ids)  # no beam may outgrow the context
    if room < 1:
        raise APIError(400, f"The prompt fills the model's context of {info.max_model_len} tokens: no room to "
                       "generate.", "messages" if chat else "prompt")
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    eos_token_ids = frozenset(info.eos_token_ids)
    candidates = min(info.max_logprobs or 20, max(2, 1 + len(eos_token_ids)) * width)
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=candidates, ignore_eos=True)

    def next_tokens(answer) -> dict[int, float]:
        position = answer.logprobs[0]
        return {entry.token_id: entry.logprob for entry in [position.sampled, *position.top]}

    steps = beam_search_steps(token_ids, params, eos_token_ids)
    try:
        sequences = next(steps)
        while True:
            answers = await side_by_side(request, [
                gateway.client.generate(sequence, step_params, f"{request_id}-{calls + number}",
                                        api_key=api_key, priority=priority, lora_name=lora_name,
                                        cache_salt=cache_salt) for number, sequence in enumerate(sequences)])
            calls += len(sequences)
            sequences = steps.send([next_tokens(answer) for answer in answers])
    except StopIteration as done:
        outputs = done.value
    gateway.metrics.generations.inc(calls)
    request.state.generations = calls
    beams = [(output, beam) for output in outputs for beam in output.sequences]
    texts = await side_by_side(request, [gateway.client.detokenize(
        generated_tokens(beam, output.prompt_len, params, eos_token_ids), skip_special_tokens=True, api_key=api_key)
        for output, beam in beams])
    choices = []
    for index, ((output, beam), text) in enumerate(zip(beams, texts)):
        ended = not params.ignore_eos and beam.tokens[-1] in eos_token_ids and len(beam.tokens) > output.prompt_len
        finish = "stop" if ended else "length"
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": finish, "stop_reason": None})
        else:
            choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                            "stop_reason": None})
    prompt_tokens = sum(len(ids) for ids in token_ids)
    completion_tokens = sum(len(beam.tokens) - output.prompt_len for output, beam in beams)
    return JSONResponse({
        "id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": lora_name or gateway._model_name(info), "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })
