"""The copy between splitserve's block-major KV cache and LMCache's memory objects (LMCache's "GPU
connector", which LMCache calls for every chunk it stores or retrieves).

Our cache is one tensor, ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]``; a token at
prompt position p lives in slot ``block_ids[p // block_size] * block_size + p % block_size``. An LMCache
memory object (format ``KV_2LTD`` in 0.5.6) holds a run of tokens as ``[2, num_layers, num_tokens,
num_kv_heads * head_size]``.

On a CPU cache the copy goes run by run: positions whose slots follow each other inside one block (a whole
block, for a prompt's blocks) are one strided copy between that block and the chunk, straight from source to
destination. One indexing operation over the slots instead (gather every token's rows, then reorder) reads
4 to 8 times slower here: it builds an intermediate of the whole chunk and copies element-wise. On a CUDA
cache the gather is one kernel on the device, so that path gathers (``from_gpu``) or scatters (``to_gpu``)
whole token rows by slot with one indexing operation and crosses to or from host memory (where LMCache's
memory objects live) with one copy. LMCache's own connectors refuse CPU tensors (they need CUDA streams),
hence this class. Both paths are checked against a per-position reference (``tests/integration/
test_lmcache.py``, ``..._on_each_device[cuda]`` where a GPU exists).
"""

from __future__ import annotations

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from splitserve.kvtransfer.layout import KVLayout


def slot_mapping(block_ids: list[int], num_tokens: int, block_size: int, device: torch.device | str = "cpu",
                 first_position: int = 0, length: int | None = None) -> torch.Tensor:
    """The cache slot of each prompt position: ``[length]`` int64 (default length ``num_tokens``), -1 for
    positions not to be touched: before ``first_position`` and from ``num_tokens`` on.

    ``block_ids`` must hold ``num_tokens`` tokens (block i holds positions ``[i * block_size, ...)``).
    """
    length = num_tokens if length is None else length
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    slots = torch.full((length,), -1, dtype=torch.long)
    slots[:num_tokens] = blocks * block_size + positions % block_size
    slots[:first_position] = -1
    return slots.to(device)


def slot_runs(slots: list[int], block_size: int) -> list[tuple[int, int, int, int]]:
    """The mapped positions of ``slots`` (a chunk's; -1: none) as runs whose slots follow each other inside
    one block: ``(first position in the chunk, block, first offset in the block, number of tokens)``."""
    runs = []
    position, num_positions = 0, len(slots)
    while position < num_positions:
        slot = slots[position]
        if slot < 0:
            position += 1
            continue
        block, offset = divmod(slot, block_size)
        length, longest = 1, min(num_positions - position, block_size - offset)
        while length < longest and slots[position + length] == slot + length:
            length += 1
        runs.append((position, block, offset, length))
        position += length
    return runs


class BlockMajorGPUConnector(GPUConnectorInterface):
    """Copies token rows between a block-major cache and LMCache memory objects.

    LMCache passes our keyword arguments through: ``kvcaches`` (the cache tensor) and ``slot_mapping``
    (:func:`slot_mapping` of the tokens LMCache was given: ``start:end`` of it are a chunk's).
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.hidden_size = layout.num_kv_heads * layout.head_size

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layout.num_layers, num_tokens, self.hidden_size])

    def _chunk_view(self, memory_obj, num_tokens: int) -> torch.Tensor:
        """``memory_obj``'s tensor as ``[2, layers, tokens, kv_heads, head_size]``."""
        layout = self.layout
        return memory_obj.tensor.view(2, layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_size)

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Copy the KV of positions ``[start, end)`` from the cache into ``memory_obj`` (every slot mapped)."""
        kv_cache, slots = kwargs["kvcaches"], kwargs["slot_mapping"][start:end]
        if bool((slots < 0).any()):
            raise ValueError("Every stored position needs a cache slot.")
        block_size = self.layout.block_size
        if kv_cache.device.type == "cpu":
            chunk = self._chunk_view(memory_obj, end - start)
            for position, block, offset, length in slot_runs(slots.tolist(), block_size):
                # [layers, 2, kv_heads, tokens, head_size] -> [2, layers, tokens, kv_heads, head_size]
                source = kv_cache[block, :, :, :, offset:offset + length].permute(1, 0, 3, 2, 4)
                chunk[:, :, position:position + length].copy_(source)
            return
        slots = slots.to(kv_cache.device)
        # rows: [tokens, layers, 2, kv_heads, head_size]
        rows = kv_cache[slots // block_size, :, :, :, slots % block_size]
        # -> [2, layers, tokens, kv_heads * head_size]
        chunk = rows.permute(2, 1, 0, 3, 4).reshape(2, self.layout.num_layers, end - start, self.hidden_size)
        memory_obj.tensor.copy_(chunk)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Copy ``memory_obj`` (positions ``[start, end)``) into the cache, at the mapped slots only."""
        kv_cache, slots = kwargs["kvcaches"], kwargs["slot_mapping"][start:end]
        chunk = self._chunk_view(memory_obj, end - start)
        if kv_cache.device.type == "cpu":
            for position, block, offset, length in slot_runs(slots.tolist(), self.layout.block_size):
                # [2, layers, tokens, kv_heads, head_size] -> [layers, 2, kv_heads, tokens, head_size]
                source = chunk[:, :, position:position + length].permute(1, 0, 3, 2, 4)
                kv_cache[block, :, :, :, offset:offset + length].copy_(source)
            return
        slots = slots.to(kv_cache.device)
        keep = (slots >= 0).nonzero().squeeze(1)
        if keep.numel() == 0:
            return
        slots = slots[keep]
        # chunk: [2, layers, tokens, kv_heads, head_size] -> rows: [kept tokens, layers, 2, kv_heads, head_size]
        rows = chunk.to(kv_cache.device).index_select(2, keep).permute(2, 1, 0, 3, 4)
        block_size = self.layout.block_size
        kv_cache[slots // block_size, :, :, :, slots % block_size] = rows

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(memory_obj, start, end, **kwargs)
