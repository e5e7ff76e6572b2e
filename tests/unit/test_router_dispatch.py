"""The dispatcher's in-flight bookkeeping over fake worker calls (no processes, no sockets).

Every exit of a request, finished, failed, cancelled or timed out at any point
(during the decode acknowledgement, the prefill, or the relay), releases each
worker's in-flight count exactly once.
"""

from __future__ import annotations

import grpc
import pytest

from splitserve.common.errors import Overloaded, Unavailable
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.types import WorkerRole, WorkerState
from splitserve.router.config import RouterConfig
from splitserve.router.dispatch import DecodeStreamFailed, Dispatcher, RequestCancelled, RouterRequest
from splitserve.router.frontend import Prompt
from splitserve.router.policies import PrefixAware, RoundRobin
from splitserve.router.registry import WorkerRegistry
from splitserve.router.servicer import InferenceServicer
from splitserve.rpc.convert import sampling_params_from_pb
from splitserve.rpc.errors import ServiceError
from splitserve.v1 import inference_pb2, worker_pb2

PREFILL, DECODE = WorkerRole.PREFILL, WorkerRole.DECODE


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeDecodeCall:
    """A Decode stream: the acknowledgement, then ``messages``; ``error`` raised after them."""

    def __init__(self, messages, error: Exception | None = None, ack_error: Exception | None = None) -> None:
        self._messages = [worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS),
                          *messages]
        self._error, self._ack_error = error, ack_error
        self.num_cancels = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._ack_error is not None:
            raise self._ack_error
        if self._messages:
            return self._messages.pop(0)
        if self._error is not None:
            raise self._error
        raise StopIteration

    def cancel(self) -> None:
        self.num_cancels += 1


class FakePrefillFuture:
    def __init__(self, outcome) -> None:
        self._outcome = outcome

    def result(self):
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        if callable(self._outcome):
            return self._outcome()
        return self._outcome

    def cancel(self) -> None:
        pass


class FakeChannels:
    """Stubs whose calls return the fakes queued per worker address."""

    def __init__(self) -> None:
        self.decode_calls: list[FakeDecodeCall] = []
        self.prefill_outcomes: list = []
        self.decode_requests: list[tuple[str, worker_pb2.DecodeRequest]] = []  # (address, request) per call
        self.metadata: list = []  # each worker call's metadata, in order

    def decode(self, address: str):
        calls, requests, metadata_seen = self.decode_calls, self.decode_requests, self.metadata

        class Stub:
            @staticmethod
            def Decode(request, timeout=None, metadata=None):
                requests.append((address, request))
                metadata_seen.append(metadata)
                return calls.pop(0)

        return Stub()

    def prefill(self, address: str):
        outcomes, metadata_seen = self.prefill_outcomes, self.metadata

        class Prefill:
            @staticmethod
            def future(request, timeout=None, metadata=None):
                metadata_seen.append(metadata)
                return FakePrefillFuture(outcomes.pop(0))

        class Stub:
            pass

        stub = Stub()
        stub.Prefill = Prefill
        return stub


FINISHED = worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_FINISHED, token_ids=[7],
                                     finish_reason=inference_pb2.FINISH_REASON_LENGTH)


@pytest.fixture
def cluster():
    registry = WorkerRegistry(model_fingerprint="m")
    registry.add_static(PREFILL, "p:1", worker_id="prefill-1", kv_endpoint=worker_pb2.KVEndpoint(address="p:2"))
    registry.add_static(DECODE, "d:1", worker_id="decode-1", kv_endpoint=worker_pb2.KVEndpoint(address="d:2"))
    channels = FakeChannels()
    dispatcher = Dispatcher(RouterConfig(prefill_attempts=1), registry, RoundRobin(), RoundRobin(), channels)
    return dispatcher, registry, channels


def job() -> RouterRequest:
    return RouterRequest("r1", Prompt(list(range(40)), None), inference_pb2.SamplingParams())


def in_flight(registry: WorkerRegistry) -> dict[str, int]:
    return {worker_id: registry.get(worker_id).num_in_flight for worker_id in ("prefill-1", "decode-1")}


