"""The domain's errors: what went wrong, in a sentence the caller can act on.

The engine, the router and the workers raise these; each docstring names the
gRPC status it ends a call with. The mapping itself lives at the edge, in one
place (``splitserve.rpc.errors``, the server interceptor): nothing here
imports gRPC. An exception that is not a :class:`SplitserveError` is a bug and
ends a call with INTERNAL.
"""

from __future__ import annotations


class SplitserveError(Exception):
    """Base of the domain errors."""


class InvalidRequest(SplitserveError, ValueError):
    """A request with a bad field: no prompt, bad token ids, a sampling value out of range (INVALID_ARGUMENT).

    Also a ``ValueError``, so the offline API raises what Python callers expect.
    """


class Overloaded(SplitserveError):
    """Queues or KV blocks are full: back-pressure, retry later (RESOURCE_EXHAUSTED)."""


class Unavailable(SplitserveError):
    """The service cannot take the call now: it is draining, or the workers it needs failed (UNAVAILABLE)."""


class NoWorkerAvailable(Unavailable):
    """A pool has no worker to route to: empty, or every worker draining or unreachable (UNAVAILABLE)."""


class NotFound(SplitserveError):
    """The call names something that does not exist (any more): a lease, a worker (NOT_FOUND)."""


class FailedPrecondition(SplitserveError):
    """The system is not in a state that allows the call, e.g. a worker serving other weights (FAILED_PRECONDITION)."""


class AlreadyExists(SplitserveError):
    """The call would create something that exists already, e.g. a worker id held by a live worker (ALREADY_EXISTS)."""


class Aborted(SplitserveError):
    """The work could not be completed for a reason outside this service, which stays healthy: a prefill
    whose KV could not be delivered to its destination (ABORTED)."""


class Cancelled(SplitserveError):
    """The work was cancelled: aborted by a client or by the server shutting down (CANCELLED)."""


class DeadlineExceeded(SplitserveError):
    """The work did not finish before its deadline (DEADLINE_EXCEEDED)."""
