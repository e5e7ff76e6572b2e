"""gRPC DecodeWorker: the engine in the decode role.

A ``Decode`` call creates the request; with remote KV its prompt's blocks are
reserved and it waits in ``WAITING_FOR_REMOTE_KVS`` (the first message says
so) until the :class:`KVReceiver` has copied the prompt's KV in; then it is
batched with every running sequence and its tokens stream back in chunks.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from splitserve.decode_service.receiver import KVReceiver, Transfer
from splitserve.engine.outputs import RequestOutput
from splitserve.rpc.convert import FINISH_REASONS, position_logprobs_to_pb, sampling_params_from_pb, set_stop_reason
from splitserve.rpc.errors import InvalidArgument, stream_errors, unary_errors
from splitserve.rpc.worker import WorkerRuntime
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_ACCEPT_TIMEOUT_SECONDS = 60.0


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Serves one decode worker's engine (role "decode", or "both" for colocated serving)."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.receiver: KVReceiver | None = None
        self._active: dict[str, str] = {}  # request id -> transfer id ("" when prefilled here)
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start receiving KV (after the runtime has started its connector)."""
        if self.runtime.connector is not None:
            self.receiver = KVReceiver(self.loop, self.runtime.connector, self.runtime.counters)
            self.receiver.start()

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()

    # ---- RPCs ----------------------------------------------------------------------

    @stream_errors
    def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext):
        remote = not request.prefill_locally
        if not request.request_id:
            raise InvalidArgument("request_id is required.")
        if remote and not request.transfer_id:
            raise InvalidArgument("transfer_id is required unless prefill_locally is set.")
        if remote and self.receiver is None:
            raise InvalidArgument(f"Worker {self.runtime.worker_id} is colocated (role both) and receives no KV: "
                                  "set prefill_locally.")
        params = sampling_params_from_pb(request.sampling_params)
        self.runtime.admit()
        try:
            yield from self._decode(request, params, remote, context)
        finally:
            self.runtime.release()

    def _decode(self, request, params, remote: bool, context):
        request_id = request.request_id
        with self._lock:
            if request_id in self._active:
                raise InvalidArgument(f"Request id {request_id!r} is already in flight on this worker.")
            self._active[request_id] = request.transfer_id if remote else ""
        completed = False
        try:
            stream = self.loop.submit(request_id, None, params, list(request.prompt_token_ids), remote_kv=remote)
            accepted = stream.wait_accepted(_ACCEPT_TIMEOUT_SECONDS)
            transfer = None
            if remote:
                timeout = (request.kv_timeout_seconds if request.HasField("kv_timeout_seconds")
                           else self.runtime.config.kv_timeout_seconds)
                fail = (request.on_kv_failure == worker_pb2.KV_FAILURE_POLICY_FAIL or
                        (request.on_kv_failure == worker_pb2.KV_FAILURE_POLICY_UNSPECIFIED
                         and self.runtime.config.kv_load_failure == "fail"))
                # The prompt's cached prefix is here already; the transfer starts after it.
                transfer = Transfer(request.transfer_id, request_id, len(request.prompt_token_ids),
                                    time.monotonic() + timeout, fail, block_ids=accepted.block_ids,
                                    num_received_tokens=accepted.num_cached_tokens)
                source = _endpoint_or_none(request)
                self.receiver.expect(transfer, source)
            else:
                self.runtime.counters.add(num_local_prefills=1)
            # From here on a client that goes away (or its deadline) aborts the request.
            if not context.add_callback(lambda: self._abort(request_id)):
                return  # already cancelled: the finally clause aborts it
            state = worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS if remote else worker_pb2.REQUEST_STATE_WAITING
            yield worker_pb2.DecodeResponse(request_id=request_id, state=state,
                                            num_cached_prompt_tokens=accepted.num_cached_tokens if remote else 0)
            yield from self._relay(stream, transfer, params.logprobs)
            completed = True
        finally:
            if not completed:  # refused after acceptance, cancelled, or the stream closed early: free its blocks
                self._abort(request_id)
            with self._lock:
                self._active.pop(request_id, None)

    def _relay(self, stream, transfer: Transfer | None, num_logprobs: int | None):
        """Token chunks from the engine: what is ready is sent as one message.

        The first token of a remote prefill (carried with its KV) is streamed
        here like every other, so the stream is whole whether the prompt's KV
        arrived or was recomputed.
        """
        while True:
            outputs = [stream.get()]
            while not outputs[-1].finished:
                ready = stream.get_nowait()
                if ready is None:
                    break
                outputs.append(ready)
            yield self._message(outputs, transfer, num_logprobs)
            if outputs[-1].finished:
                return

    def _message(self, outputs: list[RequestOutput], transfer: Transfer | None, num_logprobs: int | None):
        last = outputs[-1]
        completion = last.outputs[0]
        token_ids = [token for output in outputs for token in output.outputs[0].delta_token_ids]
        message = worker_pb2.DecodeResponse(
            request_id=last.request_id,
            state=worker_pb2.REQUEST_STATE_FINISHED if last.finished else worker_pb2.REQUEST_STATE_RUNNING,
            text="".join(output.outputs[0].delta_text for output in outputs),
            token_ids=token_ids,
        )
        if num_logprobs is not None and token_ids and completion.logprobs:
            decode = self._decode_token
            message.logprobs.extend(
                position_logprobs_to_pb(logprobs, token, num_logprobs, decode)
                for logprobs, token in zip(completion.logprobs[-len(token_ids):], token_ids)
            )
        if last.finished:
            message.finish_reason = FINISH_REASONS[completion.finish_reason]
            set_stop_reason(message, completion.stop_reason, completion.finish_reason)
            if completion.finish_reason == "error":
                message.error_message = str(completion.stop_reason)
            message.usage.prompt_tokens = len(last.prompt_token_ids)
            message.usage.completion_tokens = len(completion.token_ids)
            message.usage.cached_tokens = last.num_cached_tokens
            message.num_preemptions = last.metrics.num_preemptions
            if transfer is not None:
                message.kv_recomputed = transfer.outcome == "recomputed"
                message.kv_wait_seconds = transfer.wait_seconds
        return message

    def _decode_token(self, token_id: int) -> str:
        return self.runtime.engine.tokenizer.decode([token_id])

    def _abort(self, request_id: str) -> bool:
        with self._lock:
            transfer_id = self._active.get(request_id)
        if transfer_id is None:
            return False
        if transfer_id and self.receiver is not None:
            self.receiver.cancel(transfer_id)  # no payload may land in the blocks once aborted
        self.loop.abort(request_id)
        return True

    @unary_errors
    def Abort(self, request: worker_pb2.AbortDecodeRequest, context) -> worker_pb2.AbortDecodeResponse:
        return worker_pb2.AbortDecodeResponse(found=self._abort(request.request_id))

    @unary_errors
    def GetStatus(self, request, context) -> worker_pb2.GetWorkerStatusResponse:
        return self.runtime.status_pb()


def _endpoint_or_none(request: worker_pb2.DecodeRequest):
    if not request.HasField("source"):
        return None
    from splitserve.kvtransfer.base import KVEndpointInfo

    return KVEndpointInfo.from_pb(request.source)

