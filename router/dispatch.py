"""One request's path across the cluster: choose workers, open the decode stream, run the prefill, relay.

    decode = DecodeWorker.Decode(prompt, transfer_id, source=prefill's KV endpoint)
    ack    = first message: blocks reserved, WAITING_FOR_REMOTE_KVS
    PrefillWorker.Prefill(prompt, transfer_id, destination=decode's KV endpoint)
    relay the decode stream (first token included) until its finish reason

Short prompts (``local_prefill_threshold``), colocated workers and an empty
prefill pool skip the prefill: the decode worker computes the prompt itself.
A prefill that fails is retried on another prefill worker with a fresh decode
attempt; when every attempt fails, the decode worker prefills locally.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from splitserve.common.errors import Cancelled, NoWorkerAvailable, Unavailable
from splitserve.common.types import WorkerRole
from splitserve.router.channels import Channels
from splitserve.router.config import RouterConfig
from splitserve.router.frontend import Prompt
from splitserve.router.policies import RoutingPolicy
from splitserve.router.registry import WorkerRegistry
from splitserve.router.worker import Worker
from splitserve.rpc.errors import ServiceError
from splitserve.v1 import inference_pb2, worker_pb2

logger = logging.getLogger(__name__)

# Worker errors after which another worker is worth trying.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN}
_MAX_DECODE_ATTEMPTS = 3


class RequestCancelled(Cancelled):
    """The request was cancelled: the client went away, its deadline passed, or the Abort RPC."""


class DecodeStreamFailed(ServiceError):
    """The decode worker's stream failed after its acknowledgement (the worker died, say); the status relayed.

    Attributes:
        worker_id: the decode worker.
        reason: its call's status code and details, e.g. "UNAVAILABLE: Socket closed".
    """

    def __init__(self, worker_id: str, error: grpc.RpcError) -> None:
        self.worker_id = worker_id
        self.reason = f"{error.code().name}: {error.details() or 'no details'}"
        super().__init__(f"Decode worker {worker_id} failed during the request: {error.details()}", error.code())


@dataclass
class RouterRequest:
    """A request in flight on the router, with what cancels its worker calls."""

    request_id: str
    prompt: Prompt
    sampling_params: inference_pb2.SamplingParams
    accepted: float = field(default_factory=time.monotonic)
    aborted: bool = False
    prefill: worker_pb2.PrefillResponse | None = None
    prefilled_remotely: bool = False
    _cancels: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_cancel(self, cancel: Callable[[], None]) -> None:
        """Run ``cancel`` when the request is cancelled (at once if it already was)."""
        with self._lock:
            if not self.aborted:
                self._cancels.append(cancel)
                return
        cancel()

    def cancel(self) -> None:
        """Cancel every worker call of the request (client gone, deadline, or Abort)."""
        with self._lock:
            self.aborted = True
            cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            cancel()


class Dispatcher:
    """Runs requests across the registry's workers."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, prefill_policy: RoutingPolicy,
                 decode_policy: RoutingPolicy, channels: Channels) -> None:
        self.config = config
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.channels = channels

    def run(self, job: RouterRequest, timeout: Callable[[], float | None]) -> Iterator[worker_pb2.DecodeResponse]:
        """The decode worker's messages for ``job`` after its acknowledgement, the last one finished.

        Args:
            timeout: seconds left before the client's deadline (None: no deadline), asked before each call.

        Raises:
            Unavailable: no worker could take the request (NoWorkerAvailable: none is serving).
            ServiceError: a worker refused it for a reason another worker would share (its status, relayed);
                DecodeStreamFailed when the decode stream failed after its acknowledgement.
            RequestCancelled: the request was aborted.
        """
        call, decode_worker = self._start(job, timeout)
        try:
            yield from call
        except grpc.RpcError as error:
            if job.aborted:
                raise RequestCancelled() from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_unreachable(decode_worker.worker_id)
            raise DecodeStreamFailed(decode_worker.worker_id, error) from None
        finally:
            call.cancel()
            self.registry.end_request(decode_worker.worker_id)

    # ---- choosing workers and starting calls ----------------------------------------------

    def _start(self, job: RouterRequest, timeout):
        """Open the decode stream (after a remote prefill when there is one); returns (call, decode worker)."""
        tried_decode: set[str] = set()
        tried_prefill: set[str] = set()
        prefill_failures = 0
        for _ in range(_MAX_DECODE_ATTEMPTS + self.config.prefill_attempts):
            decode_worker, colocated = self._choose_decode(job, tried_decode)
            prefill_worker = None
            if not colocated and prefill_failures < self.config.prefill_attempts:
                prefill_worker = self._choose_prefill(job, tried_prefill)
            transfer_id = uuid.uuid4().hex if prefill_worker is not None else ""
            attempt_id = f"{job.request_id}#{uuid.uuid4().hex[:8]}"
            opened = self._open_decode(job, attempt_id, decode_worker, prefill_worker, transfer_id, timeout)
            if opened is None:
                tried_decode.add(decode_worker.worker_id)
                continue
            call, ack = opened
            if prefill_worker is None:
                return call, decode_worker
            prefilled = False
            try:
                prefilled = self._prefill(job, attempt_id, prefill_worker, decode_worker, transfer_id, timeout,
                                          ack.num_cached_prompt_tokens)
            finally:
                if not prefilled:  # failed, cancelled or timed out: drop this decode attempt (its blocks are freed)
                    call.cancel()
                    self.registry.end_request(decode_worker.worker_id)
            if prefilled:
                return call, decode_worker
            tried_prefill.add(prefill_worker.worker_id)
            prefill_failures += 1
        raise Unavailable("No decode worker could take the request: every attempt failed.")

    def _choose_decode(self, job: RouterRequest, tried: set[str]) -> tuple[Worker, bool]:
        for role, colocated in ((WorkerRole.DECODE, False), (WorkerRole.BOTH, True)):
            workers = [w for w in self.registry.routable(role) if w.worker_id not in tried]
            if workers:
                return self.decode_policy.choose(workers, job.prompt.token_ids), colocated
        if tried:
            raise Unavailable(f"No decode worker could take the request (tried {', '.join(sorted(tried))}).")
        raise NoWorkerAvailable("No decode worker is serving: the decode pool is empty or every worker is "
                                "draining or unreachable.")

    def _choose_prefill(self, job: RouterRequest, tried: set[str]) -> Worker | None:
        if len(job.prompt.token_ids) < self.config.local_prefill_threshold:
            return None
        workers = [w for w in self.registry.routable(WorkerRole.PREFILL) if w.worker_id not in tried]
        if not workers:
            return None
        return self.prefill_policy.choose(workers, job.prompt.token_ids)

    def _open_decode(self, job, attempt_id, decode_worker, prefill_worker, transfer_id, timeout):
        """Start Decode and read its acknowledgement: (call, ack), or None if the worker is unreachable or full."""
        request = worker_pb2.DecodeRequest(
            request_id=attempt_id, transfer_id=transfer_id, prompt_token_ids=job.prompt.token_ids,
            sampling_params=job.sampling_params, prefill_locally=prefill_worker is None,
        )
        if prefill_worker is not None and prefill_worker.kv_endpoint is not None:
            request.source.CopyFrom(prefill_worker.kv_endpoint)
        if self.config.kv_timeout_seconds is not None:
            request.kv_timeout_seconds = self.config.kv_timeout_seconds
        call = self.channels.decode(decode_worker.address).Decode(request, timeout=timeout())
        self.registry.begin_request(decode_worker.worker_id)
        acknowledged = False
        try:
            job.on_cancel(call.cancel)
            ack = next(call)
            acknowledged = True
        except grpc.RpcError as error:
            if job.aborted:
                raise RequestCancelled() from None
            if error.code() not in _RETRYABLE:
                raise ServiceError(error.details() or str(error.code()), error.code()) from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_unreachable(decode_worker.worker_id)
            logger.warning("Decode worker %s refused request %s: %s", decode_worker.worker_id, job.request_id,
                           error.details())
            return None
        finally:
            if not acknowledged:  # refused, cancelled or failed: released here, once
                call.cancel()
                self.registry.end_request(decode_worker.worker_id)
        return call, ack

    def _prefill(self, job, attempt_id, prefill_worker, decode_worker, transfer_id, timeout,
                 num_destination_cached_tokens: int) -> bool:
        """Run the prefill (sending only the KV the decode worker does not cache); False if it failed in a
        way another worker may not."""
        request = worker_pb2.PrefillRequest(
            request_id=attempt_id, transfer_id=transfer_id, prompt_token_ids=job.prompt.token_ids,
            sampling_params=job.sampling_params, destination=decode_worker.kv_endpoint,
            num_destination_cached_tokens=num_destination_cached_tokens,
        )
        future = self.channels.prefill(prefill_worker.address).Prefill.future(request, timeout=timeout())
        self.registry.begin_request(prefill_worker.worker_id)
        try:
            job.on_cancel(future.cancel)
            job.prefill = future.result()
            job.prefilled_remotely = True
            return True
        except grpc.RpcError as error:
            if job.aborted:
                raise RequestCancelled() from None
            if error.code() not in _RETRYABLE:
                raise ServiceError(error.details() or str(error.code()), error.code()) from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_unreachable(prefill_worker.worker_id)
            logger.warning("Prefill of %s on %s failed (%s: %s); trying again", job.request_id,
                           prefill_worker.worker_id, error.code().name, error.details())
            return False
        except grpc.FutureCancelledError:
            raise RequestCancelled() from None
        finally:
            self.registry.end_request(prefill_worker.worker_id)