def test_a_finished_request_releases_both_workers(cluster):
    dispatcher, registry, channels = cluster
    call = FakeDecodeCall([FINISHED])
    channels.decode_calls.append(call)
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=7))
    assert list(dispatcher.run(job(), lambda: None)) == [FINISHED]
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_a_request_cancelled_during_its_prefill_releases_the_decode_worker(cluster):
    dispatcher, registry, channels = cluster
    call = FakeDecodeCall([FINISHED])
    channels.decode_calls.append(call)
    request = job()

    def cancelled_while_prefilling():
        request.cancel()  # the client went away: the future is cancelled
        raise grpc.FutureCancelledError()

    channels.prefill_outcomes.append(cancelled_while_prefilling)
    with pytest.raises(RequestCancelled):
        list(dispatcher.run(request, lambda: None))
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}
    assert call.num_cancels >= 1  # the decode stream (and its reserved blocks) is dropped too


def test_a_prefill_past_the_deadline_releases_the_decode_worker(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall([FINISHED]))
    channels.prefill_outcomes.append(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    with pytest.raises(ServiceError):
        list(dispatcher.run(job(), lambda: None))
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_an_aborted_prefill_error_releases_the_decode_worker(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall([FINISHED]))
    request = job()

    def aborted():
        request.cancel()
        raise FakeRpcError(grpc.StatusCode.CANCELLED, "Cancelled")

    channels.prefill_outcomes.append(aborted)
    with pytest.raises(RequestCancelled):
        list(dispatcher.run(request, lambda: None))
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_a_failed_prefill_retry_releases_each_decode_attempt_once(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls += [FakeDecodeCall([]), FakeDecodeCall([FINISHED])]
    channels.prefill_outcomes.append(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert list(dispatcher.run(job(), lambda: None)) == [FINISHED]
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_a_refused_or_failed_decode_stream_releases_it_once(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall([], ack_error=FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)))
    with pytest.raises(Overloaded):
        list(dispatcher.run(job(), lambda: None))
    assert in_flight(registry)["decode-1"] == 0

    channels.decode_calls.append(FakeDecodeCall([], error=FakeRpcError(grpc.StatusCode.INTERNAL, "boom")))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=7))
    with pytest.raises(ServiceError):
        list(dispatcher.run(job(), lambda: None))
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_a_relay_closed_early_releases_the_decode_worker(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall([FINISHED, FINISHED]))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=7))
    messages = dispatcher.run(job(), lambda: None)
    next(messages)
    assert in_flight(registry)["decode-1"] == 1
    messages.close()  # the client went away mid-stream
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


# ---- what the client sees: InferenceServicer over the same fakes ------------------------------------------------

MID_STREAM = [worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_RUNNING, token_ids=[5, 6], text="ab"),
              worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_RUNNING, token_ids=[7], text="c")]


class FakeContext:
    def add_callback(self, callback) -> None:
        pass

    def time_remaining(self):
        return None


class FakeFrontend:
    def prompt_of(self, request, params=None) -> Prompt:
        token_ids = list(range(40))
        return Prompt(params.truncated(token_ids, 64) if params is not None else token_ids, None)

    def sampling_params_of(self, request) -> SamplingParams:
        return sampling_params_from_pb(request.sampling_params)


def servicer_of(dispatcher, registry, migration_limit: int = 3) -> InferenceServicer:
    return InferenceServicer(FakeFrontend(), dispatcher, registry, max_in_flight_requests=4, block_size=16,
                             migration_limit=migration_limit)


def test_the_router_spans_trace_context_goes_with_both_worker_calls(cluster):
    """A traced request (``job.trace_metadata``, the router span's context) sends it with the prefill and the
    decode call, so the workers' spans are its children; an untraced one sends no metadata of its own."""
    dispatcher, registry, channels = cluster
    traced = job()
    traced.trace_metadata = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),)
    for request in (traced, job()):
        channels.decode_calls.append(FakeDecodeCall([FINISHED]))
        channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=7))
        assert list(servicer_of(dispatcher, registry)._generate(request, FakeContext()))[-1].finish_reason
    assert channels.metadata == [traced.trace_metadata] * 2 + [None] * 2


