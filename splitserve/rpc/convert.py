"""Proto messages <-> domain objects (``splitserve.common``), at the edge of every servicer."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.common.block_hash import check_cache_salt
from splitserve.common.chat import Chat, ChatMessage, FunctionTool, ToolCall, check_chat_template_kwargs, check_tools
from splitserve.common.errors import InvalidRequest
from splitserve.common.load import WorkerLoad
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.common.types import FinishReason, WorkerRole, WorkerState
from splitserve.v1 import inference_pb2

# The most completions (SamplingParams.n) one request may ask a cluster for: each runs as a sequence of its own on
# one decode worker, beside every other request's.
MAX_COMPLETIONS = 64

# Finish reasons (RequestStatus.finish_reason) -> the proto enum.
FINISH_REASONS = {
    None: inference_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: inference_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: inference_pb2.FINISH_REASON_ERROR,
}


def cache_salt_from_pb(message) -> str | None:
    """A request message's ``cache_salt`` (GenerateRequest, EmbedRequest, the workers' requests), checked: 1 to 256
    characters; None when unset.

    Raises:
        InvalidRequest: an empty or longer salt.
    """
    return check_cache_salt(message.cache_salt) if message.HasField("cache_salt") else None


def sampling_params_from_pb(message: inference_pb2.SamplingParams) -> SamplingParams:
    """The SamplingParams of a request; unset optional fields take the defaults.

    Raises:
        InvalidRequest: a value out of range, naming the field.
    """
    values: dict = dict(
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
        # float32 on the wire, rounded as the fields below are.
        logit_bias={token_id: round(float(bias), 6) for token_id, bias in message.logit_bias.items()},
        include_stop_str_in_output=message.include_stop_str_in_output,
        allowed_token_ids=list(message.allowed_token_ids) or None,
        bad_words=list(message.bad_words),
        num_resumed_tokens=message.num_resumed_tokens,
    )
    for name in ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "logprobs",
                 "prompt_logprobs", "skip_special_tokens", "truncate_prompt_tokens", "n"):
        if message.HasField(name):
            values[name] = getattr(message, name)
    # float32 on the wire: 0.7 arrives as 0.699999988; round to what the client meant.
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in values:
            values[name] = round(float(values[name]), 6)
    if message.HasField("structured_outputs"):
        values["structured_outputs"] = structured_outputs_from_pb(message.structured_outputs)
    if message.n > MAX_COMPLETIONS:
        raise InvalidRequest(f"n={message.n} completions asked for; a request may ask for 1 to {MAX_COMPLETIONS}.")
    return SamplingParams(**values)


def beam_search_from_pb(message: inference_pb2.BeamSearch, params: SamplingParams) -> BeamSearchParams:
    """A request's beam search (GenerateRequest.beam_search, DecodeRequest.beam_search) with its sampling
    parameters' ``max_tokens`` and ``ignore_eos``, checked.

    Raises:
        InvalidRequest: a width outside 1 to 10, a length penalty that is not finite, a sampling field beam
            search cannot give (n, prompt_logprobs, structured_outputs), or logprobs past 2 x beam_width.
    """
    for name, given in (("n", params.n != 1), ("prompt_logprobs", params.prompt_logprobs is not None),
                        ("structured_outputs", params.structured_outputs is not None)):
        if given:
            raise InvalidRequest(f"sampling_params.{name} is not taken with beam_search (beam_width says how many "
                                 "completions; they come without prompt log probabilities or constraints).")
    if params.logprobs is not None and params.logprobs > 2 * message.beam_width:
        raise InvalidRequest(f"sampling_params.logprobs is at most 2 x beam_width ({2 * message.beam_width}) with "
                             f"beam_search, the candidates each step scores; got {params.logprobs}.")
    length_penalty = round(float(message.length_penalty), 6) if message.HasField("length_penalty") else 1.0
    if not math.isfinite(length_penalty):
        raise InvalidRequest(f"beam_search.length_penalty must be a finite number, got {length_penalty}.")
    # max_tokens is never unset off the wire (its default is 16); the worker caps it to the context's room.
    beam = BeamSearchParams(beam_width=message.beam_width, max_tokens=params.max_tokens,
                            ignore_eos=params.ignore_eos, length_penalty=length_penalty)
    beam.check()
    return beam


def beam_search_to_pb(params: BeamSearchParams) -> inference_pb2.BeamSearch:
    """The proto form of a beam search's width and length penalty (its max_tokens and ignore_eos travel in the
    request's sampling_params)."""
    return inference_pb2.BeamSearch(beam_width=params.beam_width, length_penalty=params.length_penalty)


