"""The KV transfer contract: layout, payload header (format version 1), block gather/scatter, the connector interface.

A transfer moves one prompt's KV from a prefill worker to a decode worker as
one or more payloads. Each payload holds consecutive prompt tokens starting at
a multiple of the block size: the blocks ``kv_cache[:, :, :, block_ids]``
gathered into ``[num_layers, 2, num_kv_heads, num_blocks, block_size,
head_size]`` (C order, little-endian): per layer the keys, then the values.
A ``KVTransferHeader`` (worker.proto) travels in front of each payload with a
4-byte little-endian length prefix; the receiver checks it (version, model
fingerprint, layout, checksum) before any byte reaches its cache.
"""

from __future__ import annotations

import struct
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from splitserve.v1 import worker_pb2

FORMAT_VERSION = 1

_DTYPES = {
    torch.float32: worker_pb2.KV_CACHE_DTYPE_FLOAT32,
    torch.float16: worker_pb2.KV_CACHE_DTYPE_FLOAT16,
    torch.bfloat16: worker_pb2.KV_CACHE_DTYPE_BFLOAT16,
}
_DTYPES_BY_PB = {value: key for key, value in _DTYPES.items()}


class KVTransferError(Exception):
    """A transfer failed: unreachable peer, broken connection, or a refused payload."""


class KVVerificationError(KVTransferError):
    """A payload that does not fit this worker (fingerprint, layout, version, size or checksum)."""


@dataclass(frozen=True)
class KVLayout:
    """Shape and element type of a worker's KV cache; two workers exchange KV only if theirs are equal."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_kv_cache(cls, kv_cache: torch.Tensor) -> "KVLayout":
        # kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_size]
        num_layers, _, num_kv_heads, _, block_size, head_size = kv_cache.shape
        return cls(num_layers, num_kv_heads, head_size, kv_cache.dtype, block_size)

    @property
    def block_num_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_size * element

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_size)

    def to_pb(self) -> worker_pb2.KVCacheLayout:
        return worker_pb2.KVCacheLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            dtype=_DTYPES[self.dtype], block_size=self.block_size,
        )

    @classmethod
    def from_pb(cls, message: worker_pb2.KVCacheLayout) -> "KVLayout":
        if message.dtype not in _DTYPES_BY_PB:
            raise KVVerificationError(f"Unknown KV cache dtype {message.dtype} in the header.")
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
    first_token_position: int
    num_tokens: int
    num_prompt_tokens: int
    payload_num_bytes: int
    # CRC-32 of the payload; None until the connector computes it while sending.
    checksum: int | None
    is_last: bool = False
    first_token_id: int | None = None
    format_version: int = FORMAT_VERSION

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    def to_bytes(self) -> bytes:
        message = worker_pb2.KVTransferHeader(
            format_version=self.format_version, transfer_id=self.transfer_id,
            model_fingerprint=self.model_fingerprint, layout=self.layout.to_pb(),
            first_token_position=self.first_token_position, num_tokens=self.num_tokens,
            num_prompt_tokens=self.num_prompt_tokens, payload_num_bytes=self.payload_num_bytes,
            checksum=self.checksum, is_last=self.is_last,
        )
        if self.first_token_id is not None:
            message.first_token_id = self.first_token_id
        body = message.SerializeToString()
        return struct.pack("<I", len(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> "TransferHeader":
        """Parse a length-prefixed header. Raises KVTransferError on anything that is not one."""
        data = bytes(data)
        if len(data) < 4:
            raise KVTransferError(f"A KV header needs at least 4 bytes, got {len(data)}.")
        (length,) = struct.unpack_from("<I", data)
        if length != len(data) - 4:
            raise KVTransferError(f"The KV header says {length} bytes follow; {len(data) - 4} do.")
        message = worker_pb2.KVTransferHeader()
        try:
            message.ParseFromString(data[4:])
        except Exception as error:  # protobuf's DecodeError
            raise KVTransferError(f"The KV header is not a valid KVTransferHeader: {error}") from None
        if message.format_version != FORMAT_VERSION:
            raise KVVerificationError(
                f"KV payload format version {message.format_version} is not supported (this worker reads "
                f"{FORMAT_VERSION})."
            )
        return cls(
            transfer_id=message.transfer_id, model_fingerprint=message.model_fingerprint,
            layout=KVLayout.from_pb(message.layout), first_token_position=message.first_token_position,
            num_tokens=message.num_tokens, num_prompt_tokens=message.num_prompt_tokens,
            payload_num_bytes=message.payload_num_bytes, checksum=message.checksum, is_last=message.is_last,
            first_token_id=message.first_token_id if message.HasField("first_token_id") else None,
            format_version=message.format_version,
        )


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The payload of ``block_ids``: a new contiguous ``[layers, 2, kv_heads, n, block_size, head_size]``."""
    index = torch.tensor(block_ids, dtype=torch.long)
    return kv_cache.index_select(3, index)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """Write a payload ``[layers, 2, kv_heads, n, block_size, head_size]`` into ``block_ids`` of the cache, in place."""
    if payload.shape[3] != len(block_ids):
        raise KVVerificationError(f"The payload holds {payload.shape[3]} blocks; {len(block_ids)} were reserved.")
    index = torch.tensor(block_ids, dtype=torch.long)
    kv_cache.index_copy_(3, index, payload)


