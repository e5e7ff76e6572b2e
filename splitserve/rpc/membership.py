"""A worker's membership in the cluster: register with the router, heartbeat, leave.

The router's WorkerRegistry grants a lease; a heartbeat thread renews it with a
load report every ``heartbeat_interval_seconds`` and registers again if the
router forgot the worker (router restarted, lease lapsed while paused).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from splitserve.rpc.auth import with_cluster_token
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class Membership:
    """Keeps one worker registered with one router.

    Args:
        router_address: the router's host:port.
        make_registration: builds the RegisterRequest (called again on every re-registration).
        make_load: the worker's load right now, for heartbeats.
        on_state: told the state the router holds (DRAINING after a Drain).
        cluster_token: sent with every call to the router (None: none sent).
    """

    def __init__(
        self,
        router_address: str,
        make_registration: Callable[[], worker_pb2.RegisterRequest],
        make_load: Callable[[], inference_pb2.WorkerLoad],
        on_state: Callable[[int], None] = lambda state: None,
        state: Callable[[], int] = lambda: inference_pb2.WORKER_STATE_SERVING,
        cluster_token: str | None = None,
    ) -> None:
        self.router_address = router_address
        self._make_registration = make_registration
        self._make_load = make_load
        self._on_state = on_state
        self._state = state
        self._channel = grpc.insecure_channel(router_address)
        self._stub = worker_pb2_grpc.WorkerRegistryStub(with_cluster_token(self._channel, cluster_token))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self.worker_id = ""
        self.lease_id = ""
        self.heartbeat_interval_seconds = 1.0

    def start(self, timeout: float = 30.0) -> Membership:
        """Register (retrying until the router answers or ``timeout``), then heartbeat in the background.

        Raises:
            RuntimeError: the router refused the registration or did not answer in time.
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
            self._stub.Drain(worker_pb2.DrainRequest(worker_id=self.worker_id), timeout=2)
        except grpc.RpcError as error:
            logger.warning("Drain request to the router failed: %s", error.details())

    def _register(self, timeout: float) -> None:
        registration = self._make_registration()
        try:
            response = self._stub.Register(registration, timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as error:
            raise RuntimeError(
                f"Cannot register with the router at {self.router_address}: {error.details() or error.code()}"
            ) from None
        self.worker_id, self.lease_id = response.worker_id, response.lease_id
        self.heartbeat_interval_seconds = response.heartbeat_interval_seconds or 1.0
        logger.info("Registered with the router at %s as %s", self.router_address, self.worker_id)

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_seconds):
            try:
                response = self._stub.Heartbeat(
                    worker_pb2.HeartbeatRequest(lease_id=self.lease_id, load=self._make_load(), state=self._state()),
                    timeout=max(self.heartbeat_interval_seconds, 1.0),
                )
                self._on_state(response.state)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    logger.warning("The router forgot this worker's lease; registering again")
                    try:
                        self._register(timeout=5)
                    except RuntimeError as failure:
                        logger.warning("%s", failure)
                else:
                    logger.warning("Heartbeat to %s failed: %s", self.router_address, error.code())
            except Exception:  # a broken load report must not end the heartbeats
                logger.exception("Heartbeat failed")
