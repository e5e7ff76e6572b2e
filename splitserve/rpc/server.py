"""Start a gRPC server (plaintext or TLS) with the standard health and reflection services beside ours, and the error
interceptor."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.common.errors import SplitserveError
from splitserve.rpc.auth import (
    API_KEYS_ENV,
    CLUSTER_PREFIXES,
    CLUSTER_TOKEN_ENV,
    PUBLIC_API_PREFIXES,
    Credentials,
    api_key_guard,
    cluster_token_guard,
)
from splitserve.rpc.errors import ErrorInterceptor
from splitserve.rpc.tls import MAX_MESSAGE_BYTES, TLSConfig

logger = logging.getLogger(__name__)

# Streams, keep-alive and big unary messages (KV payloads never go through gRPC).
_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class CannotListen(SplitserveError, RuntimeError):
    """The server's address cannot be bound: its port is taken, or the host is not an address of this machine.

    A sentence for the user (the command line prints it without a traceback); also a ``RuntimeError``.
    """


class RunningServer:
    """A started gRPC server, its bound port and its health servicer."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer, service_names: list[str]):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = service_names

    def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for every service (and the server as a whole, "")."""
        for name in ["", *self.service_names]:
            self.set_service_serving(name, serving)

    def set_service_serving(self, name: str, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for one service name: its readiness. The server as a whole ("") stays
        SERVING from start to stop (liveness), so an orchestrator stops routing to a draining or loading
        process without restarting it."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(name, status)

    def stop(self, grace: float = 2.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1)


def start_server(
    address: str,
    services: Iterable[tuple[Callable[[object, grpc.Server], None], object, str]],
    max_workers: int = 64,
    credentials: Credentials | None = None,
    tls: TLSConfig | None = None,
) -> RunningServer:
    """Bind ``address`` (host:port; port 0 picks a free one) and start serving.

    Every call goes through :class:`~splitserve.rpc.errors.ErrorInterceptor`: an
    exception a servicer raises ends the call with its mapped status code.

    Args:
        services: (add_XServicer_to_server, servicer, full service name) triples.
        max_workers: threads for concurrent calls; every open stream (and unary call) holds one while it runs.
            Calls beyond them wait for a thread; beyond four times as many, gRPC itself refuses them
            (RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"). A service with its own admission limit
            needs more threads than that limit, so its refusal answers first (workers:
            ``splitserve.serve.worker_server_threads``; the router: ``--max-in-flight-requests`` + 16).
        credentials: the secrets to require (:mod:`splitserve.rpc.auth`): API keys on the Inference service,
            the cluster token on WorkerRegistry, PrefillWorker and DecodeWorker; each one not configured
            leaves its services open, with a WARNING. None: no access control and no warning (tests).
        tls: serve TLS with this certificate (:mod:`splitserve.rpc.tls`); with its CA, mutual TLS: a client
            without a certificate signed by the CA fails the handshake (UNAVAILABLE). None: plaintext.

    Returns:
        The running server; its ``port`` is the bound one.

    Raises:
        CannotListen: the address cannot be bound (a ``RuntimeError``); its message says why when it can tell.
        ValueError: ``tls`` has no certificate and key.
    """
    server_credentials = tls.server_credentials() if tls is not None else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         options=_SERVER_OPTIONS, maximum_concurrent_rpcs=max_workers * 4,
                         interceptors=[*_guards(credentials, [name for _, _, name in services]),
                                       ErrorInterceptor()])
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        if server_credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise CannotListen(f"Cannot listen on {address}: {bind_failure_reason(address)}.")
    server.start()
    if tls is not None:
        logger.info("Serving TLS on %s:%d (%s)", host_of(address), port,
                    "mutual: client certificates signed by the CA required" if tls.is_mutual
                    else "no client certificate asked for")
    running = RunningServer(server, port, health_servicer, names)
    running.set_serving(True)
    return running


def bind_failure_reason(address: str) -> str:
    """Why ``address`` (host:port) cannot be listened on, as far as a socket of our own can tell now."""
    return bind_problem(address) or "gRPC could not bind it (set GRPC_VERBOSITY=debug for its reason)"


def bind_problem(address: str) -> str | None:
    """What stops a listener on ``address`` (host:port) now, found by binding it with a socket of our own and
    closing it at once; None when it binds (the port is free, for now)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as error:
        return f"the address does not resolve ({error})"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a closed port's TIME_WAIT is no obstacle
        try:
            probe.bind(sockaddr)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return "the port is taken (another process listens on it); pick another --port"
            if error.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine"
            if error.errno == errno.EACCES:
                return f"port {port} needs privileges to listen on; pick a port above 1023"
            return error.strerror or str(error)
    return None


def _guards(credentials: Credentials | None, service_names: list[str]) -> list[grpc.ServerInterceptor]:
    """The access-control interceptors for ``credentials``; warns once about each guardable service left open."""
    if credentials is None:
        return []
    guards = []
    for prefixes, configured, make_guard, how in (
        (PUBLIC_API_PREFIXES, credentials.api_keys, api_key_guard, f"--api-key-file or {API_KEYS_ENV}"),
        (CLUSTER_PREFIXES, credentials.cluster_token, cluster_token_guard, f"--cluster-token-file or {CLUSTER_TOKEN_ENV}"),
    ):
        guarded = [name for name in service_names if f"/{name}/".startswith(prefixes)]
        if not guarded:
            continue
        if configured:
            guards.append(make_guard(configured))
        else:
            logger.warning("%s is open to anyone who reaches this port: no %s is configured (%s).",
                           " and ".join(guarded), "API key" if prefixes is PUBLIC_API_PREFIXES else "cluster token",
                           how)
    return guards


def wait_for_shutdown_signal() -> None:
    """Block until SIGINT or SIGTERM (main thread only)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def host_of(address: str) -> str:
    """The host part of host:port (brackets of an IPv6 literal kept)."""
    return address.rsplit(":", 1)[0]