def structured_outputs_from_pb(message: inference_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """A request's output constraint. Raises InvalidRequest when none or a bad one is set (sizes checked here; the
    grammar itself where it is built)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest("structured_outputs is set without a constraint: set one of json, json_object, regex, "
                             "choice and grammar.")
    if kind == "json_object" and not message.json_object:
        raise InvalidRequest("structured_outputs.json_object must be true when set.")
    value = list(message.choice.values) if kind == "choice" else getattr(message, kind)
    return StructuredOutputsParams(
        **{kind: value}, num_resumed_tokens=message.num_resumed_tokens,
        disable_any_whitespace=message.disable_any_whitespace,
        disable_additional_properties=message.disable_additional_properties,
        whitespace_pattern=message.whitespace_pattern if message.HasField("whitespace_pattern") else None)


def structured_outputs_to_pb(params: StructuredOutputsParams) -> inference_pb2.StructuredOutputs:
    """The proto form of a request's output constraint."""
    message = inference_pb2.StructuredOutputs(num_resumed_tokens=params.num_resumed_tokens,
                                              disable_any_whitespace=params.disable_any_whitespace,
                                              disable_additional_properties=params.disable_additional_properties)
    if params.whitespace_pattern is not None:
        message.whitespace_pattern = params.whitespace_pattern
    if params.choice is not None:
        message.choice.values.extend(params.choice)
    else:
        setattr(message, params.kind, getattr(params, params.kind))
    return message


def chat_to_pb(chat: Chat) -> inference_pb2.ChatPrompt:
    """The proto form of a chat (each tool's parameters as JSON text).

    Raises:
        InvalidRequest: template variables ``check_chat_template_kwargs`` refuses."""
    message = inference_pb2.ChatPrompt(add_generation_prompt=chat.add_generation_prompt,
                                       continue_final_message=chat.continue_final_message)
    for item in chat.messages:
        message.messages.append(inference_pb2.ChatMessage(
            role=item.role, content=item.content, tool_call_id=item.tool_call_id, name=item.name,
            tool_calls=[inference_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
                        for call in item.tool_calls]))
    for tool in chat.tools:
        message.tools.append(inference_pb2.Tool(
            name=tool.name, description=tool.description,
            parameters=json.dumps(tool.parameters) if tool.parameters is not None else ""))
    for name, value in check_chat_template_kwargs(chat.chat_template_kwargs).items():
        message.chat_template_kwargs[name].CopyFrom(_template_value_to_pb(value))
    return message


def _template_value_to_pb(value: bool | int | float | str) -> inference_pb2.ChatTemplateValue:
    if isinstance(value, bool):
        return inference_pb2.ChatTemplateValue(bool_value=value)
    if isinstance(value, int):
        return inference_pb2.ChatTemplateValue(int_value=value)
    if isinstance(value, float):
        return inference_pb2.ChatTemplateValue(float_value=value)
    return inference_pb2.ChatTemplateValue(string_value=value)


def chat_from_pb(message: inference_pb2.ChatPrompt) -> Chat:
    """A chat from its proto form. Raises InvalidRequest for no messages, a message without a role, tools that
    :func:`splitserve.common.chat.check_tools` refuses or whose parameters are not a JSON object, or template
    variables :func:`splitserve.common.chat.check_chat_template_kwargs` refuses (a value with none set among
    them)."""
    if not message.messages:
        raise InvalidRequest("The chat prompt has no messages.")
    messages = []
    for index, item in enumerate(message.messages):
        if not item.role:
            raise InvalidRequest(f"Chat message {index} has no role.")
        messages.append(ChatMessage(item.role, item.content,
                                    tuple(ToolCall(call.id, call.name, call.arguments) for call in item.tool_calls),
                                    item.tool_call_id, item.name))
    check_tools(message.tools)  # the count, names and uniqueness, before any parameters are parsed
    tools = tuple(FunctionTool(tool.name, tool.description, _tool_parameters(tool, index))
                  for index, tool in enumerate(message.tools))
    add_generation_prompt = message.add_generation_prompt if message.HasField("add_generation_prompt") else True
    kwargs = {name: getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None
              for name, value in message.chat_template_kwargs.items()}
    return Chat(tuple(messages), tools, add_generation_prompt, check_chat_template_kwargs(kwargs),
                message.continue_final_message)


def _tool_parameters(tool: inference_pb2.Tool, index: int) -> dict | None:
    if not tool.parameters:
        return None
    try:
        parameters = json.loads(tool.parameters)
    except (ValueError, RecursionError):
        parameters = None
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"tools[{index}].parameters must be a JSON Schema object, as JSON text.")
    return parameters


