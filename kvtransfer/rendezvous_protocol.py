"""The ``p2p`` connector's rendezvous protocol: an HMAC handshake over the cluster token, then store operations.

The decode worker's KV endpoint is a plain TCP socket bound to its host
(``rendezvous_server.py``); a prefill worker that wants to send to it connects
(``rendezvous_client.py``). Every message is a frame: a 4-byte big-endian
length, then that many bytes (at most ``MAX_FRAME_BYTES``; a longer one ends
the connection).

Handshake (version 1), proving the cluster token without sending it:

    server HELLO   MAGIC, server nonce (32 bytes)
    client PROOF   MAGIC, client nonce (32), HMAC-SHA256(token, "client" | nonces | worker id) (32), worker id
    server ACCEPT  b"OK", HMAC-SHA256(token, "server" | nonces | worker id) (32), the pair number (u32)
      or REFUSE    b"NO", a sentence (never an echo of what the client sent), then the server closes

An open cluster (no token) uses the empty key: both ends must then be open.
The client checks the server's proof too, so a prefill worker never builds a
group with an impostor. The handshake authenticates, it does not encrypt: KV
itself then moves over Gloo's own sockets (run the pools on a trusted network).

After ACCEPT the connection carries the pair's store operations, which Gloo
uses to exchange its addresses: a request is an operation byte and
length-prefixed fields; a reply a status byte (``STATUS_OK`` or
``STATUS_ERROR`` with a sentence) and fields. Each pair has a store of its own
on the decode side, so peers never see or change one another's keys.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct

MAGIC = b"SPLITSERVE-KV-RENDEZVOUS/1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_WORKER_ID_BYTES = 256
MAX_FRAME_BYTES = 64 << 10
# Bounds on what one pair may keep in its store (Gloo writes two keys of about 170 bytes).
MAX_KEY_BYTES = 512
MAX_KEYS_PER_OPERATION = 16
MAX_KEYS_PER_PAIR = 256

ACCEPTED, REFUSED = b"OK", b"NO"
STATUS_OK, STATUS_ERROR = 0, 1
OPERATIONS = ("set", "get", "add", "wait", "check", "compare_set", "delete_key", "num_keys")


class HandshakeRefused(Exception):
    """The other end refused the handshake or failed to prove the cluster token (``str``: a sentence)."""


def token_key(cluster_token: str | None) -> bytes:
    """The HMAC key of a cluster token; an open cluster's is empty."""
    return cluster_token.encode() if cluster_token else b""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes, worker_id: bytes) -> bytes:
    """What ``side`` (b"client" or b"server") sends to prove it holds ``key``, bound to both nonces."""
    message = b"splitserve-kv-rendezvous|" + side + b"|" + server_nonce + client_nonce + worker_id
    return hmac.new(key, message, hashlib.sha256).digest()


def proof_matches(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, received)


# ---- frames ------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack(">I", len(body)) + body)


def receive_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One frame's body. Raises ConnectionError when the peer closes or announces more than ``max_bytes``;
    ``socket.timeout`` under the socket's timeout."""
    (length,) = struct.unpack(">I", _receive_exactly(sock, 4))
    if length > max_bytes:
        raise ConnectionError(f"a rendezvous frame of {length} bytes (at most {max_bytes})")
    return _receive_exactly(sock, length)


def _receive_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        piece = sock.recv(num_bytes - len(data))
        if not piece:
            raise ConnectionError("the rendezvous connection closed")
        data += piece
    return bytes(data)


# ---- fields of store operations ---------------------------------------------------------------


def pack_fields(*fields: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(field)) + field for field in fields)


def unpack_fields(data: bytes, offset: int = 0) -> list[bytes]:
    """The length-prefixed fields of ``data`` from ``offset``. Raises ValueError on a truncated field."""
    fields = []
    while offset < len(data):
        if offset + 4 > len(data):
            raise ValueError("a truncated field length")
        (length,) = struct.unpack_from(">I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise ValueError("a field longer than its frame")
        fields.append(data[offset : offset + length])
        offset += length
    return fields


def pack_int(value: int) -> bytes:
    return struct.pack(">q", value)


def unpack_int(field: bytes) -> int:
    if len(field) != 8:
        raise ValueError("an integer field of the wrong size")
    return struct.unpack(">q", field)[0]
