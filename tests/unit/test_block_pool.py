"""BlockPool and KVCacheManager: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.common.block_hash import hash_block_tokens
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import Request


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8))


def test_allocate_hands_out_lowest_ids_first_and_free_returns_them():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.free_block_count == 1
    assert [pool.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    pool.free([2, 1, 0])
    assert pool.free_block_count == 4
    # Freed blocks without a hash come back first, the last freed first (0, 1, 2), before never-used block 3.
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="only 1 are free"):
        pool.allocate(2)
    assert pool.free_block_count == 1


def test_double_free_is_refused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_uncached_blocks_are_reused_before_cached_and_never_used_ones():
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[0], b"prefix")
    pool.free([3, 2, 1, 0])  # block 0 cached, 1..3 hold nothing
    # 1, 2, 3 (most recently freed first), then never-used 4, 5, and the cached block 0 last.
    assert pool.allocate(6) == [1, 2, 3, 4, 5, 0]
    assert pool.lookup(b"prefix") is None and pool.num_evictions == 1


def test_cached_block_survives_free_and_is_evicted_in_lru_order():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block_id, name in zip(blocks, (b"a", b"b", b"c")):
        pool.cache_block(block_id, name)
    pool.free([1, 0, 2])  # free order: 1, 0, 2
    assert pool.free_block_count == 3
    assert pool.lookup(b"a") == 0 and pool.lookup(b"b") == 1 and pool.lookup(b"c") == 2
    # Allocating one block evicts the least recently freed: block 1 ("b").
    assert pool.allocate(1) == [1]
    assert pool.lookup(b"b") is None
    assert pool.blocks[1].block_hash is None
    assert pool.num_evictions == 1
    # A touched cached block leaves the free list; the next eviction skips it.
    pool.touch([0])
    assert pool.blocks[0].ref_count == 1
    assert pool.allocate(1) == [2]
    assert pool.lookup(b"a") == 0
    pool.free([0, 1, 2])
    assert pool.free_block_count == 3


def test_touch_shared_block_counts_references():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"x")
    pool.touch([block])
    assert pool.blocks[block].ref_count == 2
    pool.free([block])
    assert pool.free_block_count == 1  # still held once
    pool.free([block])
    assert pool.free_block_count == 2


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, b"same") == first
    assert pool.cache_block(second, b"same") == first
    assert pool.blocks[second].block_hash is None


def test_hash_chain_is_deterministic_and_depends_on_parent():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert len(first) == 32
    # Prefill and decode workers must agree: another process, another hash seed, same value.
    code = "from splitserve.common.block_hash import hash_block_tokens as h; print(h(None, [1, 2, 3, 4]).hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == first.hex()


def test_manager_allocates_block_table_and_frees_tail_first():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    request = make_request("r", range(10))
    assert manager.allocate_slots(request, 10)
    assert manager.block_ids("r") == [0, 1, 2]
    request.num_computed_tokens = 10
    request.append_output_token(99)
    request.append_output_token(98)
    assert manager.allocate_slots(request, 2)  # tokens 10, 11 fit in block 2
    assert manager.block_ids("r") == [0, 1, 2]
    request.num_computed_tokens = 12
    request.append_output_token(97)
    assert manager.allocate_slots(request, 1)
    assert manager.block_ids("r") == [0, 1, 2, 3]
    manager.free(request)
    assert manager.free_block_count == 8
    # Freed tail first (3, 2, 1, 0) and cached by nothing: they are handed out again before the never-used 4..7.
    assert manager.pool.allocate(8) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_manager_refuses_when_pool_is_short_and_changes_nothing():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("r", range(9))
    assert not manager.allocate_slots(request, 9)
    assert manager.block_ids("r") == []
    assert manager.free_block_count == 2


def test_prefix_cache_hit_shares_blocks_and_leaves_one_token_to_compute():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", range(12))
    assert manager.allocate_slots(first, 12)
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.pool.cached_block_count == 3

    # Same 12 tokens: only 2 blocks may be reused, so the last token is computed.
    same = make_request("b", range(12))
    hits, num_tokens = manager.find_cached_prefix(same)
    assert (hits, num_tokens) == ([0, 1], 8)
    assert manager.allocate_slots(same, 4, hits)
    assert manager.block_ids("b") == [0, 1, 3]
    assert [manager.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]

    # Diverging in the second block: one block reused.
    diverging = make_request("c", [0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert manager.find_cached_prefix(diverging) == ([0], 4)

    manager.free(first)
    manager.free(same)
    assert manager.free_block_count == 10
    # After both are freed the blocks stay findable until evicted.
    again = make_request("d", range(12))
    assert manager.find_cached_prefix(again) == ([0, 1], 8)


def test_prefix_hit_on_free_cached_blocks_counts_them_against_free_space():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    first = make_request("a", range(8))
    assert manager.allocate_slots(first, 8)
    manager.free(first)
    assert manager.free_block_count == 3
    second = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_tokens = manager.find_cached_prefix(second)
    assert (hits, num_tokens) == ([0, 1], 8)
    # 2 hits (both free) + 2 new blocks > 3 free blocks: refused, nothing taken.
    assert not manager.allocate_slots(second, 5, hits)
    assert manager.free_block_count == 3
    assert manager.allocate_slots(second, 4, hits)  # 12 tokens: 2 hits + 1 new
    assert manager.block_ids("b") == [0, 1, 2]
    manager.free(second)
    assert manager.free_block_count == 3


def test_caching_disabled_finds_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    first = make_request("a", range(8))
    assert manager.allocate_slots(first, 8)
    assert manager.find_cached_prefix(make_request("b", range(9))) == ([], 0)
    manager.free(first)
    assert manager.free_block_count == 4
