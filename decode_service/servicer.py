"""gRPC DecodeWorker: the engine in the decode role.

A ``Decode`` call creates the request; with remote KV the servicer announces
its transfer to the worker's :class:`KVReceiver` (the engine's KV connector; :class:`LMCacheReceiver`,
which loads the prompt's KV from LMCache, with ``--kv-transfer lmcache``),
the engine reserves the prompt's blocks and the request waits in
``WAITING_FOR_REMOTE_KVS`` (the first message says so) until the receiver
reports the KV in place; then it is batched with every running sequence and
its tokens stream back in chunks. Late or refused KV is recomputed or fails the
request, as the request's failure policy says (the engine applies it).

An ``Embed`` call computes its prompt here as an embedding request of the engine
(``engine/pooling.py``), in the same steps as the running requests, and returns
its embedding; a caller that goes away (or its deadline) aborts it in the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading

import grpc

from splitserve.common.errors import Cancelled, InvalidRequest, Unavailable
from splitserve.common.ids import MAX_WORKER_ID_LENGTH, check_id
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.types import FinishReason
from splitserve.decode_service.beam_search import LoopBeamSteps
from splitserve.decode_service.lmcache_receiver import LMCacheReceiver
from splitserve.decode_service.receiver import KVReceiver
from splitserve.engine.beam_search import BeamSearchParams, beam_candidates, beam_search
from splitserve.engine.kv_connector import KVLoadFailurePolicy, KVLoadOutcome, KVTransferParams
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.pooling import PoolingParams
from splitserve.rpc.convert import (
    FINISH_REASONS,
    beam_search_from_pb,
    cache_salt_from_pb,
    position_logprobs_to_pb,
    prompt_logprobs_to_pb,
    sampling_params_from_pb,
    set_stop_reason,
)
from splitserve.rpc.errors import ServiceError
from splitserve.rpc.worker import WorkerRuntime, wait_accepted
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# A beam search's prompt: one token (greedy, unused: the first step forks the prompt's KV for its candidates' log
# probabilities), its blocks held.
_BEAM_ROOT_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)



class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Serves one decode worker's engine (role "decode", or "both" for colocated serving)."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self._active: set[str] = set()  # request ids in flight here
        self._beams: dict[str, LoopBeamSteps] = {}  # the beam searches in flight here, by request id
        self._lock = threading.Lock()

    @property
    def receiver(self) -> KVReceiver | LMCacheReceiver | None:
        """The engine's KV connector (built when the runtime starts; LMCacheReceiver with --kv-transfer lmcache;
        None colocated: it receives no KV)."""
        return self.runtime.kv_connector

    # ---- RPCs ----------------------------------------------------------------------

    def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext):
        remote = not request.prefill_locally
        check_id(request.request_id, "request_id", MAX_WORKER_ID_LENGTH)
        if remote and not request.transfer_id:
            raise InvalidRequest("transfer_id is required unless prefill_locally is set.")
        if request.transfer_id:
            check_id(request.transfer_id, "transfer_id", MAX_WORKER_ID_LENGTH)
        if remote and self.receiver is None:
            raise InvalidRequest(f"Worker {self.runtime.worker_id} is colocated (role both) and receives no KV: "
                                  "set prefill_locally.")
        params = sampling_params_from_pb(request.sampling_params)
        beam = beam_search_from_pb(request.beam_search, params) if request.HasField("beam_search") else None
        self.runtime.admit()
        span, last, error = self.runtime.start_span("decode", context), None, None
        try:
            for message in self._decode(request, params, remote, context, beam):
                last = message
                yield message
        except BaseException as failure:
            error = failure
            raise
        finally:
            self.runtime.release()
            self.runtime.end_span(span, _span_attributes(request, last), error)

    def _decode(self, request, params, remote: bool, context, beam: BeamSearchParams | None = None):
        request_id = request.request_id
        with self._tracked(request_id):
            if beam is None:
                yield from self._decode_tracked(request, params, remote, context)
            else:
                yield from self._beam_search_tracked(request, beam, remote, context)

    def _decode_tracked(self, request, params, remote: bool, context):
        request_id = request.request_id
        completed = False
        try:
            stream, accepted = self._submit(request, params, remote)
            # From here on a client that goes away (or its deadline) aborts the request.
            if not context.add_callback(lambda: self._abort(request_id)):
                return  # already cancelled: the finally clause aborts it
            state = worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS if remote else worker_pb2.REQUEST_STATE_WAITING
            yield worker_pb2.DecodeResponse(request_id=request_id, state=state,
                                            num_cached_prompt_tokens=accepted.num_cached_tokens if remote else 0)
            yield from self._relay(stream, params)
            completed = True
        finally:
            if not completed:  # refused after acceptance, cancelled, or the stream closed early: free its blocks
                self._abort(request_id)

    @contextlib.contextmanager
    def _tracked(self, request_id: str):
        """Count ``request_id`` in flight here while the block runs (so Abort and the call's cancellation find
        it); raises InvalidRequest when it already is."""
        with self._lock:
            if request_id in self._active:
                raise InvalidRequest(f"Request id {request_id!r} is already in flight on this worker.")
            self._active.add(request_id)
        try:
            yield
        finally:
            with self._lock:
                self._active.discard(request_id)

    def _submit(self, request, params, remote: bool, keep_kv: bool = False):
        """Announce the request's transfer (remote KV) and hand the request to the engine (``keep_kv``: its blocks
        held when it finishes, for forks)."""
        request_id, prompt = request.request_id, list(request.prompt_token_ids)
        lora, salt = self.runtime.lora_request(request.lora_name), cache_salt_from_pb(request)
        if not remote:
            self.runtime.counters.add(num_local_prefills=1)
            stream = self.loop.submit(request_id, None, params, prompt, priority=request.priority, lora_request=lora,
                                      cache_salt=salt, keep_kv=keep_kv)
            return stream, wait_accepted(stream)
        config = self.runtime.config
        timeout = request.kv_timeout_seconds if request.HasField("kv_timeout_seconds") else config.kv_timeout_seconds
        if not (math.isfinite(timeout) and timeout > 0):
            raise InvalidRequest(f"kv_timeout_seconds must be a positive, finite number of seconds, not {timeout}.")
        fail = (request.on_kv_failure == worker_pb2.KV_FAILURE_POLICY_FAIL or
                (request.on_kv_failure == worker_pb2.KV_FAILURE_POLICY_UNSPECIFIED and config.kv_load_failure == "fail"))
        policy = KVLoadFailurePolicy.FAIL if fail else KVLoadFailurePolicy.RECOMPUTE
        self.receiver.expect(request_id, request.transfer_id, len(prompt), timeout, _endpoint_or_none(request),
                              prompt_token_ids=prompt, lora_request=lora, cache_salt=salt)
        try:
            stream = self.loop.submit(request_id, None, params, prompt, priority=request.priority,
                                      kv_transfer=KVTransferParams(load=True, on_load_failure=policy),
                                      lora_request=lora, cache_salt=salt, keep_kv=keep_kv)
            return stream, wait_accepted(stream)
        except BaseException:
            self.receiver.discard(request_id)  # refused (no room, bad prompt): nothing will be loaded
            raise

    def _relay(self, stream, params: SamplingParams):
        """Token chunks from the engine: what is ready is sent as one message for each completion it is of (one,
        unless the request asks for n).

        The first token of a remote prefill (carried with its KV) is streamed
        here like every other, so the stream is whole whether the prompt's KV
        arrived or was recomputed.
        """
        unfinished = stream.num_completions
        while unfinished:
            outputs = [stream.get()]
            while (ready := stream.get_nowait()) is not None:
                outputs.append(ready)
            by_index: dict[int, list[RequestOutput]] = {}
            for output in outputs:
                by_index.setdefault(output.outputs[0].index, []).append(output)
            for index, completion_outputs in by_index.items():
                yield self._message(stream.request_id, index, completion_outputs, params)
                unfinished -= completion_outputs[-1].finished

    def _message(self, request_id: str, index: int, outputs: list[RequestOutput], params: SamplingParams):
        """The message of one completion's outputs (all of one completion, in order)."""
        last = outputs[-1]
        num_logprobs = params.logprobs
        completion = last.outputs[0]
        token_ids = [token for output in outputs for token in output.outputs[0].delta_token_ids]
        message = worker_pb2.DecodeResponse(
            request_id=request_id, index=index,
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
        if last.prompt_logprobs is not None and token_ids and len(token_ids) == len(completion.token_ids):
            message.prompt_logprobs.extend(prompt_logprobs_to_pb(
                last.prompt_logprobs, last.prompt_ranks, last.prompt_token_ids, params.prompt_logprobs,
                self._decode_token))
        if last.finished:
            message.finish_reason = FINISH_REASONS[completion.finish_reason]
            set_stop_reason(message, completion.stop_reason, completion.finish_reason)
            if completion.finish_reason == FinishReason.ERROR:
                message.error_message = str(completion.stop_reason)
            message.usage.completion_tokens = len(completion.token_ids)
            self._finished(last, message)
        return message

    def _finished(self, last: RequestOutput, message: worker_pb2.DecodeResponse) -> None:
        """A finished request's prompt counts, preemptions and KV load on its last message, and in the metrics."""
        message.usage.prompt_tokens = len(last.prompt_token_ids)
        message.usage.cached_tokens = last.num_cached_tokens
        message.num_preemptions = last.metrics.num_preemptions
        outcome = last.metrics.kv_load_outcome
        if outcome is not None:
            message.kv_recomputed = outcome == KVLoadOutcome.RECOMPUTED
            message.kv_wait_seconds = last.metrics.kv_load_seconds
            if message.kv_recomputed:
                self.runtime.counters.add(num_kv_recomputes=1)
            self.runtime.metrics.observe_transfer("receive", None if message.kv_recomputed
                                                  else message.kv_wait_seconds)
        if outcome is None or message.kv_recomputed:  # this worker computed the prompt
            self.runtime.metrics.observe_prompt(message.usage.prompt_tokens, message.usage.cached_tokens)

    # ---- beam search ----------------------------------------------------------------

    def _beam_search_tracked(self, request, beam: BeamSearchParams, remote: bool, context):
        """The prompt as a one-token request holding its KV (received, or computed here), then the search
        (``decode_service/beam_search.py``); a message for each beam, best first, once it ends."""
        request_id, prompt, engine = request.request_id, list(request.prompt_token_ids), self.runtime.engine
        beam = dataclasses.replace(beam, max_tokens=max(1, min(beam.max_tokens, engine.max_model_len - len(prompt))))
        eos_token_ids = engine.eos_token_ids
        options = {"priority": request.priority, "lora_request": self.runtime.lora_request(request.lora_name),
                   "cache_salt": cache_salt_from_pb(request)}
        steps = LoopBeamSteps(self.loop, request_id, request_id, prompt,
                              beam_candidates(beam.beam_width, eos_token_ids), options)
        completed = False
        try:
            stream, accepted = self._submit(request, _BEAM_ROOT_PARAMS, remote, keep_kv=True)
            with self._lock:
                self._beams[request_id] = steps
            if not context.add_callback(lambda: self._abort(request_id)):
                return  # already cancelled: the finally clause aborts it
            state = worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS if remote else worker_pb2.REQUEST_STATE_WAITING
            yield worker_pb2.DecodeResponse(request_id=request_id, state=state,
                                            num_cached_prompt_tokens=accepted.num_cached_tokens if remote else 0)
            root = list(stream)[-1]
            summary = worker_pb2.DecodeResponse()  # the prompt's counts and KV load, counted once
            self._finished(root, summary)
            failure = root.outputs[0]
            if failure.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):  # its KV failed, or aborted
                for index in range(beam.beam_width):
                    message = worker_pb2.DecodeResponse(
                        request_id=request_id, index=index, state=worker_pb2.REQUEST_STATE_FINISHED,
                        finish_reason=FINISH_REASONS[failure.finish_reason],
                        error_message=str(failure.stop_reason) if failure.finish_reason == FinishReason.ERROR else "")
                    message.MergeFrom(summary)
                    yield message
                completed = True
                return
            tokenizer = engine.tokenizer
            [output] = beam_search([prompt], beam, steps, eos_token_ids,
                                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
            ends = frozenset() if beam.ignore_eos else frozenset(eos_token_ids)
            num_logprobs = request.sampling_params.logprobs if request.sampling_params.HasField("logprobs") else None
            for index, sequence in enumerate(output.sequences):
                token_ids = sequence.tokens[len(prompt):]
                ended = bool(token_ids) and token_ids[-1] in ends
                message = worker_pb2.DecodeResponse(
                    request_id=request_id, index=index, state=worker_pb2.REQUEST_STATE_FINISHED, text=sequence.text,
                    token_ids=token_ids,
                    finish_reason=inference_pb2.FINISH_REASON_STOP if ended else inference_pb2.FINISH_REASON_LENGTH)
                if num_logprobs is not None:  # each token's, and the best of the candidates its step scored
                    message.logprobs.extend(position_logprobs_to_pb(logprobs, token, num_logprobs, self._decode_token)
                                            for logprobs, token in zip(sequence.logprobs, token_ids))
                message.usage.completion_tokens = len(token_ids)
                message.MergeFrom(summary)
                yield message
            completed = True
        finally:
            steps.release()
            with self._lock:
                self._beams.pop(request_id, None)
            if not completed:
                self._abort(request_id)

    # ---- embeddings ------------------------------------------------------------------

    def Embed(self, request: worker_pb2.EmbedPromptRequest, context) -> worker_pb2.EmbedPromptResponse:
        request_id = check_id(request.request_id, "request_id", MAX_WORKER_ID_LENGTH)
        pooling = _pooling_params_of(request)
        pooling.check(self.runtime.engine.model_config.hidden_size)
        lora, salt = self.runtime.lora_request(request.lora_name), cache_salt_from_pb(request)
        self.runtime.admit()
        span, output, error = self.runtime.start_span("embed", context), None, None
        try:
            with self._tracked(request_id):
                output = self._embed(request_id, list(request.prompt_token_ids), pooling, lora, salt, request.priority,
                                     context)
        except BaseException as failure:
            error = failure
            raise
        finally:
            self.runtime.release()
            self.runtime.end_span(span, {"gen_ai.request.id": request_id,
                                         "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
                                         "splitserve.cached_tokens": output.num_cached_tokens if output else None},
                                  error)
        if output is None:  # cancelled: the caller is gone and reads no answer
            return worker_pb2.EmbedPromptResponse(request_id=request_id)
        self.runtime.metrics.observe_prompt(len(output.prompt_token_ids), output.num_cached_tokens)
        return worker_pb2.EmbedPromptResponse(request_id=request_id, embedding=output.embedding,
                                              prompt_tokens=len(output.prompt_token_ids),
                                              cached_tokens=output.num_cached_tokens)

    def _embed(self, request_id: str, prompt: list[int], pooling: PoolingParams, lora, salt: str | None,
               priority: int, context) -> RequestOutput | None:
        """The finished output of the embedding request, its embedding set; None when the call was cancelled
        (the request aborted in the engine, its blocks freed).

        Raises:
            InvalidRequest: the engine refused the prompt.
            Unavailable: the engine loop did not take it, or stopped before it finished (the worker stops).
            Cancelled: DecodeWorker.Abort aborted it.
            ServiceError: the engine failed the request (a broken step): INTERNAL.
        """
        completed = False
        try:
            stream = self.loop.submit(request_id, None, SamplingParams(max_tokens=1), prompt, priority=priority,
                                      lora_request=lora, pooling_params=pooling, cache_salt=salt)
            wait_accepted(stream)
            if not context.add_callback(lambda: self._abort(request_id)):
                return None  # already cancelled: the finally clause aborts it
            output = stream.get()
            while not output.finished:
                output = stream.get()
            completed = True
        finally:
            if not completed:
                self._abort(request_id)
        if output.embedding is not None:
            return output
        if not context.is_active():
            return None
        if output.outputs[0].finish_reason == FinishReason.ABORT:
            if self.runtime.state != inference_pb2.WORKER_STATE_SERVING:
                raise Unavailable(f"Worker {self.runtime.worker_id} is stopping: the embedding request was aborted.")
            raise Cancelled(f"The embedding request {request_id} was aborted on worker {self.runtime.worker_id}.")
        raise ServiceError(f"The engine failed the embedding request: {output.outputs[0].stop_reason}")

    def _decode_token(self, token_id: int) -> str:
        return self.runtime.engine.tokenizer.decode([token_id])

    def _abort(self, request_id: str) -> bool:
        """Abort at the engine's next step boundary (a beam search's step under way too); the engine closes the
        transfer before it frees the blocks."""
        with self._lock:
            if request_id not in self._active:
                return False
            steps = self._beams.get(request_id)
        self.loop.abort(request_id)
        if steps is not None:
            steps.cancel()
        return True

    def Abort(self, request: worker_pb2.AbortDecodeRequest, context) -> worker_pb2.AbortDecodeResponse:
        check_id(request.request_id, "request_id", MAX_WORKER_ID_LENGTH)
        return worker_pb2.AbortDecodeResponse(found=self._abort(request.request_id))

    def GetStatus(self, request, context) -> worker_pb2.GetWorkerStatusResponse:
        return self.runtime.status_pb()


def _pooling_params_of(request: worker_pb2.EmbedPromptRequest) -> PoolingParams:
    """The engine's PoolingParams of an EmbedPromptRequest: normalize unset is true, dimensions 0 all of them."""
    return PoolingParams(normalize=request.normalize if request.HasField("normalize") else True,
                         dimensions=request.dimensions or None)


def _endpoint_or_none(request: worker_pb2.DecodeRequest):
    if not request.HasField("source"):
        return None
    from splitserve.kvtransfer.connector import KVEndpointInfo

    return KVEndpointInfo.from_pb(request.source)


def _span_attributes(request: worker_pb2.DecodeRequest, last: worker_pb2.DecodeResponse | None) -> dict:
    """A decode call's span attributes (``splitserve.rpc.tracing``), read off its last message: counts and
    times, never a token."""
    attributes = {"gen_ai.request.id": request.request_id, "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
                  "splitserve.prefill_locally": request.prefill_locally}
    if last is not None and last.finish_reason:
        attributes.update({
            "gen_ai.usage.completion_tokens": last.usage.completion_tokens,
            "gen_ai.response.finish_reasons": [
                inference_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()],
            "splitserve.cached_tokens": last.usage.cached_tokens,
            "splitserve.kv_wait_seconds": last.kv_wait_seconds,
            "splitserve.kv_recomputed": last.kv_recomputed,
            "splitserve.preemptions": last.num_preemptions,
        })
    return attributes
