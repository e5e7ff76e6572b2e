"""KV in LMCache (Redis as its remote backend): ``LMCacheKVStore`` stores a prompt's KV from a worker's
block-major cache by token chunks, finds the longest stored prefix of another prompt, and loads it into
other blocks, in this process or any other that shares the Redis and the model.

Needs the optional extra: ``pip install 'splitserve[lmcache]'`` (LMCache 0.5.6). Nothing else in
splitserve imports LMCache; importing this module without it raises ImportError saying so.

How the pieces fit (LMCache's engine API, which runs on CPU tensors too):

- Keys: LMCache cuts token ids into chunks of ``chunk_size`` and keys chunk i by a chain hash of chunks
  0..i under a model name; ours is ``splitserve:lmcache:<model fingerprint>``, so two models sharing a
  Redis never read each other's KV, and the chain hash is SHA-256 over the token ids (LMCache's
  default without vLLM is Python's tuple ``hash``, which anyone can make collide).
- The trailing partial chunk is stored too (``save_unfull_chunk``), keyed by the hash of its tokens:
  a lookup of the same prompt finds it (``lookup`` returns the whole length), a longer prompt that
  shares only the prefix does not (its chunk there holds more tokens), and finds the full chunks.
- Copies: :class:`~splitserve.kvtransfer.lmcache_gpu_connector.BlockMajorGPUConnector`.
- Redis: :mod:`splitserve.kvtransfer.lmcache_redis` (TTL on every key, credentials, timeouts, close).
- Memory: LMCache stages every chunk in a local CPU buffer (``local_cpu_bytes``, allocated in full at
  start) on its way to and from Redis. A store hands LMCache one chunk at a time (its copy overlaps the
  previous chunk's write), a retrieve at most a buffer's worth; either waits for room (earlier writes to
  land) when the buffer is full: ``store`` returns at once for a prompt that fits the buffer, later
  otherwise. Stores and retrieves run one at a time.
- Its side effects, undone or tamed at creation: the ``spawn`` start method it forces on
  ``multiprocessing`` is restored; usage telemetry is off unless ``LMCACHE_TRACK_USAGE`` is set; its
  loggers lose their own handlers and propagate to ours (see :func:`follow_splitserve_log_level`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import multiprocessing
import os
import re
import threading
import uuid
from array import array

import torch

from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.redis_access import RedisAccess, public_redis_url, url_username

INSTALL_HINT = "LMCache is not installed: pip install 'splitserve[lmcache]' (LMCache 0.5.6, about 0.6 GB)."

# LMCache's package __init__ logs at INFO through a handler of its own: keep its import quiet (the
# loggers are then re-parented to ours, see follow_splitserve_log_level).
_log_level_before_import = os.environ.get("LMCACHE_LOG_LEVEL")
os.environ["LMCACHE_LOG_LEVEL"] = _log_level_before_import or "ERROR"
try:
    import lmcache.logging as lmcache_logging

    # Modules imported from here on get plain loggers that propagate to ours (no handler of their own).
    lmcache_logging.init_logger = logging.getLogger
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from splitserve.kvtransfer.lmcache_gpu_connector import BlockMajorGPUConnector, slot_mapping
    from splitserve.kvtransfer.lmcache_redis import (
        INSTANCE_ID_KEY,
        PLUGIN_NAME,
        SOCKET_TIMEOUT_SECONDS,
        RedisSettings,
        forget_settings,
        register_settings,
    )
except ImportError as error:
    raise ImportError(f"{INSTALL_HINT} ({error})") from error
finally:
    if _log_level_before_import is None:
        del os.environ["LMCACHE_LOG_LEVEL"]

logger = logging.getLogger(__name__)

MODEL_NAME_PREFIX = "splitserve:lmcache:"
# Chunks a store copies out of the cache before LMCache hands them to Redis: one, so the next chunk's copy runs
# while the previous one is sent (kv_transfer benchmark: store 0.71-0.74 of a raw SET of the same chunks with
# whole-buffer windows, 0.81-1.06 with one chunk, from 1,024 tokens up). Retrieves use the whole buffer.
STORE_WINDOW_CHUNKS = 1
_CLOSE_TIMEOUT_SECONDS = 4.5
_HASH_ROOT = b"splitserve-lmcache-v1"


class _WaitingForBufferRoom(logging.Filter):
    """Drops LMCache's warnings that a chunk waits for room in its buffer: the windows of a long prompt
    wait for the previous window's writes by design."""

    MESSAGES = ("Failed to allocate memory block", "No eviction candidates found")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.MESSAGES))


_BUFFER_ROOM_FILTER = _WaitingForBufferRoom()