class BlockSource:
    """A payload not gathered yet: ``block_ids`` of a KV cache, read layer by layer by the connector,
    so gathering, checksumming and the wire overlap (and no whole-payload copy is made up front).

    Until the connector's ``send`` returns, the blocks must not be freed or rewritten.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
        self.kv_cache = kv_cache  # [layers, 2, kv_heads, blocks, block_size, head_size]
        self.index = torch.tensor(block_ids, dtype=torch.long)
        self.num_layers = kv_cache.shape[0]
        self.layer_shape = (2, kv_cache.shape[2], len(block_ids), kv_cache.shape[4], kv_cache.shape[5])
        self.layer_num_bytes = kv_cache.element_size() * 2 * kv_cache.shape[2] * len(block_ids) * \
            kv_cache.shape[4] * kv_cache.shape[5]
        self.num_bytes = self.layer_num_bytes * self.num_layers

    def gather_layer(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s part of the payload, ``[2, kv_heads, n, block_size, head_size]``, written into ``out``."""
        return torch.index_select(self.kv_cache[layer], 2, self.index, out=out.view(self.layer_shape))


def payload_layers(payload: "torch.Tensor | BlockSource", staging: torch.Tensor | None = None):
    """The payload's bytes layer by layer, as uint8 tensors (views of ``payload``, or gathered into ``staging``,
    a uint8 buffer of at least ``payload.num_bytes``)."""
    if isinstance(payload, BlockSource):
        for layer in range(payload.num_layers):
            out = staging[layer * payload.layer_num_bytes : (layer + 1) * payload.layer_num_bytes]
            payload.gather_layer(layer, out.view(payload.kv_cache.dtype))
            yield out
        return
    flat = payload.contiguous()
    for layer in range(flat.shape[0]):
        yield flat[layer].reshape(-1).view(torch.uint8)


def payload_num_bytes(payload: "torch.Tensor | BlockSource") -> int:
    if isinstance(payload, BlockSource):
        return payload.num_bytes
    return payload.numel() * payload.element_size()


def payload_bytes(payload: torch.Tensor) -> memoryview:
    """The payload's bytes without a copy (the tensor must be contiguous)."""
    return memoryview(payload.contiguous().view(-1).view(torch.uint8).numpy())


def payload_checksum(payload: torch.Tensor) -> int:
    """CRC-32 (zlib's, IEEE) of the payload's bytes."""
    return zlib.crc32(payload_bytes(payload)) & 0xFFFFFFFF


