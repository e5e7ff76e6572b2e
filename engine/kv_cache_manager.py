"""Which KV blocks each request holds, and prefix reuse across requests.

Sits between the scheduler and the :class:`BlockPool`: it turns "this request
needs N more token slots" into block allocations, and finds the longest run of
already-computed full blocks for a new prompt by its chained block hashes.

Block hashes chain: ``hash(block i) = H(hash(block i-1) || token ids of block i)``
(``splitserve.common.block_hash``), so that two processes (a prefill and a
decode worker, and the router's prefix-aware policy) agree on them.
"""

from __future__ import annotations

from typing import NamedTuple

from splitserve.common.block_hash import hash_block_tokens
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.request import Request


class BlockCopy(NamedTuple):
    """The first ``num_tokens`` slots of block ``src`` are to be copied into block ``dst`` before the step's forward
    pass (a forked request's copy of its parent's last, partial block)."""

    src: int
    dst: int
    num_tokens: int


class KVCacheManager:
    """Block tables of all requests of one engine.

    Args:
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        enable_caching: reuse full blocks across requests with the same prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        # Per request: how many of its blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def free_block_count(self) -> int:
        return self.pool.free_block_count

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none)."""
        return self.block_tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks matching the request's tokens.

        At least one token is always left to compute, so that the step that
        schedules the request produces logits for it; nothing is reused for a
        request whose prompt logprobs are still to compute. Changes nothing but
        the request's ``block_hashes``.

        Returns:
            (block ids, number of tokens they hold).
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        if request.wants_prompt_logprobs:  # every prompt position's logits are needed: compute them all
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_block_ids: list[int] | None = None,
        cache_blocks: bool = True,
    ) -> bool:
        """Give the request room for ``num_new_tokens`` more tokens.

        Args:
            request: its ``num_computed_tokens`` tokens are already in its blocks.
            num_new_tokens: tokens to be computed next (after any cached prefix).
            cached_block_ids: prefix-cache hits from :meth:`find_cached_prefix`,
                taken only for a request that holds no blocks yet.
            cache_blocks: register the blocks that these tokens fill in the prefix
                cache now (False while their KV is still to be written from outside).

        Returns:
            False, changing nothing, when the pool has too few free blocks.
        """
        cached_block_ids = cached_block_ids or []
        table = self.block_tables.get(request.request_id, [])
        num_computed = max(request.num_computed_tokens, len(cached_block_ids) * self.block_size)
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.num_blocks_for(total_tokens) - len(table) - len(cached_block_ids)
        # Cache hits that sit in the free list stop being free when taken.
        num_free_hits = sum(1 for block_id in cached_block_ids if self.pool.blocks[block_id].ref_count == 0)
        if max(num_new_blocks, 0) + num_free_hits > self.pool.free_block_count:
            return False
        if cached_block_ids:
            self.pool.touch(cached_block_ids)
            table = table + cached_block_ids
            self._num_cached_blocks[request.request_id] = len(cached_block_ids)
        if num_new_blocks > 0:
            table = table + self.pool.allocate(num_new_blocks)
        self.block_tables[request.request_id] = table
        if cache_blocks:
            self.cache_full_blocks(request, total_tokens)
        return True

    def forkable_tokens(self, request: Request, parent: Request) -> int:
        """How many of ``request``'s first tokens the ``parent``'s blocks hold for it to take (:meth:`fork`): the
        parent's computed tokens, but for the request's last (it computes at least one, for its logits), when the
        request holds no blocks, starts with those tokens, chains its block hashes from the same root (adapter and
        salt) and wants no prompt logprobs; else 0. The parent may be finished (held) or running."""
        num_tokens = min(parent.num_computed_tokens, request.num_tokens - 1)
        if (num_tokens <= 0 or request.request_id in self.block_tables or parent.request_id not in self.block_tables
                or request.wants_prompt_logprobs or request.block_hash_root != parent.block_hash_root
                or request.all_token_ids[:num_tokens] != parent.all_token_ids[:num_tokens]):
            return 0
        return num_tokens

    def fork(self, request: Request, parent: Request, num_tokens: int, num_new_tokens: int,
             take_tail: bool) -> list[BlockCopy] | None:
        """Give ``request`` the KV of its first ``num_tokens`` tokens from the parent's blocks (at most
        :meth:`forkable_tokens`) and room for ``num_new_tokens`` more: the full blocks shared, the last, partial
        one copied into a new block (the copy returned, for the model runner to make before the step), or with
        ``take_tail`` (only for a finished parent) taken over: the parent then holds, and counts as computed, only
        the blocks before it.

        Returns:
            The block copies to make; None, changing nothing, when the pool has too few free blocks.
        """
        size, table = self.block_size, self.block_tables[parent.request_id]
        num_full, tail_tokens = divmod(num_tokens, size)
        tail = table[num_full] if tail_tokens else None
        take_tail = take_tail and tail is not None and self.pool.blocks[tail].ref_count == 1
        total_tokens = num_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_for(total_tokens) - num_full - take_tail
        if num_new_blocks > self.pool.free_block_count:
            return None
        shared = table[:num_full]
        self.pool.touch(shared)
        if take_tail:  # its reference moves from the parent to the request; blocks past it (rejected drafts) go
            self.pool.free(table[:num_full:-1])
            del table[num_full:]
            parent.num_computed_tokens = num_full * size
            shared.append(tail)
        new_blocks = self.pool.allocate(num_new_blocks)
        self.block_tables[request.request_id] = shared + new_blocks
        self._num_cached_blocks[request.request_id] = min(num_full, self._num_cached_blocks.get(parent.request_id, 0))
        self.cache_full_blocks(request, total_tokens)
        if tail is None or take_tail:
            return []
        return [BlockCopy(tail, new_blocks[0], tail_tokens)]

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` of its tokens fill completely."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        table = self.block_tables[request_id]
        for index in range(start, num_full):
            self.pool.cache_block(table[index], request.block_hashes[index])
        self._num_cached_blocks[request_id] = num_full

    def free(self, request: Request) -> None:
        """Return every block the request holds (tail first, for eviction order)."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            self.pool.free(table[::-1])

    def _update_block_hashes(self, request: Request) -> None:
        tokens, size, hashes = request.all_token_ids, self.block_size, request.block_hashes
        for index in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else request.block_hash_root
            hashes.append(hash_block_tokens(parent, tokens[index * size : (index + 1) * size]))