def follow_splitserve_log_level() -> None:
    """LMCache's loggers: no handler of their own, propagating to ours, at a level that follows the
    ``splitserve`` logger's: DEBUG shows LMCache's DEBUG and INFO (a line per operation); any other level
    shows LMCache's warnings and errors at least."""
    ours = logging.getLogger("splitserve").getEffectiveLevel()
    for name, library_logger in list(logging.root.manager.loggerDict.items()):
        if (name == "lmcache" or name.startswith("lmcache.")) and isinstance(library_logger, logging.Logger):
            library_logger.handlers.clear()
            library_logger.propagate = True
            library_logger.setLevel(logging.NOTSET)
    for name in ("lmcache.v1.memory_management", "lmcache.v1.storage_backend.local_cpu_backend"):
        logging.getLogger(name).addFilter(_BUFFER_ROOM_FILTER)  # once: addFilter ignores a repeat
    logging.getLogger("lmcache").setLevel(logging.DEBUG if ours <= logging.DEBUG else max(ours, logging.WARNING))


follow_splitserve_log_level()


def _chunk_hash(inputs: tuple) -> bytes:
    """LMCache's chain hash of one chunk: SHA-256 of the previous chunk's hash and the chunk's token ids
    (LMCache keeps its first 8 bytes)."""
    previous_hash, token_ids, extra_keys = inputs
    digest = hashlib.sha256(_HASH_ROOT)
    digest.update(int(previous_hash).to_bytes(8, "little", signed=previous_hash < 0))
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


_TAG = re.compile(r"[A-Za-z0-9._-]{1,128}")


def request_configs(tag: str | None) -> dict:
    """LMCache's request configs for KV stored under ``tag``: LMCache puts an ``lmcache.tag.*`` config's value in
    every chunk's key (its Redis key name too), so the same tokens under two tags (the base model and a LoRA
    adapter, or two adapters: ``splitserve.engine.lora.lora_cache_tag``) are two keys, never one.

    Raises:
        ValueError: a tag that is not 1 to 128 characters from [A-Za-z0-9._-] (LMCache's key strings split on
            '@' and '%').
    """
    if tag is None:
        return {}
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise ValueError("An LMCache tag is 1 to 128 characters from [A-Za-z0-9._-].")
    return {"lmcache.tag.lora": tag}


