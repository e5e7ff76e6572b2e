"""A worker's membership in the cluster: register with the router, heartbeat, leave.

The router's WorkerRegistry grants a lease; a heartbeat thread renews it with a
load report every ``heartbeat_interval_seconds`` and registers again if the
router forgot the worker (router restarted, lease lapsed while paused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from splitserve.common.errors import Unavailable
from splitserve.rpc.auth import with_cluster_token
from splitserve.rpc.tls import TLSConfig, open_channel
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class RegistrationFailed(Unavailable, RuntimeError):
    """The router refused this worker's registration or did not answer in time (the sentence says which)."""


class Membership:
    """Keeps one worker registered with one router.

    Args:
        router_address: the router's host:port.
        make_registration: builds the RegisterRequest (called again on every re-registration).
        make_load: the worker's load right now, for heartbeats.
        on_state: told the state the router holds (DRAINING after a Drain).
        cluster_token: sent with every call to the router (None: none sent).
        tls: call the router over TLS, presenting this worker's certificate when it has one (the router
            requires it under mutual TLS, and ``splitserve.rpc.tls.peer_identity`` names it there); None:
            plaintext.
        lora_names: the LoRA adapters the worker serves now, told on every heartbeat (HeartbeatRequest.lora_names),
            for a worker whose adapters change while it runs (--lora-dir); None: its registration's hold.
    """

    def __init__(
        self,
        router_address: str,
        make_registration: Callable[[], worker_pb2.RegisterRequest],
        make_load: Callable[[], inference_pb2.WorkerLoad],
        on_state: Callable[[int], None] = lambda state: None,
        state: Callable[[], int] = lambda: inference_pb2.WORKER_STATE_SERVING,
        cluster_token: str | None = None,
        tls: TLSConfig | None = None,
        lora_names: Callable[[], list[str]] | None = None,
    ) -> None:
        self.router_address = router_address
        self._make_registration = make_registration
        self._make_load = make_load
        self._on_state = on_state
        self._state = state
        self._tls = tls
        self._lora_names = lora_names
        self._channel = open_channel(router_address, tls)
        self._stub = worker_pb2_grpc.WorkerRegistryStub(with_cluster_token(self._channel, cluster_token))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self.worker_id = ""
        self.lease_id = ""
        self.heartbeat_interval_seconds = 1.0

    def _heartbeat(self) -> worker_pb2.HeartbeatRequest:
        request = worker_pb2.HeartbeatRequest(lease_id=self.lease_id, load=self._make_load(), state=self._state())
        if self._lora_names is not None:
            request.lora_names.names.extend(self._lora_names())
        return request

    def start(self, timeout: float = 30.0) -> Membership:
        """Register (retrying until the router answers or ``timeout``), then heartbeat in the background.

        Raises:
            RegistrationFailed: the router refused the registration or did not answer in time.
        """
        self._register(timeout)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop heartbeating and deregister (best effort, bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.lease_id:
            try:
                self._stub.Deregister(worker_pb2.DeregisterRequest(lease_id=self.lease_id), timeout=2)
            except grpc.RpcError:
                pass
        self._channel.close()

    def drain(self) -> None:
        """Ask the router to send this worker no new requests."""
        try:
            self._stub.Drain(worker_pb2.DrainRequest(worker_id=self.worker_id, lease_id=self.lease_id), timeout=2)
        except grpc.RpcError as error:
            logger.warning("Drain request to the router failed: %s", error.details())

    def _register(self, timeout: float) -> None:
        registration = self._make_registration()
        registration.previous_lease_id = self.lease_id  # proves this worker made a registration still live
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = self._stub.Register(registration, timeout=max(deadline - time.monotonic(), 0.1),
                                               wait_for_ready=True)
                break
            except grpc.RpcError as error:
                # ALREADY_EXISTS: this address's earlier registration (a previous run of this worker) is still
                # live; the router lets it go once it is silent.
                if error.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() + 0.5 >= deadline:
                    raise RegistrationFailed(f"Cannot register with the router at {self.router_address}: "
                                       f"{self._describe_failure(error, timeout)}") from None
                time.sleep(0.5)
        self.worker_id, self.lease_id = response.worker_id, response.lease_id
        self.heartbeat_interval_seconds = response.heartbeat_interval_seconds or 1.0
        logger.info("Registered with the router at %s as %s", self.router_address, self.worker_id)

    def _describe_failure(self, error: grpc.RpcError, timeout: float) -> str:
        """What went wrong with a registration, in a sentence (no secret: the TLS hint names flags only)."""
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            return error.details() or str(error.code())
        # Register waits for a connection: a router that is down, and a TLS handshake that fails, both end here.
        if self._tls is None:
            return (f"no answer within {timeout:.0f} s (is the router up, and is it plaintext? a TLS router "
                    "needs --tls-ca, and --tls-cert/--tls-key when it requires client certificates).")
        return (f"no TLS connection within {timeout:.0f} s: the router is down, or the handshake failed (the "
                "router's certificate must be signed by --tls-ca and name the address dialed; a router with "
                "--tls-ca requires this worker's --tls-cert, signed by that CA).")

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_seconds):
            try:
                response = self._stub.Heartbeat(
                    self._heartbeat(),
                    timeout=max(self.heartbeat_interval_seconds, 1.0),
                )
                self._on_state(response.state)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    logger.warning("The router forgot this worker's lease; registering again")
                    try:
                        self._register(timeout=5)
                    except RegistrationFailed as failure:
                        logger.warning("%s", failure)
                else:
                    logger.warning("Heartbeat to %s failed: %s", self.router_address, error.code())
            except Exception:  # a broken load report must not end the heartbeats
                logger.exception("Heartbeat failed")
