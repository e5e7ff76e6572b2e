"""The connector interface every KV transport implements, and what it hands the worker.

``KVConnector`` (one per worker process, both sides of a transfer),
``KVEndpointInfo`` (where a worker receives KV), ``ReceivedPayload`` and the
callbacks it goes to, and ``DroppedTransfers``, the connectors' shared record
of transfers whose later payloads are dropped. The payloads themselves are
described in ``header.py``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.common.errors import InvalidRequest
from splitserve.common.types import KVConnectorKind
from splitserve.kvtransfer.blocks import BlockSource, copy_blocks, scatter_blocks
from splitserve.kvtransfer.header import CHECKSUM_TYPES, TransferHeader, payload_tensor
from splitserve.kvtransfer.layout import KVLayout
from splitserve.v1 import worker_pb2

_CONNECTORS = {
    KVConnectorKind.P2P: worker_pb2.KV_CONNECTOR_TYPE_P2P,
    KVConnectorKind.REDIS: worker_pb2.KV_CONNECTOR_TYPE_REDIS,
    KVConnectorKind.LMCACHE: worker_pb2.KV_CONNECTOR_TYPE_LMCACHE,
}
_CONNECTORS_BY_PB = {value: key for key, value in _CONNECTORS.items()}


@dataclass(frozen=True)
class KVEndpointInfo:
    """Where a worker receives KV (mirror of worker_pb2.KVEndpoint); ``connector`` is "p2p" or "redis"."""

    connector: str
    address: str
    worker_id: str
    options: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def to_pb(self) -> worker_pb2.KVEndpoint:
        return worker_pb2.KVEndpoint(connector=_CONNECTORS[KVConnectorKind(self.connector)], address=self.address,
                                     worker_id=self.worker_id, options=dict(self.options))

    @classmethod
    def from_pb(cls, message: worker_pb2.KVEndpoint) -> KVEndpointInfo:
        if message.connector not in _CONNECTORS_BY_PB:
            raise InvalidRequest(f"The KV endpoint's connector {message.connector} is not P2P, REDIS or LMCACHE.")
        return cls(_CONNECTORS_BY_PB[message.connector].value, message.address, message.worker_id, dict(message.options))


class ReceivedPayload:
    """A payload that passed verification against this worker: its header, and its blocks, either bytes the
    connector received (``payload``) or, from a p2p peer that shares this worker's memory, the peer's blocks
    themselves (``source``), which ``write_to`` copies straight into the cache, one pass.

    Both are valid only until the callback returns: copy the blocks into the cache there (``write_to``), or
    clone ``payload``.
    """

    def __init__(self, header: TransferHeader, payload: torch.Tensor | None = None,
                 source: BlockSource | None = None) -> None:
        if (payload is None) == (source is None):
            raise ValueError("A received payload has its bytes or a source of blocks, one of the two.")
        self.header = header
        self.source = source
        self._payload = payload

    @property
    def payload(self) -> torch.Tensor:
        """The blocks as ``[n, layers, 2, kv_heads, block_size, head_size]`` in the layout's dtype (gathered out of
        ``source`` on first use, where the connector received no bytes)."""
        if self._payload is None:
            gathered = self.source.kv_cache.index_select(
                0, torch.tensor(self.source.block_ids, dtype=torch.long, device=self.source.kv_cache.device))
            self._payload = payload_tensor(self.header, gathered.view(-1).view(torch.uint8))
        return self._payload

    @payload.setter
    def payload(self, value: torch.Tensor) -> None:
        self._payload, self.source = value, None

    def write_to(self, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
        """Copy the payload's blocks into ``block_ids`` of the cache, in order (from ``source`` without an
        intermediate copy)."""
        if self.source is not None:
            copy_blocks(self.source.kv_cache, self.source.block_ids, kv_cache, block_ids)
        else:
            scatter_blocks(kv_cache, block_ids, self.payload)


OnPayload = Callable[[ReceivedPayload], None]
OnError = Callable[["str | None", Exception], None]


class KVConnector(ABC):
    """One per worker process, for both sides of a transfer.

    Decode side: :meth:`endpoint` (advertised to the router), :meth:`start_receiving` (callbacks on the
    connector's threads), :meth:`expect` and :meth:`cancel`. Prefill side: :meth:`send`. Both: :meth:`close`.
    No method touches a KV cache except through the payloads it is handed or hands out.
    """

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout, checksum: str = "xxh3") -> None:
        if checksum not in CHECKSUM_TYPES:
            raise ValueError(f"checksum must be one of {', '.join(CHECKSUM_TYPES)}, got {checksum!r}.")
        self.worker_id = worker_id
        self.model_fingerprint = model_fingerprint
        self.layout = layout
        self.checksum_type = checksum  # --kv-checksum: what this worker sends and requires

    @abstractmethod
    def endpoint(self) -> KVEndpointInfo:
        """Where prefill workers send this worker's KV (opens the listening side if needed)."""

    @abstractmethod
    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        """Start the receiving threads: each verified payload goes to ``on_payload`` (in order per transfer,
        one call at a time per sender), each refused payload or broken peer to ``on_error(transfer_id or None,
        error)``, once per transfer. Both are called from the connector's threads and should return quickly."""

    def expect(self, transfer_id: str, source: KVEndpointInfo | None) -> None:  # noqa: B027 (optional hook)
        """The decode worker now waits for ``transfer_id`` from ``source`` (a hint; may be None)."""

    @abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """The transfer is no longer wanted: its later payloads are dropped and their storage freed."""

    @abstractmethod
    def send(self, destination: KVEndpointInfo, header: TransferHeader, payload: torch.Tensor | BlockSource) -> None:
        """Hand one payload to ``destination``; blocks until it is safely there. Thread-safe.

        Args:
            header: its fields describe the whole payload; a ``checksum`` of None is computed here. The
                object is not modified. A connector may split the payload into several consecutive payloads
                of whole blocks (each with its own header), which the receiver delivers one by one.
            payload: a gathered tensor ``[n, layers, 2, kv_heads, block_size, head_size]``, or a
                :class:`BlockSource` (read from the cache here; its blocks must not change until this returns).

        Raises:
            KVTransferError: the destination cannot be reached in time or the connection broke.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close connections; idempotent and bounded in time."""


class DroppedTransfers:
    """Transfer ids whose later payloads are dropped (cancelled or refused); keeps the newest ``capacity``."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._ids: dict[str, None] = {}  # insertion-ordered: the oldest first
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, transfer_id: str) -> None:
        with self._lock:
            self._ids[transfer_id] = None
            while len(self._ids) > self._capacity:
                del self._ids[next(iter(self._ids))]

    def discard(self, transfer_id: str) -> None:
        with self._lock:
            self._ids.pop(transfer_id, None)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._ids
