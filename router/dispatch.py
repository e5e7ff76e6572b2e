"""One request's path across the cluster: choose workers, open the decode stream, run the prefill, relay.

    decode = DecodeWorker.Decode(prompt, transfer_id, source=prefill's KV endpoint)
    ack    = first message: blocks reserved, WAITING_FOR_REMOTE_KVS
    PrefillWorker.Prefill(prompt, transfer_id, destination=decode's KV endpoint)
    relay the decode stream (first token included) until its finish reason

Short prompts (``local_prefill_threshold``), colocated workers and an empty
prefill pool skip the prefill: the decode worker computes the prompt itself.
A prefill that fails is retried on another prefill worker with a fresh decode
attempt; when every attempt fails, the decode worker prefills locally.

An embedding (``embed``) is one unary call, DecodeWorker.Embed, on a decode or
colocated worker chosen as for a local prefill; it moves no KV.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from splitserve.common.block_hash import request_root_hash
from splitserve.common.errors import Cancelled, NoWorkerAvailable, Overloaded, Unavailable
from splitserve.common.sampling_params import completion_seed
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

    def __init__(self, worker_id: str, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.worker_id = worker_id
        self.reason = reason
        super().__init__(f"Decode worker {worker_id} failed during the request: {reason}", code)

    @classmethod
    def of(cls, worker_id: str, error: grpc.RpcError) -> DecodeStreamFailed:
        """The failure of a decode stream that ended with ``error``."""
        return cls(worker_id, f"{error.code().name}: {error.details() or 'no details'}", error.code())


@dataclass
class RouterRequest:
    """A request in flight on the router, with what cancels its worker calls.

    After a migration (:meth:`continue_after`) ``prompt`` and ``sampling_params`` are those of the
    continuation the workers run; ``original_prompt`` stays the client's.
    """

    request_id: str
    prompt: Prompt
    sampling_params: inference_pb2.SamplingParams
    priority: int = 0  # GenerateRequest.priority, passed to every worker call (continuations too)
    lora_name: str = ""  # GenerateRequest.lora_name: the LoRA adapter of every worker call ("" none)
    cache_salt: str | None = None  # GenerateRequest.cache_salt, on every worker call (None: none); never logged
    trace_metadata: tuple[tuple[str, str], ...] = ()  # W3C trace context of the router's span, sent to the workers
    accepted: float = field(default_factory=time.monotonic)
    aborted: bool = False
    prefill: worker_pb2.PrefillResponse | None = None
    prefilled_remotely: bool = False
    original_prompt: Prompt | None = None  # the client's; set in __post_init__
    original_sampling_params: inference_pb2.SamplingParams | None = None  # the client's; set in __post_init__
    num_migrations: int = 0
    echo_text: str | None = None  # the prompt's text, for a request that asked for it (GenerateRequest.echo)
    return_prompt_token_ids: bool = False  # GenerateRequest.return_prompt_token_ids: the client's prompt's ids, once
    excluded_decode_workers: set[str] = field(default_factory=set)  # decode workers that failed this request
    beam_search: inference_pb2.BeamSearch | None = None  # GenerateRequest.beam_search: a search on the decode worker
    completion_index: int | None = None  # which completion of the client's request for n this is (``completion``)
    _cancels: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.original_prompt is None:
            self.original_prompt = self.prompt
        if self.original_sampling_params is None:
            self.original_sampling_params = self.sampling_params

    @property
    def num_completions(self) -> int:
        """The completions the client is streamed: the beam width of a beam search, else ``n``."""
        if self.beam_search is not None:
            return self.beam_search.beam_width
        return max(self.sampling_params.n, 1)

    def continue_after(self, sent_token_ids: list[int], failed_worker_id: str, max_tokens: int) -> None:
        """Turn this request into its continuation on another decode worker (a migration): the prompt becomes
        the client's prompt plus every token already streamed, ``max_tokens`` and ``min_tokens`` shrink by
        their number, the sent tokens count as generated for penalties and bad words (``num_resumed_tokens``), a
        structured outputs grammar resumes after them, and the failed worker is not chosen again.

        Args:
            sent_token_ids: every token the client has received so far.
            failed_worker_id: the decode worker whose stream failed.
            max_tokens: the request's effective max_tokens (its default applied).
        """
        num_sent = len(sent_token_ids)
        params = inference_pb2.SamplingParams()
        params.CopyFrom(self.original_sampling_params)
        params.max_tokens = max(max_tokens - num_sent, 1)
        params.min_tokens = max(params.min_tokens - num_sent, 0)
        params.num_resumed_tokens += num_sent
        if num_sent:  # the client has the prompt's logprobs (they came with the first token)
            params.ClearField("prompt_logprobs")
        if params.HasField("structured_outputs"):  # the grammar takes the tokens already sent first
            params.structured_outputs.num_resumed_tokens += num_sent
        self.sampling_params = params
        self.prompt = Prompt(list(self.original_prompt.token_ids) + list(sent_token_ids), None)
        self.prefill = None
        self.prefilled_remotely = False
        self.num_migrations += 1
        self.excluded_decode_workers.add(failed_worker_id)

    def completion(self, index: int) -> RouterRequest:
        """Completion ``index`` of this request for ``n`` as a request of its own, for one completion (with a
        seed, seed + index: what the decode worker seeded it with): how a completion continues on another decode
        worker when theirs failed. It shares the client's prompt, request id, options and trace context, its
        migrations count on from this request's, and cancelling this request cancels it."""
        params = inference_pb2.SamplingParams()
        params.CopyFrom(self.original_sampling_params)
        params.ClearField("n")
        if params.HasField("seed"):
            params.seed = completion_seed(params.seed, index)
        completion = RouterRequest(
            self.request_id, self.original_prompt, params, priority=self.priority, lora_name=self.lora_name,
            cache_salt=self.cache_salt, trace_metadata=self.trace_metadata, accepted=self.accepted,
            num_migrations=self.num_migrations, echo_text=self.echo_text,
            return_prompt_token_ids=self.return_prompt_token_ids,
            excluded_decode_workers=set(self.excluded_decode_workers), completion_index=index,
        )
        self.on_cancel(completion.cancel)
        return completion

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


