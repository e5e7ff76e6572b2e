"""The copy between splitserve's block-major KV cache and LMCache's memory objects (LMCache's "GPU
connector", which LMCache calls for every chunk it stores or retrieves).

Our cache is one tensor, ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]``; a token at
prompt position p lives in slot ``block_ids[p // block_size] * block_size + p % block_size``. An LMCache
memory object (format ``KV_2LTD`` in 0.5.6) holds a run of tokens as ``[2, num_layers, num_tokens,
num_kv_heads * head_size]``. The copy gathers (``from_gpu``) or scatters (``to_gpu``) whole token rows by
slot with one indexing operation each way, on the cache's own device: the same code serves a CPU cache
and a CUDA one (LMCache's memory objects stay in host memory; the gathered rows cross with one copy).
LMCache's own connectors refuse CPU tensors (they need CUDA streams), hence this class. The copy is
checked against a per-position reference on CPU, and on CUDA where a GPU exists
(``tests/integration/test_lmcache.py``, ``..._on_each_device[cuda]``).
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

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Copy the KV of positions ``[start, end)`` from the cache into ``memory_obj`` (every slot mapped)."""
        kv_cache, slots = kwargs["kvcaches"], kwargs["slot_mapping"][start:end].to(kwargs["kvcaches"].device)
        if bool((slots < 0).any()):
            raise ValueError("Every stored position needs a cache slot.")
        block_size = self.layout.block_size
        # rows: [tokens, layers, 2, kv_heads, head_size]
        rows = kv_cache[slots // block_size, :, :, :, slots % block_size]
        # -> [2, layers, tokens, kv_heads * head_size]
        chunk = rows.permute(2, 1, 0, 3, 4).reshape(2, self.layout.num_layers, end - start, self.hidden_size)
        memory_obj.tensor.copy_(chunk)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Copy ``memory_obj`` (positions ``[start, end)``) into the cache, at the mapped slots only."""
        kv_cache = kwargs["kvcaches"]
        slots = kwargs["slot_mapping"][start:end].to(kv_cache.device)
        keep = (slots >= 0).nonzero().squeeze(1)
        if keep.numel() == 0:
            return
        slots = slots[keep]
        # chunk: [2, layers, tokens, kv_heads * head_size] -> rows: [kept tokens, layers, 2, kv_heads, head_size]
        chunk = memory_obj.tensor.to(kv_cache.device).view(2, self.layout.num_layers, end - start,
                                                           self.layout.num_kv_heads, self.layout.head_size)
        rows = chunk.index_select(2, keep).permute(2, 1, 0, 3, 4)
        block_size = self.layout.block_size
        kv_cache[slots // block_size, :, :, :, slots % block_size] = rows

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(memory_obj, start, end, **kwargs)