def test_a_decode_worker_failing_after_tokens_ends_the_stream_with_an_error_message(cluster):
    """Without migration (limit 0) the stream ends with a last FINISH_REASON_ERROR message."""
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall(MID_STREAM, error=FakeRpcError(grpc.StatusCode.UNAVAILABLE,
                                                                                "Socket closed")))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=5))
    chunks = list(servicer_of(dispatcher, registry, migration_limit=0)._generate(job(), FakeContext()))
    assert [list(c.token_ids) for c in chunks] == [[5, 6], [7], []]
    last = chunks[-1]
    assert last.finish_reason == inference_pb2.FINISH_REASON_ERROR
    assert last.error_message == ("The decode worker decode-1 failed mid-stream after 3 tokens: UNAVAILABLE: "
                                  "Socket closed; the text so far is complete up to here.")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 3)
    assert [c.usage.completion_tokens for c in chunks] == [2, 3, 3]
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_with_no_other_decode_worker_a_failed_stream_ends_with_an_error_message(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall(MID_STREAM, error=FakeRpcError(grpc.StatusCode.UNAVAILABLE,
                                                                                "Socket closed")))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=5))
    chunks = list(servicer_of(dispatcher, registry)._generate(job(), FakeContext()))
    assert [list(c.token_ids) for c in chunks] == [[5, 6], [7], []]
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_ERROR
    assert chunks[-1].error_message == (
        "The decode worker decode-1 failed mid-stream after 3 tokens: UNAVAILABLE: Socket closed; no other decode "
        "worker could continue the request: No decode worker could take the request (tried decode-1); the text so "
        "far is complete up to here.")
    assert len(channels.decode_requests) == 1
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}


def test_a_stream_whose_decode_worker_fails_migrates_to_another_one(cluster):
    """The continuation carries the prompt plus the tokens streamed; the client sees one stream."""
    dispatcher, registry, channels = cluster
    registry.add_static(DECODE, "d:3", worker_id="decode-2", kv_endpoint=worker_pb2.KVEndpoint(address="d:4"))
    channels.decode_calls.append(FakeDecodeCall(MID_STREAM, error=FakeRpcError(grpc.StatusCode.UNAVAILABLE,
                                                                                "Socket closed")))
    finished = worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_FINISHED, token_ids=[9],
                                         finish_reason=inference_pb2.FINISH_REASON_LENGTH,
                                         usage=inference_pb2.Usage(prompt_tokens=43, completion_tokens=2))
    channels.decode_calls.append(FakeDecodeCall([
        worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_RUNNING, token_ids=[8], text="d"), finished]))
    channels.prefill_outcomes += [worker_pb2.PrefillResponse(first_token_id=5),
                                  worker_pb2.PrefillResponse(first_token_id=8)]
    params = inference_pb2.SamplingParams(max_tokens=5, min_tokens=4, temperature=0.0,
                                          structured_outputs=inference_pb2.StructuredOutputs(regex="[a-z]+"))
    request = RouterRequest("r1", Prompt(list(range(40)), None), params)
    chunks = list(servicer_of(dispatcher, registry)._generate(request, FakeContext()))
    assert [list(c.token_ids) for c in chunks] == [[5, 6], [7], [8], [9]]
    assert "".join(c.text for c in chunks) == "abcd"
    last = chunks[-1]
    assert (last.finish_reason, last.error_message) == (inference_pb2.FINISH_REASON_LENGTH, "")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 5)
    # Every message counts the client's prompt and the tokens sent so far, across the migration (continuous usage).
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks] == [(40, 2), (40, 3), (40, 4), (40, 5)]
    [(first_address, first), (second_address, second)] = channels.decode_requests
    assert (first_address, second_address) == ("d:1", "d:3")  # the failed worker is not chosen again
    assert list(second.prompt_token_ids) == [*range(40), 5, 6, 7]
    assert (second.sampling_params.max_tokens, second.sampling_params.min_tokens) == (2, 1)
    # Penalties and bad words count the three as generated tokens (the continuation's resumed tokens).
    assert (first.sampling_params.num_resumed_tokens, second.sampling_params.num_resumed_tokens) == (0, 3)
    # The grammar takes the three tokens sent before it samples: they end the continuation's prompt.
    assert first.sampling_params.structured_outputs.num_resumed_tokens == 0
    assert second.sampling_params.structured_outputs == inference_pb2.StructuredOutputs(regex="[a-z]+",
                                                                                       num_resumed_tokens=3)
    assert second.sampling_params.temperature == 0.0 and first.request_id != second.request_id
    assert request.num_migrations == 1 and request.original_prompt.token_ids == list(range(40))
    assert {w: registry.get(w).num_in_flight for w in ("prefill-1", "decode-1", "decode-2")} == {
        "prefill-1": 0, "decode-1": 0, "decode-2": 0}


