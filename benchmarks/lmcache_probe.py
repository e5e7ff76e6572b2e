"""The ``lmcache`` rows of ``benchmarks/kv_transfer.py``: LMCache's store and retrieve beside raw redis-py on
the same bytes, cut the way LMCache cuts them, and where each one's time goes.

LMCache moves KV in two steps, so it gets two rows, each against its own ceiling:

* ``lmcache-store``: the sender process calls ``LMCacheKVStore.store`` on a prompt's scattered blocks;
  timed from the call until this process's ``lookup`` sees the whole prompt in Redis (store returns before
  Redis has the data, and there is no flush: the reader polls, as a decode worker does). Ceiling: one
  pipelined redis-py ``SET`` of values of exactly LMCache's chunks (``CHUNK_TOKENS`` tokens each, 11.8 MB
  for the default model, the last one partial), in the sender, until Redis has answered them all.
* ``lmcache-retrieve``: ``retrieve`` of the whole prompt into other blocks of a cache here. Ceiling: one
  pipelined ``GET`` of those values here.

Both ceilings use a client built as our LMCache Redis adapter builds its own (``connection_options``: the
same socket timeouts), on the same Redis server.

Stages (:class:`StageClock` times our parts inside each process; CLOCK_MONOTONIC is shared by both):

* store: ``Redis`` (while one of the adapter's pipelined ``SET`` of bytes and metadata runs), ``copy``
  (while only our copy out of the block-major cache into LMCache's chunks runs: a copy that overlaps a
  ``SET`` counts as Redis), ``wait`` (from the last ``SET``'s answer until the reader's ``lookup`` sees it
  all: the poll) and ``LMCache`` (the rest: hashing the chunks, allocating them in its buffer, handing them
  to its event loop and our transfer thread). They partition the row's time.
* retrieve: ``lookup`` (LMCache asks Redis which chunks it holds), ``Redis`` (the pipelined ``GET``),
  ``staging`` (the bytes copied into LMCache's buffer, then freed), ``copy`` (our copy from its chunks into the blocks)
  and ``LMCache`` (the rest); they too partition the row's time.

Each repeat stores a fresh prompt (random token ids: LMCache skips chunks it holds already), and its keys are
deleted after the retrieve, as the ceiling deletes its own.
"""

from __future__ import annotations

import inspect
import random
import time

import torch

CHUNK_TOKENS = 256
# The reader's poll: finer than the workers' 15 ms (kvtransfer/lmcache_loads.py), so the wait it adds stays
# small, and coarse enough that its lookups (0.6 ms of CPU each) leave the 2 cores to the transfer.
LOOKUP_POLL_SECONDS = 0.005
TTL_SECONDS = 60.0
MODEL_FINGERPRINT = "bench"
STORE_STAGES = ("copy", "LMCache", "Redis", "wait")
RETRIEVE_STAGES = ("lookup", "Redis", "staging", "copy", "LMCache")


def open_store(url: str, layout):
    """The ``LMCacheKVStore`` both processes use (a 256 MiB buffer: a whole 4,096-token prompt at once)."""
    from splitserve.kvtransfer.lmcache_connector import LMCacheKVStore

    return LMCacheKVStore(url, MODEL_FINGERPRINT, layout, chunk_size=CHUNK_TOKENS, local_cpu_bytes=256 << 20,
                          ttl_seconds=TTL_SECONDS)


def ceiling_client_options(url: str) -> dict:
    """The redis-py connection options our LMCache adapter uses, for the ceiling's client."""
    from splitserve.kvtransfer.lmcache_redis import RedisSettings, connection_options
    from splitserve.kvtransfer.redis_access import RedisAccess

    return connection_options(RedisSettings(url, RedisAccess(), TTL_SECONDS))


