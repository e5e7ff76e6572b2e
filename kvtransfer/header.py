"""The payload header (format version 2), its checksums and the receiver's verification.

A transfer moves one prompt's KV from a prefill worker to a decode worker as
one or more payloads. Each payload holds consecutive prompt tokens starting at
a multiple of the block size: the blocks ``kv_cache[block_ids]`` one after the
other, ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]`` (C
order, little-endian): per block, per layer the keys, then the values. That is
the engine's block-major cache layout (``layout.py``), so a block travels as
one contiguous piece of the cache (format version 2; version 1 was head-major).
A ``KVTransferHeader`` (worker.proto) travels in front of each payload with a
4-byte little-endian length prefix; the receiver checks it (version, model
fingerprint, layout, size, checksum) before any byte reaches its cache.
Gathering and scattering blocks live in ``blocks.py``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.kvtransfer.blocks import BlockSource, checksum, checksum_of_pieces, payload_bytes
from splitserve.kvtransfer.errors import KVTransferError, KVVerificationError
from splitserve.kvtransfer.layout import KVLayout
from splitserve.v1 import worker_pb2

if TYPE_CHECKING:
    from collections.abc import Buffer

FORMAT_VERSION = 2

# --kv-checksum: "xxh3" (XXH3-64 of every payload, computed by the sender and verified by the receiver)
# or "none" (neither; the transport's own integrity is trusted, as vLLM's and SGLang's KV connectors do).
CHECKSUM_TYPES = {"xxh3": worker_pb2.KV_CHECKSUM_TYPE_XXH3_64, "none": worker_pb2.KV_CHECKSUM_TYPE_NONE}
_CHECKSUM_TYPES_BY_PB = {value: key for key, value in CHECKSUM_TYPES.items()}


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


def check_header(header: TransferHeader, model_fingerprint: str, layout: KVLayout) -> None:
    """Check what a header says against this worker's fingerprint and layout, before any of its payload is read:
    the format, the model, the layout, a start on a block boundary and a payload size its blocks account for.

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
    expected = header.num_blocks * layout.block_num_bytes
    if header.payload_num_bytes != expected:
        raise KVVerificationError(f"The header says {header.payload_num_bytes} payload bytes, but {header.num_tokens} "
                                  f"tokens in {header.num_blocks} blocks need {expected}.")


def verify(header: TransferHeader, payload: torch.Tensor | Buffer | BlockSource, model_fingerprint: str,
           layout: KVLayout, checksum_type: str = "xxh3") -> None:
    """Check a received payload (its bytes, a tensor, or blocks of a memory) against this worker's fingerprint and
    layout (:func:`check_header`), then its size and checksum.

    Args:
        checksum_type: this worker's --kv-checksum: "xxh3" verifies the checksum and refuses payloads
            without one; "none" verifies everything but the bytes' checksum.

    Raises:
        KVVerificationError: saying what differs.
    """
    check_header(header, model_fingerprint, layout)
    if isinstance(payload, BlockSource):  # blocks not gathered (a mapped peer's memory): hashed piece by piece
        num_bytes = payload.num_bytes
        data = None if payload.kv_cache.device.type != "cpu" else payload
    elif isinstance(payload, torch.Tensor) and payload.device.type != "cpu":
        data, num_bytes = None, payload.numel() * payload.element_size()  # on a GPU: its bytes stay there
    else:
        data = payload_bytes(payload) if isinstance(payload, torch.Tensor) else memoryview(payload).cast("B")
        num_bytes = len(data)
    if num_bytes != header.payload_num_bytes:
        raise KVVerificationError(f"The payload has {num_bytes} bytes, header says {header.payload_num_bytes}.")
    if checksum_type == "none":
        return
    if header.checksum_type != "xxh3":
        raise KVVerificationError("The sender sent this KV without a checksum (--kv-checksum none) and this worker "
                                  "requires one (--kv-checksum xxh3): start both with the same --kv-checksum.")
    if data is None:
        raise KVVerificationError("A KV payload on a GPU cannot be checksummed on the host: receive it with "
                                  "--kv-checksum none (the p2p connector does so for CUDA caches).")
    if isinstance(data, BlockSource):
        actual = checksum_of_pieces(payload_bytes(data.block(index)) for index in range(data.num_blocks))
    else:
        actual = checksum(data)
    if actual != header.checksum:
        raise KVVerificationError(f"Checksum mismatch: the payload's XXH3-64 is {actual:016x}, the header says "
                                  f"{(header.checksum or 0):016x}.")


def payload_tensor(header: TransferHeader, data: Buffer | torch.Tensor) -> torch.Tensor:
    """A verified payload's bytes (a buffer, or a contiguous uint8 tensor on any device) as
    ``[n, layers, 2, kv_heads, block_size, head_size]`` (no copy when writable)."""
    if isinstance(data, torch.Tensor):
        flat = data.view(-1)
    else:
        flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return flat.view(header.layout.dtype).view(header.layout.payload_shape(header.num_blocks))
