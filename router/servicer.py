"""The router's gRPC services: Inference (the public API) and WorkerRegistry (membership).

Methods raise domain errors (``splitserve.common.errors``); the interceptor that
``start_server`` installs turns each into its gRPC status.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import grpc

from splitserve.common.errors import InvalidRequest, Overloaded, SplitserveError, Unavailable
from splitserve.common.ids import check_id
from splitserve.common.types import WorkerRole
from splitserve.router.dispatch import DecodeStreamFailed, Dispatcher, RequestCancelled, RouterRequest
from splitserve.router.frontend import Frontend
from splitserve.router.registry import WorkerRegistry
from splitserve.router.worker import KVCacheLayout
from splitserve.rpc.convert import (
    sampling_params_from_pb,
    worker_load_from_pb,
    worker_load_to_pb,
    worker_role_from_pb,
    worker_state_from_pb,
)
from splitserve.rpc.errors import status_of
from splitserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """The public API: validates, tokenizes, dispatches and relays."""

    def __init__(self, frontend: Frontend, dispatcher: Dispatcher, registry: WorkerRegistry,
                 max_in_flight_requests: int, block_size: int) -> None:
        self.frontend = frontend
        self.dispatcher = dispatcher
        self.registry = registry
        self.max_in_flight_requests = max_in_flight_requests
        self.block_size = block_size
        self._in_flight: dict[str, RouterRequest] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._draining = False

    # ---- generation ------------------------------------------------------------------

    def GenerateStream(self, request: inference_pb2.GenerateRequest, context: grpc.ServicerContext):
        job = self._admit(request, context)
        try:
            yield from self._generate(job, context)
        finally:
            self._release(job)

    def Generate(self, request: inference_pb2.GenerateRequest, context) -> inference_pb2.GenerateResponse:
        job = self._admit(request, context)
        try:
            response = inference_pb2.GenerateResponse(request_id=job.request_id)
            for chunk in self._generate(job, context):
                response.text += chunk.text
                response.token_ids.extend(chunk.token_ids)
                response.logprobs.extend(chunk.logprobs)
                if chunk.finish_reason:
                    response.finish_reason = chunk.finish_reason
                    kind = chunk.WhichOneof("stop_reason")
                    if kind:
                        setattr(response, kind, getattr(chunk, kind))
                    response.error_message = chunk.error_message
                    response.usage.CopyFrom(chunk.usage)
                    response.timing.CopyFrom(chunk.timing)
            return response
        finally:
            self._release(job)

    # ---- draining ------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Refuse new generation calls (UNAVAILABLE) and wait up to ``timeout`` seconds for those in flight.

        Returns True when none is left; False when some still run (``abort_all`` ends them).
        """
        deadline = time.monotonic() + timeout
        with self._idle:
            self._draining = True
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def abort_all(self) -> int:
        """Cancel every request in flight (each stream ends with FINISH_REASON_ABORT); returns how many."""
        with self._lock:
            jobs = list(self._in_flight.values())
        for job in jobs:
            job.cancel()
        return len(jobs)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def _admit(self, request: inference_pb2.GenerateRequest, context) -> RouterRequest:
        request_id = uuid.uuid4().hex
        if request.HasField("request_id"):
            request_id = check_id(request.request_id, "request_id")
        prompt = self.frontend.prompt_of(request)
        params = sampling_params_from_pb(request.sampling_params)  # validates; workers get the message
        del params
        job = RouterRequest(request_id, prompt, request.sampling_params)
        with self._lock:
            if self._draining:
                raise Unavailable("The router is draining: it is shutting down and takes no new requests; "
                                  "retry on another router.")
            if request_id in self._in_flight:
                raise InvalidRequest(f"Request id {request_id!r} is already in flight.")
            if len(self._in_flight) >= self.max_in_flight_requests:
                raise Overloaded(
                    f"The router has {len(self._in_flight)} requests in flight, its limit; retry later."
                )
            self._in_flight[request_id] = job
        # A client that goes away, or whose deadline passes, cancels the worker calls.
        context.add_callback(job.cancel)
        return job

    def _release(self, job: RouterRequest) -> None:
        with self._lock:
            self._in_flight.pop(job.request_id, None)
            if not self._in_flight:
                self._idle.notify_all()

    def _generate(self, job: RouterRequest, context):
        """The client's messages for ``job``. A failure before the first message raises (its status code);
        after it, the stream ends with a last message carrying FINISH_REASON_ERROR, so the text sent is kept."""
        first_token_time = None
        num_sent_messages = num_sent_tokens = 0
        try:
            for message in self.dispatcher.run(job, lambda: _seconds_left(context)):
                chunk = inference_pb2.GenerateStreamResponse(
                    request_id=job.request_id, text=message.text, token_ids=message.token_ids,
                    logprobs=message.logprobs, finish_reason=message.finish_reason,
                    error_message=message.error_message,
                )
                if message.token_ids and first_token_time is None:
                    first_token_time = time.monotonic()
                    self._fill_first_logprobs(job, chunk)
                kind = message.WhichOneof("stop_reason")
                if kind:
                    setattr(chunk, kind, getattr(message, kind))
                if message.finish_reason:
                    chunk.usage.CopyFrom(message.usage)
                    chunk.timing.CopyFrom(self._timing(job, first_token_time))
                if chunk.text or chunk.token_ids or chunk.finish_reason:
                    yield chunk
                    num_sent_messages += 1
                    num_sent_tokens += len(chunk.token_ids)
        except RequestCancelled:
            yield inference_pb2.GenerateStreamResponse(
                request_id=job.request_id, finish_reason=inference_pb2.FINISH_REASON_ABORT,
                timing=self._timing(job, first_token_time),
            )
        except Exception as error:
            if not num_sent_messages:
                raise  # nothing reached the client: the status code says what failed
            yield self._failed_mid_stream(job, error, num_sent_tokens, first_token_time)

    def _failed_mid_stream(self, job: RouterRequest, error: Exception, num_sent_tokens: int,
                           first_token_time: float | None) -> inference_pb2.GenerateStreamResponse:
        """The last message of a stream that failed after tokens were sent: FINISH_REASON_ERROR, a sentence, usage."""
        if not isinstance(error, SplitserveError | grpc.RpcError):
            logger.exception("Request %s failed mid-stream", job.request_id)
        if isinstance(error, DecodeStreamFailed):
            what, details = f"The decode worker {error.worker_id}", error.reason
        else:
            what, details = "The request", status_of(error)[1]
        message = (f"{what} failed mid-stream after {num_sent_tokens} tokens: {details.rstrip('.')}; "
                   "the text so far is complete up to here.")
        logger.warning("Request %s: %s", job.request_id, message)
        return inference_pb2.GenerateStreamResponse(
            request_id=job.request_id, finish_reason=inference_pb2.FINISH_REASON_ERROR, error_message=message,
            usage=inference_pb2.Usage(prompt_tokens=len(job.prompt.token_ids), completion_tokens=num_sent_tokens),
            timing=self._timing(job, first_token_time),
        )

    @staticmethod
    def _fill_first_logprobs(job: RouterRequest, chunk: inference_pb2.GenerateStreamResponse) -> None:
        """The first token of a remote prefill carries no logprobs on the decode side; the prefill's answer has them."""
        if chunk.logprobs and not chunk.logprobs[0].HasField("sampled") and job.prefill is not None:
            chunk.logprobs[0].CopyFrom(job.prefill.first_token_logprobs)

    def _timing(self, job: RouterRequest, first_token_time: float | None) -> inference_pb2.Timing:
        now = time.monotonic()
        timing = inference_pb2.Timing(end_to_end_seconds=now - job.accepted)
        if first_token_time is not None:
            timing.time_to_first_token_seconds = first_token_time - job.accepted
        if job.prefill is not None:
            timing.queue_seconds = job.prefill.queue_seconds
            timing.kv_transfer_seconds = job.prefill.kv_send_seconds
        return timing

    # ---- the rest of the API ----------------------------------------------------------------

    def Abort(self, request: inference_pb2.AbortRequest, context) -> inference_pb2.AbortResponse:
        request_id = check_id(request.request_id, "request_id")
        with self._lock:
            job = self._in_flight.get(request_id)
        if job is None:
            return inference_pb2.AbortResponse(found=False)
        job.cancel()
        return inference_pb2.AbortResponse(found=True)

    def Tokenize(self, request: inference_pb2.TokenizeRequest, context) -> inference_pb2.TokenizeResponse:
        prompt = self.frontend.prompt_of(request)
        return inference_pb2.TokenizeResponse(
            token_ids=prompt.token_ids, prompt_text=prompt.text or "", max_model_len=self.frontend.max_model_len
        )

    def GetModelInfo(self, request, context) -> inference_pb2.GetModelInfoResponse:
        info = self.frontend.model_info()
        info.kv_block_size = self.block_size
        info.model_fingerprint = self.registry.model_fingerprint or ""
        return info

    def GetClusterStatus(self, request, context) -> inference_pb2.GetClusterStatusResponse:
        response = inference_pb2.GetClusterStatusResponse()
        now = time.monotonic()
        for role, workers in self.registry.pools().items():
            if not workers:
                continue
            pool = response.pools.add(role=role.value)
            for worker in workers:
                pool.workers.add(
                    worker_id=worker.worker_id, role=role.value, address=worker.address, state=worker.state.value,
                    load=worker_load_to_pb(worker.load), seconds_since_heartbeat=max(now - worker.last_heard, 0.0),
                )
        return response


