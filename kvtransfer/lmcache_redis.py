"""LMCache's Redis backend as splitserve needs it: keys with a TTL, credentials kept out of URLs and logs,
bounded waits, one logged reason when Redis is down, and a ``close`` that returns.

LMCache 0.5.6's own ``RedisConnector`` writes two keys per chunk,
``<key>kv_bytes`` then ``<key>metadata`` (a key is
``<model_name>@<world_size>@<worker_id>@<chunk hash>@<dtype>``), without a TTL;
it takes credentials only inside the URL, which LMCache logs; its client has no
socket timeouts; and its ``close`` calls the executor's synchronous
``shutdown`` on the executor's own event loop, so it waits for itself forever
(and ``LMCacheEngineBuilder.destroy`` with it, and a non-daemon loop thread
keeps the process alive). :class:`SplitserveRedisConnector` changes those four
things: every ``SET`` carries ``PX`` (the TTL, milliseconds), the client is
built from a public URL plus a :class:`RedisAccess`, every socket operation is
bounded, and ``close`` lets the writes in flight land (bounded), awaits the
asynchronous shutdown and closes the connection pools. A Redis error is logged
once and read as a miss.

It also moves the chunks faster (``benchmarks/kv_transfer.py`` measures each
way against redis-py on the same chunks, settings and server). LMCache's
connector sends each chunk on a connection of its own through asyncio, whose
transport (Python 3.11) joins and buffers every 11.8 MB value before sending
it, and reads each chunk with two round trips (metadata, then bytes). Ours
writes a whole batch in one pipeline of a synchronous redis-py client on a
thread of its own (``SET`` bytes then metadata, chunk by chunk, sent from
LMCache's buffer without a copy), and reads one with a single pipelined
``GET`` of every chunk's metadata and bytes on the event loop. A lookup asks
for every chunk's metadata key in one pipeline from the calling thread (a
reader polls it until a prompt has landed: through the event loop, each poll
cost 1.2 ms of CPU, beside Redis, on a 2-core machine).

LMCache builds remote connectors itself, from its configuration, through a
"remote storage plugin": :class:`SplitserveRedisAdapter` is that plugin. It
finds its store's settings by the instance id written in the configuration's
``extra_config`` (:func:`register_settings`), so the password never enters
LMCache's configuration, which LMCache logs in full.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
import redis.asyncio as redis_asyncio
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.redis_connector import Priorities, RedisConnector
from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError

from splitserve.kvtransfer.redis_access import CREDENTIALS_HINT, RedisAccess

logger = logging.getLogger(__name__)

# The plugin's name in LMCache's configuration (remote_storage_plugins) and its extra_config keys.
PLUGIN_NAME = "splitserve_redis"
INSTANCE_ID_KEY = "splitserve.instance_id"
# A request to Redis (connect, one command) gives up after this long; the store then acts as if Redis were down.
SOCKET_TIMEOUT_SECONDS = 5.0
# At close: writes in flight get this long to land, the connections this long to close.
DRAIN_SECONDS = 2.0
CLOSE_CONNECTIONS_SECONDS = 1.0
# Batches written at once, each on a thread and a connection of its own: LMCache's executor runs 4 jobs.
TRANSFER_THREADS = 4
# The synchronous client's connections: the writing threads' and those of callers looking keys up.
TRANSFER_CONNECTIONS = 8


@dataclass(frozen=True)
class RedisSettings:
    """How one store reaches Redis: ``url`` has no password (``public_redis_url``); ``access`` has it."""

    url: str
    access: RedisAccess
    ttl_seconds: float


def connection_options(settings: RedisSettings) -> dict:
    """Keyword arguments of a redis-py connection pool (``from_url(settings.url, ...)``), asyncio or not:
    credentials, TLS, and a bound on every socket operation."""
    return {"socket_connect_timeout": SOCKET_TIMEOUT_SECONDS, "socket_timeout": SOCKET_TIMEOUT_SECONDS,
            **settings.access.client_options(settings.url)}


# instance id -> settings, for the adapter LMCache instantiates without arguments. One entry per open store.
_settings_by_instance: dict[str, RedisSettings] = {}
_settings_lock = threading.Lock()


def register_settings(instance_id: str, settings: RedisSettings) -> None:
    """Make ``settings`` what the connector of LMCache instance ``instance_id`` uses."""
    with _settings_lock:
        _settings_by_instance[instance_id] = settings


def forget_settings(instance_id: str) -> None:
    with _settings_lock:
        _settings_by_instance.pop(instance_id, None)


class RedisOutage:
    """Logs once when Redis stops answering and once when it answers again (not once per chunk)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._down = False
        self._lock = threading.Lock()

    def failed(self, operation: str, error: Exception) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
        refused = isinstance(error, (AuthenticationError, AuthorizationError)) or "NOAUTH" in str(error)
        logger.warning("LMCache cannot reach Redis at %s (%s failed: %s%s); its KV is recomputed until Redis "
                       "answers again.", self.url, operation, type(error).__name__,
                       f": {CREDENTIALS_HINT}" if refused else "")

    def succeeded(self) -> None:
        if not self._down:
            return
        with self._lock:
            self._down = False
        logger.info("LMCache reaches Redis at %s again.", self.url)


