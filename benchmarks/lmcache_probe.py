"""The ``lmcache`` rows of ``benchmarks/kv_transfer.py``: LMCache's store and retrieve beside raw redis-py
(its ``RedisCeiling``, the redis rows' ceiling, SET and GET timed apart).

LMCache moves KV in two steps, so it gets two rows, each against its own ceiling on the same bytes:

* ``lmcache-store``: the sender process calls ``LMCacheKVStore.store`` on a prompt's scattered blocks;
  timed from the call until this process's ``lookup`` sees the whole prompt in Redis (store returns before
  Redis has the data, and there is no flush: the reader polls, as a decode worker does). Ceiling: a
  pipelined redis-py ``SET`` of the same bytes in pieces of one block, in the sender.
* ``lmcache-retrieve``: ``retrieve`` of the whole prompt into other blocks of a cache here. Ceiling: a
  pipelined ``GET`` of those pieces here.

Each repeat stores a fresh prompt (random token ids): LMCache skips chunks it holds already.
"""

from __future__ import annotations

import random
import time

import torch

CHUNK_TOKENS = 256
LOOKUP_POLL_SECONDS = 0.002


class LMCacheProbe:
    """Times one LMCache store (in the sender process) and one retrieve (here) per call of ``once``."""

    def __init__(self, sender, url: str, layout, num_cache_blocks: int) -> None:
        from splitserve.kvtransfer.lmcache_connector import LMCacheKVStore

        self.sender, self.url, self.layout = sender, url, layout
        self.store = LMCacheKVStore(url, "bench", layout, chunk_size=CHUNK_TOKENS, local_cpu_bytes=256 << 20,
                                    ttl_seconds=60)
        self.cache = torch.zeros(layout.payload_shape(num_cache_blocks))
        self.random = random.Random(0)
        self.count = 0

    def once(self, num_blocks: int) -> tuple[float, float]:
        """(store seconds until all landed, retrieve seconds) of a fresh prompt of ``num_blocks`` blocks."""
        num_tokens = num_blocks * self.layout.block_size
        token_ids = [self.random.randrange(49152) for _ in range(num_tokens)]
        reply = self.sender.ask(kind="lmcache_store", num_blocks=num_blocks, url=self.url, token_ids=token_ids,
                                chunk_tokens=CHUNK_TOKENS)
        while self.store.lookup(token_ids) < num_tokens:
            if time.monotonic() - reply["started"] > 60:
                raise RuntimeError("lmcache: the stored prompt did not land in Redis within 60 s")
            time.sleep(LOOKUP_POLL_SECONDS)
        landed = time.monotonic()
        blocks = [(11 * index + 3) % self.cache.shape[0] for index in range(num_blocks)]
        started = time.monotonic()
        loaded = self.store.retrieve(token_ids, self.cache, blocks, num_tokens)
        retrieved = time.monotonic()
        if loaded != num_tokens:
            raise RuntimeError(f"lmcache: retrieve loaded {loaded} of {num_tokens} tokens")
        return landed - reply["started"], retrieved - started

    def close(self) -> None:
        self.store.close()