def worker_load_to_pb(load: WorkerLoad) -> inference_pb2.WorkerLoad:
    """The proto form of a worker's load (``kv_block_usage`` included)."""
    return inference_pb2.WorkerLoad(
        num_running_requests=load.num_running_requests, num_waiting_requests=load.num_waiting_requests,
        num_waiting_for_remote_kvs_requests=load.num_waiting_for_remote_kvs_requests,
        num_queued_prefill_tokens=load.num_queued_prefill_tokens, num_total_kv_blocks=load.num_total_kv_blocks,
        num_free_kv_blocks=load.num_free_kv_blocks, kv_block_usage=load.kv_block_usage,
    )


def worker_load_from_pb(message: inference_pb2.WorkerLoad) -> WorkerLoad:
    """A worker's load from its report (``kv_block_usage`` is recomputed, not read)."""
    return WorkerLoad(
        num_running_requests=message.num_running_requests, num_waiting_requests=message.num_waiting_requests,
        num_waiting_for_remote_kvs_requests=message.num_waiting_for_remote_kvs_requests,
        num_queued_prefill_tokens=message.num_queued_prefill_tokens,
        num_total_kv_blocks=message.num_total_kv_blocks, num_free_kv_blocks=message.num_free_kv_blocks,
    )


def worker_role_from_pb(value: int) -> WorkerRole:
    """A WorkerRole field's value. Raises InvalidRequest when unset or unknown."""
    if value == inference_pb2.WORKER_ROLE_UNSPECIFIED:
        raise InvalidRequest("role is required.")
    try:
        return WorkerRole(value)
    except ValueError:
        raise InvalidRequest(f"role {value} is not a WorkerRole (PREFILL, DECODE or BOTH).") from None


def worker_state_from_pb(value: int) -> WorkerState:
    """A WorkerState field's value, SERVING when unset. Raises InvalidRequest when unknown."""
    if value == inference_pb2.WORKER_STATE_UNSPECIFIED:
        return WorkerState.SERVING
    try:
        return WorkerState(value)
    except ValueError:
        raise InvalidRequest(f"state {value} is not a WorkerState.") from None


def position_logprobs_to_pb(
    logprobs: dict[int, float], sampled_token_id: int, num_top: int, decode_token: Callable[[int], str]
) -> inference_pb2.PositionLogprobs:
    """One position's logprobs: the sampled token's and the ``num_top`` most likely, most likely first.

    Empty ``logprobs`` (a token sampled by another worker) give an empty message.
    """
    if not logprobs:
        return inference_pb2.PositionLogprobs()
    ranked = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:num_top]

    def entry(token_id: int, value: float) -> inference_pb2.TokenLogprob:
        return inference_pb2.TokenLogprob(token_id=token_id, logprob=value, text=decode_token(token_id))

    return inference_pb2.PositionLogprobs(
        sampled=entry(sampled_token_id, logprobs[sampled_token_id]),
        top=[entry(token_id, value) for token_id, value in ranked],
    )


def prompt_logprobs_to_pb(
    prompt_logprobs: list[dict[int, float] | None], prompt_ranks: list[int | None], prompt_token_ids: list[int],
    num_top: int, decode_token: Callable[[int], str],
) -> list[inference_pb2.PositionLogprobs]:
    """A request's prompt logprobs, one message per prompt token (``sampled`` is the prompt's token, with its
    rank; the alternatives ranked 1, 2, ...): the first, which nothing predicts, names its token with logprob 0,
    rank 0 and no alternatives."""
    texts: dict[int, str] = {}  # a long prompt names the same tokens many times: each decoded once

    def decode_token_once(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = decode_token(token_id)
        return texts[token_id]

    positions = [inference_pb2.PositionLogprobs(sampled=inference_pb2.TokenLogprob(
        token_id=prompt_token_ids[0], text=decode_token_once(prompt_token_ids[0])))]
    for entry, rank, token_id in zip(prompt_logprobs[1:], prompt_ranks[1:], prompt_token_ids[1:]):
        position = position_logprobs_to_pb(entry, token_id, num_top, decode_token_once)
        position.sampled.rank = rank
        for index, top in enumerate(position.top, start=1):
            top.rank = index
        positions.append(position)
    return positions


def set_stop_reason(message, stop_reason: int | str | None, finish_reason: str | None) -> None:
    """Fill the ``stop_reason`` oneof of a response for a finished "stop" request."""
    if finish_reason != FinishReason.STOP or stop_reason is None:
        return
    if isinstance(stop_reason, str):
        message.stop_string = stop_reason
    else:
        message.stop_token_id = int(stop_reason)