class SplitserveRedisConnector(RedisConnector):
    """LMCache's Redis connector with TTL'd keys, credentials outside the URL, bounded waits and a working
    ``close``. Redis errors are logged once (:class:`RedisOutage`) and read as a miss: ``exists`` is False,
    ``get`` None, a ``put`` is dropped."""

    def __init__(self, settings: RedisSettings, loop: asyncio.AbstractEventLoop, local_cpu_backend) -> None:
        # RedisConnector.__init__ builds its pool from the URL alone; build ours instead (same attributes).
        super(RedisConnector, self).__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.ttl_milliseconds = max(1, int(settings.ttl_seconds * 1000))
        self.outage = RedisOutage(settings.url)
        self.max_connections = 32
        self.sem = asyncio.Semaphore(self.max_connections)
        options = connection_options(settings)
        self.pool = redis_asyncio.ConnectionPool.from_url(settings.url, max_connections=self.max_connections,
                                                          **options)
        self.connection = redis_asyncio.Redis.from_pool(self.pool)
        # Writes and lookups go through a synchronous client (see the module docstring); a caller that finds
        # every connection busy waits for one, at most the socket timeout.
        self.transfer_pool = redis.BlockingConnectionPool.from_url(
            settings.url, max_connections=TRANSFER_CONNECTIONS, timeout=SOCKET_TIMEOUT_SECONDS, **options)
        self.transfer_connection = redis.Redis(connection_pool=self.transfer_pool)
        self.transfer_threads = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="lmcache-redis")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.pq_executor = AsyncPQExecutor(loop)
        self.writes_in_flight = 0  # changed on the event loop only

    async def put(self, key, memory_obj) -> None:
        self.writes_in_flight += 1
        try:
            await super().put(key, memory_obj)
        finally:
            self.writes_in_flight -= 1

    async def batched_put(self, keys, memory_objs) -> None:
        self.writes_in_flight += 1
        try:
            await super().batched_put(keys, memory_objs)
        finally:
            self.writes_in_flight -= 1

    async def _put(self, key, memory_obj) -> None:
        await self._batched_put([key], [memory_obj])

    async def _batched_put(self, keys, memory_objs) -> None:
        """``SET`` each chunk's bytes, then its metadata (readers look for the metadata), all with the TTL, in
        one pipeline on a transfer thread. The bytes go from LMCache's buffer as they are (no copy): the
        caller holds each memory object until this returns."""
        entries = []
        for key, memory_obj in zip(keys, memory_objs):
            kv_bytes = memory_obj.byte_array
            metadata_bytes = RemoteMetadata(len(kv_bytes), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                            memory_obj.get_memory_format()).serialize()
            entries.append((key.to_string(), kv_bytes, metadata_bytes))
        try:
            await self.loop.run_in_executor(self.transfer_threads, self._set_all, entries)
        except (RedisError, OSError) as error:
            self.outage.failed("a store", error)
            return
        self.outage.succeeded()

    def _set_all(self, entries) -> None:
        """On a transfer thread: one pipeline of ``SET`` bytes and metadata per (key name, bytes, metadata)."""
        pipeline = self.transfer_connection.pipeline(transaction=False)
        for key_name, kv_bytes, metadata_bytes in entries:
            pipeline.set(key_name + "kv_bytes", kv_bytes, px=self.ttl_milliseconds)
            pipeline.set(key_name + "metadata", metadata_bytes, px=self.ttl_milliseconds)
        pipeline.execute()

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys):
        return await self.pq_executor.submit_job(self._batched_get, keys=keys, priority=Priorities.GET)

    async def _batched_get(self, keys):
        """The memory objects of ``keys``: their leading run found in Redis, then None for the rest (a missing
        chunk ends what LMCache can load). One pipeline of ``GET`` metadata and bytes, on the event loop."""
        try:
            values = await self._get_all([key.to_string() for key in keys])
        except (RedisError, OSError) as error:
            self.outage.failed("a retrieve", error)
            return [None] * len(keys)
        self.outage.succeeded()
        memory_objs = self._stage_all(values)
        return memory_objs + [None] * (len(keys) - len(memory_objs))

    async def _get_all(self, key_names: list[str]) -> list[tuple[bytes | None, bytes | None]]:
        """(metadata, bytes) of each key name, None where Redis has none, in one pipeline. Read on the event
        loop: the same reads on a transfer thread took 1.3 times as long here."""
        async with self.sem:
            pipeline = self.connection.pipeline(transaction=False)
            for key_name in key_names:
                pipeline.get(key_name + "metadata")
                pipeline.get(key_name + "kv_bytes")
            values = await pipeline.execute()
        return list(zip(values[0::2], values[1::2]))

    def _stage_all(self, values: list) -> list:
        """The memory objects of the leading ``(metadata, bytes)`` pairs found, staged in LMCache's buffer;
        empties ``values`` (freeing a chunk's bytes unmaps its pages: 0.3 to 0.6 ms per 11.8 MB here)."""
        memory_objs = []
        for metadata_bytes, kv_bytes in values:
            memory_obj = None if metadata_bytes is None or kv_bytes is None else self._load(metadata_bytes, kv_bytes)
            if memory_obj is None:
                break
            memory_objs.append(memory_obj)
        values.clear()
        return memory_objs

    def _load(self, metadata_bytes: bytes, kv_bytes: bytes):
        """A memory object of LMCache's buffer holding ``kv_bytes``, shaped as ``metadata_bytes`` says; None
        when the buffer has no room or the bytes are not the metadata's length."""
        metadata = RemoteMetadata.deserialize(memoryview(metadata_bytes))
        if len(kv_bytes) != metadata.length:
            return None
        memory_obj = self.local_cpu_backend.allocate(metadata.shapes, metadata.dtypes, metadata.fmt)
        if memory_obj is None:
            return None
        view = memory_obj.byte_array
        if view.format != "B":
            view = view.cast("B")
        view[:metadata.length] = kv_bytes
        return memory_obj

    async def _exists(self, key) -> bool:
        try:
            found = await super()._exists(key)
        except (RedisError, OSError) as error:
            self.outage.failed("a lookup", error)
            return False
        self.outage.succeeded()
        return found

    async def _get(self, key):
        try:
            memory_obj = await super()._get(key)
        except (RedisError, OSError) as error:
            self.outage.failed("a retrieve", error)
            return None
        self.outage.succeeded()
        return memory_obj

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys) -> int:
        """How many of ``keys``, from the first, Redis holds (their metadata key exists): one pipeline, sent
        from the calling thread (LMCache's default asks key by key, through its event loop)."""
        if not keys:
            return 0
        try:
            pipeline = self.transfer_connection.pipeline(transaction=False)
            for key in keys:
                pipeline.exists(key.to_string() + "metadata")
            found = pipeline.execute()
        except (RedisError, OSError) as error:
            self.outage.failed("a lookup", error)
            return 0
        self.outage.succeeded()
        count = 0
        for present in found:
            if not present:
                break
            count += 1
        return count

    async def close(self) -> None:
        """Let the writes in flight land (at most ``DRAIN_SECONDS``), stop the executor with its asynchronous
        shutdown (LMCache's calls the synchronous one here, on the loop it waits for) and close the connections.

        A write submitted before this coroutine was scheduled has entered ``put``/``batched_put`` by the time
        it runs (the event loop runs what was scheduled in order), so the count sees every earlier store.
        """
        deadline = self.loop.time() + DRAIN_SECONDS
        while self.writes_in_flight and self.loop.time() < deadline:
            await asyncio.sleep(0.005)
        if self.writes_in_flight:
            logger.warning("%d LMCache writes to Redis were still in flight %.0f s after close; dropped.",
                           self.writes_in_flight, DRAIN_SECONDS)
        # wait=False: it cancels the workers at once, so waiting for its queue could wait forever.
        await self.pq_executor.shutdown_async(wait=False)
        # Nothing waits for the writing threads: disconnecting shuts their sockets, which ends a send at once.
        self.transfer_threads.shutdown(wait=False, cancel_futures=True)
        self.transfer_pool.disconnect()
        try:
            await asyncio.wait_for(self.connection.aclose(close_connection_pool=True), CLOSE_CONNECTIONS_SECONDS)
        except (asyncio.TimeoutError, RedisError, OSError):
            pass


class SplitserveRedisAdapter(ConnectorAdapter):
    """The remote storage plugin LMCache instantiates: builds a :class:`SplitserveRedisConnector` from the
    settings registered for the configuration's instance id."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_NAME}")

    def create_connector(self, context: ConnectorContext) -> SplitserveRedisConnector:
        instance_id = (context.config.extra_config or {}).get(INSTANCE_ID_KEY)
        with _settings_lock:
            settings = _settings_by_instance.get(instance_id)
        if settings is None:
            raise ValueError(f"No Redis settings registered for LMCache instance {instance_id!r}.")
        return SplitserveRedisConnector(settings, context.loop, context.local_cpu_backend)
