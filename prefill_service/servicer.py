"""gRPC PrefillWorker: the engine in the prefill role.

``Prefill`` queues the prompt (batched with other prefills, chunked when long)
with its blocks held past the end of the request. After every engine step the
blocks that step completed are queued for sending, so a long prompt's KV
travels while its later chunks are computed; the first token's step queues
the rest with the token in the last header. The blocks are freed once the
connector has confirmed the last payload.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc

from splitserve.engine.llm_engine import LLMEngine
from splitserve.prefill_service.sender import PayloadPlan, TransferSender
from splitserve.rpc.convert import position_logprobs_to_pb, sampling_params_from_pb, set_stop_reason
from splitserve.rpc.errors import InvalidArgument, ServiceError, Unavailable, unary_errors
from splitserve.rpc.worker import WorkerRuntime
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_ACCEPT_TIMEOUT_SECONDS = 60.0
_SEND_TIMEOUT_SECONDS = 120.0


@dataclasses.dataclass
class _Job:
    request_id: str
    sender: TransferSender
    num_prompt_tokens: int


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """Serves one prefill worker's engine. Build the runtime with ``after_step=servicer.after_step``."""

    def __init__(self) -> None:
        self.runtime: WorkerRuntime | None = None
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def attach(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.block_size = runtime.config.engine.block_size

    # ---- RPCs ----------------------------------------------------------------------

    @unary_errors
    def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> worker_pb2.PrefillResponse:
        if not request.request_id or not request.transfer_id:
            raise InvalidArgument("request_id and transfer_id are required.")
        if not request.HasField("destination") or not request.destination.address:
            raise InvalidArgument("destination (the decode worker's KV endpoint) is required.")
        skip = request.num_destination_cached_tokens
        if skip % self.block_size or skip >= len(request.prompt_token_ids):
            raise InvalidArgument(
                f"num_destination_cached_tokens ({skip}) must be a multiple of the block size "
                f"({self.block_size}) and shorter than the prompt ({len(request.prompt_token_ids)} tokens)."
            )
        params = sampling_params_from_pb(request.sampling_params)
        # The prefill computes the prompt and samples exactly one token.
        engine_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.runtime.admit()
        try:
            return self._prefill(request, params, engine_params, context)
        finally:
            self.runtime.release()

    def _prefill(self, request, params, engine_params, context) -> worker_pb2.PrefillResponse:
        from splitserve.kvtransfer.base import KVEndpointInfo

        runtime, request_id = self.runtime, request.request_id
        prompt = list(request.prompt_token_ids)
        received = time.monotonic()
        sender = TransferSender(
            runtime.connector, runtime.engine.model_runner.kv_cache, request.transfer_id,
            KVEndpointInfo.from_pb(request.destination), runtime.model_fingerprint, runtime.kv_layout, len(prompt),
        )
        # The decode worker caches this prefix already: its KV is not sent.
        sender.num_queued_tokens = request.num_destination_cached_tokens
        with self._lock:
            if request_id in self._jobs:
                sender.cancel()
                raise InvalidArgument(f"Request id {request_id!r} is already being prefilled here.")
            self._jobs[request_id] = _Job(request_id, sender, len(prompt))
        completed = False
        try:
            try:
                stream = runtime.loop.submit(request_id, None, engine_params, prompt, hold_kv_on_finish=True)
            except ValueError:
                sender.cancel()
                raise
            if not context.add_callback(lambda: self._abort(request_id)):
                raise ServiceError("The prefill was cancelled.", grpc.StatusCode.CANCELLED)
            stream.wait_accepted(_ACCEPT_TIMEOUT_SECONDS)
            final = None
            for output in stream:
                final = output
            completion = final.outputs[0]
            if completion.finish_reason in ("abort", "error"):
                sender.cancel()
                self._release(request_id)
                if completion.finish_reason == "abort":
                    raise ServiceError("The prefill was aborted.", grpc.StatusCode.CANCELLED)
                raise ServiceError(f"The prefill failed: {completion.stop_reason}", grpc.StatusCode.INTERNAL)
            sampled = time.monotonic()
            if not sender.wait(_SEND_TIMEOUT_SECONDS) or sender.error is not None:
                sender.cancel()
                self._release(request_id)
                reason = sender.error or "timed out"
                raise Unavailable(f"Cannot send the prompt's KV to {request.destination.address}: {reason}")
            self._release(request_id)
            runtime.counters.add(num_kv_transfers_sent=1, num_kv_bytes=sender.num_sent_bytes)
            logger.info("Request %s: KV of %d prompt tokens sent in %d sends as steps completed them (%.1f MB)",
                        request_id, sender.num_queued_tokens, sender.num_sends, sender.num_sent_bytes / 1e6)
            completed = True
        finally:
            if not completed:  # any failure: no more KV goes out, and the blocks are freed
                self._abort(request_id)
            with self._lock:
                self._jobs.pop(request_id, None)
        return self._response(request, params, final, sender, received, sampled)

    def _response(self, request, params, final, sender: TransferSender, received: float, sampled: float):
        completion = final.outputs[0]
        first_token = completion.token_ids[0]
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id, transfer_id=request.transfer_id, first_token_id=first_token,
            first_token_text=completion.text, num_cached_tokens=final.num_cached_tokens,
            num_sent_blocks=sender.num_sent_blocks,
        )
        if params.logprobs is not None and completion.logprobs:
            decode = lambda token_id: self.runtime.engine.tokenizer.decode([token_id])  # noqa: E731
            response.first_token_logprobs.CopyFrom(
                position_logprobs_to_pb(completion.logprobs[0], first_token, params.logprobs, decode)
            )
        # The engine ran with max_tokens=1: "length" is a finish only if the request wanted one token.
        if completion.finish_reason == "stop":
            response.finish_reason = inference_pb2.FINISH_REASON_STOP
            set_stop_reason(response, completion.stop_reason, "stop")
        elif params.max_tokens == 1 or len(request.prompt_token_ids) + 1 >= self.runtime.engine.max_model_len:
            response.finish_reason = inference_pb2.FINISH_REASON_LENGTH
        metrics = final.metrics
        started = metrics.first_scheduled_time or received
        response.queue_seconds = max(started - metrics.arrival_time, 0.0)
        response.prefill_seconds = max(sampled - started, 0.0)
        response.kv_send_seconds = max((sender.last_handed_over or sampled) - sampled, 0.0)
        return response

    @unary_errors
    def Abort(self, request: worker_pb2.AbortPrefillRequest, context) -> worker_pb2.AbortPrefillResponse:
        return worker_pb2.AbortPrefillResponse(found=self._abort(request.request_id))

    @unary_errors
    def GetStatus(self, request, context) -> worker_pb2.GetWorkerStatusResponse:
        return self.runtime.status_pb()

    # ---- the engine thread's hook -------------------------------------------------------

    def after_step(self, engine: LLMEngine, outputs) -> None:
        """Queue the KV blocks this step completed; the request's first token queues the rest."""
        finished = {output.request_id: output for output in outputs if output.finished}
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            sender = job.sender
            if sender.cancelled or sender.num_queued_tokens >= job.num_prompt_tokens:
                continue
            output = finished.get(job.request_id)
            if output is not None:
                if output.outputs[0].finish_reason in ("stop", "length"):
                    first_token = output.outputs[0].token_ids[0]
                    self._queue(engine, job, job.num_prompt_tokens, is_last=True, first_token_id=first_token)
                continue
            request = engine.scheduler.requests.get(job.request_id)
            if request is None:
                continue
            # Full blocks only; a prompt computed whole in this step is sent with its first token.
            num_full_tokens = min(request.num_computed_tokens, job.num_prompt_tokens) // self.block_size * self.block_size
            if num_full_tokens < job.num_prompt_tokens and num_full_tokens > sender.num_queued_tokens:
                self._queue(engine, job, num_full_tokens)

    def _queue(self, engine: LLMEngine, job: _Job, end: int, is_last: bool = False,
               first_token_id: int | None = None) -> None:
        sender = job.sender
        start = sender.num_queued_tokens
        first_block, end_block = start // self.block_size, -(-end // self.block_size)
        block_ids = engine.block_ids(job.request_id)[first_block:end_block]
        sender.queue_payload(PayloadPlan(tuple(block_ids), start, end - start, is_last, first_token_id))

    # ---- ending ----------------------------------------------------------------------

    def _abort(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is None:
            return False
        job.sender.cancel()
        self._release(request_id)
        return True

    def _release(self, request_id: str) -> None:
        """Abort the request if unfinished, or free the blocks it holds for the transfer."""
        self.runtime.loop.post(lambda engine: engine.abort_request(request_id) or engine.release_kv(request_id))
