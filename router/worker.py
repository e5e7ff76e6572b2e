"""Worker: one worker as the router sees it, and the errors its registration can meet.

The registry keeps one ``Worker`` per worker; the policies and the dispatcher
read copies (:func:`snapshot`, its ``WorkerLoad`` copied too), so they may read
while heartbeats write. The opaque ``kv_endpoint`` and ``capacity`` messages
are shared, never mutated. The errors are domain errors: each maps to the gRPC
status its docstring names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.errors import AlreadyExists, FailedPrecondition, InvalidRequest, NotFound
from splitserve.common.load import WorkerLoad
from splitserve.common.types import WorkerRole, WorkerState


@dataclass
class Worker:
    """One worker: what it told at registration (the proto's RegisterRequest), its state, load and lease."""

    worker_id: str
    role: WorkerRole
    address: str  # host:port of its gRPC server
    kv_endpoint: Any = None  # opaque (a KVEndpoint message); None for colocated workers
    capacity: Any = None  # opaque (a WorkerCapacity message)
    model_fingerprint: str = ""
    state: WorkerState = WorkerState.SERVING
    load: WorkerLoad = field(default_factory=WorkerLoad)
    lease_id: str | None = None  # None for static workers
    registered_at: float = 0.0  # clock seconds
    last_heard: float = 0.0  # clock seconds of the last heartbeat or successful poll
    is_static: bool = False
    num_in_flight: int = 0  # requests the router has outstanding on it right now

    @property
    def is_routable(self) -> bool:
        return self.state == WorkerState.SERVING


def snapshot(worker: Worker) -> Worker:
    """A copy of ``worker`` whose load is its own (the registry hands out nothing else)."""
    return dataclasses.replace(worker, load=dataclasses.replace(worker.load))


class InvalidRegistration(InvalidRequest):
    """A registration with a missing or bad field (INVALID_ARGUMENT)."""


class WorkerIdInUse(AlreadyExists):
    """The requested worker id belongs to a live worker at another address (ALREADY_EXISTS)."""


class FingerprintMismatch(FailedPrecondition):
    """A worker serving other weights than the cluster (FAILED_PRECONDITION)."""


class UnknownLease(NotFound):
    """No live lease with this id: register again (NOT_FOUND)."""


class UnknownWorker(NotFound):
    """No worker with this id (NOT_FOUND)."""


def check_registration(role: Any, address: Any) -> None:
    """Raises InvalidRegistration unless ``role`` is a WorkerRole and ``address`` a non-empty string."""
    if not isinstance(role, WorkerRole):
        raise InvalidRegistration(f"role must be a WorkerRole (PREFILL, DECODE or BOTH), got {role!r}.")
    if not address or not isinstance(address, str):
        raise InvalidRegistration("address is required: the host:port the router can reach the worker at.")