class _PrefillOutcome(enum.Enum):
    DONE = "done"
    WORKER_FAILED = "worker failed"  # try another prefill worker
    KV_DELIVERY_FAILED = "KV delivery failed"  # the prefill worker is fine: the destination or the KV store is not


class _OpenStream:
    """A decode stream the dispatcher relays, which it may end when the registry loses its worker."""

    def __init__(self, call) -> None:
        self.call = call
        self.lost_reason = ""

    def lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.call.cancel()


class Dispatcher:
    """Runs requests across the registry's workers."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, prefill_policy: RoutingPolicy,
                 decode_policy: RoutingPolicy, channels: Channels, long_rope_context: int | None = None) -> None:
        """``long_rope_context``: the model's original context when it rotates by LongRoPE (a longer prompt's
        blocks hash from a root of their own, which prefix-aware routing keys on), else None."""
        self.config = config
        self.long_rope_context = long_rope_context
        self.registry = registry
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.channels = channels
        self._streams: dict[str, set[_OpenStream]] = {}  # decode worker id -> streams open on it
        self._streams_lock = threading.Lock()
        registry.on_removed(self._workers_lost)

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
        stream = _OpenStream(call)
        with self._streams_lock:
            self._streams.setdefault(decode_worker.worker_id, set()).add(stream)
        try:
            yield from call
        except grpc.RpcError as error:
            if job.aborted:
                raise RequestCancelled() from None
            if stream.lost_reason:
                raise DecodeStreamFailed(decode_worker.worker_id, stream.lost_reason) from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_unreachable(decode_worker.worker_id)
            raise DecodeStreamFailed.of(decode_worker.worker_id, error) from None
        finally:
            call.cancel()
            with self._streams_lock:
                self._streams.get(decode_worker.worker_id, set()).discard(stream)
            self.registry.end_request(decode_worker.worker_id)

    def _workers_lost(self, workers: list[Worker]) -> None:
        """The registry removed ``workers`` (silent past their lease): end the streams still open on them, so
        their requests migrate instead of waiting on a worker that will not answer (one stopped, say)."""
        for worker in workers:
            with self._streams_lock:
                streams = self._streams.pop(worker.worker_id, set())
            for stream in streams:
                stream.lose(f"no heartbeat for {self.registry.lease_duration_seconds:g} s, the router gave the "
                            "worker up")

    def embed(self, job: RouterRequest, request: worker_pb2.EmbedPromptRequest,
              timeout: Callable[[], float | None]) -> worker_pb2.EmbedPromptResponse:
        """Run ``request`` (its request_id set here, per attempt) on a decode or colocated worker serving
        ``job.lora_name``, chosen by the decode policy; a worker that refuses it as a generation's decode would be
        retried (unreachable, full, failed) is left for another, at most ``_MAX_DECODE_ATTEMPTS`` in all.

        Raises:
            Unavailable: no worker could take it (NoWorkerAvailable: none is serving); Overloaded when every
                worker tried was full.
            ServiceError: a refusal another worker would share (INVALID_ARGUMENT, NOT_FOUND, DEADLINE_EXCEEDED),
                its status relayed.
            RequestCancelled: the request was aborted.
        """
        tried: set[str] = set()
        refusals: set[grpc.StatusCode] = set()
        for _ in range(_MAX_DECODE_ATTEMPTS):
            try:
                worker, _ = self._choose_decode(job, tried)
            except Unavailable as error:
                raise _all_full(tried, refusals) or error from None
            request.request_id = f"{job.request_id}#{uuid.uuid4().hex[:8]}"
            future = self.channels.decode(worker.address).Embed.future(request, timeout=timeout(),
                                                                       metadata=job.trace_metadata or None)
            self.registry.begin_request(worker.worker_id)
            try:
                job.on_cancel(future.cancel)
                return future.result()
            except grpc.FutureCancelledError:
                raise RequestCancelled() from None
            except grpc.RpcError as error:
                if job.aborted:
                    raise RequestCancelled() from None
                if error.code() not in _RETRYABLE:
                    raise ServiceError(error.details() or str(error.code()), error.code()) from None
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_unreachable(worker.worker_id)
                logger.warning("Worker %s refused embedding request %s: %s", worker.worker_id, job.request_id,
                               error.details())
                tried.add(worker.worker_id)
                refusals.add(error.code())
            finally:
                self.registry.end_request(worker.worker_id)
        raise _all_full(tried, refusals) or Unavailable("No decode worker could embed the request: every attempt "
                                                        "failed.")

    # ---- choosing workers and starting calls ----------------------------------------------

    def _start(self, job: RouterRequest, timeout):
        """Open the decode stream (after a remote prefill when there is one); returns (call, decode worker)."""
        tried_decode: set[str] = set(job.excluded_decode_workers)
        tried_prefill: set[str] = set()
        prefill_failures = 0
        refusals: set[grpc.StatusCode] = set()  # how decode workers refused this request
        for _ in range(_MAX_DECODE_ATTEMPTS + self.config.prefill_attempts):
            try:
                decode_worker, colocated = self._choose_decode(job, tried_decode)
            except Unavailable as error:
                raise _all_full(tried_decode, refusals) or error from None
            prefill_worker = None
            if not colocated and prefill_failures < self.config.prefill_attempts:
                prefill_worker = self._choose_prefill(job, tried_prefill)
            transfer_id = uuid.uuid4().hex if prefill_worker is not None else ""
            attempt_id = f"{job.request_id}#{uuid.uuid4().hex[:8]}"
            opened = self._open_decode(job, attempt_id, decode_worker, prefill_worker, transfer_id, timeout)
            if isinstance(opened, grpc.StatusCode):
                tried_decode.add(decode_worker.worker_id)
                refusals.add(opened)
                continue
            call, ack = opened
            if prefill_worker is None:
                return call, decode_worker
            outcome = None
            try:
                outcome = self._prefill(job, attempt_id, prefill_worker, decode_worker, transfer_id, timeout,
                                        ack.num_cached_prompt_tokens)
            finally:
                if outcome is not _PrefillOutcome.DONE:  # failed, cancelled or timed out: drop this decode attempt
                    call.cancel()                        # (its blocks are freed)
                    self.registry.end_request(decode_worker.worker_id)
            if outcome is _PrefillOutcome.DONE:
                return call, decode_worker
            if outcome is _PrefillOutcome.KV_DELIVERY_FAILED:  # the prefill worker is fine; the KV path is not
                prefill_failures = self.config.prefill_attempts  # next: a decode worker prefills locally
                continue
            tried_prefill.add(prefill_worker.worker_id)
            prefill_failures += 1
        raise _all_full(tried_decode, refusals) or Unavailable("No decode worker could take the request: every "
                                                               "attempt failed.")

    def _choose_decode(self, job: RouterRequest, tried: set[str]) -> tuple[Worker, bool]:
        for role, colocated in ((WorkerRole.DECODE, False), (WorkerRole.BOTH, True)):
            workers = [w for w in self.registry.routable(role) if w.worker_id not in tried and w.serves(job.lora_name)]
            if workers:
                return self.decode_policy.choose(workers, job.prompt.token_ids, self._hash_root(job)), colocated
        if tried:
            raise Unavailable(f"No decode worker could take the request (tried {', '.join(sorted(tried))}).")
        raise NoWorkerAvailable("No decode worker is serving: the decode pool is empty or every worker is "
                                "draining or unreachable.")

    def _choose_prefill(self, job: RouterRequest, tried: set[str]) -> Worker | None:
        if len(job.prompt.token_ids) < self.config.local_prefill_threshold:
            return None
        workers = [w for w in self.registry.routable(WorkerRole.PREFILL)
                   if w.worker_id not in tried and w.serves(job.lora_name)]
        if not workers:  # none (that serves its adapter): the decode worker prefills it
            return None
        return self.prefill_policy.choose(workers, job.prompt.token_ids, self._hash_root(job))

    def _hash_root(self, job: RouterRequest) -> bytes | None:
        """The hash the workers chain the request's blocks from: its adapter, salt and rotation (a continuation's
        longer prompt may cross LongRoPE's original context, as its worker will see)."""
        long_rope = self.long_rope_context is not None and len(job.prompt.token_ids) > self.long_rope_context
        return request_root_hash(job.lora_name or None, job.cache_salt, long_rope)

    def _open_decode(self, job, attempt_id, decode_worker, prefill_worker, transfer_id, timeout):
        """Start Decode and read its acknowledgement: (call, ack), or the status code with which the worker
        refused it in a way another worker may not (unreachable, full)."""
        request = worker_pb2.DecodeRequest(
            request_id=attempt_id, transfer_id=transfer_id, prompt_token_ids=job.prompt.token_ids,
            sampling_params=job.sampling_params, prefill_locally=prefill_worker is None, priority=job.priority,
            lora_name=job.lora_name, cache_salt=job.cache_salt,
        )
        if prefill_worker is not None:  # the prefill worker computes the prompt, and its logprobs if asked
            request.sampling_params.ClearField("prompt_logprobs")
        if job.beam_search is not None:
            request.beam_search.CopyFrom(job.beam_search)
        if prefill_worker is not None and prefill_worker.kv_endpoint is not None:
            request.source.CopyFrom(prefill_worker.kv_endpoint)
        if self.config.kv_timeout_seconds is not None:
            request.kv_timeout_seconds = self.config.kv_timeout_seconds
        call = self.channels.decode(decode_worker.address).Decode(request, timeout=timeout(),
                                                                  metadata=job.trace_metadata or None)
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
            return error.code()
        finally:
            if not acknowledged:  # refused, cancelled or failed: released here, once
                call.cancel()
                self.registry.end_request(decode_worker.worker_id)
        return call, ack

    def _prefill(self, job, attempt_id, prefill_worker, decode_worker, transfer_id, timeout,
                 num_destination_cached_tokens: int) -> _PrefillOutcome:
        """Run the prefill (sending only the KV the decode worker does not cache): DONE, WORKER_FAILED when it
        failed in a way another prefill worker may not, KV_DELIVERY_FAILED when the prefill worker could not
        deliver the KV (ABORTED: the destination's KV endpoint or the KV store failed, not the prefill worker).

        Raises:
            RequestCancelled: the request was aborted.
            ServiceError: a refusal another worker would share (INVALID_ARGUMENT, say), relayed.
        """
        request = worker_pb2.PrefillRequest(
            request_id=attempt_id, transfer_id=transfer_id, prompt_token_ids=job.prompt.token_ids,
            sampling_params=job.sampling_params, destination=decode_worker.kv_endpoint,
            num_destination_cached_tokens=num_destination_cached_tokens, priority=job.priority,
            lora_name=job.lora_name, cache_salt=job.cache_salt,
        )
        request.sampling_params.ClearField("n")  # the prefill samples completion 0; the decode worker forks the others
        future = self.channels.prefill(prefill_worker.address).Prefill.future(request, timeout=timeout(),
                                                                              metadata=job.trace_metadata or None)
        self.registry.begin_request(prefill_worker.worker_id)
        try:
            job.on_cancel(future.cancel)
            job.prefill = future.result()
            job.prefilled_remotely = True
            return _PrefillOutcome.DONE
        except grpc.RpcError as error:
            if job.aborted:
                raise RequestCancelled() from None
            if error.code() == grpc.StatusCode.ABORTED:
                logger.warning("Prefill of %s on %s could not deliver its KV to decode worker %s (%s); the decode "
                               "worker prefills it", job.request_id, prefill_worker.worker_id,
                               decode_worker.worker_id, error.details())
                return _PrefillOutcome.KV_DELIVERY_FAILED
            if error.code() not in _RETRYABLE:
                raise ServiceError(error.details() or str(error.code()), error.code()) from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_unreachable(prefill_worker.worker_id)
            logger.warning("Prefill of %s on %s failed (%s: %s); trying again", job.request_id,
                           prefill_worker.worker_id, error.code().name, error.details())
            return _PrefillOutcome.WORKER_FAILED
        except grpc.FutureCancelledError:
            raise RequestCancelled() from None
        finally:
            self.registry.end_request(prefill_worker.worker_id)


def _all_full(tried_decode: set[str], refusals: set[grpc.StatusCode]) -> Overloaded | None:
    """RESOURCE_EXHAUSTED for the client when every decode worker tried refused for want of room (back off and
    retry), rather than UNAVAILABLE; None otherwise."""
    if refusals != {grpc.StatusCode.RESOURCE_EXHAUSTED}:
        return None
    return Overloaded(f"Every decode worker tried is full (tried {', '.join(sorted(tried_decode))}): no free KV "
                      "blocks or queue room for this request now; retry later.")
