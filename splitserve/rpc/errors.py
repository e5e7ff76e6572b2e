"""The one place that maps exceptions to gRPC status codes: a server interceptor.

``start_server`` installs :class:`ErrorInterceptor` on every server (router and
workers), so servicer methods just raise:

* a domain error (``splitserve.common.errors``) ends the call with the status its
  class names, and its message as the details;
* a ``grpc.RpcError`` from a downstream call (a worker, seen by the router) ends it
  with that call's code and details (:class:`ServiceError` relays one with a
  sentence of ours);
* ``context.abort()`` keeps the status it set;
* anything else (a plain ``ValueError`` too) is a bug: INTERNAL with
  "Internal error: ...", logged with its traceback.

Request bytes that do not parse as the method's message would end the call with
INTERNAL inside gRPC, before any handler runs; the interceptor's deserializer
hands the handler a :class:`MalformedRequest` instead, which ends the call with
INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from splitserve.common.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    Overloaded,
    Unavailable,
)

logger = logging.getLogger(__name__)

# A parser's error may quote the request's bytes, a bug's the request's fields: at most this much of either is echoed.
_ECHOED_PARSE_ERROR_CHARACTERS = 160
_ECHOED_INTERNAL_ERROR_CHARACTERS = 200

# Domain error -> status code; a subclass maps as its nearest listed base (NoWorkerAvailable as Unavailable).
STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Cancelled: grpc.StatusCode.CANCELLED,
    Aborted: grpc.StatusCode.ABORTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class ServiceError(grpc.RpcError):
    """A failure with an explicit gRPC status: a downstream call's code, relayed with a sentence of ours.

    Handled like the ``grpc.RpcError`` of a failed call (``code()``, ``details()``).
    Raise a domain error (``splitserve.common.errors``) for anything else.
    """

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self._code = code
        self._details = message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details an exception ends a call with (see the module docstring)."""
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        code = error.code()
        return code, error.details() or code.name
    for cls in type(error).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code, str(error)
    reason = str(error)
    if len(reason) > _ECHOED_INTERNAL_ERROR_CHARACTERS:  # may quote a client's input: the log has it whole
        reason = reason[:_ECHOED_INTERNAL_ERROR_CHARACTERS] + "..."
    return grpc.StatusCode.INTERNAL, f"Internal error: {type(error).__name__}: {reason}"


class ErrorInterceptor(grpc.ServerInterceptor):
    """Ends every unary-unary and unary-stream call that raises with the status :func:`status_of` gives.

    Streaming-request handlers (server reflection) are left as they are.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary, method),
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )


class MalformedRequest:
    """What the interceptor's deserializer returns for bytes that do not parse as the method's message."""

    def __init__(self, message_name: str, error: Exception) -> None:
        self.message_name = message_name
        self.error = error

    def refusal(self) -> InvalidRequest:
        """INVALID_ARGUMENT with a sentence: the message expected, and the parser's reason (at most 160 characters)."""
        reason = str(self.error).strip().rstrip(".")[:_ECHOED_PARSE_ERROR_CHARACTERS] or type(self.error).__name__
        return InvalidRequest(f"The request is not a valid {self.message_name}: its bytes do not parse ({reason}).")


def _tolerant(deserializer: Callable | None) -> Callable | None:
    """``deserializer``, returning a :class:`MalformedRequest` where it would raise."""
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)  # Message.FromString, bound to its class
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    message_name = descriptor.name if descriptor is not None else "request message"

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as error:
            return MalformedRequest(message_name, error)

    return deserialize


def _unary(behavior: Callable, method: str) -> Callable:
    def handle(request, context):
        try:
            if isinstance(request, MalformedRequest):
                raise request.refusal()
            return behavior(request, context)
        except Exception as error:
            if _is_abort(error):
                raise
            code, details = _end_call(context, error, method)
        # Outside the except clause (no chained traceback); returning None instead would make gRPC log
        # "Exception serializing message!" for every refused call.
        context.abort(code, details)

    return handle


def _streaming(behavior: Callable, method: str) -> Callable:
    def handle(request, context):
        try:
            if isinstance(request, MalformedRequest):
                raise request.refusal()
            yield from behavior(request, context)
        except Exception as error:
            if _is_abort(error):
                raise
            _end_call(context, error, method)

    return handle


def _end_call(context: grpc.ServicerContext, error: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    code, details = status_of(error)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, grpc.RpcError):
        logger.error("Internal error in %s", method, exc_info=error)
    else:
        logger.debug("%s ended with %s: %s", method, code.name, details)
    context.set_code(code)
    context.set_details(details)
    return code, details


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises a bare Exception() after setting the status; let it through.
    return type(error) is Exception and not error.args
