"""The KV transfer contract: layout, payload header (format version 2), verification, the connector interface.

A transfer moves one prompt's KV from a prefill worker to a decode worker as
one or more payloads. Each payload holds consecutive prompt tokens starting at
a multiple of the block size: the blocks ``kv_cache[block_ids]`` one after the
other, ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]`` (C
order, little-endian): per block, per layer the keys, then the values. That is
the engine's block-major cache layout, so a block travels as one contiguous
piece of the cache (format version 2; version 1 was head-major).
A ``KVTransferHeader`` (worker.proto) travels in front of each payload with a
4-byte little-endian length prefix; the receiver checks it (version, model
fingerprint, layout, size, checksum) before any byte reaches its cache.
Gathering and scattering blocks live in ``blocks.py``.
"""

from __future__ import annotations

import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.kvtransfer.blocks import BlockSource, checksum, gather_blocks, payload_bytes, scatter_blocks
from splitserve.kvtransfer.errors import KVTransferError, KVVerificationError
from splitserve.v1 import worker_pb2

if TYPE_CHECKING:
    from collections.abc import Buffer

__all__ = [
    "FORMAT_VERSION", "BlockSource", "KVConnector", "KVEndpointInfo", "KVLayout", "KVTransferError",
    "KVVerificationError", "ReceivedPayload", "TransferHeader", "gather_blocks", "payload_checksum",
    "scatter_blocks", "verify",
]

FORMAT_VERSION = 2

_DTYPES = {
    torch.float32: worker_pb2.KV_CACHE_DTYPE_FLOAT32,
    torch.float16: worker_pb2.KV_CACHE_DTYPE_FLOAT16,
    torch.bfloat16: worker_pb2.KV_CACHE_DTYPE_BFLOAT16,
}
_DTYPES_BY_PB = {value: key for key, value in _DTYPES.items()}
_CONNECTORS = {
    "p2p": worker_pb2.KV_CONNECTOR_TYPE_P2P,
    "redis": worker_pb2.KV_CONNECTOR_TYPE_REDIS,
    "lmcache": worker_pb2.KV_CONNECTOR_TYPE_LMCACHE,
}
_CONNECTORS_BY_PB = {value: key for key, value in _CONNECTORS.items()}
# --kv-checksum: "xxh3" (XXH3-64 of every payload, computed by the sender and verified by the receiver)
# or "none" (neither; the transport's own integrity is trusted, as vLLM's and SGLang's KV connectors do).
CHECKSUM_TYPES = {"xxh3": worker_pb2.KV_CHECKSUM_TYPE_XXH3_64, "none": worker_pb2.KV_CHECKSUM_TYPE_NONE}
_CHECKSUM_TYPES_BY_PB = {value: key for key, value in CHECKSUM_TYPES.items()}


@dataclass(frozen=True)
class KVLayout:
    """Shape and element type of a worker's KV cache; two workers exchange KV only if theirs are equal."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_kv_cache(cls, kv_cache: torch.Tensor) -> KVLayout:
        # kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]
        _, num_layers, _, num_kv_heads, block_size, head_size = kv_cache.shape
        return cls(num_layers, num_kv_heads, head_size, kv_cache.dtype, block_size)

    @property
    def block_num_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_size * element_size

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]``."""
        return (num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_size)

    def to_pb(self) -> worker_pb2.KVCacheLayout:
        return worker_pb2.KVCacheLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            dtype=_DTYPES[self.dtype], block_size=self.block_size,
        )

    @classmethod
    def from_pb(cls, message: worker_pb2.KVCacheLayout) -> KVLayout:
        if message.dtype not in _DTYPES_BY_PB:
            raise KVVerificationError(f"Unknown KV cache dtype {message.dtype} in the layout.")
        return cls(message.num_layers, message.num_kv_heads, message.head_size, _DTYPES_BY_PB[message.dtype],
                   message.block_size)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head {self.head_size}, {dtype}, "
                f"block {self.block_size}")


@dataclass
class TransferHeader:
    """The header in front of one payload (mirror of worker_pb2.KVTransferHeader)."""

    transfer_id: str
    model_fingerprint: str
    layout: KVLayout
    # Position in the prompt of the payload's first token (a multiple of the block size).
    first_token_position: int
    # Tokens whose KV the payload holds; the payload has ceil(num_tokens / block_size) blocks.
    num_tokens: int
    num_prompt_tokens: int
    payload_num_bytes: int
    # XXH3-64 of the payload bytes; None lets the connector compute it while sending.
    checksum: int | None
    is_last: bool = False
    # The first output token, on the last payload only.
    first_token_id: int | None = None
    format_version: int = FORMAT_VERSION
    # "xxh3", or "none" when the sender computes no checksum (``checksum`` is then 0).
    checksum_type: str = "xxh3"

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    def to_bytes(self) -> bytes:
        """The 4-byte little-endian length, then the serialized ``KVTransferHeader``."""
        message = worker_pb2.KVTransferHeader(
            format_version=self.format_version, transfer_id=self.transfer_id,
            model_fingerprint=self.model_fingerprint, layout=self.layout.to_pb(),
            first_token_position=self.first_token_position, num_tokens=self.num_tokens,
            num_prompt_tokens=self.num_prompt_tokens, payload_num_bytes=self.payload_num_bytes,
            checksum=self.checksum or 0, is_last=self.is_last, first_token_id=self.first_token_id,
            checksum_type=CHECKSUM_TYPES[self.checksum_type],
        )
        body = message.SerializeToString()
        return struct.pack("<I", len(body)) + body

    @classmethod
    def from_bytes(cls, data: Buffer) -> TransferHeader:
        """Parse a length-prefixed header. Raises KVTransferError on anything that is not one, and
        KVVerificationError on a format version this worker does not read."""
        data = bytes(data)
        if len(data) < 4:
            raise KVTransferError(f"A KV header needs at least 4 bytes, got {len(data)}.")
        (length,) = struct.unpack_from("<I", data)
        if length != len(data) - 4:
            raise KVTransferError(f"The KV header's length prefix says {length} bytes follow; {len(data) - 4} do.")
        message = worker_pb2.KVTransferHeader()
        try:
            message.ParseFromString(data[4:])
        except Exception as error:  # protobuf's DecodeError
            raise KVTransferError(f"The KV header is not a valid KVTransferHeader: {error}") from None
        try:
            _check_version(message.format_version)
        except KVVerificationError as error:
            error.transfer_id = message.transfer_id or None  # so the receiver can fail that transfer
            raise
        return cls(
            transfer_id=message.transfer_id, model_fingerprint=message.model_fingerprint,
            layout=KVLayout.from_pb(message.layout), first_token_position=message.first_token_position,
            num_tokens=message.num_tokens, num_prompt_tokens=message.num_prompt_tokens,
            payload_num_bytes=message.payload_num_bytes, checksum=message.checksum, is_last=message.is_last,
            first_token_id=message.first_token_id if message.HasField("first_token_id") else None,
            format_version=message.format_version,
            checksum_type=_CHECKSUM_TYPES_BY_PB.get(message.checksum_type, "unknown"),
        )


