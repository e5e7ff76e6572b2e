"""Run one process of a cluster: a worker (prefill, decode or both) or the router.

Each ``run_*`` builds its servicer, starts a gRPC server (with health and
reflection), prints a ``READY <address>`` line on stdout for launchers, and
blocks until SIGINT/SIGTERM, then shuts down in order.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Server threads a worker keeps beyond its admission limit (--max-queued-requests): every admitted request's
# call holds a thread while it runs, and these answer the rest at once: refusals (RESOURCE_EXHAUSTED from
# admission), status polls, aborts and health checks.
NUM_CONTROL_THREADS = 32


def worker_server_threads(max_queued_requests: int) -> int:
    """Threads of a worker's gRPC server: more than its admission limit, so admission answers overload."""
    return max_queued_requests + NUM_CONTROL_THREADS


def build_worker(config):
    """Start a worker's runtime and gRPC server; returns (server, runtime, servicer). Does not block."""
    from splitserve.rpc.auth import Credentials
    from splitserve.rpc.worker import WorkerRuntime
    from splitserve.v1 import worker_pb2_grpc

    address = f"{config.host}:{config.port}"
    if config.role == "prefill":
        from splitserve.prefill_service.servicer import PrefillServicer

        runtime = WorkerRuntime(config, make_kv_connector=_kv_sender_factory(config))
        servicer = PrefillServicer(runtime)
        services = [(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer, "splitserve.v1.PrefillWorker")]
    else:
        from splitserve.decode_service.servicer import DecodeServicer

        runtime = WorkerRuntime(config, make_kv_connector=_kv_receiver_factory(config))
        servicer = DecodeServicer(runtime)
        services = [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer, "splitserve.v1.DecodeWorker")]
    server = start_worker_server(address, services, config.max_queued_requests,
                                 Credentials(cluster_token=config.cluster_token), tls=config.tls)
    bound = f"{config.host}:{server.port}"
    runtime.metrics_server = None
    service_name = services[0][2]
    server.set_service_serving(service_name, False)  # ready (health of the service) once warmed up and registered
    try:
        if config.metrics_port is not None:
            from splitserve.rpc.metrics import serve_metrics

            runtime.metrics_server = serve_metrics(runtime.metrics.registry, config.host, config.metrics_port)
        runtime.start(bound)
    except BaseException:
        server.stop(0)
        runtime.stop()
        raise
    server.set_service_serving(service_name, True)
    return server, runtime, servicer


def _kv_sender_factory(config):
    """``(transport, counters) -> connector`` of a prefill worker: LMCacheSender over the worker's LMCache store
    with --kv-transfer lmcache, else KVSender over its transport (with the test-only faults, if any)."""
    if config.kv_transfer == "lmcache":
        from splitserve.prefill_service.lmcache_sender import LMCacheSender

        if config.kv_faults is not None and config.kv_faults.enabled:
            logger.warning("KV fault injection applies to p2p and redis only: LMCache stores go untouched.")
        return lambda store, counters: LMCacheSender(store)
    from splitserve.prefill_service.sender import KVSender

    return lambda transport, counters: KVSender(transport, config.kv_faults)


def _kv_receiver_factory(config):
    """``(transport, counters) -> connector`` of a decode worker: LMCacheReceiver over the worker's LMCache
    store with --kv-transfer lmcache, else KVReceiver over its transport."""
    if config.kv_transfer == "lmcache":
        from splitserve.decode_service.lmcache_receiver import LMCacheReceiver

        return LMCacheReceiver
    from splitserve.decode_service.receiver import KVReceiver

    return KVReceiver


def start_worker_server(address: str, services, max_queued_requests: int, credentials=None, tls=None):
    """Start a worker's gRPC server (``start_server``) sized by :func:`worker_server_threads`.

    Every admitted request holds a server thread; with fewer threads than ``max_queued_requests``,
    the calls beyond them would wait for one until their deadline instead of hearing RESOURCE_EXHAUSTED.
    ``credentials`` (``splitserve.rpc.auth.Credentials``): the cluster token its calls must carry (None: open).
    ``tls`` (``splitserve.rpc.tls.TLSConfig``): serve TLS, mutual when it has a CA (None: plaintext).
    """
    from splitserve.rpc.server import start_server

    return start_server(address, services, max_workers=worker_server_threads(max_queued_requests),
                        credentials=credentials, tls=tls)


def run_worker(config) -> int:
    """Serve as a worker until a signal; returns the exit status."""
    from splitserve.rpc.server import wait_for_shutdown_signal

    server, runtime, servicer = build_worker(config)
    print(f"READY {runtime.address} {config.role} {runtime.worker_id}", flush=True)
    logger.info("%s worker %s serving on %s", config.role, runtime.worker_id, runtime.address)
    try:
        wait_for_shutdown_signal()
    finally:
        logger.info("Shutting down worker %s: draining", runtime.worker_id)
        server.set_service_serving(server.service_names[0], False)  # not ready; alive ("") until it stops
        runtime.state = runtime.draining_state()
        if runtime.membership is not None:
            runtime.membership.drain()
        if not runtime.wait_idle(config.drain_timeout_seconds):
            logger.warning("%d requests still in flight after %.0f s; aborting them", runtime.num_in_flight,
                           config.drain_timeout_seconds)
            if config.role == "prefill":
                # Its prefills end at the engine's next step (UNAVAILABLE: the router has them prefilled
                # elsewhere) instead of running on through the server's grace below. Decode streams are left to
                # the grace and then cancelled, which the router answers by moving them to another worker.
                runtime.loop.stop()
        server.stop(1.0)
        runtime.stop()
    return 0


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Every process of a cluster logs this way: the request's ids as fields of every line about it."""
    from splitserve.common.log_fields import configure_logging as configure

    configure(level, log_format)