def decode_only(channels: FakeChannels) -> tuple[Dispatcher, WorkerRegistry]:
    """Two decode workers and no prefill worker (each decode worker prefills locally: no prefill futures)."""
    registry = WorkerRegistry(model_fingerprint="m")
    for index in (1, 2):
        registry.add_static(DECODE, f"d:{index}", worker_id=f"decode-{index}",
                            kv_endpoint=worker_pb2.KVEndpoint(address=f"d:{index}0"))
    return Dispatcher(RouterConfig(), registry, RoundRobin(), RoundRobin(), channels), registry


def running(index: int, *token_ids: int) -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_RUNNING, token_ids=token_ids, index=index)


def test_n_completions_whose_decode_worker_fails_migrate_one_by_one(cluster):
    """A request for 3 seeded completions whose decode worker fails after completion 2 finished: completions 0 and
    1 each continue as a request for one (the prompt plus its own tokens sent, its seed + index), on the other
    decode worker; the client's stream goes on under their indexes."""
    channels = FakeChannels()
    dispatcher, registry = decode_only(channels)
    done = worker_pb2.DecodeResponse(state=worker_pb2.REQUEST_STATE_FINISHED, token_ids=[2],
                                     finish_reason=inference_pb2.FINISH_REASON_STOP, index=2)
    channels.decode_calls.append(FakeDecodeCall([running(0, 5, 6), running(1, 7), done],
                                                error=FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")))
    for _ in range(2):  # the continuations: one more token each
        channels.decode_calls.append(FakeDecodeCall([FINISHED]))
    params = inference_pb2.SamplingParams(n=3, seed=2**63 - 1, max_tokens=6, temperature=0.7)
    request = RouterRequest("r1", Prompt(list(range(40)), None), params)
    chunks = list(servicer_of(dispatcher, registry)._generate(request, FakeContext()))
    sent = {index: [t for c in chunks if c.index == index for t in c.token_ids] for index in range(3)}
    assert sent == {0: [5, 6, 7], 1: [7, 7], 2: [2]}
    last = {c.index: c for c in chunks if c.finish_reason}
    assert {index: (c.finish_reason, c.usage.completion_tokens) for index, c in last.items()} == {
        0: (inference_pb2.FINISH_REASON_LENGTH, 3), 1: (inference_pb2.FINISH_REASON_LENGTH, 2),
        2: (inference_pb2.FINISH_REASON_STOP, 1)}
    first, *continuations = channels.decode_requests
    assert first[0] == "d:1" and first[1].sampling_params.n == 3
    by_seed = sorted(continuations, key=lambda call: call[1].sampling_params.seed)
    # Completion 1's seed wraps past 2**63 - 1 as the decode worker's did (signed 64 bits); completion 0's is kept.
    assert [call[1].sampling_params.seed for call in by_seed] == [-(2**63), 2**63 - 1]
    assert [list(call[1].prompt_token_ids[40:]) for call in by_seed] == [[7], [5, 6]]
    for address, continuation in continuations:
        assert address == "d:2" and not continuation.sampling_params.HasField("n")
        resumed = len(continuation.prompt_token_ids) - 40
        assert (continuation.sampling_params.num_resumed_tokens, continuation.sampling_params.max_tokens) == (
            resumed, 6 - resumed)
    assert request.num_migrations == 1
    assert {w: registry.get(w).num_in_flight for w in ("decode-1", "decode-2")} == {"decode-1": 0, "decode-2": 0}


def test_more_completions_than_continuation_threads_all_continue(cluster):
    """12 completions whose decode worker fails after each sent a token: 8 continue at once, the other 4 after
    them; every one ends with its own two tokens."""
    channels = FakeChannels()
    dispatcher, registry = decode_only(channels)
    channels.decode_calls.append(FakeDecodeCall([running(index, 100 + index) for index in range(12)],
                                                error=FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")))
    channels.decode_calls.extend(FakeDecodeCall([FINISHED]) for _ in range(12))
    request = RouterRequest("r1", Prompt(list(range(40)), None), inference_pb2.SamplingParams(n=12, max_tokens=4))
    chunks = list(servicer_of(dispatcher, registry)._generate(request, FakeContext()))
    sent = {index: [t for c in chunks if c.index == index for t in c.token_ids] for index in range(12)}
    assert sent == {index: [100 + index, 7] for index in range(12)}
    assert sorted(c.index for c in chunks if c.finish_reason) == list(range(12))
    assert sorted(call.prompt_token_ids[-1] for _, call in channels.decode_requests[1:]) == [100 + i for i in range(12)]


def test_n_completions_that_sent_nothing_migrate_whole(cluster):
    """A request for 2 whose decode worker fails before any message (a beam search's case too) moves as it is."""
    channels = FakeChannels()
    dispatcher, registry = decode_only(channels)
    channels.decode_calls.append(FakeDecodeCall([], error=FakeRpcError(grpc.StatusCode.UNAVAILABLE, "gone")))
    channels.decode_calls.append(FakeDecodeCall([running(1, 3), with_fields(FINISHED, index=1),
                                                 with_fields(FINISHED, index=0)]))
    request = RouterRequest("r1", Prompt(list(range(40)), None), inference_pb2.SamplingParams(n=2, max_tokens=4))
    chunks = list(servicer_of(dispatcher, registry)._generate(request, FakeContext()))
    assert [(c.index, list(c.token_ids)) for c in chunks] == [(1, [3]), (1, [7]), (0, [7])]
    [(_, first), (address, second)] = channels.decode_requests
    assert address == "d:2" and second.sampling_params.n == 2 and list(second.prompt_token_ids) == list(range(40))
    assert request.num_migrations == 1


def with_fields(message: worker_pb2.DecodeResponse, **fields) -> worker_pb2.DecodeResponse:
    copy = worker_pb2.DecodeResponse()
    copy.CopyFrom(message)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def test_migrations_stop_at_the_limit(cluster):
    dispatcher, registry, channels = cluster
    registry.add_static(DECODE, "d:3", worker_id="decode-2", kv_endpoint=worker_pb2.KVEndpoint(address="d:4"))
    for _ in range(2):
        channels.decode_calls.append(FakeDecodeCall(MID_STREAM, error=FakeRpcError(grpc.StatusCode.INTERNAL, "boom")))
        channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=5))
    chunks = list(servicer_of(dispatcher, registry, migration_limit=1)._generate(job(), FakeContext()))
    assert [list(c.token_ids) for c in chunks] == [[5, 6], [7], [5, 6], [7], []]
    assert chunks[-1].error_message == ("The decode worker decode-2 failed mid-stream after 6 tokens: INTERNAL: "
                                        "boom (after 1 migration, the limit); the text so far is complete up to "
                                        "here.")
    assert len(channels.decode_requests) == 2


def test_a_decode_worker_failing_before_any_token_keeps_its_status(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall([], error=FakeRpcError(grpc.StatusCode.UNAVAILABLE, "gone")))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=5))
    with pytest.raises(DecodeStreamFailed) as failed:
        list(servicer_of(dispatcher, registry)._generate(job(), FakeContext()))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failed.value.worker_id == "decode-1"


