"""Proto messages <-> engine domain objects, at the edge of every servicer."""

from __future__ import annotations

from collections.abc import Callable

from splitserve.engine.sampling_params import SamplingParams
from splitserve.v1 import inference_pb2

# Engine finish reasons (RequestStatus.finish_reason) -> the proto enum.
FINISH_REASONS = {
    None: inference_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "abort": inference_pb2.FINISH_REASON_ABORT,
    "error": inference_pb2.FINISH_REASON_ERROR,
}


def sampling_params_from_pb(message: inference_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; unset optional fields take the engine defaults.

    Raises:
        ValueError: a value out of range, naming the field.
    """
    values: dict = dict(
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
    )
    for name in ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "logprobs",
                 "skip_special_tokens"):
        if message.HasField(name):
            values[name] = getattr(message, name)
    # float32 on the wire: 0.7 arrives as 0.699999988; round to what the client meant.
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in values:
            values[name] = round(float(values[name]), 6)
    return SamplingParams(**values)


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


def set_stop_reason(message, stop_reason: int | str | None, finish_reason: str | None) -> None:
    """Fill the ``stop_reason`` oneof of a response for a finished "stop" request."""
    if finish_reason != "stop" or stop_reason is None:
        return
    if isinstance(stop_reason, str):
        message.stop_string = stop_reason
    else:
        message.stop_token_id = int(stop_reason)