class StageClock:
    """Records when our parts of one ``LMCacheKVStore`` run, as (start, end) intervals per stage.

    It wraps methods of the store's engine (reached through private attributes: a benchmark's view inside):
    the copy (:class:`BlockMajorGPUConnector`), and the Redis adapter's pipelines, staging and lookups.
    """

    def __init__(self, store) -> None:
        from splitserve.kvtransfer.lmcache_redis import PLUGIN_NAME

        engine = store._engine
        backend = engine.storage_manager.storage_backends[f"RemoteBackend-{PLUGIN_NAME}"]
        self.redis_connector = redis_connector = backend.connection.getWrappedConnector()
        self.intervals: dict[str, list[tuple[float, float]]] = {}
        for owner, name, stage in ((engine.gpu_connector, "batched_from_gpu", "copy"),
                                   (engine.gpu_connector, "batched_to_gpu", "copy"),
                                   (redis_connector, "_set_all", "Redis"), (redis_connector, "_get_all", "Redis"),
                                   (redis_connector, "_stage_all", "staging"),
                                   (redis_connector, "batched_contains", "lookup")):
            self._time(owner, name, stage)

    def _time(self, owner, name: str, stage: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self.intervals.setdefault(stage, []).append((started, time.monotonic()))

        async def timed_coroutine(*args, **kwargs):
            started = time.monotonic()
            try:
                return await method(*args, **kwargs)
            finally:
                self.intervals.setdefault(stage, []).append((started, time.monotonic()))

        setattr(owner, name, timed_coroutine if inspect.iscoroutinefunction(method) else timed)

    def take(self) -> dict[str, list[tuple[float, float]]]:
        """The intervals recorded since the last call."""
        intervals, self.intervals = self.intervals, {}
        return intervals


def seconds_in(intervals) -> float:
    """The time covered by ``intervals`` (overlaps counted once)."""
    covered, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        covered += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return covered


def split_timeline(started: float, ended: float, intervals: dict, stages: tuple[str, ...],
                   rest: str) -> dict[str, float]:
    """Seconds of ``[started, ended]`` per stage: each instant goes to the first of ``stages`` running then
    (so a copy hidden behind a Redis transfer counts as Redis), else to ``rest``. They sum to the span."""
    edges = sorted({started, ended, *(min(max(point, started), ended)
                                      for stage in stages for interval in intervals.get(stage, [])
                                      for point in interval)})
    seconds = dict.fromkeys((*stages, rest), 0.0)
    for left, right in zip(edges, edges[1:]):
        middle = (left + right) / 2
        running = [stage for stage in stages
                   if any(start <= middle < end for start, end in intervals.get(stage, []))]
        seconds[running[0] if running else rest] += right - left
    return seconds


def store_stages(started: float, landed: float, intervals: dict) -> dict[str, float]:
    """Seconds per store stage, summing to ``landed - started``: ``Redis`` while a ``SET`` pipeline runs,
    ``copy`` while only a copy runs, ``wait`` after the last ``SET`` answered, ``LMCache`` the rest."""
    last_answer = max((end for _, end in intervals.get("Redis", [])), default=landed)
    timeline = dict(intervals, wait=[(last_answer, landed)])
    seconds = split_timeline(started, landed, timeline, ("Redis", "copy", "wait"), "LMCache")
    return {stage: seconds[stage] for stage in STORE_STAGES}


def retrieve_stages(total: float, started: float, intervals: dict) -> dict[str, float]:
    """Seconds per retrieve stage, summing to ``total`` (its steps run one after another)."""
    seconds = split_timeline(started, started + total, intervals, ("lookup", "Redis", "staging", "copy"),
                             "LMCache")
    return {stage: seconds[stage] for stage in RETRIEVE_STAGES}


class SenderStore:
    """The sender process's side: one store, timed by stage."""

    def __init__(self, url: str, layout) -> None:
        self.store = open_store(url, layout)
        self.clock = StageClock(self.store)

    def store_once(self, token_ids: list[int], kv_cache: torch.Tensor, block_ids: list[int]) -> dict:
        self.clock.take()
        started = time.monotonic()
        self.store.store(token_ids, kv_cache, block_ids)
        returned = time.monotonic()
        # The writes land on a transfer thread after store returns: the reader's lookup tells when, then
        # `intervals` collects them (the receiver asks once it has seen them all).
        return {"started": started, "returned": returned}

    def intervals(self, timeout: float = 10.0) -> dict:
        """The stages' intervals of the last store, once its writes have all returned (the reader may see the
        last chunk a moment before the transfer thread has Redis's answer)."""
        connector = self.clock.redis_connector
        deadline = time.monotonic() + timeout
        while connector.writes_in_flight and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.clock.take()

    def close(self) -> None:
        self.store.close()


class LMCacheProbe:
    """Times one LMCache store (in the sender process) and one retrieve (here) per call of ``once``."""

    def __init__(self, sender, url: str, layout, num_cache_blocks: int) -> None:
        import redis

        self.sender, self.url, self.layout = sender, url, layout
        self.store = open_store(url, layout)
        self.clock = StageClock(self.store)
        self.cache = torch.zeros(layout.payload_shape(num_cache_blocks))
        self.random = random.Random(0)
        self.client = redis.Redis.from_url(url)

    def once(self, num_blocks: int) -> dict:
        """Seconds of the store (until all landed) and retrieve of a fresh prompt of ``num_blocks`` blocks,
        with their stages: ``{"store": s, "retrieve": s, "store_stages": {...}, "retrieve_stages": {...}}``."""
        num_tokens = num_blocks * self.layout.block_size
        token_ids = [self.random.randrange(49152) for _ in range(num_tokens)]
        reply = self.sender.ask(kind="lmcache_store", num_blocks=num_blocks, url=self.url, token_ids=token_ids)
        while self.store.lookup(token_ids) < num_tokens:
            if time.monotonic() - reply["started"] > 60:
                raise RuntimeError("lmcache: the stored prompt did not land in Redis within 60 s")
            time.sleep(LOOKUP_POLL_SECONDS)
        landed = time.monotonic()
        store_intervals = self.sender.ask(kind="lmcache_intervals")["intervals"]
        blocks = [(11 * index + 3) % self.cache.shape[0] for index in range(num_blocks)]
        self.clock.take()
        started = time.monotonic()
        loaded = self.store.retrieve(token_ids, self.cache, blocks, num_tokens)
        retrieved = time.monotonic()
        if loaded != num_tokens:
            raise RuntimeError(f"lmcache: retrieve loaded {loaded} of {num_tokens} tokens")
        self._delete_keys()
        return {"store": landed - reply["started"], "retrieve": retrieved - started,
                "store_stages": store_stages(reply["started"], landed, store_intervals),
                "retrieve_stages": retrieve_stages(retrieved - started, started, self.clock.take())}

    def _delete_keys(self) -> None:
        keys = list(self.client.scan_iter(match=f"*{MODEL_FINGERPRINT}@*", count=1000))
        if keys:
            self.client.delete(*keys)  # as the ceiling deletes its own: freed before the next timing

    def close(self) -> None:
        self.client.close()
        self.store.close()