def test_a_unary_generate_failing_after_tokens_returns_what_it_has_with_the_error(cluster):
    dispatcher, registry, channels = cluster
    channels.decode_calls.append(FakeDecodeCall(MID_STREAM, error=FakeRpcError(grpc.StatusCode.INTERNAL, "boom")))
    channels.prefill_outcomes.append(worker_pb2.PrefillResponse(first_token_id=5))
    response = servicer_of(dispatcher, registry).Generate(inference_pb2.GenerateRequest(text="x"), FakeContext())
    assert (list(response.token_ids), response.text) == ([5, 6, 7], "abc")
    assert response.finish_reason == inference_pb2.FINISH_REASON_ERROR
    assert "decode-1 failed mid-stream after 3 tokens: INTERNAL: boom" in response.error_message
    assert response.usage.completion_tokens == 3


def test_a_truncated_prompt_reaches_the_workers_cut_and_without_the_field(cluster):
    """truncate_prompt_tokens is the router's to apply: the job's prompt is the last tokens, and the sampling
    params the workers get no longer ask for a cut (a migration resends the cut prompt plus the tokens sent, which
    a worker must not cut again)."""
    dispatcher, registry, channels = cluster
    servicer = servicer_of(dispatcher, registry)
    params = inference_pb2.SamplingParams(truncate_prompt_tokens=7, max_tokens=3)
    job_ = servicer._admit(inference_pb2.GenerateRequest(text="x", sampling_params=params), FakeContext())
    assert job_.prompt.token_ids == list(range(33, 40)) and job_.prompt.text is None
    assert not job_.sampling_params.HasField("truncate_prompt_tokens") and job_.sampling_params.max_tokens == 3
    assert params.HasField("truncate_prompt_tokens")  # the client's message is left as it came
    servicer._release(job_)


