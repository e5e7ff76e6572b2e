"""WorkerRegistry: who is in each pool, their state, load and lease.

Workers started with ``--router`` register and heartbeat (a lease); workers
named on the router's command line are static (no lease; the router polls
them). Thread-safe: gRPC threads call it concurrently, under one lock. No gRPC
or torch here: the servicer converts messages at its edge
(``splitserve.rpc.convert``: ``worker_role_from_pb``, ``worker_load_from_pb``).
Readers get copies (:func:`splitserve.router.worker.snapshot`).

Its errors (``splitserve.router.worker``) are domain errors: the gRPC
interceptor gives each its status code.

One class over one lock, a little over 300 lines: registration, leases,
state changes and the in-flight counts all read and write the same pools
under that lock, so they stay together; the worker record, its checks and
the errors live in ``router/worker.py``.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from splitserve.common.load import WorkerLoad
from splitserve.common.types import WorkerRole, WorkerState
from splitserve.router.worker import (
    FingerprintMismatch,
    InvalidRegistration,
    KVCacheLayout,
    RegistrationInUse,
    UnknownLease,
    Worker,
    WorkerIdInUse,
    check_kv_connector,
    check_kv_identity,
    check_kv_layout,
    check_reasoning_parser,
    check_reasoning_parser_name,
    check_registration,
    snapshot,
)

# Prefix of the ids the registry assigns: decode-1, prefill-2, worker-3.
_ID_PREFIXES = {WorkerRole.PREFILL: "prefill", WorkerRole.DECODE: "decode", WorkerRole.BOTH: "worker"}


class WorkerRegistry:
    """Pools of workers with leases.

    Args:
        lease_duration_seconds: a registered worker silent this long is removed.
        heartbeat_interval_seconds: how often workers are asked to heartbeat.
        unreachable_after_seconds: silence after which a worker is not routed to
            (default: two heartbeat intervals).
        model_fingerprint: the weights every worker must serve (None: those of the
            workers already registered; an empty registry accepts any of ``allowed_fingerprints``).
        allowed_fingerprints: with no fixed fingerprint, those the first worker may serve (the router's
            model in either dtype under --dtype auto; None: any).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        lease_duration_seconds: float = 10.0,
        heartbeat_interval_seconds: float = 2.0,
        unreachable_after_seconds: float | None = None,
        model_fingerprint: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        allowed_fingerprints: frozenset[str] | None = None,
    ) -> None:
        if not lease_duration_seconds > 0 or not heartbeat_interval_seconds > 0:
            raise ValueError("lease_duration_seconds and heartbeat_interval_seconds must be > 0.")
        self.lease_duration_seconds = lease_duration_seconds
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.unreachable_after_seconds = (
            unreachable_after_seconds if unreachable_after_seconds is not None else 2 * heartbeat_interval_seconds
        )
        self._fixed_fingerprint = model_fingerprint
        self._allowed_fingerprints = allowed_fingerprints
        self._clock = clock
        self._workers: dict[str, Worker] = {}  # insertion order = registration order
        self._leases: dict[str, str] = {}  # lease id -> worker id
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._removal_listeners: list[Callable[[list[Worker]], None]] = []

    def on_removed(self, listener: Callable[[list[Worker]], None]) -> None:
        """Call ``listener`` with copies of the workers ``expire`` removes (silent past their lease), outside
        the lock."""
        self._removal_listeners.append(listener)

    @property
    def model_fingerprint(self) -> str | None:
        """The fingerprint workers must match now (None: any)."""
        with self._lock:
            return self._cluster_fingerprint(excluding=None)

    # ---- joining and leaving ----------------------------------------------------------

    def register(self, role: WorkerRole, address: str, kv_endpoint: Any = None, capacity: Any = None,
                 model_fingerprint: str = "", state: WorkerState = WorkerState.SERVING, worker_id: str = "",
                 kv_layout: KVCacheLayout | None = None, previous_lease_id: str = "",
                 identity: str | None = None, kv_connector: str | None = None,
                 lora_names: frozenset[str] = frozenset(), reasoning_parser: str = "") -> Worker:
        """Add a worker with a new lease and return a copy of it (serving the LoRA adapters ``lora_names``).

        A registration is bound to whoever made it: its lease id and, under mutual
        TLS, the client-certificate ``identity``. A registration with the ``address``
        or ``worker_id`` of another one replaces it (its old lease dies; its in-flight
        count carries over when the id is the same) only when that one is silent
        (``unreachable_after_seconds`` without a heartbeat: a restarted worker) or
        the caller proves it made it (``previous_lease_id`` is its lease, or the same
        non-empty ``identity``). Empty ``worker_id``: one is assigned (``decode-1``,
        ``prefill-2``, ``worker-3``).

        A prefill or decode worker's ``kv_layout`` and ``kv_connector`` (how it moves
        KV: "p2p", "redis", "lmcache") must equal the other prefill and decode workers'
        (the first one sets them; colocated workers exchange no KV and are not checked). Every worker's
        ``reasoning_parser`` ("" for none) must equal the others'.

        Raises:
            InvalidRegistration: no address, a bad role or state; a prefill or decode worker without a fingerprint
                or a KV layout.
            WorkerIdInUse: ``worker_id`` belongs to a live worker at another address.
            RegistrationInUse: ``address`` or ``worker_id`` is a live registration the caller did not make.
            FingerprintMismatch: it serves other weights than the cluster.
            KVLayoutMismatch: a prefill or decode worker with another KV layout than the cluster's.
            KVConnectorMismatch: a prefill or decode worker moving KV another way than the cluster's.
            ReasoningParserMismatch: another reasoning parser than the cluster's workers'.
        """
        check_registration(role, address)
        check_kv_identity(role, model_fingerprint, kv_layout)
        check_reasoning_parser_name(reasoning_parser)
        if not isinstance(state, WorkerState) or state == WorkerState.UNREACHABLE:
            raise InvalidRegistration(f"A worker registers as STARTING, SERVING or DRAINING, not {state!r}.")
        with self._lock:
            previous = self._by_address(address)
            if previous is not None and not self._may_replace(previous, previous_lease_id, identity):
                raise RegistrationInUse(
                    f"The worker at {address} is registered and alive, and only it can register there again. A "
                    f"restarted worker registers once the old one is silent ({self.unreachable_after_seconds:g} s)."
                )
            self._check_fingerprint(address, model_fingerprint, excluding=previous)
            self._check_kv_layout(address, role, kv_layout, excluding=previous)
            self._check_kv_connector(address, role, kv_connector, excluding=previous)
            check_reasoning_parser(address, reasoning_parser, self._cluster_reasoning_parser(excluding=previous))
            holder = self._workers.get(worker_id) if worker_id else None
            if holder is not None and holder is not previous:
                if not self._may_replace(holder, previous_lease_id, identity):
                    raise WorkerIdInUse(
                        f"Worker id {worker_id!r} is in use by the live worker at {holder.address}: give this "
                        "worker another --worker-id, or stop that one first."
                    )
                self._remove(holder)
            num_in_flight = 0
            if previous is not None:
                self._remove(previous)
                if previous.worker_id == worker_id:
                    num_in_flight = previous.num_in_flight
            now = self._clock()
            worker = Worker(worker_id or self._new_id(role), role, address, kv_endpoint, capacity,
                            model_fingerprint, _exchanged_layout(role, kv_layout), state,
                            lease_id=uuid.uuid4().hex, registered_at=now,
                            last_heard=now, num_in_flight=num_in_flight, identity=identity,
                            kv_connector=kv_connector if role != WorkerRole.BOTH else None,
                            lora_names=frozenset(lora_names), reasoning_parser=reasoning_parser)
            self._workers[worker.worker_id] = worker
            self._leases[worker.lease_id] = worker.worker_id
            return snapshot(worker)

    def add_static(self, role: WorkerRole, address: str, worker_id: str | None = None, kv_endpoint: Any = None,
                   capacity: Any = None, model_fingerprint: str = "", kv_layout: KVCacheLayout | None = None,
                   reasoning_parser: str = "", lora_names: frozenset[str] = frozenset()) -> Worker:
        """Add a worker named on the router's command line: no lease, never expires (polled instead).

        Idempotent per address: if a worker (static or registered) is already at
        ``address``, nothing changes and a copy of it is returned. A ``worker_id``
        already taken gets a numeric suffix.

        Raises:
            InvalidRegistration: no address or a bad role.
            FingerprintMismatch: it serves other weights than the cluster.
            KVLayoutMismatch: a prefill or decode worker with another KV layout than the cluster's.
            ReasoningParserMismatch: another reasoning parser than the cluster's workers'.
        """
        check_registration(role, address)
        check_reasoning_parser_name(reasoning_parser)
        with self._lock:
            existing = self._by_address(address)
            if existing is not None:
                return snapshot(existing)
            self._check_fingerprint(address, model_fingerprint, excluding=None)
            self._check_kv_layout(address, role, kv_layout, excluding=None)
            check_reasoning_parser(address, reasoning_parser, self._cluster_reasoning_parser(excluding=None))
            if not worker_id:
                worker_id = self._new_id(role)
            elif worker_id in self._workers:
                worker_id = f"{worker_id}-{next(self._ids)}"
            now = self._clock()
            worker = Worker(worker_id, role, address, kv_endpoint, capacity, model_fingerprint,
                            _exchanged_layout(role, kv_layout), registered_at=now, last_heard=now, is_static=True,
                            reasoning_parser=reasoning_parser, lora_names=frozenset(lora_names))
            self._workers[worker_id] = worker
            return snapshot(worker)

    def deregister(self, lease_id: str) -> None:
        """Remove the worker holding ``lease_id`` at once. Raises UnknownLease."""
        with self._lock:
            self._remove(self._by_lease(lease_id))

    def drain(self, lease_id: str, worker_id: str = "") -> int:
        """Mark the worker holding ``lease_id`` DRAINING (sticky: no heartbeat undoes it); returns its requests
        in flight. Only the worker itself holds its lease, so only it can drain itself.

        Raises:
            InvalidRegistration: no ``lease_id``.
            UnknownLease: unknown or expired lease, or ``worker_id`` given and not the lease's worker.
        """
        if not lease_id:
            raise InvalidRegistration("lease_id is required: a worker drains itself with the lease its "
                                      "registration was granted (drain another worker by sending it SIGTERM).")
        with self._lock:
            worker = self._by_lease(lease_id)
            if worker_id and worker_id != worker.worker_id:
                raise UnknownLease("This lease is not the named worker's.")
            worker.state = WorkerState.DRAINING
            return worker.num_in_flight

    # ---- liveness -----------------------------------------------------------------------

    def heartbeat(self, lease_id: str, load: WorkerLoad, state: WorkerState,
                  lora_names: frozenset[str] | None = None) -> tuple[WorkerState, float]:
        """Renew a lease: record the load, the time and the worker's own state, and the LoRA adapters it serves
        now when it says them (``lora_names``; None: unchanged).

        DRAINING, once held, stays; an UNREACHABLE worker becomes SERVING (or the
        state it reports).

        Returns:
            (the state the router holds for the worker, lease seconds from now).
        Raises:
            UnknownLease: unknown lease, or expired (the worker is removed then).
        """
        with self._lock:
            worker = self._by_lease(lease_id)
            if self._clock() - worker.last_heard >= self.lease_duration_seconds:
                self._remove(worker)
                raise UnknownLease("This lease expired: register again.")
            self._heard(worker, load, state)
            if lora_names is not None:
                worker.lora_names = frozenset(lora_names)
            return worker.state, self.lease_duration_seconds

    def update_static(self, worker_id: str, load: WorkerLoad, state: WorkerState,
                      lora_names: frozenset[str] | None = None) -> None:
        """Record a worker's polled status as a heartbeat would, its LoRA adapters too when given (no-op for an
        unknown id)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                self._heard(worker, load, state)
                if lora_names is not None:
                    worker.lora_names = frozenset(lora_names)

    def mark_unreachable(self, worker_id: str) -> None:
        """A call or poll failed: route nothing to the worker until it is heard from again.

        A DRAINING worker stays DRAINING; an unknown id is a no-op.
        """
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.state != WorkerState.DRAINING:
                worker.state = WorkerState.UNREACHABLE

    def expire(self) -> list[Worker]:
        """Apply silence to registered (not static) workers; returns copies of those removed.

        Silent for ``unreachable_after_seconds`` or more: SERVING -> UNREACHABLE.
        Silent for ``lease_duration_seconds`` or more: removed, lease dead.
        """
        removed = []
        with self._lock:
            now = self._clock()
            for worker in list(self._workers.values()):
                if worker.is_static:
                    continue
                silence = now - worker.last_heard
                if silence >= self.lease_duration_seconds:
                    self._remove(worker)
                    removed.append(snapshot(worker))
                elif silence >= self.unreachable_after_seconds and worker.state == WorkerState.SERVING:
                    worker.state = WorkerState.UNREACHABLE
        if removed:
            for listener in self._removal_listeners:
                listener(removed)
        return removed

    # ---- reading ------------------------------------------------------------------------

    def routable(self, role: WorkerRole) -> list[Worker]:
        """Runs ``expire()``, then returns copies of the SERVING workers of ``role``, in registration order."""
        self.expire()
        with self._lock:
            return [snapshot(w) for w in self._workers.values() if w.role == role and w.is_routable]

    def get(self, worker_id: str) -> Worker | None:
        """A copy of the worker, None if unknown."""
        with self._lock:
            worker = self._workers.get(worker_id)
            return snapshot(worker) if worker is not None else None

    def by_address(self, address: str) -> Worker | None:
        """A copy of the worker at ``address``, None if none."""
        with self._lock:
            worker = self._by_address(address)
            return snapshot(worker) if worker is not None else None

    def lora_names(self) -> list[str]:
        """The LoRA adapters some registered decode or colocated worker serves (a request's whole path), sorted."""
        with self._lock:
            return sorted({name for w in self._workers.values() if w.role != WorkerRole.PREFILL for name in w.lora_names})

    @property
    def reasoning_parser(self) -> str:
        """The reasoning parser every worker has ("": none, or no worker yet)."""
        with self._lock:
            return self._cluster_reasoning_parser(excluding=None) or ""

    def pools(self) -> dict[WorkerRole, list[Worker]]:
        """Copies of every worker by role (every role a key), in registration order."""
        with self._lock:
            return {role: [snapshot(w) for w in self._workers.values() if w.role == role] for role in WorkerRole}

    def begin_request(self, worker_id: str) -> None:
        """Count one more request in flight on the worker (no-op for an unknown id)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.num_in_flight += 1

    def end_request(self, worker_id: str) -> None:
        """Count one request fewer in flight (no-op for a removed worker; never below 0)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.num_in_flight > 0:
                worker.num_in_flight -= 1

    # ---- internals (lock held) ---------------------------------------------------------------

    def _heard(self, worker: Worker, load: WorkerLoad, state: WorkerState) -> None:
        worker.last_heard = self._clock()
        worker.load = dataclasses.replace(load)
        if worker.state == WorkerState.DRAINING:
            return
        worker.state = WorkerState.SERVING if state == WorkerState.UNREACHABLE else state

    def _may_replace(self, worker: Worker, previous_lease_id: str, identity: str | None) -> bool:
        """Whether a new registration may replace ``worker``'s: it is silent, or the caller proves it made it."""
        if self._is_silent(worker) or worker.is_static:  # a static entry (from the command line) binds no one
            return True
        if previous_lease_id and worker.lease_id and hmac.compare_digest(previous_lease_id, worker.lease_id):
            return True
        return identity is not None and worker.identity is not None and identity == worker.identity

    def _is_silent(self, worker: Worker) -> bool:
        if worker.state == WorkerState.UNREACHABLE:
            return True
        return not worker.is_static and self._clock() - worker.last_heard >= self.unreachable_after_seconds

    def _cluster_fingerprint(self, excluding: Worker | None) -> str | None:
        if self._fixed_fingerprint is not None:
            return self._fixed_fingerprint
        return next((w.model_fingerprint for w in self._workers.values()
                     if w.model_fingerprint and w is not excluding), None)

    def _check_fingerprint(self, address: str, fingerprint: str, excluding: Worker | None) -> None:
        """An empty fingerprint is not checked (the worker did not say)."""
        cluster = self._cluster_fingerprint(excluding)
        if fingerprint and not cluster and self._allowed_fingerprints and fingerprint not in self._allowed_fingerprints:
            raise FingerprintMismatch(
                f"The worker at {address} serves model {fingerprint}, which is not the router's model in float32 or "
                f"bfloat16 ({', '.join(sorted(self._allowed_fingerprints))}): start it with the router's --model."
            )
        if fingerprint and cluster and fingerprint != cluster:
            raise FingerprintMismatch(
                f"The worker at {address} serves model {fingerprint}, but this cluster serves {cluster}: "
                "start it with the same --model and --dtype as the rest of the cluster."
            )

    def _check_kv_layout(self, address: str, role: WorkerRole, layout: KVCacheLayout | None,
                         excluding: Worker | None) -> None:
        """Colocated workers exchange no KV: not checked; nor is a worker that gave no layout."""
        if role == WorkerRole.BOTH:
            return
        cluster = next((w.kv_layout for w in self._workers.values()
                        if w.kv_layout is not None and w is not excluding), None)
        check_kv_layout(address, layout, cluster)

    def _cluster_reasoning_parser(self, excluding: Worker | None) -> str | None:
        """The workers' reasoning parser ("": none); None with no worker but ``excluding``."""
        return next((w.reasoning_parser for w in self._workers.values() if w is not excluding), None)

    def _check_kv_connector(self, address: str, role: WorkerRole, connector: str | None,
                            excluding: Worker | None) -> None:
        """Colocated workers exchange no KV: not checked; nor is a worker that named no connector."""
        if role == WorkerRole.BOTH:
            return
        cluster = next((w.kv_connector for w in self._workers.values() if w.kv_connector and w is not excluding),
                       None)
        check_kv_connector(address, connector, cluster)

    def _new_id(self, role: WorkerRole) -> str:
        while True:
            worker_id = f"{_ID_PREFIXES[role]}-{next(self._ids)}"
            if worker_id not in self._workers:
                return worker_id

    def _by_address(self, address: str) -> Worker | None:
        return next((w for w in self._workers.values() if w.address == address), None)

    def _by_lease(self, lease_id: str) -> Worker:
        worker_id = self._leases.get(lease_id)
        if worker_id is None or worker_id not in self._workers:
            raise UnknownLease("This lease is unknown or expired: register again.")
        return self._workers[worker_id]

    def _remove(self, worker: Worker) -> None:
        self._workers.pop(worker.worker_id, None)
        if worker.lease_id:
            self._leases.pop(worker.lease_id, None)


def _exchanged_layout(role: WorkerRole, layout: KVCacheLayout | None) -> KVCacheLayout | None:
    """The layout the cluster keeps for a worker: None for a colocated one (it exchanges no KV)."""
    return None if role == WorkerRole.BOTH else layout
