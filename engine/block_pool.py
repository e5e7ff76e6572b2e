"""The paged KV block allocator: free list, reference counts, prefix-hash cache, LRU eviction.

Plain Python over block ids; the KV tensors themselves live in the model runner.
A block is *free* when no request references it (``ref_count == 0``). A free
block may still be *cached*: it keeps its hash and contents so that a later
request with the same prefix can take it back (:meth:`BlockPool.touch`). A freed
block that holds nothing to reuse (no hash: a partial block, or caching is off)
is handed out again first, before never-used blocks: its memory is already
mapped and likely still in the CPU's caches, where a never-used block of a lazily
mapped cache costs a page fault on its first write. Cached blocks come next,
least recently freed first; a cached block that is handed out loses its hash
(eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chained hash of the block's tokens and every block before it; None until full and cached.
    block_hash: bytes | None = None


class BlockPool:
    """Every KV block of one engine, allocated once.

    Args:
        num_blocks: size of the pool.
        enable_caching: keep hashes of full blocks for prefix reuse.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Free blocks in the order they are handed out: freed blocks without a hash (most recently freed
        # first), then never-used blocks and cached blocks (least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict((block_id, None) for block_id in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def free_block_count(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def cached_block_count(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return 1.0 - self.free_block_count / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, evicting cached contents if needed.

        Returns:
            The block ids, each with ``ref_count`` 1 and no hash.

        Raises:
            RuntimeError: fewer than ``count`` blocks are free (callers check first).
        """
        if count > len(self._free):
            raise RuntimeError(f"Asked for {count} KV blocks, only {len(self._free)} are free.")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes) -> int | None:
        """The id of the cached block with this hash, or None. Changes nothing."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on each block (cache hits); a free one leaves the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free list: a cached block at its
        tail, a block without a hash at its head (handed out next).

        Pass a request's blocks last-first, so that its tail blocks (least likely
        to be shared) are evicted before its prefix.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than it was taken.")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: bytes) -> int:
        """Register a full block under its hash.

        Returns:
            The id now cached under that hash: ``block_id``, or the id already
            cached there (another request computed the same block first; both keep
            their own copy, only the first is found by lookups).
        """
        if not self.enable_caching:
            return block_id
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block_id
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
