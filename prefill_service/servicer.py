"""gRPC PrefillWorker: the engine in the prefill role.

``Prefill`` announces the request's transfer to the worker's :class:`KVSender`
(the engine's KV connector; :class:`LMCacheSender` with ``--kv-transfer lmcache``, which stores the whole
prompt in LMCache once it is computed) and queues the prompt with
``KVTransferParams(save=True)`` (batched with other prefills, chunked when
long). The engine hands the sender the blocks each step completed, so a long
prompt's KV travels while its later chunks are computed; the step that
samples the first token sends the rest with the token in the last header.
The engine frees the blocks once the sender reports the last payload handed
over; the call answers then.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from splitserve.common.errors import Aborted, Cancelled, InvalidRequest, Unavailable
from splitserve.common.ids import MAX_WORKER_ID_LENGTH, check_id
from splitserve.common.log_fields import request_log
from splitserve.common.types import FinishReason
from splitserve.engine.kv_connector import KVTransferParams
from splitserve.prefill_service.lmcache_sender import LMCacheSender
from splitserve.prefill_service.sender import KVSender, TransferSender
from splitserve.rpc.convert import (
    cache_salt_from_pb,
    position_logprobs_to_pb,
    prompt_logprobs_to_pb,
    sampling_params_from_pb,
    set_stop_reason,
)
from splitserve.rpc.worker import WorkerRuntime, wait_accepted
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_SEND_TIMEOUT_SECONDS = 120.0


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Serves one prefill worker's engine."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.block_size = runtime.config.engine.block_size

    @property
    def sender(self) -> KVSender | LMCacheSender:
        """The engine's KV connector (built when the runtime starts): LMCacheSender with --kv-transfer lmcache."""
        return self.runtime.kv_connector

    # ---- RPCs ----------------------------------------------------------------------

    def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> worker_pb2.PrefillResponse:
        check_id(request.request_id, "request_id", MAX_WORKER_ID_LENGTH)
        check_id(request.transfer_id, "transfer_id", MAX_WORKER_ID_LENGTH)
        if not request.HasField("destination") or not request.destination.address:
            raise InvalidRequest("destination (the decode worker's KV endpoint) is required.")
        skip = request.num_destination_cached_tokens
        if skip % self.block_size or skip >= len(request.prompt_token_ids):
            raise InvalidRequest(
                f"num_destination_cached_tokens ({skip}) must be a multiple of the block size "
                f"({self.block_size}) and shorter than the prompt ({len(request.prompt_token_ids)} tokens)."
            )
        params = sampling_params_from_pb(request.sampling_params)
        # The prefill computes the prompt and samples exactly one token.
        engine_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.runtime.admit()
        span, response, error = self.runtime.start_span("prefill", context), None, None
        try:
            response = self._prefill(request, params, engine_params, context)
            return response
        except BaseException as failure:
            error = failure
            raise
        finally:
            self.runtime.release()
            self.runtime.end_span(span, _span_attributes(request, response), error)

    def _prefill(self, request, params, engine_params, context) -> worker_pb2.PrefillResponse:
        from splitserve.kvtransfer.connector import KVEndpointInfo

        runtime, request_id = self.runtime, request.request_id
        prompt = list(request.prompt_token_ids)
        lora, salt = runtime.lora_request(request.lora_name), cache_salt_from_pb(request)
        received = time.monotonic()
        sender = self.sender.expect(request_id, request.transfer_id, KVEndpointInfo.from_pb(request.destination),
                                    len(prompt), prompt_token_ids=prompt, lora_request=lora, cache_salt=salt)
        completed = False
        try:
            # The decode worker caches num_destination_cached_tokens already: the connector says what it skips.
            skip = self.sender.num_skip_tokens(request.num_destination_cached_tokens)
            kv_transfer = KVTransferParams(save=True, num_skip_tokens=skip)
            try:
                stream = runtime.loop.submit(request_id, None, engine_params, prompt, kv_transfer=kv_transfer,
                                             priority=request.priority, lora_request=lora, cache_salt=salt)
                wait_accepted(stream)
            except BaseException:
                self.sender.discard(request_id)
                raise
            if not context.add_callback(lambda: runtime.loop.abort(request_id)):
                raise Cancelled("The prefill was cancelled.")
            final = None
            for output in stream:
                final = output
            completion = final.outputs[0]
            if completion.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                if completion.finish_reason == FinishReason.ABORT:
                    if runtime.state != inference_pb2.WORKER_STATE_SERVING:
                        raise Unavailable(f"Worker {runtime.worker_id} is shutting down and stopped this prefill "
                                          "when its drain timeout ran out.")
                    raise Cancelled("The prefill was aborted.")
                raise RuntimeError(f"The prefill failed: {completion.stop_reason}")
            sampled = time.monotonic()
            if not sender.wait(_SEND_TIMEOUT_SECONDS) or not sender.succeeded:
                runtime.metrics.observe_transfer("send", None)
                reason = sender.error or "timed out"
                raise Aborted(f"Cannot deliver the prompt's KV to {request.destination.address}: {reason}")
            runtime.counters.add(num_kv_transfers_sent=1, num_kv_bytes=sender.num_sent_bytes)
            request_log(logger, request_id, request.transfer_id).info(
                "KV of %d prompt tokens sent in %d sends as steps completed them (%.1f MB)",
                sender.num_sent_tokens, sender.num_sends, sender.num_sent_bytes / 1e6)
            completed = True
        finally:
            if not completed:  # any failure: the engine stops the transfer and frees the blocks
                runtime.loop.abort(request_id)
        return self._response(request, params, final, sender, received, sampled)

    def _response(self, request, params, final, sender: TransferSender, received: float, sampled: float):
        completion = final.outputs[0]
        first_token = completion.token_ids[0]
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id, transfer_id=request.transfer_id, first_token_id=first_token,
            first_token_text=completion.text, num_cached_tokens=final.num_cached_tokens,
            num_loaded_tokens=final.num_loaded_tokens, num_sent_blocks=sender.num_sent_blocks,
        )
        decode = lambda token_id: self.runtime.engine.tokenizer.decode([token_id])  # noqa: E731
        if params.logprobs is not None and completion.logprobs:
            response.first_token_logprobs.CopyFrom(
                position_logprobs_to_pb(completion.logprobs[0], first_token, params.logprobs, decode)
            )
        if final.prompt_logprobs is not None:
            response.prompt_logprobs.extend(prompt_logprobs_to_pb(
                final.prompt_logprobs, final.prompt_ranks, list(request.prompt_token_ids), params.prompt_logprobs,
                decode))
        # The engine ran with max_tokens=1: "length" is a finish only if the request wanted one token.
        if completion.finish_reason == FinishReason.STOP:
            response.finish_reason = inference_pb2.FINISH_REASON_STOP
            set_stop_reason(response, completion.stop_reason, FinishReason.STOP)
        elif params.max_tokens == 1 or len(request.prompt_token_ids) + 1 >= self.runtime.engine.max_model_len:
            response.finish_reason = inference_pb2.FINISH_REASON_LENGTH
        metrics = final.metrics
        started = metrics.first_scheduled_time or received
        response.queue_seconds = max(started - metrics.arrival_time, 0.0)
        response.prefill_seconds = max(sampled - started, 0.0)
        response.kv_send_seconds = max((sender.last_handed_over or sampled) - sampled, 0.0)
        if final.num_loaded_tokens:
            response.prefix_load_seconds = metrics.kv_load_seconds
        self.runtime.metrics.observe_transfer("send", response.kv_send_seconds)
        self.runtime.metrics.observe_prompt(len(request.prompt_token_ids),
                                            final.num_cached_tokens + final.num_loaded_tokens)
        return response

    def Abort(self, request: worker_pb2.AbortPrefillRequest, context) -> worker_pb2.AbortPrefillResponse:
        check_id(request.request_id, "request_id", MAX_WORKER_ID_LENGTH)
        found = self.sender.is_sending(request.request_id)
        self.runtime.loop.abort(request.request_id)
        return worker_pb2.AbortPrefillResponse(found=found)

    def GetStatus(self, request, context) -> worker_pb2.GetWorkerStatusResponse:
        return self.runtime.status_pb()


def _span_attributes(request: worker_pb2.PrefillRequest, response: worker_pb2.PrefillResponse | None) -> dict:
    """A prefill call's span attributes (``splitserve.rpc.tracing``): counts and times, never a token."""
    attributes = {"gen_ai.request.id": request.request_id, "splitserve.transfer_id": request.transfer_id,
                  "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
                  "splitserve.destination_cached_tokens": request.num_destination_cached_tokens}
    if response is not None:
        attributes.update({
            "gen_ai.latency.time_in_queue": response.queue_seconds,
            "splitserve.prefill_seconds": response.prefill_seconds,
            "splitserve.kv_send_seconds": response.kv_send_seconds,
            "splitserve.prefix_load_seconds": response.prefix_load_seconds,
            "splitserve.cached_tokens": response.num_cached_tokens,
            "splitserve.loaded_tokens": response.num_loaded_tokens,
            "splitserve.sent_blocks": response.num_sent_blocks,
        })
    return attributes
