"""``KVLayout``: the shape and element type of a worker's KV cache, and their wire form.

Two workers exchange KV only if their layouts are equal. The cache is
block-major, ``[num_blocks, num_layers, 2, num_kv_heads, block_size,
head_size]``, so one block is one contiguous piece of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.kvtransfer.errors import KVVerificationError
from splitserve.v1 import worker_pb2

_DTYPES = {
    torch.float32: worker_pb2.KV_CACHE_DTYPE_FLOAT32,
    torch.float16: worker_pb2.KV_CACHE_DTYPE_FLOAT16,
    torch.bfloat16: worker_pb2.KV_CACHE_DTYPE_BFLOAT16,
}
_DTYPES_BY_PB = {value: key for key, value in _DTYPES.items()}


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