def verify(header: TransferHeader, data: memoryview | bytes, model_fingerprint: str, layout: KVLayout,
           checksum: int | None = None) -> None:
    """Check a received payload against this worker. Raises KVVerificationError saying what differs.

    ``checksum``: the payload's CRC-32 when the caller computed it on the way in (else computed here).
    """
    if header.model_fingerprint != model_fingerprint:
        raise KVVerificationError(
            f"The sender's model fingerprint {header.model_fingerprint} differs from this worker's "
            f"{model_fingerprint}: the workers serve different weights."
        )
    if header.layout != layout:
        raise KVVerificationError(
            f"The sender's KV layout ({header.layout.describe()}) differs from this worker's ({layout.describe()})."
        )
    expected = header.num_blocks * layout.block_num_bytes
    if len(data) != header.payload_num_bytes or header.payload_num_bytes != expected:
        raise KVVerificationError(
            f"The payload has {len(data)} bytes, its header says {header.payload_num_bytes}, and "
            f"{header.num_tokens} tokens in {header.num_blocks} blocks need {expected}."
        )
    actual = (zlib.crc32(data) if checksum is None else checksum) & 0xFFFFFFFF
    if actual != header.checksum:
        raise KVVerificationError(f"Checksum mismatch: the payload's CRC-32 is {actual:08x}, the header says "
                                  f"{header.checksum:08x}.")


def payload_tensor(header: TransferHeader, data) -> torch.Tensor:
    """A verified payload's bytes as ``[layers, 2, kv_heads, n, block_size, head_size]`` (no copy when writable)."""
    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return flat.view(header.layout.dtype).view(header.layout.payload_shape(header.num_blocks))


@dataclass(frozen=True)
class KVEndpointInfo:
    """Where a worker sends or receives KV (mirror of worker_pb2.KVEndpoint)."""

    connector: str
    address: str
    worker_id: str
    options: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def to_pb(self) -> worker_pb2.KVEndpoint:
        return worker_pb2.KVEndpoint(
            connector=_CONNECTORS[self.connector], address=self.address, worker_id=self.worker_id,
            options=dict(self.options),
        )

    @classmethod
    def from_pb(cls, message: worker_pb2.KVEndpoint) -> "KVEndpointInfo":
        names = {value: key for key, value in _CONNECTORS.items()}
        if message.connector not in names:
            raise KVTransferError(f"Unknown KV connector type {message.connector} in the endpoint.")
        return cls(names[message.connector], message.address, message.worker_id, dict(message.options))


_CONNECTORS = {
    "p2p": worker_pb2.KV_CONNECTOR_TYPE_P2P,
    "redis": worker_pb2.KV_CONNECTOR_TYPE_REDIS,
    "lmcache": worker_pb2.KV_CONNECTOR_TYPE_LMCACHE,
}


@dataclass
class ReceivedPayload:
    """A payload that passed verification: its header and its tensor ``[layers, 2, kv_heads, n, block_size, head_size]``.

    The tensor may live in the connector's receive buffer: it is valid only until the callback returns
    (copy it into the cache there, or clone it).
    """

    header: TransferHeader
    payload: torch.Tensor


OnPayload = Callable[[ReceivedPayload], None]
OnError = Callable[["str | None", Exception], None]


class KVConnector(ABC):
    """One per worker process, for both sides of a transfer.

    Decode side: :meth:`endpoint` (advertised to the router), :meth:`start_receiving`
    (callbacks on the connector's threads), :meth:`expect` and :meth:`cancel`.
    Prefill side: :meth:`send`. Both: :meth:`close`.
    """

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout) -> None:
        self.worker_id = worker_id
        self.model_fingerprint = model_fingerprint
        self.layout = layout

    @abstractmethod
    def endpoint(self) -> KVEndpointInfo:
        """Where prefill workers send this worker's KV."""

    @abstractmethod
    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        """Deliver verified payloads to ``on_payload`` (in order per transfer) and failures to
        ``on_error(transfer_id or None, error)``, from the connector's own threads."""

    def expect(self, transfer_id: str, source: KVEndpointInfo | None) -> None:
        """The decode worker now waits for ``transfer_id`` from ``source`` (a hint; may be None)."""

    @abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """The transfer is no longer wanted: its later payloads are dropped and their storage freed."""

    @abstractmethod
    def send(self, destination: KVEndpointInfo, header: TransferHeader, payload: "torch.Tensor | BlockSource") -> None:
        """Hand one payload to ``destination``; returns once it is safely there. Thread-safe.

        ``payload`` is a gathered tensor ``[layers, 2, kv_heads, n, block_size, head_size]`` or a
        :class:`BlockSource`; a ``header.checksum`` of None is computed here, on the way.

        Raises:
            KVTransferError: the destination cannot be reached or the connection broke.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close connections; idempotent, bounded in time."""