def test_a_draining_router_refuses_new_requests_and_waits_for_those_in_flight(cluster):
    dispatcher, registry, channels = cluster
    servicer = servicer_of(dispatcher, registry)
    request = inference_pb2.GenerateRequest(text="x", request_id="r-in-flight")
    in_flight_job = servicer._admit(request, FakeContext())
    assert servicer.drain(timeout=0.05) is False  # one still in flight
    with pytest.raises(Unavailable, match="draining"):
        servicer._admit(inference_pb2.GenerateRequest(text="y"), FakeContext())
    assert servicer.abort_all() == 1 and in_flight_job.aborted
    servicer._release(in_flight_job)
    assert servicer.drain(timeout=0.05) is True


def test_a_kv_delivery_failure_is_not_blamed_on_the_prefill_worker(cluster):
    """ABORTED from Prefill (its KV could not reach the destination): the prefill worker stays SERVING and the
    decode worker prefills the prompt itself."""
    dispatcher, registry, channels = cluster
    channels.decode_calls += [FakeDecodeCall([]), FakeDecodeCall([FINISHED])]
    channels.prefill_outcomes.append(FakeRpcError(grpc.StatusCode.ABORTED, "Cannot deliver the prompt's KV"))
    assert list(dispatcher.run(job(), lambda: None)) == [FINISHED]
    [(_, remote), (_, local)] = channels.decode_requests
    assert (remote.prefill_locally, local.prefill_locally) == (False, True)
    assert registry.get("prefill-1").state == WorkerState.SERVING
    assert in_flight(registry) == {"prefill-1": 0, "decode-1": 0}
    assert channels.prefill_outcomes == []


def test_when_every_decode_worker_is_full_the_client_is_told_to_back_off(cluster):
    """RESOURCE_EXHAUSTED (retry later), not UNAVAILABLE, when each decode worker refused for want of room."""
    dispatcher, registry, channels = cluster
    registry.add_static(DECODE, "d:3", worker_id="decode-2", kv_endpoint=worker_pb2.KVEndpoint(address="d:4"))
    full = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Cannot reserve 38 KV blocks")
    channels.decode_calls += [FakeDecodeCall([], ack_error=full), FakeDecodeCall([], ack_error=full)]
    with pytest.raises(Overloaded, match=r"Every decode worker tried is full \(tried decode-1, decode-2\)"):
        list(dispatcher.run(job(), lambda: None))
    assert {w: registry.get(w).num_in_flight for w in ("decode-1", "decode-2")} == {"decode-1": 0, "decode-2": 0}
    channels.decode_calls += [FakeDecodeCall([], ack_error=full),
                              FakeDecodeCall([], ack_error=FakeRpcError(grpc.StatusCode.UNAVAILABLE, "gone"))]
    with pytest.raises(Unavailable, match="No decode worker could take the request"):
        list(dispatcher.run(job(), lambda: None))


def test_prefix_aware_routing_keys_a_request_as_its_workers_hash_its_blocks():
    """The policies get the root the workers chain the request's blocks from: its adapter's, mixed with its salt,
    then LongRoPE's once the prompt (a continuation's too) is longer than the original context, so a prefix-aware
    policy keys an adapter's or a tenant's prompts apart from the same tokens on the base model."""
    from splitserve.common.block_hash import hash_block_tokens, long_rope_root_hash, lora_root_hash, salted_root_hash

    registry = WorkerRegistry(model_fingerprint="m")
    dispatcher = Dispatcher(RouterConfig(), registry, PrefixAware(), PrefixAware(DECODE), FakeChannels(),
                            long_rope_context=48)
    request = RouterRequest("r1", Prompt(list(range(40)), None), inference_pb2.SamplingParams(), lora_name="sql",
                            cache_salt="tenant")
    salted = salted_root_hash(lora_root_hash("sql"), "tenant")
    assert dispatcher._hash_root(request) == salted
    request.continue_after(list(range(9)), "decode-1", 64)  # 49 tokens now: past the original context
    assert dispatcher._hash_root(request) == long_rope_root_hash(salted)
    plain = RouterRequest("r2", Prompt(list(range(40)), None), inference_pb2.SamplingParams())
    assert dispatcher._hash_root(plain) is None
    key = PrefixAware(block_size=16).prefix_key(list(range(40)), salted)
    assert key == hash_block_tokens(hash_block_tokens(salted, list(range(16))), list(range(16, 32)))
