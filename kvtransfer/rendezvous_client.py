"""The prefill end of the rendezvous: prove the cluster token to a decode worker, then use its pair store.

``connect_rendezvous`` performs the handshake of ``rendezvous_protocol.py``
and returns a :class:`RendezvousClient`, a ``torch.distributed.Store`` whose
operations run on the decode worker's store of this pair (Gloo builds the
pair's group over it).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from splitserve.kvtransfer.rendezvous_protocol import (
    ACCEPTED,
    MAC_BYTES,
    MAGIC,
    MAX_WORKER_ID_BYTES,
    OPERATIONS,
    REFUSED,
    STATUS_OK,
    HandshakeRefused,
    new_nonce,
    pack_fields,
    pack_int,
    proof,
    proof_matches,
    receive_frame,
    send_frame,
    token_key,
    unpack_fields,
    unpack_int,
)

GRACE_SECONDS = 5.0  # a reply may take this much longer than the wait it answers


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port). Raises ValueError on anything else."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"A KV endpoint address must be host:port, not {address[:100]!r}.")
    return host.strip("[]"), int(port)


class RendezvousClient(dist.Store):
    """A store whose operations run on the decode worker's store of one pair, over an authenticated
    connection. Thread-safe (one operation at a time). ``local_host``: this end's address on the connection,
    the one Gloo should bind (it reaches the decode worker)."""

    def __init__(self, sock: socket.socket, pair_index: int, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self.pair_index = pair_index
        self.local_host = sock.getsockname()[0]
        self._sock = sock
        self._lock = threading.Lock()

    def _call(self, operation: str, *fields: bytes, wait_seconds: float | None = None) -> list[bytes]:
        """Run one operation remotely; raises DistStoreError with the decode side's sentence on a failure."""
        wait_seconds = self.timeout.total_seconds() if wait_seconds is None else wait_seconds
        with self._lock:
            try:
                self._sock.settimeout(wait_seconds + GRACE_SECONDS)
                send_frame(self._sock, bytes([OPERATIONS.index(operation)]) + pack_fields(*fields))
                reply = receive_frame(self._sock)
            except OSError as error:
                raise dist.DistStoreError(f"The KV rendezvous connection failed during {operation}: {error}") from None
        if not reply:
            raise dist.DistStoreError(f"An empty KV rendezvous reply to {operation}.")
        if reply[0] != STATUS_OK:
            raise dist.DistStoreError(reply[1:501].decode(errors="replace"))
        return unpack_fields(reply, 1)

    def set(self, key, value) -> None:
        self._call("set", _bytes(key), _bytes(value))

    def get(self, key) -> bytes:
        return self._call("get", _bytes(key))[0]

    def add(self, key, amount) -> int:
        return unpack_int(self._call("add", _bytes(key), pack_int(int(amount)))[0])

    def wait(self, keys, timeout=None) -> None:
        timeout = self.timeout if timeout is None else timeout
        seconds = timeout.total_seconds()
        self._call("wait", pack_int(int(seconds * 1000)), *(_bytes(key) for key in keys), wait_seconds=seconds)

    def check(self, keys) -> bool:
        return unpack_int(self._call("check", *(_bytes(key) for key in keys))[0]) != 0

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._call("compare_set", _bytes(key), _bytes(expected_value), _bytes(desired_value))[0]

    def delete_key(self, key) -> bool:
        return unpack_int(self._call("delete_key", _bytes(key))[0]) != 0

    def num_keys(self) -> int:
        return unpack_int(self._call("num_keys")[0])

    def close(self) -> None:
        """Close the connection: the decode worker's pair store is no longer reachable through it."""
        try:
            self._sock.close()
        except OSError:
            pass


def connect_rendezvous(address: str, worker_id: str, cluster_token: str | None,
                       timeout: timedelta) -> RendezvousClient:
    """Prove the cluster token to the decode worker at ``address`` and take a pair; retries a connection that
    is refused or cut (a restarting worker, a handshake evicted by a flood) until ``timeout``.

    Raises:
        HandshakeRefused: the decode worker refused (wrong token, no free pair) or failed to prove the token.
        OSError: the endpoint could not be reached within ``timeout``.
    """
    host, port = split_address(address)
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.05
    while True:
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(remaining, 0.1))
            try:
                sock.settimeout(max(remaining, 0.1))
                pair_index = _handshake(sock, worker_id.encode()[:MAX_WORKER_ID_BYTES], token_key(cluster_token))
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            return RendezvousClient(sock, pair_index, timeout)
        except HandshakeRefused:
            raise
        except (OSError, ConnectionError):
            if time.monotonic() + delay >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _handshake(sock: socket.socket, worker_id: bytes, key: bytes) -> int:
    """The client's side of the handshake; returns the pair number."""
    hello = receive_frame(sock, len(MAGIC) + 64)
    if not hello.startswith(MAGIC) or len(hello) != len(MAGIC) + 32:
        raise HandshakeRefused("The KV endpoint does not speak the splitserve KV rendezvous protocol 1 (another "
                               "service, or another splitserve version).")
    server_nonce, client_nonce = hello[len(MAGIC):], new_nonce()
    send_frame(sock, MAGIC + client_nonce + proof(key, b"client", server_nonce, client_nonce, worker_id) + worker_id)
    reply = receive_frame(sock, 1024)
    if reply.startswith(REFUSED):
        raise HandshakeRefused(reply[len(REFUSED):500].decode(errors="replace"))
    expected = proof(key, b"server", server_nonce, client_nonce, worker_id)
    if (not reply.startswith(ACCEPTED) or len(reply) != len(ACCEPTED) + MAC_BYTES + 4
            or not proof_matches(expected, reply[len(ACCEPTED) : len(ACCEPTED) + MAC_BYTES])):
        raise HandshakeRefused("The KV endpoint did not prove the cluster token: give every worker the same "
                               "cluster token (--cluster-token-file or SPLITSERVE_CLUSTER_TOKEN).")
    return struct.unpack(">I", reply[-4:])[0]


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
