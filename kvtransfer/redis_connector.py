"""The ``redis`` connector: payloads as binary values in Redis with a TTL, announced on the receiver's inbox list.

Sender, per payload, in one pipeline on one connection (so Redis applies it
in order): ``SET`` each layer of the payload as its own piece (one huge value
was erratic to read on this machine) with a TTL, then ``RPUSH`` an
envelope (the length-prefixed header and the piece keys) onto the decode
worker's inbox list and ``EXPIRE`` the list. ``send`` returns once Redis has
applied it. Receiver: a thread ``BLPOP``s its inbox, reads the pieces with
``GETDEL`` (consumed keys are deleted), verifies, and delivers. Keys of
cancelled or abandoned transfers are deleted or expire by TTL: nothing
accumulates.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import uuid
import zlib

import redis
import torch

from splitserve.kvtransfer.base import (BlockSource, KVConnector, KVEndpointInfo, KVLayout, KVTransferError, OnError,
                                        OnPayload, ReceivedPayload, TransferHeader, payload_layers, payload_num_bytes,
                                        payload_tensor, verify)

logger = logging.getLogger(__name__)


class RedisConnector(KVConnector):
    """Options: ``url`` (redis://host:port/db, this worker's Redis), ``key_prefix`` (default "splitserve:kv:"),
    ``ttl_seconds`` (default 60)."""

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout, url: str = "redis://127.0.0.1:6379/0",
                 key_prefix: str = "splitserve:kv:", ttl_seconds: float = 60.0) -> None:
        super().__init__(worker_id, model_fingerprint, layout)
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_ms = int(float(ttl_seconds) * 1000)
        self.inbox = f"{key_prefix}inbox:{worker_id}:{uuid.uuid4().hex[:8]}"
        self._clients: dict[str, redis.Redis] = {}
        self._clients_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._local = threading.local()  # per sending thread: a reused staging buffer
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the receiving thread's reused buffer

    def _client(self, url: str) -> redis.Redis:
        with self._clients_lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
            return client

    # ---- decode side ---------------------------------------------------------------------

    def endpoint(self) -> KVEndpointInfo:
        return KVEndpointInfo("redis", self.url, self.worker_id, {"inbox": self.inbox})

    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        self._on_payload, self._on_error = on_payload, on_error
        # A connection of its own: BLPOP blocks it.
        self._inbox_client = redis.Redis.from_url(self.url, socket_connect_timeout=5, socket_timeout=30)
        self._thread = threading.Thread(target=self._receive, name="redis-kv-inbox", daemon=True)
        self._thread.start()

    def cancel(self, transfer_id: str) -> None:
        with self._clients_lock:
            self._cancelled.add(transfer_id)
            if len(self._cancelled) > 100_000:
                self._cancelled.clear()

    def _receive(self) -> None:
        client = self._inbox_client
        while not self._closed.is_set():
            try:
                item = client.blpop([self.inbox], timeout=1)
            except redis.RedisError as error:
                if self._closed.is_set():
                    return
                logger.warning("Reading the KV inbox %s failed: %s", self.inbox, error)
                self._closed.wait(0.5)
                continue
            if item is not None:
                self._handle(client, item[1])

    def _handle(self, client: redis.Redis, envelope: bytes) -> None:
        transfer_id = None
        try:
            (header_length,) = struct.unpack_from("<I", envelope)
            header = TransferHeader.from_bytes(envelope[: 4 + header_length])
            transfer_id = header.transfer_id
            keys = json.loads(envelope[4 + header_length :])
            pipeline = client.pipeline(transaction=False)
            for key in keys:
                pipeline.getdel(key)
            pieces = pipeline.execute()
            with self._clients_lock:
                cancelled = transfer_id in self._cancelled
            if cancelled:
                return
            if any(piece is None for piece in pieces):
                raise KVTransferError("some of its pieces are gone from Redis (expired?)")
            # One copy into a reused buffer, checksummed on the way (valid until the callback returns).
            num_bytes = sum(len(piece) for piece in pieces)
            if self._buffer.numel() < num_bytes:
                self._buffer = torch.empty(num_bytes, dtype=torch.uint8)
            data = memoryview(self._buffer.numpy())[:num_bytes]
            checksum, offset = 0, 0
            for piece in pieces:
                data[offset : offset + len(piece)] = piece
                checksum = zlib.crc32(piece, checksum)
                offset += len(piece)
            verify(header, data, self.model_fingerprint, self.layout, checksum=checksum)
            payload = payload_tensor(header, data)
        except KVTransferError as error:
            self._on_error(transfer_id, error)
            return
        except (ValueError, redis.RedisError) as error:
            self._on_error(transfer_id, KVTransferError(f"a bad KV envelope or a Redis error: {error}"))
            return
        try:
            self._on_payload(ReceivedPayload(header, payload))
        except Exception:
            logger.exception("KV payload handler failed for transfer %s", transfer_id)

    # ---- prefill side ------------------------------------------------------------------------

    def send(self, destination: KVEndpointInfo, header: TransferHeader, payload) -> None:
        inbox = destination.options.get("inbox")
        if not inbox:
            raise KVTransferError(f"The KV endpoint of {destination.worker_id} has no inbox option.")
        num_bytes = payload_num_bytes(payload)
        staging = None
        if isinstance(payload, BlockSource):
            staging = getattr(self._local, "staging", None)
            if staging is None or staging.numel() < num_bytes:
                staging = self._local.staging = torch.empty(num_bytes, dtype=torch.uint8)
        base = f"{self.key_prefix}{header.transfer_id}:{header.first_token_position}:"
        keys, checksum = [], 0
        try:
            pipeline = self._client(destination.address).pipeline(transaction=False)
            # One piece per layer (a few MB at most); the pieces are queued while the next layer is gathered.
            for index, segment in enumerate(payload_layers(payload, staging)):
                data = memoryview(segment.numpy())
                checksum = zlib.crc32(data, checksum)
                keys.append(f"{base}{index}")
                pipeline.set(keys[-1], data, px=self.ttl_ms)
            header.payload_num_bytes = num_bytes
            if header.checksum is None:
                header.checksum = checksum & 0xFFFFFFFF
            pipeline.rpush(inbox, header.to_bytes() + json.dumps(keys).encode())
            pipeline.pexpire(inbox, self.ttl_ms)
            pipeline.execute()
        except redis.RedisError as error:
            raise KVTransferError(f"Sending KV through Redis at {destination.address} failed: {error}") from None

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(3)
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
