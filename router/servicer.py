"""The router's gRPC services: Inference (the public API: generation, embeddings and the small calls).

Methods raise domain errors (``splitserve.common.errors``); the interceptor that
``start_server`` installs turns each into its gRPC status.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from splitserve.common.errors import InvalidRequest, NotFound, Overloaded, SplitserveError, Unavailable
from splitserve.common.ids import check_id
from splitserve.common.log_fields import request_log
from splitserve.common.lora_names import check_lora_name
from splitserve.common.sampling_params import SamplingParams
from splitserve.router.dispatch import DecodeStreamFailed, Dispatcher, RequestCancelled, RouterRequest
from splitserve.router.frontend import Frontend
from splitserve.router.registry import WorkerRegistry
from splitserve.rpc.convert import (
    beam_search_from_pb,
    cache_salt_from_pb,
    sampling_params_from_pb,
    worker_load_to_pb,
)
from splitserve.rpc.errors import ServiceError, status_of
from splitserve.rpc.metrics import RouterMetrics
from splitserve.rpc.tracing import RequestTracer
from splitserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)

# Abort, Tokenize, Detokenize, GetModelInfo and GetClusterStatus calls answered at once; the router's server has threads for
# these, max_in_flight_requests generation calls, and more (``router.server``), so heartbeats always find one.
MAX_CONCURRENT_SMALL_CALLS = 8
# A request for n whose decode worker failed continues each unfinished completion on its own: at most this many at
# once (a thread each), the rest after them.
MAX_PARALLEL_CONTINUATIONS = 8


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """The public API: validates, tokenizes, dispatches and relays."""

    def __init__(self, frontend: Frontend, dispatcher: Dispatcher, registry: WorkerRegistry,
                 max_in_flight_requests: int, block_size: int, migration_limit: int = 3,
                 metrics: RouterMetrics | None = None, tracer: RequestTracer | None = None) -> None:
        self.frontend = frontend
        self.metrics = metrics or RouterMetrics()
        self.tracer = tracer  # None: no spans
        self.dispatcher = dispatcher
        self.registry = registry
        self.max_in_flight_requests = max_in_flight_requests
        self.block_size = block_size
        self.migration_limit = migration_limit
        self._small_calls = threading.BoundedSemaphore(MAX_CONCURRENT_SMALL_CALLS)
        self._in_flight: dict[str, RouterRequest] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._draining = False

    # ---- generation ------------------------------------------------------------------

    def GenerateStream(self, request: inference_pb2.GenerateRequest, context: grpc.ServicerContext):
        job = self._counted_admit(request, context)
        try:
            yield from self._observed(job, self._generate(job, context), context)
        finally:
            self._release(job)

    def Generate(self, request: inference_pb2.GenerateRequest, context) -> inference_pb2.GenerateResponse:
        job = self._counted_admit(request, context, streamed=False)
        try:
            response = inference_pb2.GenerateResponse(request_id=job.request_id)
            for chunk in self._observed(job, self._generate(job, context), context):
                response.text += chunk.text
                response.token_ids.extend(chunk.token_ids)
                response.logprobs.extend(chunk.logprobs)
                response.prompt_logprobs.extend(chunk.prompt_logprobs)
                response.prompt_text += chunk.prompt_text
                response.prompt_token_ids.extend(chunk.prompt_token_ids)
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

    # ---- embeddings --------------------------------------------------------------------

    def Embed(self, request: inference_pb2.EmbedRequest, context) -> inference_pb2.EmbedResponse:
        """One decode or colocated worker computes the prompt and returns its embedding (``Dispatcher.embed``).
        It counts among the requests in flight (its thread, the router's limit, draining, Abort by its id)."""
        code, job, span, answer = grpc.StatusCode.UNKNOWN.name, None, None, None
        try:
            job = self._enter(self._embedding_job(request), context)
            try:
                if self.tracer is not None:  # a span of the admitted request, the worker's its child
                    span = self.tracer.start_span("embedding_request", context.invocation_metadata() or (),
                                                  time.monotonic() - job.accepted)
                    job.trace_metadata = self.tracer.headers(span)
                answer = self.dispatcher.embed(job, _worker_embed_request(job, request), lambda: _seconds_left(context))
            finally:
                self._release(job)
            code = grpc.StatusCode.OK.name
            return inference_pb2.EmbedResponse(request_id=job.request_id, embedding=answer.embedding,
                                               prompt_tokens=answer.prompt_tokens, cached_tokens=answer.cached_tokens)
        except Exception as error:
            code = status_of(error)[0].name
            raise
        finally:
            self.metrics.embeddings.labels(code).inc()
            if span is not None:
                self.tracer.end(span, _embedding_span_attributes(job, answer, code),
                                None if code == grpc.StatusCode.OK.name else code)

    def _embedding_job(self, request: inference_pb2.EmbedRequest) -> RouterRequest:
        """The router's request for an EmbedRequest: its id and prompt validated as Generate's, its adapter served.
        Dimensions are the workers' to check (PoolingParams.check: 1 to the model's hidden size)."""
        request_id = check_id(request.request_id, "request_id") if request.HasField("request_id") else uuid.uuid4().hex
        truncate = request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
        prompt = self.frontend.prompt_of(request, SamplingParams(truncate_prompt_tokens=truncate))
        return RouterRequest(request_id, prompt, inference_pb2.SamplingParams(), priority=request.priority,
                             lora_name=self._lora_name_of(request), cache_salt=cache_salt_from_pb(request))

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

    def _counted_admit(self, request: inference_pb2.GenerateRequest, context, streamed: bool = True) -> RouterRequest:
        """:meth:`_admit`, a refusal counted in the metrics by its status code; a request for several completions
        is refused unless ``streamed``."""
        try:
            if not streamed and request.sampling_params.n > 1:
                raise InvalidRequest(f"n={request.sampling_params.n}: Generate answers one completion; "
                                     "GenerateStream streams n of them (each message says its completion's index).")
            if not streamed and request.HasField("beam_search"):
                raise InvalidRequest("A beam search answers beam_width completions: ask GenerateStream for it (each "
                                     "message says its completion's index).")
            return self._admit(request, context)
        except Exception as error:
            self.metrics.requests.labels("refused", status_of(error)[0].name).inc()
            raise

    def _admit(self, request: inference_pb2.GenerateRequest, context) -> RouterRequest:
        request_id = uuid.uuid4().hex
        if request.HasField("request_id"):
            request_id = check_id(request.request_id, "request_id")
        params = self.frontend.sampling_params_of(request)  # validated here; the workers get the message
        prompt = self.frontend.prompt_of(request, params)
        params.check_prompt_length(len(prompt.token_ids))
        sampling = request.sampling_params
        if sampling.HasField("truncate_prompt_tokens"):  # the prompt is cut here: a migration's longer one must not be
            sampling = inference_pb2.SamplingParams()
            sampling.CopyFrom(request.sampling_params)
            sampling.ClearField("truncate_prompt_tokens")
        job = RouterRequest(request_id, prompt, sampling, priority=request.priority,
                            lora_name=self._lora_name_of(request), cache_salt=cache_salt_from_pb(request),
                            return_prompt_token_ids=request.return_prompt_token_ids)
        if request.HasField("beam_search"):
            beam_search_from_pb(request.beam_search, params)  # checked here; the decode worker gets the message
            job.beam_search = request.beam_search
        if request.echo:
            job.echo_text = prompt.text if prompt.text is not None else self.frontend.detokenize(prompt.token_ids)
        return self._enter(job, context)

    def _enter(self, job: RouterRequest, context) -> RouterRequest:
        """Count ``job`` in flight, or refuse it: UNAVAILABLE while draining, INVALID_ARGUMENT for an id already in
        flight, RESOURCE_EXHAUSTED at the limit. Its worker calls are cancelled when the client goes away."""
        request_id = job.request_id
        with self._lock:
            if self._draining:
                self.metrics.admission_refusals.labels("draining").inc()
                raise Unavailable("The router is draining: it is shutting down and takes no new requests; "
                                  "retry on another router.")
            if request_id in self._in_flight:
                raise InvalidRequest(f"Request id {request_id!r} is already in flight.")
            if len(self._in_flight) >= self.max_in_flight_requests:
                self.metrics.admission_refusals.labels("in_flight_limit").inc()
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

    def _observed(self, job: RouterRequest, chunks, context):
        """``chunks`` passed through, timed for the metrics: time to first token, the intervals between tokens,
        end to end and queue time, and the request's outcome (its finish reason, or the status it ended with);
        and, with a tracer, the request's span (a child of the caller's, from ``context``'s metadata)."""
        metrics, last_token_time, finish = self.metrics, None, None
        last_token_times: dict[int, float] = {}  # by completion: the intervals are each completion's own
        outcome = ("abort", grpc.StatusCode.CANCELLED.name)  # the client went away (GeneratorExit)
        first_token_seconds = None
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("llm_request", context.invocation_metadata() or (),
                                          time.monotonic() - job.accepted)
            job.trace_metadata = self.tracer.headers(span)  # the workers' spans are its children
        try:
            for chunk in chunks:
                if chunk.token_ids:
                    now = time.monotonic()
                    if last_token_time is None:
                        first_token_seconds = now - job.accepted
                        metrics.time_to_first_token.observe(first_token_seconds)
                    if chunk.index in last_token_times:
                        share = (now - last_token_times[chunk.index]) / len(chunk.token_ids)
                        for _ in chunk.token_ids:
                            metrics.inter_token_latency.observe(share)
                    last_token_time = last_token_times[chunk.index] = now
                if chunk.finish_reason:
                    finish = chunk
                yield chunk
            if finish is not None:
                outcome = (_FINISH_LABELS.get(finish.finish_reason, "error"), grpc.StatusCode.OK.name)
                if job.prefill is not None:
                    metrics.queue_time.observe(finish.timing.queue_seconds)
        except Exception as error:
            outcome = ("refused", status_of(error)[0].name)
            raise
        finally:
            seconds = time.monotonic() - job.accepted
            metrics.requests.labels(*outcome).inc()
            metrics.e2e_latency.observe(seconds)
            if span is not None:
                self.tracer.end(span, _span_attributes(job, finish, outcome, seconds, first_token_seconds),
                                None if outcome[1] == grpc.StatusCode.OK.name and outcome[0] != "error"
                                else f"{outcome[0]} ({outcome[1]})")
            request_log(logger, job.request_id).info(
                "Request ended: %s (%s) after %.3f s; %d prompt tokens, %s", outcome[0], outcome[1], seconds,
                len(job.original_prompt.token_ids),
                "no token" if last_token_time is None else f"first token after {first_token_seconds:.3f} s")

    def _generate(self, job: RouterRequest, context, progresses: list[_StreamProgress] | None = None,
                  mid_stream: bool = False):
        """The client's messages for ``job``. A failure before the first message raises (its status code);
        after it, the stream ends with a last message carrying FINISH_REASON_ERROR, so the text sent is kept.

        A decode worker that fails mid-stream (killed, or lost by the registry) is replaced: the request
        migrates to another decode worker as a continuation (the prompt plus the tokens already streamed,
        :meth:`RouterRequest.continue_after`), at most ``migration_limit`` times, and the client sees one stream.
        With ``n`` completions each has its own progress (messages carry their index): a request that had sent
        nothing yet (a beam search's beams come at its end) migrates whole; otherwise each unfinished completion
        continues on its own (:meth:`_continue_apart`).

        Args:
            progresses: what the client was sent of each completion so far (new ones when None).
            mid_stream: the client was sent messages of this request already (another completion's): a failure
                ends each unfinished completion with a message, never with a status code.
        """
        if progresses is None:
            progresses = [_StreamProgress(index) for index in range(job.num_completions)]
        while True:
            try:
                for message in self.dispatcher.run(job, lambda: _seconds_left(context)):
                    if message.index >= len(progresses):
                        raise ServiceError(f"The decode worker sent completion {message.index} of a request for "
                                           f"{len(progresses)}.")
                    chunk = self._chunk(job, message, progresses[message.index])
                    if chunk is not None:
                        yield chunk
                unfinished = [progress.index for progress in progresses if not progress.finished]
                if not unfinished:
                    return
                raise ServiceError(f"The decode worker ended the stream before completion {unfinished[0]} "
                                   "finished.")
            except RequestCancelled:
                for progress in progresses:
                    if not progress.finished:
                        yield inference_pb2.GenerateStreamResponse(
                            request_id=job.request_id, index=progress.index,
                            finish_reason=inference_pb2.FINISH_REASON_ABORT, usage=_usage_so_far(job, progress),
                            timing=self._timing(job, progress.first_token_time))
                return
            except DecodeStreamFailed as error:
                for progress in progresses:
                    progress.decode_failure = error
                nothing_sent = not any(progress.num_sent_messages for progress in progresses)
                if nothing_sent or (len(progresses) == 1 and job.beam_search is None):
                    if self._migrate(job, error, progresses):
                        continue
                elif job.beam_search is None:
                    yield from self._continue_apart(job, error, progresses, context)
                    return
                failure = error
            except Exception as error:
                failure = error
            if not mid_stream and not any(progress.num_sent_messages for progress in progresses):
                # a status code says what failed
                raise progresses[0].decode_failure or failure
            for progress in progresses:
                if not progress.finished:
                    yield self._failed_mid_stream(job, failure, progress)
            return

    def _continue_apart(self, job: RouterRequest, error: DecodeStreamFailed, progresses: list[_StreamProgress],
                        context):
        """The rest of a request for several completions whose decode worker failed after some were sent: each
        unfinished completion migrates on its own (:meth:`RouterRequest.completion`: its prompt plus its tokens
        sent, on whichever decode worker the policy picks), up to MAX_PARALLEL_CONTINUATIONS at once (a thread
        each, the others queued for them), their messages relayed as they come; one that may not migrate ends with
        FINISH_REASON_ERROR and a sentence."""
        merged: queue.SimpleQueue = queue.SimpleQueue()
        completions: list[tuple[RouterRequest, _StreamProgress]] = []
        for progress in progresses:
            if progress.finished:
                continue
            completion = job.completion(progress.index)
            if self._migrate(completion, error, [progress]):
                completions.append((completion, progress))
            else:
                yield self._failed_mid_stream(job, error, progress)
        if not completions:
            return
        job.num_migrations += 1
        pending = collections.deque(completions)

        def relay() -> None:
            try:
                while True:
                    try:
                        completion, progress = pending.popleft()
                    except IndexError:
                        return
                    try:
                        for chunk in self._generate(completion, context, [progress], mid_stream=True):
                            merged.put(chunk)
                    except Exception as failure:  # unexpected: _generate ends a completion with a message
                        logger.exception("Request %s: completion %d failed", job.request_id, progress.index)
                        merged.put(self._failed_mid_stream(completion, failure, progress))
            finally:
                merged.put(None)

        num_threads = min(len(completions), MAX_PARALLEL_CONTINUATIONS)
        for number in range(num_threads):
            threading.Thread(target=relay, daemon=True, name=f"continuations-{number}").start()
        try:
            for _ in range(num_threads):
                while (chunk := merged.get()) is not None:
                    yield chunk
        finally:  # the client went away: the completions' worker calls end too (queued ones at once)
            for completion, _ in completions:
                completion.cancel()

    def _chunk(self, job: RouterRequest, message: worker_pb2.DecodeResponse,
               progress: _StreamProgress) -> inference_pb2.GenerateStreamResponse | None:
        """The client's message for one decode message (None when it carries nothing); counts what was sent."""
        chunk = inference_pb2.GenerateStreamResponse(
            request_id=job.request_id, text=message.text, token_ids=message.token_ids,
            logprobs=message.logprobs, finish_reason=message.finish_reason,
            error_message=message.error_message, index=progress.index,
        )
        if message.token_ids:
            if progress.first_token_time is None:
                progress.first_token_time = time.monotonic()
            if progress.num_attempt_tokens == 0:
                if message.index == 0:  # the decode worker sampled the others' first token (the n it forked)
                    self._fill_first_logprobs(job, chunk)
                if not progress.sent_token_ids:  # the client's first token: what it asked of the prompt comes with it
                    chunk.prompt_logprobs.extend(message.prompt_logprobs or
                                                 (job.prefill.prompt_logprobs if job.prefill is not None else []))
                    chunk.prompt_text = job.echo_text or ""
                    if job.return_prompt_token_ids:
                        chunk.prompt_token_ids.extend(job.original_prompt.token_ids)
            progress.num_attempt_tokens += len(message.token_ids)
        kind = message.WhichOneof("stop_reason")
        if kind:
            setattr(chunk, kind, getattr(message, kind))
        # Every message counts the client's prompt and the tokens sent so far, its own included (the gateway's
        # continuous usage needs them before the end; after a migration the workers count the continuation, not
        # the client's request). The last message adds the cached tokens.
        chunk.usage.CopyFrom(_usage_so_far(job, progress, len(message.token_ids)))
        if message.finish_reason:
            if job.prefill is not None and not message.kv_recomputed:  # the prefill worker computed the prompt
                chunk.usage.cached_tokens = job.prefill.num_cached_tokens + job.prefill.num_loaded_tokens
                chunk.usage.loaded_tokens = job.prefill.num_loaded_tokens
            else:
                chunk.usage.cached_tokens = message.usage.cached_tokens
                chunk.usage.loaded_tokens = message.usage.loaded_tokens
            chunk.timing.CopyFrom(self._timing(job, progress.first_token_time))
        if not (chunk.text or chunk.token_ids or chunk.finish_reason):
            return None
        progress.finished = bool(chunk.finish_reason)
        progress.num_sent_messages += 1
        progress.sent_token_ids.extend(chunk.token_ids)
        return chunk

    def _migrate(self, job: RouterRequest, error: DecodeStreamFailed, progresses: list[_StreamProgress]) -> bool:
        """Turn ``job`` into its continuation on another decode worker, if it may migrate once more: one
        completion (``progresses[0]``) after its tokens sent, or a request that sent nothing yet whole."""
        if job.aborted or job.num_migrations >= self.migration_limit:
            return False
        max_tokens = sampling_params_from_pb(job.original_sampling_params).max_tokens
        sent_token_ids = progresses[0].sent_token_ids if len(progresses) == 1 else []
        if len(sent_token_ids) >= max_tokens:
            return False
        job.continue_after(sent_token_ids, error.worker_id, max_tokens)
        self.metrics.migrations.inc()
        for progress in progresses:
            progress.num_attempt_tokens = 0
        completion = f" (completion {job.completion_index})" if job.completion_index is not None else ""
        logger.warning("Request %s%s: decode worker %s failed after %d tokens (%s); migrating it (%d of at most %d)",
                       job.request_id, completion, error.worker_id, len(sent_token_ids), error.reason,
                       job.num_migrations, self.migration_limit)
        return True

    def _failed_mid_stream(self, job: RouterRequest, error: Exception,
                           progress: _StreamProgress) -> inference_pb2.GenerateStreamResponse:
        """The last message of a stream that failed after tokens were sent (or after a migration):
        FINISH_REASON_ERROR, a sentence, usage."""
        if not isinstance(error, SplitserveError | grpc.RpcError):
            logger.exception("Request %s failed mid-stream", job.request_id)
        num_sent_tokens = len(progress.sent_token_ids)
        failed = progress.decode_failure
        if failed is not None:
            message = (f"The decode worker {failed.worker_id} failed mid-stream after {num_sent_tokens} tokens: "
                       f"{failed.reason.rstrip('.')}")
            if error is not failed:
                message += f"; no other decode worker could continue the request: {status_of(error)[1].rstrip('.')}"
            elif job.num_migrations:
                plural = "s" if job.num_migrations > 1 else ""
                message += f" (after {job.num_migrations} migration{plural}, the limit)"
        else:
            message = f"The request failed mid-stream after {num_sent_tokens} tokens: {status_of(error)[1].rstrip('.')}"
        message += "; the text so far is complete up to here."
        logger.warning("Request %s: %s", job.request_id, message)
        return inference_pb2.GenerateStreamResponse(
            request_id=job.request_id, index=progress.index, finish_reason=inference_pb2.FINISH_REASON_ERROR,
            error_message=message,
            usage=_usage_so_far(job, progress),
            timing=self._timing(job, progress.first_token_time),
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
            timing.prefix_load_seconds = job.prefill.prefix_load_seconds
        return timing

    # ---- the rest of the API ----------------------------------------------------------------
    # At most MAX_CONCURRENT_SMALL_CALLS of these run at once (the rest: RESOURCE_EXHAUSTED): with generation
    # capped by max_in_flight_requests, the router's gRPC threads always leave some for workers' heartbeats.

    def Abort(self, request: inference_pb2.AbortRequest, context) -> inference_pb2.AbortResponse:
        with self._small_call():
            return self._abort(request)

    def Tokenize(self, request: inference_pb2.TokenizeRequest, context) -> inference_pb2.TokenizeResponse:
        with self._small_call():
            return self._tokenize(request)

    def Detokenize(self, request: inference_pb2.DetokenizeRequest, context) -> inference_pb2.DetokenizeResponse:
        with self._small_call():
            text = self.frontend.detokenize(list(request.token_ids), request.skip_special_tokens)
            return inference_pb2.DetokenizeResponse(text=text)

    def GetModelInfo(self, request, context) -> inference_pb2.GetModelInfoResponse:
        with self._small_call():
            return self._model_info()

    def GetClusterStatus(self, request, context) -> inference_pb2.GetClusterStatusResponse:
        with self._small_call():
            return self._cluster_status()

    @contextlib.contextmanager
    def _small_call(self):
        if not self._small_calls.acquire(blocking=False):
            raise Overloaded(f"The router is answering {MAX_CONCURRENT_SMALL_CALLS} Abort, Tokenize, Detokenize, "
                             "GetModelInfo and GetClusterStatus calls already, its limit; retry later.")
        try:
            yield
        finally:
            self._small_calls.release()

    def _abort(self, request: inference_pb2.AbortRequest) -> inference_pb2.AbortResponse:
        request_id = check_id(request.request_id, "request_id")
        with self._lock:
            job = self._in_flight.get(request_id)
        if job is None:
            return inference_pb2.AbortResponse(found=False)
        job.cancel()
        return inference_pb2.AbortResponse(found=True)

    def _tokenize(self, request: inference_pb2.TokenizeRequest) -> inference_pb2.TokenizeResponse:
        prompt = self.frontend.tokenize(request)  # no length limit: the client compares with max_model_len
        response = inference_pb2.TokenizeResponse(
            token_ids=prompt.token_ids, prompt_text=prompt.text or "", max_model_len=self.frontend.max_model_len
        )
        if request.return_token_strs:
            response.token_strs.extend(self.frontend.token_strings(prompt.token_ids))
        return response

    def _model_info(self) -> inference_pb2.GetModelInfoResponse:
        info = self.frontend.model_info()
        info.kv_block_size = self.block_size
        info.model_fingerprint = self.registry.model_fingerprint or ""
        info.lora_names.extend(self.registry.lora_names())
        info.reasoning_parser = self.registry.reasoning_parser
        return info

    def _lora_name_of(self, request: inference_pb2.GenerateRequest | inference_pb2.EmbedRequest) -> str:
        """The request's LoRA adapter ("" for the base model), served by some registered decode worker."""
        if not request.lora_name:
            return ""
        name = check_lora_name(request.lora_name)
        if name not in self.registry.lora_names():
            raise NotFound(f"No worker serves LoRA adapter {name!r}; GetModelInfo's lora_names lists those served.")
        return name

    def _cluster_status(self) -> inference_pb2.GetClusterStatusResponse:
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
                    num_router_in_flight_requests=worker.num_in_flight,
                )
        return response


_FINISH_LABELS = {inference_pb2.FINISH_REASON_STOP: "stop", inference_pb2.FINISH_REASON_LENGTH: "length",
                  inference_pb2.FINISH_REASON_ABORT: "abort", inference_pb2.FINISH_REASON_ERROR: "error"}


@dataclass
class _StreamProgress:
    """What one client stream (one completion of it: ``index``) has been sent so far, across migrations."""

    index: int = 0
    finished: bool = False  # its last message was sent
    num_sent_messages: int = 0
    sent_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    num_attempt_tokens: int = 0  # tokens relayed from the current decode worker
    decode_failure: DecodeStreamFailed | None = None  # the first decode worker failure, if any


def _span_attributes(job: RouterRequest, finish: inference_pb2.GenerateStreamResponse | None,
                     outcome: tuple[str, str], seconds: float, first_token_seconds: float | None) -> dict:
    """A request's span attributes: vLLM's ``gen_ai.*`` names where it has one, ``splitserve.*`` for the rest
    (counts and times only: never a prompt, a token or a key)."""
    params, usage, timing = job.original_sampling_params, finish.usage if finish else None, finish.timing if finish else None
    return {
        "gen_ai.request.id": job.request_id,
        "gen_ai.request.max_tokens": params.max_tokens if params.HasField("max_tokens") else None,
        "gen_ai.request.temperature": params.temperature if params.HasField("temperature") else None,
        "gen_ai.request.top_p": params.top_p if params.HasField("top_p") else None,
        "gen_ai.usage.prompt_tokens": len(job.original_prompt.token_ids),
        "gen_ai.usage.completion_tokens": usage.completion_tokens if usage is not None else None,
        "gen_ai.response.finish_reasons": [outcome[0]],
        "gen_ai.latency.time_in_queue": timing.queue_seconds if timing is not None else None,
        "gen_ai.latency.time_to_first_token": first_token_seconds,
        "gen_ai.latency.e2e": seconds,
        "rpc.grpc.status_code": outcome[1],
        "splitserve.cached_tokens": usage.cached_tokens if usage is not None else None,
        "splitserve.loaded_tokens": usage.loaded_tokens if usage is not None else None,
        "splitserve.kv_transfer_seconds": timing.kv_transfer_seconds if timing is not None else None,
        "splitserve.prefix_load_seconds": timing.prefix_load_seconds if timing is not None else None,
        "splitserve.prefilled_remotely": job.prefilled_remotely,
        "splitserve.migrations": job.num_migrations,
        "splitserve.lora_name": job.lora_name or None,
    }


def _embedding_span_attributes(job: RouterRequest, answer: worker_pb2.EmbedPromptResponse | None, code: str) -> dict:
    """An embedding request's span attributes (OpenTelemetry's ``gen_ai.operation.name`` "embeddings"): counts and
    times, never the prompt or the vector."""
    return {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.request.id": job.request_id,
        "gen_ai.usage.prompt_tokens": len(job.prompt.token_ids),
        "gen_ai.latency.e2e": time.monotonic() - job.accepted,
        "rpc.grpc.status_code": code,
        "splitserve.cached_tokens": answer.cached_tokens if answer is not None else None,
        "splitserve.lora_name": job.lora_name or None,
    }


def _usage_so_far(job: RouterRequest, progress: _StreamProgress, num_new_tokens: int = 0) -> inference_pb2.Usage:
    """The client's prompt tokens and the tokens it was sent, with ``num_new_tokens`` about to be."""
    return inference_pb2.Usage(prompt_tokens=len(job.original_prompt.token_ids),
                               completion_tokens=len(progress.sent_token_ids) + num_new_tokens)


def _worker_embed_request(job: RouterRequest, request: inference_pb2.EmbedRequest) -> worker_pb2.EmbedPromptRequest:
    """The worker's request for an admitted EmbedRequest (its request_id set per attempt by the dispatcher)."""
    worker_request = worker_pb2.EmbedPromptRequest(prompt_token_ids=job.prompt.token_ids,
                                                   dimensions=request.dimensions, lora_name=job.lora_name,
                                                   cache_salt=job.cache_salt, priority=job.priority)
    if request.HasField("normalize"):
        worker_request.normalize = request.normalize
    return worker_request


def _seconds_left(context: grpc.ServicerContext) -> float | None:
    """Seconds before the client's deadline, None without one (gRPC reports "no deadline" as a huge number)."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 10**7:
        return None
    return max(remaining, 0.001)
