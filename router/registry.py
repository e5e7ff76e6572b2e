"""The router's worker registry: who is in each pool, their state, load and lease.

Workers started with ``--router`` register and heartbeat (a lease); workers
named on the router's command line are static (no lease; the router polls
them). Thread-safe: gRPC threads call it concurrently. No gRPC or torch here:
the servicer converts messages at its edge.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


class WorkerRole(enum.Enum):
    """Values equal the proto's WorkerRole numbers."""

    PREFILL = 1
    DECODE = 2
    BOTH = 3


class WorkerState(enum.Enum):
    """Values equal the proto's WorkerState numbers."""

    STARTING = 1
    SERVING = 2
    DRAINING = 3
    UNREACHABLE = 4


class RegistryError(Exception):
    """Base of the registry's errors."""


class InvalidRegistration(RegistryError, ValueError):
    """A registration with a missing or bad field (INVALID_ARGUMENT)."""


class FingerprintMismatch(RegistryError):
    """A worker serving other weights than the cluster (FAILED_PRECONDITION)."""


class UnknownLease(RegistryError):
    """No live lease with this id: register again (NOT_FOUND)."""


class UnknownWorker(RegistryError):
    """No worker with this id (NOT_FOUND)."""


@dataclass
class WorkerLoad:
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_waiting_for_remote_kvs_requests: int = 0
    num_queued_prefill_tokens: int = 0
    num_total_kv_blocks: int = 0
    num_free_kv_blocks: int = 0

    @property
    def kv_block_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]; 0 before the first report."""
        if self.num_total_kv_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_total_kv_blocks


@dataclass
class Worker:
    """One worker as the router sees it (``pools()`` and ``routable()`` hand out copies)."""

    worker_id: str
    role: WorkerRole
    address: str
    kv_endpoint: Any = None
    capacity: Any = None
    model_fingerprint: str = ""
    state: WorkerState = WorkerState.SERVING
    load: WorkerLoad = field(default_factory=WorkerLoad)
    lease_id: str | None = None
    registered_at: float = 0.0
    last_heard: float = 0.0
    is_static: bool = False
    # Requests the router has outstanding on this worker right now.
    num_in_flight: int = 0

    @property
    def is_routable(self) -> bool:
        return self.state == WorkerState.SERVING


class WorkerRegistry:
    """Pools of workers with leases.

    Args:
        lease_duration_seconds: a registered worker silent this long is removed.
        heartbeat_interval_seconds: how often workers are asked to heartbeat.
        unreachable_after_seconds: silence after which a worker is not routed to
            (default: two heartbeat intervals).
        model_fingerprint: the weights every worker must serve (None: the first worker's).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        lease_duration_seconds: float = 10.0,
        heartbeat_interval_seconds: float = 2.0,
        unreachable_after_seconds: float | None = None,
        model_fingerprint: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease_duration_seconds = lease_duration_seconds
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.unreachable_after_seconds = (
            unreachable_after_seconds if unreachable_after_seconds is not None else 2 * heartbeat_interval_seconds
        )
        self.model_fingerprint = model_fingerprint
        self._clock = clock
        self._workers: dict[str, Worker] = {}  # insertion order = registration order
        self._leases: dict[str, str] = {}  # lease id -> worker id
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ---- joining and leaving ----------------------------------------------------------

    def register(self, role: WorkerRole, address: str, kv_endpoint: Any = None, capacity: Any = None,
                 model_fingerprint: str = "", state: WorkerState = WorkerState.SERVING, worker_id: str = "") -> Worker:
        """Add a worker with a new lease; one registered before from the same address is replaced.

        Raises:
            InvalidRegistration: no address or a bad role.
            FingerprintMismatch: it serves other weights than the cluster.
        """
        if not isinstance(role, WorkerRole):
            raise InvalidRegistration(f"role must be a WorkerRole, got {role!r}.")
        if not address:
            raise InvalidRegistration("address is required: the host:port the router can reach the worker at.")
        with self._lock:
            self._check_fingerprint(model_fingerprint)
            previous = self._by_address(address)
            if previous is not None:
                self._remove(previous)
            worker_id = worker_id or f"{role.name.lower()}-{next(self._ids)}"
            if worker_id in self._workers:
                raise InvalidRegistration(f"Worker id {worker_id!r} is already registered from another address.")
            now = self._clock()
            worker = Worker(worker_id, role, address, kv_endpoint, capacity, model_fingerprint, state,
                            lease_id=uuid.uuid4().hex, registered_at=now, last_heard=now)
            self._workers[worker_id] = worker
            self._leases[worker.lease_id] = worker_id
            return dataclasses.replace(worker)

    def add_static(self, role: WorkerRole, address: str, worker_id: str | None = None, kv_endpoint: Any = None,
                   capacity: Any = None, model_fingerprint: str = "") -> Worker:
        """Add a worker named on the router's command line: no lease, never expires (polled instead)."""
        with self._lock:
            self._check_fingerprint(model_fingerprint)
            previous = self._by_address(address)
            if previous is not None:
                self._remove(previous)
            worker_id = worker_id or f"{role.name.lower()}-{next(self._ids)}"
            if worker_id in self._workers:
                worker_id = f"{worker_id}-{next(self._ids)}"
            now = self._clock()
            worker = Worker(worker_id, role, address, kv_endpoint, capacity, model_fingerprint,
                            registered_at=now, last_heard=now, is_static=True)
            self._workers[worker_id] = worker
            return dataclasses.replace(worker)

    def deregister(self, lease_id: str) -> None:
        """Remove the worker holding ``lease_id`` at once. Raises UnknownLease."""
        with self._lock:
            self._remove(self._by_lease(lease_id))

    def drain(self, worker_id: str) -> int:
        """Route no new requests to the worker (sticky); returns its requests in flight. Raises UnknownWorker."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                raise UnknownWorker(f"No worker {worker_id!r} in the registry.")
            worker.state = WorkerState.DRAINING
            return worker.num_in_flight

    # ---- liveness -----------------------------------------------------------------------

    def heartbeat(self, lease_id: str, load: WorkerLoad, state: WorkerState) -> tuple[WorkerState, float]:
        """Renew a lease and record the load. A DRAINING worker stays draining; an UNREACHABLE one serves again.

        Returns:
            (the state the router holds for the worker, lease seconds from now).
        Raises:
            UnknownLease: unknown or expired lease.
        """
        with self._lock:
            worker = self._by_lease(lease_id)
            self._heard(worker, load, state)
            return worker.state, self.lease_duration_seconds

    def update_static(self, worker_id: str, load: WorkerLoad, state: WorkerState) -> None:
        """Record a static worker's polled status."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                self._heard(worker, load, state)

    def mark_unreachable(self, worker_id: str) -> None:
        """A call to the worker failed with UNAVAILABLE: stop routing to it until it is heard from again."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.state != WorkerState.DRAINING:
                worker.state = WorkerState.UNREACHABLE

    def expire(self) -> list[Worker]:
        """Mark silent workers UNREACHABLE and remove those past their lease; returns the removed."""
        removed = []
        with self._lock:
            now = self._clock()
            for worker in list(self._workers.values()):
                if worker.is_static:
                    continue
                silence = now - worker.last_heard
                if silence >= self.lease_duration_seconds:
                    self._remove(worker)
                    removed.append(dataclasses.replace(worker))
                elif silence >= self.unreachable_after_seconds and worker.state == WorkerState.SERVING:
                    worker.state = WorkerState.UNREACHABLE
        return removed

    # ---- reading ------------------------------------------------------------------------

    def routable(self, role: WorkerRole) -> list[Worker]:
        """SERVING workers of ``role``, in registration order (copies)."""
        self.expire()
        with self._lock:
            return [dataclasses.replace(w) for w in self._workers.values() if w.role == role and w.is_routable]

    def get(self, worker_id: str) -> Worker | None:
        with self._lock:
            worker = self._workers.get(worker_id)
            return dataclasses.replace(worker) if worker is not None else None

    def pools(self) -> dict[WorkerRole, list[Worker]]:
        """Every worker by role, in registration order (copies)."""
        with self._lock:
            return {role: [dataclasses.replace(w) for w in self._workers.values() if w.role == role]
                    for role in WorkerRole}

    def begin_request(self, worker_id: str) -> None:
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.num_in_flight += 1

    def end_request(self, worker_id: str) -> None:
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.num_in_flight > 0:
                worker.num_in_flight -= 1

    # ---- internals (lock held) ---------------------------------------------------------------

    def _heard(self, worker: Worker, load: WorkerLoad, state: WorkerState) -> None:
        worker.last_heard = self._clock()
        worker.load = load
        if worker.state == WorkerState.DRAINING:
            return
        worker.state = WorkerState.SERVING if state == WorkerState.UNREACHABLE else state

    def _check_fingerprint(self, fingerprint: str) -> None:
        if self.model_fingerprint is None:
            self.model_fingerprint = fingerprint
        elif fingerprint and fingerprint != self.model_fingerprint:
            raise FingerprintMismatch(
                f"The worker serves model {fingerprint}, but this cluster serves {self.model_fingerprint}: "
                "start it with the same --model and --dtype as the router."
            )

    def _by_address(self, address: str) -> Worker | None:
        return next((w for w in self._workers.values() if w.address == address), None)

    def _by_lease(self, lease_id: str) -> Worker:
        worker_id = self._leases.get(lease_id)
        if worker_id is None or worker_id not in self._workers:
            raise UnknownLease(f"Lease {lease_id!r} is unknown or expired: register again.")
        return self._workers[worker_id]

    def _remove(self, worker: Worker) -> None:
        self._workers.pop(worker.worker_id, None)
        if worker.lease_id:
            self._leases.pop(worker.lease_id, None)
