"""Payload bytes from and into a KV cache: gather, scatter, a block source, the checksum.

The checksum is XXH3-64 (seed 0) of the payload bytes, through the ``xxhash``
package: a standard non-cryptographic hash (zstd's frame checksums are from the
same family) that runs at memory speed, about 40 GB/s here on data in cache,
where CRC-32 (zlib-ng's, PCLMUL) ran at 15 and zlib's at 6. On a small machine
the sender and the receiver share the cores with the loopback wire, so every
pass over the bytes is paid in throughput.
"""

from __future__ import annotations

import importlib.util

import torch
import xxhash

from splitserve.kvtransfer.errors import KVVerificationError

CHECKSUM_NAME = "XXH3-64"


def checksum(data) -> int:
    """XXH3-64 of ``data`` (a bytes-like object), an unsigned 64-bit integer."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_of_pieces(pieces) -> int:
    """XXH3-64 of the concatenation of ``pieces`` (bytes-like objects, in order), without joining them."""
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
    return state.intdigest()


def payload_bytes(payload: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy when it is contiguous."""
    return memoryview(payload.contiguous().view(-1).view(torch.uint8).numpy())


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The payload of ``block_ids``, a new contiguous tensor (one whole-block copy each).

    kv_cache: [num_blocks, layers, 2, kv_heads, block_size, head_size]
    returns:  [len(block_ids), layers, 2, kv_heads, block_size, head_size]
    """
    return kv_cache.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device))


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """Write a payload into ``block_ids`` of the cache, in place (one ``index_copy_`` of whole blocks).

    kv_cache: [num_blocks, layers, 2, kv_heads, block_size, head_size]   (modified)
    payload:  [len(block_ids), layers, 2, kv_heads, block_size, head_size]
    """
    if payload.shape[0] != len(block_ids):
        raise KVVerificationError(f"The payload holds {payload.shape[0]} blocks; {len(block_ids)} were reserved.")
    if payload.device != kv_cache.device:  # bytes received on the host, for a cache on CUDA: one copy over
        payload = payload.to(kv_cache.device)  # PCIe (synchronous: the connector reuses the host buffer after)
    kv_cache.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device), payload)


def copy_blocks(source: torch.Tensor, source_ids: list[int], kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """Write block ``source_ids[i]`` of ``source`` into block ``block_ids[i]`` of the cache, in place: blocks of the
    same bytes, copied as bytes. On CUDA in one pass (Triton's block copy; without Triton a gather, then an
    ``index_copy_``); on CPU one ``copy_`` a block (a memcpy each: over three times torch's indexed copies of
    rows of bytes here).

    source:   [num_source_blocks, ...], each block contiguous (a peer's cache, or its memory seen as rows of bytes)
    kv_cache: [num_blocks, layers, 2, kv_heads, block_size, head_size], contiguous   (modified)
    """
    if len(source_ids) != len(block_ids):
        raise KVVerificationError(f"The payload holds {len(source_ids)} blocks; {len(block_ids)} were reserved.")
    if kv_cache.device.type == "cuda" and importlib.util.find_spec("triton") is not None:  # CUDA torch brings it
        from splitserve.kernels import triton_ops

        triton_ops.copy_blocks(source, source_ids, kv_cache, block_ids)
        return
    block_bytes = kv_cache[:1].numel() * kv_cache.element_size()
    rows = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
    source_rows = source.reshape(source.shape[0], -1).view(torch.uint8).view(source.shape[0], block_bytes)
    if kv_cache.device.type == "cpu":
        for ids, count in ((source_ids, source_rows.shape[0]), (block_ids, rows.shape[0])):
            if ids and not (0 <= min(ids) and max(ids) < count):
                raise IndexError(f"Block ids {min(ids)}..{max(ids)} are outside the {count} blocks.")
        for source_id, block_id in zip(source_ids, block_ids):
            rows[block_id].copy_(source_rows[source_id])
        return
    device = kv_cache.device
    rows.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=device),
                     source_rows.index_select(0, torch.tensor(source_ids, dtype=torch.long, device=device)))


class BlockSource:
    """A payload not gathered: ``block_ids`` of a KV cache. Each block is one contiguous piece of the
    cache, so a connector sends the blocks themselves (no copy) or gathers runs of them as it needs.

    Until the connector's ``send`` returns, the blocks must not be freed or rewritten.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int] | range) -> None:
        self.kv_cache = kv_cache  # [num_blocks, layers, 2, kv_heads, block_size, head_size]
        self.block_ids = list(block_ids)
        self.num_blocks = len(self.block_ids)
        self.block_num_bytes = kv_cache[:1].numel() * kv_cache.element_size()
        self.num_bytes = self.block_num_bytes * self.num_blocks

    @classmethod
    def of(cls, payload: torch.Tensor | BlockSource) -> BlockSource:
        """``payload`` itself, or a gathered payload tensor seen as all of its own blocks."""
        if isinstance(payload, BlockSource):
            return payload
        return cls(payload, range(payload.shape[0]))

    def block(self, index: int) -> torch.Tensor:
        """Block ``index`` of the payload: a view of the cache ``[layers, 2, kv_heads, block_size, head_size]``
        (contiguous when the cache is)."""
        return self.kv_cache[self.block_ids[index]]

    def on_host(self) -> BlockSource:
        """The payload in host memory, for a transport that reads host bytes (redis): itself where the cache is on
        the CPU; from a CUDA cache, its blocks gathered on the device and copied into pinned host memory in one
        transfer, which has ended when this returns (the blocks may then be freed)."""
        if self.kv_cache.device.type == "cpu":
            return self
        ids = torch.tensor(self.block_ids, dtype=torch.long, device=self.kv_cache.device)
        gathered = self.kv_cache.index_select(0, ids)
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)  # torch caches pinned buffers
        host.copy_(gathered)
        return BlockSource(host, range(self.num_blocks))

    def pieces(self, max_bytes: int) -> list[memoryview]:
        """The payload's bytes as views of the cache, in order, without a copy: runs of blocks consecutive in
        the cache (one contiguous piece each), split to at most ``max_bytes`` (but at least one block)."""
        blocks_per_piece = max(1, max_bytes // self.block_num_bytes)
        pieces: list[memoryview] = []
        start = 0
        while start < self.num_blocks:
            end = start + 1
            while (end < self.num_blocks and end - start < blocks_per_piece
                   and self.block_ids[end] == self.block_ids[end - 1] + 1):
                end += 1
            run = self.kv_cache[self.block_ids[start] : self.block_ids[start] + end - start]
            pieces.append(memoryview(run.contiguous().view(-1).view(torch.uint8).numpy()))
            start = end
        return pieces
