"""The ``redis`` connector: payloads as binary values in Redis with a TTL, announced on the receiver's inbox list.

Sender, per payload, in one pipeline on one connection (so Redis applies it in order): ``SET`` the
payload's bytes in pieces of ``piece_bytes`` (one 46 MB value was erratic to read on this machine)
with a TTL, then ``RPUSH`` an envelope (the length-prefixed header, then the JSON list of piece
keys) onto the decode worker's inbox list and ``PEXPIRE`` the list. ``send`` returns once Redis has
applied it. Receiver: one thread ``BLPOP``s its inbox, reads the pieces with ``GETDEL`` (consumed
keys are deleted) into a reused buffer, verifies and delivers; the envelope's header and keys are
checked before any piece is read (its keys must name this payload's pieces). Redis holds bytes on
the host: a sender whose cache is on CUDA copies each payload's blocks into pinned host memory first
(one transfer), and a receiver's buffer is pinned, so that the decode worker's write into its CUDA
cache is one copy too. Keys of cancelled or refused transfers are deleted when their envelope comes;
abandoned ones expire with their TTL: nothing accumulates. Credentials and TLS: ``redis_access.py``
(the URL this worker advertises never holds a password; each side connects with its own).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import threading
import uuid

import redis
import torch

from splitserve.kvtransfer.blocks import BlockSource, checksum_of_pieces
from splitserve.kvtransfer.connector import (
    DroppedTransfers,
    KVConnector,
    KVEndpointInfo,
    OnError,
    OnPayload,
    ReceivedPayload,
)
from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.header import TransferHeader, check_header, payload_tensor, verify
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.redis_access import CREDENTIALS_HINT, RedisAccess, public_redis_url, url_username

logger = logging.getLogger(__name__)


class RedisConnector(KVConnector):
    """Options: ``url`` (redis://host:port/db or rediss:// for TLS, the Redis this worker receives through; no
    password in it), ``key_prefix`` (default "splitserve:kv:"), ``ttl_seconds`` (default 60), ``piece_bytes``
    (default 4 MiB), ``checksum`` ("xxh3" or "none", see ``header.CHECKSUM_TYPES``), and this worker's
    credentials for every Redis it connects to (``RedisAccess``): ``username``, ``password``, ``tls_ca_file``,
    ``tls_cert_file``, ``tls_key_file``; ``device``, where this worker's cache is ("cpu" or a CUDA device: the
    receive buffer is then pinned).

    Raises:
        ValueError: ``url`` is not a Redis URL or holds a password.
    """

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout, url: str = "redis://127.0.0.1:6379/0",
                 key_prefix: str = "splitserve:kv:", ttl_seconds: float = 60.0, piece_bytes: int = 4 << 20,
                 checksum: str = "xxh3", username: str | None = None, password: str | None = None,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, device: str = "cpu") -> None:
        super().__init__(worker_id, model_fingerprint, layout, checksum)
        self._pin_buffer = torch.device(device).type == "cuda"
        self.url = public_redis_url(url)
        self._access = RedisAccess(username or url_username(url), password, tls_ca_file, tls_cert_file, tls_key_file)
        self.key_prefix = key_prefix
        self.ttl_ms = int(float(ttl_seconds) * 1000)
        self.piece_bytes = int(piece_bytes)
        # A fresh inbox per process: envelopes for a previous incarnation of this worker just expire.
        self.inbox = f"{key_prefix}inbox:{worker_id}:{uuid.uuid4().hex[:8]}"
        self._clients: dict[str, redis.Redis] = {}
        self._clients_lock = threading.Lock()
        self._dropped = DroppedTransfers()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._inbox_client: redis.Redis | None = None
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the receiving thread's, reused

    def _new_client(self, url: str) -> redis.Redis:
        """A client of ``url`` (public: no user name) with this worker's own credentials."""
        return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30,
                                    **self._access.client_options(url))

    def _client(self, url: str) -> redis.Redis:
        try:
            url = public_redis_url(url)
        except ValueError as error:
            raise KVTransferError(f"The decode worker advertises an unusable Redis URL: {error}") from None
        with self._clients_lock:
            if self._closed.is_set():
                raise KVTransferError("The redis KV connector is closed.")
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = self._new_client(url)
            return client

    # ---- decode side ---------------------------------------------------------------------

    def endpoint(self) -> KVEndpointInfo:
        return KVEndpointInfo("redis", self.url, self.worker_id, {"inbox": self.inbox})

    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        self._on_payload, self._on_error = on_payload, on_error
        # A connection of its own: BLPOP blocks it.
        self._inbox_client = self._new_client(self.url)
        try:
            self._inbox_client.ping()
        except redis.RedisError as error:
            if is_refusal(error) or is_tls_failure(error):  # a configuration error: say so at start
                raise KVTransferError(failure_sentence(self.url, error)) from None
            logger.warning("Redis at %s does not answer yet (the inbox thread retries): %s", self.url, error)
        self._thread = threading.Thread(target=self._receive, name="redis-kv-inbox", daemon=True)
        self._thread.start()

    def cancel(self, transfer_id: str) -> None:
        self._dropped.add(transfer_id)

    def _receive(self) -> None:
        client = self._inbox_client
        while not self._closed.is_set():
            try:
                item = client.blpop([self.inbox], timeout=1)
                if item is not None:
                    self._handle(client, item[1])
            except (redis.RedisError, OSError, ValueError, AttributeError) as error:
                # close() cut the connection under the blocking read, or under a reconnect's handshake
                # (redis-py then reads from a parser it has already torn down: AttributeError).
                if self._closed.is_set():
                    return
                if not isinstance(error, redis.RedisError):
                    raise
                logger.warning("Reading the KV inbox %s failed: %s", self.inbox, error)
                self._closed.wait(0.5)

    def _handle(self, client: redis.Redis, envelope: bytes) -> None:
        """Fetch, verify and deliver one payload; refusals go to on_error, once per transfer."""
        transfer_id = None
        try:
            header, keys = _parse_envelope(envelope)
            transfer_id = header.transfer_id
            # Only keys the sender wrote for this payload are read or deleted, whoever pushed the envelope.
            own = [key for key in keys if isinstance(key, str) and key.startswith(self._piece_key_base(header))]
            if transfer_id in self._dropped:
                if own:
                    client.delete(*own)
                return
            if len(own) != len(keys):
                raise KVTransferError("The KV envelope names keys that are not this transfer's pieces.")
            check_header(header, self.model_fingerprint, self.layout)  # before reading any piece
            if not 0 < len(keys) <= header.num_blocks:  # a sender writes a piece per run of whole blocks
                raise KVTransferError(f"The KV envelope names {len(keys)} pieces for {header.num_blocks} blocks.")
            pipeline = client.pipeline(transaction=False)
            for key in keys:
                pipeline.getdel(key)
            pieces = pipeline.execute()
            if transfer_id in self._dropped:
                return
            if any(piece is None for piece in pieces):
                raise KVTransferError(f"Some of the payload's pieces are gone from Redis (older than the "
                                      f"{self.ttl_ms / 1000:g} s TTL?).")
            data = self._join(pieces, header.payload_num_bytes)
            verify(header, data, self.model_fingerprint, self.layout, checksum_type=self.checksum_type)
            payload = payload_tensor(header, data)
        except redis.RedisError:
            raise  # the inbox loop reports it and retries
        except (KVTransferError, ValueError) as error:
            transfer_id = transfer_id or getattr(error, "transfer_id", None)
            if transfer_id is not None:
                self._dropped.add(transfer_id)
            if not isinstance(error, KVTransferError):
                error = KVTransferError(f"An unreadable KV envelope: {error}")
            self._on_error(transfer_id, error)
            return
        try:
            self._on_payload(ReceivedPayload(header, payload))
        except Exception:
            logger.exception("KV payload handler failed for transfer %s", transfer_id)

    def _join(self, pieces: list[bytes], expected: int) -> memoryview:
        """The pieces copied once into the reused receive buffer (valid until the next payload); a
        KVTransferError, before the buffer grows, when they do not hold the ``expected`` bytes."""
        num_bytes = sum(len(piece) for piece in pieces)
        if num_bytes != expected:
            raise KVTransferError(f"The payload's pieces hold {num_bytes} bytes; its header says {expected}.")
        if self._buffer.numel() < num_bytes:
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self._pin_buffer)
        data = memoryview(self._buffer.numpy())[:num_bytes]
        offset = 0
        for piece in pieces:
            data[offset : offset + len(piece)] = piece
            offset += len(piece)
        return data

    # ---- prefill side ------------------------------------------------------------------------

    def send(self, destination: KVEndpointInfo, header: TransferHeader, payload: torch.Tensor | BlockSource) -> None:
        inbox = destination.options.get("inbox")
        if not inbox:
            raise KVTransferError(f"The KV endpoint of {destination.worker_id} has no inbox option.")
        source = BlockSource.of(payload)
        if source.num_blocks != header.num_blocks:
            raise KVTransferError(f"The header says {header.num_tokens} tokens ({header.num_blocks} blocks of "
                                  f"{header.layout.block_size}); the payload holds {source.num_blocks} blocks.")
        # From a CPU cache the blocks themselves, no gathered copy: redis-py writes large values straight to the
        # socket. From a CUDA cache, one copy of them in pinned host memory.
        source = source.on_host()
        pieces = source.pieces(self.piece_bytes)
        if self.checksum_type == "none":
            envelope_header = dataclasses.replace(header, payload_num_bytes=source.num_bytes, checksum=0,
                                                  checksum_type="none")
        else:
            payload_checksum = checksum_of_pieces(pieces) if header.checksum is None else header.checksum
            envelope_header = dataclasses.replace(header, payload_num_bytes=source.num_bytes, checksum=payload_checksum)
        base = self._piece_key_base(header)
        keys = []
        try:
            pipeline = self._client(destination.address).pipeline(transaction=False)
            for index, piece in enumerate(pieces):
                keys.append(f"{base}{index}")
                pipeline.set(keys[-1], piece, px=self.ttl_ms)
            pipeline.rpush(inbox, envelope_header.to_bytes() + json.dumps(keys).encode())
            pipeline.pexpire(inbox, self.ttl_ms)
            pipeline.execute()
        except redis.RedisError as error:
            raise KVTransferError(failure_sentence(public_redis_url(destination.address), error)) from None

    def _piece_key_base(self, header: TransferHeader) -> str:
        """What the name of each of a payload's pieces starts with (its index follows)."""
        return f"{self.key_prefix}{header.transfer_id}:{header.first_token_position}:"

    def close(self) -> None:
        """Stop the inbox thread (its blocking read is interrupted) and close the connections."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._inbox_client is not None:
            self._inbox_client.connection_pool.disconnect()
        if self._thread is not None:
            self._thread.join(2)
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def _parse_envelope(envelope: bytes) -> tuple[TransferHeader, list[str]]:
    if len(envelope) < 4:
        raise KVTransferError(f"A KV envelope of {len(envelope)} bytes is too short.")
    (header_length,) = struct.unpack_from("<I", envelope)
    header = TransferHeader.from_bytes(envelope[: 4 + header_length])
    keys = json.loads(envelope[4 + header_length :])
    if not isinstance(keys, list):
        raise KVTransferError("A KV envelope without its list of piece keys.")
    return header, keys


def is_refusal(error: redis.RedisError) -> bool:
    """Whether Redis refused this worker's credentials (rather than being unreachable or failing)."""
    if isinstance(error, redis.AuthenticationError):
        return True
    message = str(error)
    return message.startswith(("NOAUTH", "WRONGPASS", "NOPERM")) or "without any password configured" in message


def is_tls_failure(error: redis.RedisError) -> bool:
    return "SSL" in str(error)


def failure_sentence(url: str, error: redis.RedisError) -> str:
    """What to tell the operator about a failed Redis call (Redis's and redis-py's reasons never hold the
    password, and ``url`` is the public one)."""
    reason = str(error)[:200]
    if is_refusal(error):
        return f"Redis at {url} refused this worker ({reason}): {CREDENTIALS_HINT}."
    if is_tls_failure(error):
        return (f"TLS with Redis at {url} failed ({reason}): give --redis-tls-ca the CA that signed Redis's "
                f"certificate (and --redis-tls-cert and --redis-tls-key if Redis asks for a client certificate).")
    return f"Sending KV through Redis at {url} failed: {reason}"
