"""The router process: the Inference and WorkerRegistry services, lease expiry, static-worker polling."""

from __future__ import annotations

import logging
import threading

import grpc

from splitserve.common.errors import FailedPrecondition, InvalidRequest
from splitserve.common.types import WorkerRole, WorkerState
from splitserve.router.channels import Channels
from splitserve.router.config import RouterConfig
from splitserve.router.dispatch import Dispatcher
from splitserve.router.frontend import Frontend
from splitserve.router.policies import make_policy
from splitserve.router.registry import WorkerRegistry
from splitserve.router.registry_servicer import RegistryServicer, checked_lora_names
from splitserve.router.servicer import MAX_CONCURRENT_SMALL_CALLS, InferenceServicer
from splitserve.router.worker import KVCacheLayout
from splitserve.rpc.convert import worker_load_from_pb, worker_state_from_pb
from splitserve.rpc.metrics import RouterMetrics, serve_metrics
from splitserve.rpc.server import start_server
from splitserve.rpc.tracing import RequestTracer
from splitserve.v1 import inference_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

INFERENCE_SERVICE = "splitserve.v1.Inference"


class Router:
    """A started router: its server, registry and background threads."""

    def __init__(self, config: RouterConfig) -> None:
        """Raises FileNotFoundError when the model directory (tokenizer and config.json) is missing."""
        self.config = config
        self.frontend = Frontend(config.model, config.dtype, config.max_model_len, config.chat_template)
        self.registry = WorkerRegistry(
            lease_duration_seconds=config.lease_seconds, heartbeat_interval_seconds=config.heartbeat_seconds,
            model_fingerprint=self.frontend.model_fingerprint, allowed_fingerprints=self.frontend.allowed_fingerprints,
        )
        self.channels = Channels(config.credentials.cluster_token, config.tls)
        self.dispatcher = Dispatcher(
            config, self.registry,
            make_policy(config.prefill_policy, WorkerRole.PREFILL, block_size=config.block_size),
            make_policy(config.decode_policy, WorkerRole.DECODE, block_size=config.block_size),
            self.channels, long_rope_context=self.frontend.model_config.long_rope_context,
        )
        self.metrics = RouterMetrics(self.registry.pools, lambda: self.inference.num_in_flight)
        self.tracer = (RequestTracer("splitserve-router", config.otlp_traces_endpoint)
                       if config.otlp_traces_endpoint else None)
        self.inference = InferenceServicer(self.frontend, self.dispatcher, self.registry,
                                           config.max_in_flight_requests, config.block_size,
                                           config.migration_limit, self.metrics, self.tracer)
        self._static: list[tuple[WorkerRole, str]] = (
            [(WorkerRole.PREFILL, a) for a in config.prefill_workers]
            + [(WorkerRole.DECODE, a) for a in config.decode_workers]
            + [(WorkerRole.BOTH, a) for a in config.colocated_workers]
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._maintain, name="registry", daemon=True)
        self.server = start_server(
            f"{config.host}:{config.port}",
            [
                (inference_pb2_grpc.add_InferenceServicer_to_server, self.inference, INFERENCE_SERVICE),
                (worker_pb2_grpc.add_WorkerRegistryServicer_to_server, RegistryServicer(self.registry, self._on_registry_change),
                 "splitserve.v1.WorkerRegistry"),
            ],
            # Threads for every admitted generation call and every small call, and 16 more: heartbeats and
            # registrations never wait behind request work.
            max_workers=max(64, config.max_in_flight_requests + MAX_CONCURRENT_SMALL_CALLS + 16),
            credentials=config.credentials,
            tls=config.tls,
        )
        self.address = f"{config.host}:{self.server.port}"
        self.metrics_server = None
        if config.metrics_port is not None:
            try:
                self.metrics_server = serve_metrics(self.metrics.registry, config.host, config.metrics_port)
            except BaseException:
                self.server.stop(0)
                raise
        self._static_ids: dict[str, str] = {}
        self._left_out: set[str] = set()  # static workers refused (their refusal logged once)
        self._bad_lora_names: set[str] = set()  # static workers whose adapter names were refused (logged once)
        self._draining = False
        self._poll_static()
        self.update_readiness()
        self._thread.start()

    def _on_registry_change(self) -> None:
        if hasattr(self, "_draining"):  # once started
            self.update_readiness()

    def update_readiness(self) -> bool:
        """The Inference service's health, its readiness: SERVING while the router is not draining and a decode
        (or colocated) worker is serving, NOT_SERVING otherwise (a request would get UNAVAILABLE). The server as
        a whole ("") stays SERVING until it stops: liveness. Returns whether it is ready."""
        pools = self.registry.pools()
        ready = not self._draining and any(worker.state == WorkerState.SERVING
                                           for role in (WorkerRole.DECODE, WorkerRole.BOTH) for worker in pools[role])
        self.server.set_service_serving(INFERENCE_SERVICE, ready)
        return ready

    def drain(self, timeout: float) -> None:
        """Stop taking requests (health NOT_SERVING, new generation calls UNAVAILABLE) and let those in flight
        finish for up to ``timeout`` seconds; the ones still running then end with FINISH_REASON_ABORT."""
        self._draining = True
        self.server.set_service_serving(INFERENCE_SERVICE, False)
        num_in_flight = self.inference.num_in_flight
        logger.info("Router draining: %d requests in flight, up to %.0f s", num_in_flight, timeout)
        if not self.inference.drain(timeout):
            logger.warning("%d requests still in flight after %.0f s; aborting them", self.inference.abort_all(),
                           timeout)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop(2.0)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.tracer is not None:
            self.tracer.close()
        self.channels.close()

    def _maintain(self) -> None:
        """Expire silent workers; poll the static ones for their load."""
        while not self._stop.wait(self.config.heartbeat_seconds):
            for worker in self.registry.expire():
                logger.warning("Worker %s at %s missed its lease and was removed", worker.worker_id, worker.address)
                self.channels.forget(worker.address)
            self._poll_static()
            self.update_readiness()

    def _poll_static(self) -> None:
        for role, address in self._static:
            stub = worker_pb2_grpc.DecodeWorkerStub(self.channels.channel(address)) if role != WorkerRole.PREFILL \
                else worker_pb2_grpc.PrefillWorkerStub(self.channels.channel(address))
            worker_id = self._static_ids.get(address)
            try:
                status = stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=self.config.heartbeat_seconds * 2)
            except grpc.RpcError:
                if worker_id is not None:
                    self.registry.mark_unreachable(worker_id)
                continue
            try:
                names = checked_lora_names(status.lora_names)
            except InvalidRequest as error:  # its adapters are not routed to; the rest of it is
                if address not in self._bad_lora_names:
                    logger.error("Static %s worker at %s says bad LoRA adapter names: %s", role.name.lower(), address,
                                 error)
                    self._bad_lora_names.add(address)
                names = frozenset()
            if worker_id is None or self.registry.get(worker_id) is None:
                try:
                    worker = self.registry.add_static(
                        role, address, worker_id=status.status.worker_id or None,
                        kv_endpoint=status.kv_endpoint if status.HasField("kv_endpoint") else None,
                        capacity=status.capacity, model_fingerprint=status.model_fingerprint,
                        kv_layout=KVCacheLayout.from_pb(status.kv_layout) if status.HasField("kv_layout") else None,
                        reasoning_parser=status.reasoning_parser, lora_names=names,
                    )
                except (FailedPrecondition, InvalidRequest) as error:  # other weights, KV layout, reasoning: left out
                    if address not in self._left_out:
                        logger.error("Static %s worker at %s is left out: %s", role.name.lower(), address, error)
                        self._left_out.add(address)
                    continue
                self._static_ids[address] = worker.worker_id
                logger.info("Static %s worker %s at %s is serving", role.name.lower(), worker.worker_id, address)
            else:
                self.registry.update_static(worker_id, worker_load_from_pb(status.status.load),
                                            worker_state_from_pb(status.status.state),
                                            lora_names=names)


def run_router(config: RouterConfig) -> int:
    from splitserve.rpc.server import wait_for_shutdown_signal

    router = Router(config)
    print(f"READY {router.address} router", flush=True)
    logger.info("Router serving on %s", router.address)
    try:
        wait_for_shutdown_signal()
        router.drain(config.drain_timeout_seconds)
    finally:
        router.stop()
    return 0