class LMCacheKVStore:
    """A worker's KV store in LMCache over Redis, for one model (``model_fingerprint``) and cache layout.

    Args:
        redis_url: redis://host:port/db or rediss:// (TLS); no password in it (``RedisAccess`` has it).
        model_fingerprint: the served model's fingerprint; keys carry it.
        layout: the KV cache's layout (equal in every process that shares the store).
        chunk_size: tokens per LMCache chunk (a multiple of the block size).
        local_cpu_bytes: LMCache's staging buffer, allocated in full now; it must hold a chunk.
        ttl_seconds: every key expires this long after its last write.
        instance_id: LMCache's instance id (default: a fresh one).
        redis_access: user name, password and TLS files for Redis (default: the URL's user name only).

    Raises:
        ValueError: a bad URL (or one holding a password), fingerprint, chunk size or buffer size.
    """

    def __init__(self, redis_url: str, model_fingerprint: str, layout: KVLayout, *, chunk_size: int = 256,
                 local_cpu_bytes: int = 64 << 20, ttl_seconds: float = 600.0, instance_id: str | None = None,
                 redis_access: RedisAccess | None = None) -> None:
        self.url = public_redis_url(redis_url)
        if not model_fingerprint or "@" in model_fingerprint or len(model_fingerprint) > 200:
            raise ValueError("The model fingerprint must be 1 to 200 characters without '@'.")
        if chunk_size <= 0 or chunk_size % layout.block_size:
            raise ValueError(f"chunk_size must be a positive multiple of the block size {layout.block_size}, "
                             f"got {chunk_size}.")
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}.")
        self.layout = layout
        self.chunk_size = chunk_size
        self.model_name = MODEL_NAME_PREFIX + model_fingerprint
        chunk_bytes = layout.block_num_bytes * (chunk_size // layout.block_size)
        # Chunks moved at a time: what the buffer holds, less one for the allocator's alignment and slack.
        self.window_chunks = max(1, local_cpu_bytes // chunk_bytes - 1)
        if local_cpu_bytes < chunk_bytes:
            raise ValueError(f"local_cpu_bytes must hold one chunk of {chunk_size} tokens ({chunk_bytes} bytes "
                             f"for {layout.describe()}), got {local_cpu_bytes}.")
        self.instance_id = instance_id or f"splitserve-{uuid.uuid4().hex[:12]}"
        access = redis_access or RedisAccess(username=url_username(redis_url))
        register_settings(self.instance_id, RedisSettings(self.url, access, ttl_seconds))
        self._lock = threading.Lock()  # one store or retrieve at a time (see the module docstring)
        self._closed = False
        try:
            self._engine = self._create_engine(local_cpu_bytes)
        except BaseException:
            if LMCacheEngineBuilder.get(self.instance_id) is not None:
                LMCacheEngineBuilder.destroy(self.instance_id)
            forget_settings(self.instance_id)
            raise

    def _create_engine(self, local_cpu_bytes: int):
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        follow_splitserve_log_level()
        library_logger = logging.getLogger("lmcache")
        level_after_creation = library_logger.level
        if level_after_creation > logging.DEBUG:
            # Its creation warns of what does not apply here: no vLLM hash (ours replaces it), no controller.
            library_logger.setLevel(logging.ERROR)
        layout = self.layout
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk_size, local_cpu=False, max_local_cpu_size=local_cpu_bytes / 2**30,
            save_unfull_chunk=True, remote_url=None, remote_serde="naive", remote_storage_plugins=[PLUGIN_NAME],
            blocking_timeout_secs=math.ceil(2 * SOCKET_TIMEOUT_SECONDS),
            extra_config={
                f"remote_storage_plugin.{PLUGIN_NAME}.module_path": "splitserve.kvtransfer.lmcache_redis",
                f"remote_storage_plugin.{PLUGIN_NAME}.class_name": "SplitserveRedisAdapter",
                INSTANCE_ID_KEY: self.instance_id,
                # A store waits for buffer room instead of dropping chunks (stores run one at a time).
                "force_store_wait": True,
            })
        metadata = LMCacheMetadata(
            model_name=self.model_name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=layout.dtype, kv_shape=(layout.num_layers, 2, self.chunk_size, layout.num_kv_heads,
                                             layout.head_size), chunk_size=self.chunk_size)
        start_method = multiprocessing.get_start_method(allow_none=True)
        try:
            engine = LMCacheEngineBuilder.get_or_create(self.instance_id, config, metadata,
                                                        BlockMajorGPUConnector(layout), None, None)
            engine.post_init()
        finally:
            multiprocessing.set_start_method(start_method, force=True)
            follow_splitserve_log_level()
            library_logger.setLevel(level_after_creation)
        engine.token_database.hash_func = _chunk_hash
        return engine

    # ---- the store's API -----------------------------------------------------------------------

    def store(self, token_ids: list[int], kv_cache: torch.Tensor, block_ids: list[int], *,
              first_position: int = 0, tag: str | None = None) -> None:
        """Store the KV of ``token_ids`` (positions 0..n-1, held in ``block_ids`` in order) in LMCache, from
        ``first_position`` on (a multiple of the chunk size: the chunks before it are stored already), under
        ``tag`` (a LoRA adapter's: see :func:`request_configs`; None: the base model's).

        Returns once the chunks are copied out of ``kv_cache`` (the blocks may then change); the writes
        to Redis land shortly after (``lookup`` tells when). Redis errors are logged once, not raised.

        Raises:
            ValueError: ``block_ids`` hold fewer than ``len(token_ids)`` tokens, ``first_position`` is not a
                chunk boundary within the prompt, or the cache has another layout.
        """
        num_tokens = len(token_ids)
        self._check_cache(kv_cache)
        self._check_blocks(block_ids, num_tokens)
        if first_position % self.chunk_size or not 0 <= first_position <= num_tokens:
            raise ValueError(f"first_position ({first_position}) must be a multiple of the chunk size "
                             f"({self.chunk_size}) within the prompt ({num_tokens} tokens).")
        if num_tokens == first_position:
            return
        configs = request_configs(tag)
        slots = slot_mapping(block_ids, num_tokens, self.layout.block_size, kv_cache.device)
        with self._lock:
            self._check_open()
            for start, end in self._windows(first_position, num_tokens, STORE_WINDOW_CHUNKS):
                self._engine.store(list(token_ids[:end]), mask=self._mask(start, end), kvcaches=kv_cache,
                                   slot_mapping=slots[:end], request_configs=configs)

    def lookup(self, token_ids: list[int], tag: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` LMCache holds in Redis under ``tag``: a multiple of the chunk
        size, or ``len(token_ids)`` when the whole prompt (its partial last chunk too) is there. 0 when Redis is
        down."""
        configs = request_configs(tag)
        self._check_open()
        if not token_ids:
            return 0
        return int(self._engine.lookup(list(token_ids), request_configs=configs))

    def retrieve(self, token_ids: list[int], kv_cache: torch.Tensor, block_ids: list[int],
                 num_tokens: int | None = None, *, num_computed_tokens: int = 0, tag: str | None = None) -> int:
        """Load the KV of the first ``num_tokens`` tokens of ``token_ids`` (default: all LMCache holds) into
        ``block_ids`` (block i holds positions ``[i * block_size, (i + 1) * block_size)``), in place. Writes
        only those positions, never a block outside ``block_ids``, and not the first ``num_computed_tokens``
        positions (KV this worker has already).

        Returns:
            how many leading tokens ``block_ids`` hold afterwards, counting the ``num_computed_tokens``:
            ``num_tokens`` when all was found, less when LMCache holds less (a prefix of whole chunks),
            ``num_computed_tokens`` when nothing was loaded (Redis down too).

        Raises:
            ValueError: ``num_tokens`` or ``num_computed_tokens`` out of range, ``block_ids`` too few, or the
                cache has another layout.
        """
        configs = request_configs(tag)
        if num_tokens is None:
            num_tokens = max(self.lookup(token_ids, tag), num_computed_tokens)
        if not 0 <= num_computed_tokens <= num_tokens <= len(token_ids):
            raise ValueError(f"Need 0 <= num_computed_tokens ({num_computed_tokens}) <= num_tokens ({num_tokens}) "
                             f"<= len(token_ids) ({len(token_ids)}).")
        self._check_cache(kv_cache)
        self._check_blocks(block_ids, num_tokens)
        if num_tokens == num_computed_tokens:
            return num_tokens
        # Whole chunks are read (the last one may hold tokens past num_tokens: not written).
        read_end = min(len(token_ids), -(-num_tokens // self.chunk_size) * self.chunk_size)
        first_chunk_start = num_computed_tokens // self.chunk_size * self.chunk_size
        slots = slot_mapping(block_ids, num_tokens, self.layout.block_size, kv_cache.device,
                             first_position=num_computed_tokens, length=read_end)
        loaded = num_computed_tokens
        with self._lock:
            self._check_open()
            for start, end in self._windows(first_chunk_start, read_end):
                found = self._engine.retrieve(list(token_ids[:end]), mask=self._mask(start, end),
                                              kvcaches=kv_cache, slot_mapping=slots[:end], request_configs=configs)
                found_end = start + _leading_true(found[start:end])
                loaded = max(loaded, min(found_end, num_tokens))
                if found_end < end:
                    break
        return loaded

    def close(self) -> None:
        """Stop LMCache's engine and its threads, within 5 s; idempotent. Writes in flight get 2 s to land,
        then are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        closer = threading.Thread(target=self._shut_down, name="lmcache-close", daemon=True)
        closer.start()
        closer.join(_CLOSE_TIMEOUT_SECONDS)
        forget_settings(self.instance_id)
        if closer.is_alive():
            logger.warning("LMCache did not stop within %.1f s; its threads are left to the process exit.",
                           _CLOSE_TIMEOUT_SECONDS)

    def _shut_down(self) -> None:
        """The Redis backend first (its writes in flight land, then its connections close), then the rest:
        LMCache's own order frees the staging buffer first, under writes still reading it (a crash)."""
        storage_manager = self._engine.storage_manager
        if storage_manager is not None:
            storage_manager.close_backend(f"RemoteBackend-{PLUGIN_NAME}")
        LMCacheEngineBuilder.destroy(self.instance_id)

    def __enter__(self) -> LMCacheKVStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- helpers --------------------------------------------------------------------------------

    def _windows(self, start: int, end: int, max_chunks: int | None = None):
        """``[start, end)`` in runs of at most ``window_chunks`` (and ``max_chunks``) chunks (``start`` is a chunk
        boundary)."""
        step = min(self.window_chunks, max_chunks or self.window_chunks) * self.chunk_size
        for window_start in range(start, end, step):
            yield window_start, min(end, window_start + step)

    def _mask(self, start: int, end: int) -> torch.Tensor | None:
        """LMCache's mask for ``tokens[:end]`` that selects ``[start, end)``: False before ``start``."""
        if start == 0:
            return None
        mask = torch.ones(end, dtype=torch.bool)
        mask[:start] = False
        return mask

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6 or KVLayout.from_kv_cache(kv_cache) != self.layout:
            raise ValueError(f"The KV cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not have this store's "
                             f"layout ({self.layout.describe()}).")

    def _check_blocks(self, block_ids: list[int], num_tokens: int) -> None:
        if len(block_ids) * self.layout.block_size < num_tokens:
            raise ValueError(f"{len(block_ids)} blocks of {self.layout.block_size} tokens cannot hold "
                             f"{num_tokens} tokens.")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("The LMCache KV store is closed.")


def _leading_true(mask: torch.Tensor) -> int:
    """The number of leading True values of a 1-D bool tensor."""
    false_positions = (~mask).nonzero()
    return int(false_positions[0, 0]) if len(false_positions) else int(mask.numel())
