"""The router's WorkerRegistry service: workers register, heartbeat, drain themselves and leave.

Each method converts its message at the edge (``splitserve.rpc.convert``) and calls the registry, whose
domain errors the interceptor turns into status codes. A registration is bound to its caller: the lease it
is granted and, under mutual TLS, the client certificate's identity (``splitserve.rpc.tls.peer_identity``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from splitserve.common.errors import InvalidRequest
from splitserve.common.ids import check_id
from splitserve.common.lora_names import MAX_LORA_MODULES, check_lora_name
from splitserve.common.types import WorkerRole
from splitserve.router.registry import WorkerRegistry
from splitserve.router.worker import InvalidRegistration, KVCacheLayout
from splitserve.rpc.convert import worker_load_from_pb, worker_role_from_pb, worker_state_from_pb
from splitserve.rpc.tls import peer_identity
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class RegistryServicer(worker_pb2_grpc.WorkerRegistryServicer):
    """Workers register, heartbeat, drain and leave through here."""

    def __init__(self, registry: WorkerRegistry, on_change: Callable[[], object] | None = None) -> None:
        """``on_change``: called after every call that may change a worker's membership or state (the router's
        readiness follows its decode pool at once)."""
        self.registry = registry
        self._on_change = on_change or (lambda: None)

    def Register(self, request: worker_pb2.RegisterRequest, context) -> worker_pb2.RegisterResponse:
        role = worker_role_from_pb(request.role)
        if role != WorkerRole.BOTH and not request.HasField("kv_endpoint"):
            raise InvalidRequest("A prefill or decode worker must give its kv_endpoint.")
        worker = self.registry.register(
            role=role, address=request.address,
            kv_endpoint=request.kv_endpoint if request.HasField("kv_endpoint") else None,
            capacity=request.capacity, model_fingerprint=request.model_fingerprint,
            state=worker_state_from_pb(request.state), worker_id=request.worker_id,
            kv_layout=KVCacheLayout.from_pb(request.kv_layout) if request.HasField("kv_layout") else None,
            previous_lease_id=request.previous_lease_id, identity=peer_identity(context),
            kv_connector=_connector_name(request.kv_endpoint.connector) if request.HasField("kv_endpoint") else None,
            lora_names=checked_lora_names(request.lora_names), reasoning_parser=request.reasoning_parser,
        )
        logger.info("Worker %s (%s) registered from %s", worker.worker_id, role.name.lower(), request.address)
        self._on_change()
        return worker_pb2.RegisterResponse(
            worker_id=worker.worker_id, lease_id=worker.lease_id,
            lease_duration_seconds=self.registry.lease_duration_seconds,
            heartbeat_interval_seconds=self.registry.heartbeat_interval_seconds,
        )

    def Heartbeat(self, request: worker_pb2.HeartbeatRequest, context) -> worker_pb2.HeartbeatResponse:
        state, lease = self.registry.heartbeat(
            request.lease_id, worker_load_from_pb(request.load), worker_state_from_pb(request.state),
            lora_names=checked_lora_names(request.lora_names.names) if request.HasField("lora_names") else None,
        )
        self._on_change()
        return worker_pb2.HeartbeatResponse(state=state.value, lease_duration_seconds=lease)

    def Deregister(self, request: worker_pb2.DeregisterRequest, context) -> worker_pb2.DeregisterResponse:
        self.registry.deregister(request.lease_id)
        self._on_change()
        return worker_pb2.DeregisterResponse()

    def Drain(self, request: worker_pb2.DrainRequest, context) -> worker_pb2.DrainResponse:
        in_flight = self.registry.drain(request.lease_id, check_id(request.worker_id, "worker_id")
                                        if request.worker_id else "")
        logger.info("Worker %s is draining", request.worker_id or "(by lease)")
        self._on_change()
        return worker_pb2.DrainResponse(num_in_flight_requests=in_flight)


def checked_lora_names(names) -> frozenset[str]:
    """A registration's (or a heartbeat's) LoRA adapter names, checked (InvalidRequest: too many, or a bad name)."""
    if len(names) > MAX_LORA_MODULES:
        raise InvalidRequest(f"A worker registers at most {MAX_LORA_MODULES} LoRA adapters, not {len(names)}.")
    return frozenset(check_lora_name(name) for name in names)


def _connector_name(connector: int) -> str:
    """The KV connector's name ("p2p", "redis", "lmcache"), from its KVConnectorType number.

    Raises:
        InvalidRegistration: an unknown or unset connector.
    """
    if connector == worker_pb2.KV_CONNECTOR_TYPE_UNSPECIFIED or connector not in worker_pb2.KVConnectorType.values():
        raise InvalidRegistration(f"The kv_endpoint's connector {connector} is not P2P, REDIS or LMCACHE.")
    return worker_pb2.KVConnectorType.Name(connector).removeprefix("KV_CONNECTOR_TYPE_").lower()
