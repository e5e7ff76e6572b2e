"""The one error path: exceptions -> gRPC status codes, through the server interceptor (fake contexts, no sockets)."""

from __future__ import annotations

import logging
from collections import namedtuple

import grpc
import pytest

from splitserve.common import errors
from splitserve.engine.scheduler import KVCacheFullError
from splitserve.rpc.errors import ErrorInterceptor, ServiceError, status_of
from splitserve.v1 import inference_pb2

CallDetails = namedtuple("CallDetails", "method invocation_metadata")
Code = grpc.StatusCode


class FakeContext:
    def __init__(self) -> None:
        self.code, self.details = None, None

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details

    def abort(self, code, details):
        """As gRPC's: the status is set, and a bare Exception() ends the handler."""
        self.code, self.details, self.aborted = code, details, True
        raise Exception()


def unary(handler, request, context: FakeContext):
    """Call a unary handler: its answer, or None when it ended the call through ``context.abort``."""
    try:
        return handler.unary_unary(request, context)
    except Exception as error:
        if type(error) is Exception and not error.args and getattr(context, "aborted", False):
            return None
        raise


@pytest.mark.parametrize("error, code", [
    (errors.InvalidRequest("bad temperature"), Code.INVALID_ARGUMENT),
    (errors.Overloaded("queue full"), Code.RESOURCE_EXHAUSTED),
    (KVCacheFullError("Cannot reserve 3 KV blocks"), Code.RESOURCE_EXHAUSTED),
    (errors.Unavailable("draining"), Code.UNAVAILABLE),
    (errors.NoWorkerAvailable("no decode worker"), Code.UNAVAILABLE),
    (errors.NotFound("no lease"), Code.NOT_FOUND),
    (errors.FailedPrecondition("other weights"), Code.FAILED_PRECONDITION),
    (errors.AlreadyExists("id in use"), Code.ALREADY_EXISTS),
    (errors.Cancelled("aborted"), Code.CANCELLED),
    (errors.DeadlineExceeded("too late"), Code.DEADLINE_EXCEEDED),
])
def test_domain_errors_map_to_the_status_their_docstring_names(error, code):
    assert status_of(error) == (code, str(error))
    nearest_domain_class = next(cls for cls in type(error).__mro__ if cls.__module__ == errors.__name__)
    assert f"({code.name})" in nearest_domain_class.__doc__


def test_a_plain_exception_is_internal_even_a_value_error():
    assert status_of(ValueError("oops")) == (Code.INTERNAL, "Internal error: ValueError: oops")
    assert status_of(KeyError("k")) == (Code.INTERNAL, "Internal error: KeyError: 'k'")
    assert isinstance(errors.InvalidRequest("x"), ValueError)  # the offline API still raises ValueError


def test_a_downstream_status_passes_through():
    assert status_of(ServiceError("Decode worker d1 failed: boom", Code.DATA_LOSS)) == (
        Code.DATA_LOSS, "Decode worker d1 failed: boom")
    assert status_of(ServiceError("no code given")) == (Code.INTERNAL, "no code given")


def intercepted(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return ErrorInterceptor().intercept_service(lambda details: handler, CallDetails("/splitserve.v1.Test/Call", ()))


def test_unary_calls_end_with_the_mapped_status():
    def fail(request, context):
        raise errors.Overloaded(f"{request} requests in flight; retry later.")

    context = FakeContext()
    # Aborted, not answered with None (gRPC would log a failure to serialize it).
    with pytest.raises(Exception) as aborted:
        intercepted(grpc.unary_unary_rpc_method_handler(fail)).unary_unary(512, context)
    assert type(aborted.value) is Exception and not aborted.value.args
    assert (context.code, context.details) == (Code.RESOURCE_EXHAUSTED, "512 requests in flight; retry later.")
    ok = FakeContext()
    assert intercepted(grpc.unary_unary_rpc_method_handler(lambda request, context: request + 1)).unary_unary(1, ok) == 2
    assert ok.code is None


def test_streams_keep_what_they_sent_and_end_with_the_mapped_status():
    def stream(request, context):
        yield "first"
        raise errors.InvalidRequest("The prompt is empty: give at least one token.")

    context = FakeContext()
    handler = intercepted(grpc.unary_stream_rpc_method_handler(stream))
    assert list(handler.unary_stream(None, context)) == ["first"]
    assert (context.code, context.details) == (Code.INVALID_ARGUMENT, "The prompt is empty: give at least one token.")


def test_internal_errors_are_logged_with_their_traceback(caplog):
    def broken(request, context):
        raise ValueError("a bug")

    context = FakeContext()
    with caplog.at_level(logging.ERROR, logger="splitserve.rpc.errors"):
        assert unary(intercepted(grpc.unary_unary_rpc_method_handler(broken)), None, context) is None
    assert (context.code, context.details) == (Code.INTERNAL, "Internal error: ValueError: a bug")
    [record] = caplog.records
    assert "/splitserve.v1.Test/Call" in record.getMessage() and record.exc_info[0] is ValueError


def test_context_abort_is_let_through():
    def abort(request, context):
        raise Exception()  # what context.abort() raises once it has set the status

    with pytest.raises(Exception) as raised:
        intercepted(grpc.unary_unary_rpc_method_handler(abort)).unary_unary(None, FakeContext())
    assert type(raised.value) is Exception


def test_streaming_request_handlers_are_left_alone():
    handler = grpc.stream_stream_rpc_method_handler(lambda requests, context: iter(()))
    assert intercepted(handler) is handler


@pytest.mark.parametrize("make_handler", [grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler])
def test_request_bytes_that_do_not_parse_end_the_call_with_invalid_argument(make_handler):
    def behavior(request, context):
        raise AssertionError("the handler must not run on a request that does not parse")

    handler = intercepted(make_handler(behavior, request_deserializer=inference_pb2.AbortRequest.FromString))
    request = handler.request_deserializer(b"\x0a\xff")  # field 1, 255 bytes long, then nothing
    context = FakeContext()
    if handler.response_streaming:
        assert list(handler.unary_stream(request, context)) == []
    else:
        assert unary(handler, request, context) is None
    assert context.code == Code.INVALID_ARGUMENT
    assert context.details.startswith("The request is not a valid AbortRequest: its bytes do not parse (")
    assert context.details.endswith(").")
    assert handler.request_deserializer(b"\x0a\x02ab") == inference_pb2.AbortRequest(request_id="ab")


def test_a_parse_error_is_echoed_at_most_160_characters():
    class LongWinded(Exception):
        pass

    def parse(data: bytes):
        raise LongWinded("bytes " + data.hex())

    handler = intercepted(grpc.unary_unary_rpc_method_handler(lambda request, context: None,
                                                              request_deserializer=parse))
    context = FakeContext()
    assert unary(handler, handler.request_deserializer(b"\xab" * 10_000), context) is None
    assert context.code == Code.INVALID_ARGUMENT
    assert context.details == f"The request is not a valid request message: its bytes do not parse ({('bytes ' + 'ab' * 77)[:160]})."


def test_an_internal_error_echoes_at_most_200_characters_of_its_message():
    code, details = status_of(ValueError("x" * 10_000))
    assert (code, details) == (Code.INTERNAL, "Internal error: ValueError: " + "x" * 200 + "...")
