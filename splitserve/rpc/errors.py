"""One place that maps exceptions to gRPC status codes with a sentence a user understands."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with the gRPC status it should end the call with."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(ServiceError):
    """Queues or KV blocks are full: back-pressure, retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message an exception should end a call with."""
    from splitserve.engine.scheduler import KVCacheFullError

    if isinstance(error, ServiceError):
        return error.code, str(error)
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return error.code(), error.details() or str(error.code())
    if isinstance(error, KVCacheFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "The deadline passed."
    return grpc.StatusCode.INTERNAL, f"Internal error: {type(error).__name__}: {error}"


def _set_status(context: grpc.ServicerContext, error: BaseException) -> None:
    code, message = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("Internal error in a call", exc_info=error)
    elif not isinstance(error, (ServiceError, grpc.RpcError)):
        logger.info("Call ended with %s: %s", code.name, message, exc_info=error)
    context.set_code(code)
    context.set_details(message)


def unary_errors(method: Callable) -> Callable:
    """Decorate a unary servicer method: exceptions end the call with their mapped status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as error:
            if _is_abort(error):
                raise
            _set_status(context, error)
            return None

    return wrapper


def stream_errors(method: Callable) -> Callable:
    """Decorate a server-streaming servicer method the same way."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as error:
            if _is_abort(error):
                raise
            _set_status(context, error)

    return wrapper


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises a bare Exception() after setting the status; let it through.
    return type(error) is Exception and not error.args
