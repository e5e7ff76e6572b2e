"""The decode end of the rendezvous: a socket bound to the worker's host that pairs only peers proving the token.

Replaces a ``TCPStore`` at the KV endpoint, which listens on every interface,
authenticates nobody, and lets anyone grow its pair counter. Here a peer first
completes the handshake of ``rendezvous_protocol.py``; only then does it get a
pair, with a store of its own (a ``HashStore`` in this process, reached through
its connection), and ``on_pair`` runs for it on a thread of its own.

Bounds, whatever peers send: at most ``max_pending_handshakes`` connections
mid-handshake (a new one evicts the oldest, so a flood of idle or garbage
connections cannot keep a real prefill worker out for long), each for at most
``handshake_timeout`` seconds and one frame of a few hundred bytes; at most
``max_pairs`` pairs (two threads each: its store's connection and
``on_pair``), even for peers holding the token; at most ``MAX_KEYS_PER_PAIR``
keys in a pair's store.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from splitserve.kvtransfer.rendezvous_protocol import (
    ACCEPTED,
    MAC_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_OPERATION,
    MAX_KEYS_PER_PAIR,
    MAX_WORKER_ID_BYTES,
    NONCE_BYTES,
    OPERATIONS,
    REFUSED,
    STATUS_ERROR,
    STATUS_OK,
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

logger = logging.getLogger(__name__)

TOKEN_REFUSAL = (b"This decode worker refused the KV pair: the cluster token does not match (give every worker the "
                 b"same --cluster-token-file or SPLITSERVE_CLUSTER_TOKEN).")
REFUSAL_LOG_SECONDS = 10.0
# on_pair(pair index, the peer's worker id, the pair's store, this end's address on the connection)
OnPair = Callable[[int, str, dist.Store, str], None]


class RendezvousServer:
    """Listens on ``host`` (port 0: a free one, then ``port``) and pairs authenticated peers.

    Args:
        host: the address to bind (only this one).
        cluster_token: the secret peers must prove (None: an open cluster, peers must be open too).
        on_pair: runs once per pair on its own thread, for as long as the pair lives; its slot is free again
            when it returns.
        pair_timeout: the longest a store operation of a pair may wait (Gloo's connect timeout).
    """

    def __init__(self, host: str, cluster_token: str | None, on_pair: OnPair, pair_timeout: timedelta,
                 max_pairs: int = 64, max_pending_handshakes: int = 16, handshake_timeout: float = 5.0) -> None:
        self._key = token_key(cluster_token)
        self._on_pair = on_pair
        self._pair_timeout = pair_timeout
        self.max_pairs = max_pairs
        self.max_pending_handshakes = max_pending_handshakes
        self.handshake_timeout = handshake_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self._listener.settimeout(0.25)
        self.port = self._listener.getsockname()[1]
        self._pending: OrderedDict[socket.socket, float] = OrderedDict()  # mid-handshake, oldest first
        self._pairs: dict[int, socket.socket] = {}
        self._num_pairs_made = 0
        self._num_refused, self._last_refusal_log = 0, -REFUSAL_LOG_SECONDS
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kv-rendezvous", daemon=True)

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    def start(self) -> RendezvousServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop listening and cut every rendezvous connection (pairs already built keep their groups)."""
        self._closed.set()
        if self._thread.ident is not None:  # a sending worker's server is built (for its port) and never started
            self._thread.join(2)
        self._listener.close()
        with self._lock:
            connections = [*self._pending, *self._pairs.values()]
        for connection in connections:
            _cut(connection)

    # ---- accepting ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            self._evict_expired_handshakes()
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # out of descriptors, say: do not spin
                continue
            with self._lock:
                while len(self._pending) >= self.max_pending_handshakes:
                    _cut(self._pending.popitem(last=False)[0])
                self._pending[connection] = time.monotonic()
            threading.Thread(target=self._serve, args=(connection,), name="kv-rendezvous-peer", daemon=True).start()

    def _evict_expired_handshakes(self) -> None:
        expired_before = time.monotonic() - self.handshake_timeout
        with self._lock:
            while self._pending and next(iter(self._pending.values())) < expired_before:
                _cut(self._pending.popitem(last=False)[0])

    def _serve(self, connection: socket.socket) -> None:
        """One connection: the handshake, then, for an accepted pair, its store operations until it closes."""
        pair = None
        try:
            connection.settimeout(self.handshake_timeout)
            pair = self._handshake(connection)
        except (OSError, ConnectionError, ValueError):
            pass  # garbage, silence, or evicted: dropped without an answer
        finally:
            with self._lock:
                self._pending.pop(connection, None)
        if pair is None:
            connection.close()
            return
        index, worker_id = pair
        store = dist.HashStore()
        store.set_timeout(self._pair_timeout)
        local_host = connection.getsockname()[0]
        threading.Thread(target=self._run_pair, args=(index, worker_id, store, local_host), daemon=True,
                         name=f"p2p-recv-{index}").start()
        connection.settimeout(None)
        try:
            self._serve_store(connection, store)
        finally:
            connection.close()

    def _handshake(self, connection: socket.socket) -> tuple[int, str] | None:
        """The server's side of the handshake: the new pair (number, peer worker id), or None if refused."""
        server_nonce = new_nonce()
        send_frame(connection, MAGIC + server_nonce)
        message = receive_frame(connection, len(MAGIC) + NONCE_BYTES + MAC_BYTES + MAX_WORKER_ID_BYTES)
        if not message.startswith(MAGIC) or len(message) < len(MAGIC) + NONCE_BYTES + MAC_BYTES:
            return None
        offset = len(MAGIC)
        client_nonce = message[offset : offset + NONCE_BYTES]
        client_proof = message[offset + NONCE_BYTES : offset + NONCE_BYTES + MAC_BYTES]
        worker_id = message[offset + NONCE_BYTES + MAC_BYTES :]
        if not proof_matches(proof(self._key, b"client", server_nonce, client_nonce, worker_id), client_proof):
            self._log_refusal(connection)
            send_frame(connection, REFUSED + TOKEN_REFUSAL)
            return None
        with self._lock:
            if self._closed.is_set() or len(self._pairs) >= self.max_pairs:
                full = True
            else:
                full, index = False, self._num_pairs_made
                self._num_pairs_made += 1
                self._pairs[index] = connection
        if full:
            send_frame(connection, REFUSED + f"This decode worker has {self.max_pairs} KV pairs already "
                       f"(max_pairs) or is closing.".encode())
            return None
        server_proof = proof(self._key, b"server", server_nonce, client_nonce, worker_id)
        send_frame(connection, ACCEPTED + server_proof + struct.pack(">I", index))
        return index, "".join(c if c.isprintable() else "?" for c in worker_id.decode(errors="replace"))[:128]

    def _log_refusal(self, connection: socket.socket) -> None:
        """A warning about a peer without the token, at most one every ``REFUSAL_LOG_SECONDS``."""
        with self._lock:
            self._num_refused += 1
            if time.monotonic() - self._last_refusal_log < REFUSAL_LOG_SECONDS:
                return
            self._last_refusal_log, num_refused, self._num_refused = time.monotonic(), self._num_refused, 0
        logger.warning("Refused %d KV pair request(s) without the cluster token, the latest from %s", num_refused,
                       _peer_name(connection))

    def _run_pair(self, index: int, worker_id: str, store: dist.Store, local_host: str) -> None:
        try:
            self._on_pair(index, worker_id, store, local_host)
        except Exception:
            logger.exception("KV pair %d failed", index)
        finally:
            with self._lock:
                connection = self._pairs.pop(index, None)
            if connection is not None:
                _cut(connection)

    # ---- a pair's store --------------------------------------------------------------------------------

    def _serve_store(self, connection: socket.socket, store: dist.Store) -> None:
        """Answer the pair's store operations until the connection closes or sends something malformed."""
        while not self._closed.is_set():
            try:
                request = receive_frame(connection)
                if not request or request[0] >= len(OPERATIONS):
                    return
                fields = unpack_fields(request, 1)
                try:
                    reply = bytes([STATUS_OK]) + pack_fields(*self._operate(store, OPERATIONS[request[0]], fields))
                except (dist.DistError, RuntimeError, ValueError) as error:
                    reply = bytes([STATUS_ERROR]) + str(error)[:400].encode()
                send_frame(connection, reply)
            except (OSError, ConnectionError, ValueError):
                return

    def _operate(self, store: dist.Store, operation: str, fields: list[bytes]) -> list[bytes]:
        """One store operation within the pair's bounds. Raises ValueError on a request out of bounds."""
        timeout_ms = 0
        if operation == "wait":
            if not fields:
                raise ValueError("A wait request without its timeout.")
            timeout_ms, keys = unpack_int(fields[0]), fields[1:]
        elif operation == "check":
            keys = fields
        else:
            keys = fields[:1]
        if len(keys) > MAX_KEYS_PER_OPERATION or any(len(key) > MAX_KEY_BYTES for key in keys):
            raise ValueError(f"At most {MAX_KEYS_PER_OPERATION} keys of {MAX_KEY_BYTES} bytes an operation.")
        names = [key.decode(errors="replace") for key in keys]
        if operation in ("set", "add", "compare_set") and store.num_keys() >= MAX_KEYS_PER_PAIR \
                and not store.check(names[:1]):
            raise ValueError(f"A KV pair's store holds at most {MAX_KEYS_PER_PAIR} keys.")
        if operation == "set" and len(fields) == 2:
            store.set(names[0], fields[1])
            return []
        if operation == "get" and len(fields) == 1:
            return [store.get(names[0])]
        if operation == "add" and len(fields) == 2:
            return [pack_int(store.add(names[0], unpack_int(fields[1])))]
        if operation == "wait":
            limit_ms = int(self._pair_timeout.total_seconds() * 1000)
            store.wait(names, timedelta(milliseconds=max(0, min(timeout_ms, limit_ms))))
            return []
        if operation == "check":
            return [pack_int(int(store.check(names)))]
        if operation == "compare_set" and len(fields) == 3:
            return [store.compare_set(names[0], fields[1], fields[2])]
        if operation == "delete_key" and len(fields) == 1:
            return [pack_int(int(store.delete_key(names[0])))]
        if operation == "num_keys" and not fields:
            return [pack_int(store.num_keys())]
        raise ValueError(f"A malformed {operation} request.")


def _cut(connection: socket.socket) -> None:
    """Shut a connection down: the thread that serves it, blocked reading it, returns and closes it."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _peer_name(connection: socket.socket) -> str:
    try:
        host, port = connection.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed connection"