def _check_version(format_version: int) -> None:
    if format_version != FORMAT_VERSION:
        raise KVVerificationError(f"KV payload format version {format_version} is not supported (this worker reads "
                                  f"{FORMAT_VERSION}).")


def payload_checksum(payload: torch.Tensor) -> int:
    """XXH3-64 of a payload tensor's bytes."""
    return checksum(payload_bytes(payload))


def verify(header: TransferHeader, payload: torch.Tensor | Buffer, model_fingerprint: str, layout: KVLayout,
           checksum_type: str = "xxh3") -> None:
    """Check a received payload (its bytes, or a tensor) against this worker's fingerprint and layout.

    Args:
        checksum_type: this worker's --kv-checksum: "xxh3" verifies the checksum and refuses payloads
            without one; "none" verifies everything but the bytes' checksum.

    Raises:
        KVVerificationError: saying what differs.
    """
    _check_version(header.format_version)
    if header.model_fingerprint != model_fingerprint:
        raise KVVerificationError(
            f"The sender's model fingerprint {header.model_fingerprint} differs from this worker's "
            f"{model_fingerprint}: the workers serve different weights."
        )
    if header.layout != layout:
        raise KVVerificationError(
            f"The sender's KV layout ({header.layout.describe()}) differs from this worker's ({layout.describe()})."
        )
    if header.first_token_position % layout.block_size:
        raise KVVerificationError(f"The payload starts at token {header.first_token_position}, not at a block "
                                  f"boundary (block size {layout.block_size}).")
    data = payload_bytes(payload) if isinstance(payload, torch.Tensor) else memoryview(payload).cast("B")
    if len(data) != header.payload_num_bytes:
        raise KVVerificationError(f"The payload has {len(data)} bytes, header says {header.payload_num_bytes}.")
    expected = header.num_blocks * layout.block_num_bytes
    if header.payload_num_bytes != expected:
        raise KVVerificationError(f"The header says {header.payload_num_bytes} payload bytes, but {header.num_tokens} "
                                  f"tokens in {header.num_blocks} blocks need {expected}.")
    if checksum_type == "none":
        return
    if header.checksum_type != "xxh3":
        raise KVVerificationError("The sender sent this KV without a checksum (--kv-checksum none) and this worker "
                                  "requires one (--kv-checksum xxh3): start both with the same --kv-checksum.")
    actual = checksum(data)
    if actual != header.checksum:
        raise KVVerificationError(f"Checksum mismatch: the payload's XXH3-64 is {actual:016x}, the header says "
                                  f"{(header.checksum or 0):016x}.")


def payload_tensor(header: TransferHeader, data: Buffer) -> torch.Tensor:
    """A verified payload's bytes as ``[n, layers, 2, kv_heads, block_size, head_size]`` (no copy when writable)."""
    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return flat.view(header.layout.dtype).view(header.layout.payload_shape(header.num_blocks))


@dataclass(frozen=True)
class KVEndpointInfo:
    """Where a worker receives KV (mirror of worker_pb2.KVEndpoint); ``connector`` is "p2p" or "redis"."""

    connector: str
    address: str
    worker_id: str
    options: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def to_pb(self) -> worker_pb2.KVEndpoint:
        return worker_pb2.KVEndpoint(connector=_CONNECTORS[self.connector], address=self.address,
                                     worker_id=self.worker_id, options=dict(self.options))

    @classmethod
    def from_pb(cls, message: worker_pb2.KVEndpoint) -> KVEndpointInfo:
        if message.connector not in _CONNECTORS_BY_PB:
            raise KVTransferError(f"Unknown KV connector type {message.connector} in the endpoint.")
        return cls(_CONNECTORS_BY_PB[message.connector], message.address, message.worker_id, dict(message.options))


@dataclass
class ReceivedPayload:
    """A payload that passed verification against this worker: its header, and its tensor ``[n, layers, 2,
    kv_heads, block_size, head_size]`` in the layout's dtype.

    The tensor lives in the connector's receive buffer: it is valid only until the callback returns
    (copy it into the cache there with ``scatter_blocks``, or clone it).
    """

    header: TransferHeader
    payload: torch.Tensor


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