class RegistryServicer(worker_pb2_grpc.WorkerRegistryServicer):
    """Workers register, heartbeat, drain and leave through here."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def Register(self, request: worker_pb2.RegisterRequest, context) -> worker_pb2.RegisterResponse:
        role = worker_role_from_pb(request.role)
        if role != WorkerRole.BOTH and not request.HasField("kv_endpoint"):
            raise InvalidRequest("A prefill or decode worker must give its kv_endpoint.")
        worker = self.registry.register(
            role=role, address=request.address,
            kv_endpoint=request.kv_endpoint if request.HasField("kv_endpoint") else None,
            capacity=request.capacity, model_fingerprint=request.model_fingerprint,
            state=worker_state_from_pb(request.state), worker_id=request.worker_id,
            kv_layout=KVCacheLayout.from_pb(request.kv_layout) if request.HasField("kv_layout") else None,
        )
        logger.info("Worker %s (%s) registered from %s", worker.worker_id, role.name.lower(), request.address)
        return worker_pb2.RegisterResponse(
            worker_id=worker.worker_id, lease_id=worker.lease_id,
            lease_duration_seconds=self.registry.lease_duration_seconds,
            heartbeat_interval_seconds=self.registry.heartbeat_interval_seconds,
        )

    def Heartbeat(self, request: worker_pb2.HeartbeatRequest, context) -> worker_pb2.HeartbeatResponse:
        state, lease = self.registry.heartbeat(
            request.lease_id, worker_load_from_pb(request.load), worker_state_from_pb(request.state)
        )
        return worker_pb2.HeartbeatResponse(state=state.value, lease_duration_seconds=lease)

    def Deregister(self, request: worker_pb2.DeregisterRequest, context) -> worker_pb2.DeregisterResponse:
        self.registry.deregister(request.lease_id)
        return worker_pb2.DeregisterResponse()

    def Drain(self, request: worker_pb2.DrainRequest, context) -> worker_pb2.DrainResponse:
        in_flight = self.registry.drain(request.worker_id)
        logger.info("Worker %s is draining", request.worker_id)
        return worker_pb2.DrainResponse(num_in_flight_requests=in_flight)


def _seconds_left(context: grpc.ServicerContext) -> float | None:
    """Seconds before the client's deadline, None without one (gRPC reports "no deadline" as a huge number)."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 10**7:
        return None
    return max(remaining, 0.001)
