"""KV loads from LMCache into blocks an engine reserved, watched by one thread per worker: the engine's KV
connector on the loading side of ``--kv-transfer lmcache``.

Two kinds of load go through it. A decode worker loads a whole prompt another worker is storing
(``decode_service/lmcache_receiver.py``); a prefill worker loads the prefix of a prompt that some worker
stored before, then computes the rest (``prefill_service/lmcache_sender.py``). Either way the worker announces
the load (:meth:`LMCacheLoader.expect`, with the prompt's token ids and how long it may wait), the engine
reserves the request's blocks and calls :meth:`LMCacheLoader.start_load` with how many leading tokens must
end up in them, and the loader's one poller thread takes it from there:

- every ``LOOKUP_INTERVAL_SECONDS`` it asks LMCache's ``lookup`` whether it holds those tokens yet, for every
  started load in order (LMCache's ``store`` returns before Redis has the data, and there is no flush to wait
  on); a load whose tokens are there is retrieved at once into the blocks this engine does not cache, then
  reported finished with no first token (the engine recomputes the last prompt token for its logits, or
  computes the rest of the prompt);
- a load LMCache does not cover before its timeout, or a retrieve that comes back short (Redis down, keys
  expired), is reported failed with a sentence; the engine applies the request's failure policy.

One thread, not one per load: retrieves run one at a time anyway (the store holds one lock for them), and a
worker with a hundred waiting requests keeps one poller and one lookup per load per interval.

Blocks are written only while a load is open: a retrieve runs under the load's lock, and
:meth:`LMCacheLoader.request_finished` (which the engine calls before it frees or reuses the blocks) closes the
load under that same lock, so it waits for a retrieve in progress and none starts after it. The wait is bounded
by one retrieve (Redis errors end a retrieve within the store's socket timeouts).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequest
from splitserve.common.log_fields import request_log
from splitserve.engine.kv_connector import KVConnectorBase, KVConnectorEvents, KVLoad, KVSave
from splitserve.engine.lora import kv_store_tag

logger = logging.getLogger(__name__)

# How often a waiting load asks LMCache whether its tokens have landed.
LOOKUP_INTERVAL_SECONDS = 0.015


@dataclass
class LMCacheLoad:
    """One prompt's KV on its way in from LMCache."""

    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    # How long the load may wait for LMCache to hold its tokens, from start_load (0: one lookup).
    timeout_seconds: float
    # The tag its KV was stored under (its adapter's and cache salt's, ``kv_store_tag``; None: the base model's).
    cache_tag: str | None = None
    block_ids: tuple[int, ...] = ()
    # Leading prompt tokens this worker's prefix cache holds: not written.
    num_computed_tokens: int = 0
    # Leading prompt tokens the blocks hold once the load is done (the whole prompt on a decode worker).
    num_tokens: int = 0
    started: float = 0.0
    # Closed by request_finished, discard or stop: no retrieve starts (or writes) after that.
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def whole_prompt(self) -> bool:
        return self.num_tokens >= len(self.prompt_token_ids)


class LMCacheLoader(KVConnectorBase):
    """Loads prompts' KV from LMCache into the blocks the engine reserved; saves nothing.

    Args:
        store: the worker's ``LMCacheKVStore`` (``splitserve.kvtransfer.lmcache_connector``); closed by the
            worker, not here.
        counters: the worker's Counters (``num_kv_transfers_received`` and ``num_kv_bytes`` per load), or None.
    """

    def __init__(self, store, counters=None) -> None:
        self.store = store
        self.counters = counters
        self.token_num_bytes = store.layout.block_num_bytes // store.layout.block_size
        self._kv_cache = None
        self._loads: dict[str, LMCacheLoad] = {}
        self._events = KVConnectorEvents()
        self._lock = threading.Lock()
        self._started = threading.Condition(self._lock)  # a load started, or the loader stopped
        self._poller: threading.Thread | None = None
        self._stopped = False

    def stop(self) -> None:
        """Close every open load and end the poller (no retrieve starts after this returns)."""
        with self._lock:
            loads = list(self._loads.values())
            self._loads.clear()
            self._stopped = True
            self._started.notify_all()
        for load in loads:
            self._close(load)

    # ---- the servicer's side ---------------------------------------------------------------

    def expect(self, request_id: str, transfer_id: str, num_prompt_tokens: int, timeout_seconds: float,
               source=None, *, prompt_token_ids: list[int] | None = None, lora_request=None,
               cache_salt: str | None = None) -> None:
        """A request's prompt KV will be in LMCache, under the tag of its LoRA adapter and cache salt
        (``kv_store_tag``; neither: the base model's); ``source``, the prefill worker's endpoint, is not needed.

        Raises:
            InvalidRequest: the request id already waits for KV here, or the prompt's token ids are missing.
        """
        if prompt_token_ids is None or len(prompt_token_ids) != num_prompt_tokens:
            raise InvalidRequest("An LMCache load needs the prompt's token ids (LMCache keys KV by them).")
        load = LMCacheLoad(request_id, transfer_id, list(prompt_token_ids), timeout_seconds,
                           kv_store_tag(lora_request, cache_salt))
        with self._lock:
            if request_id in self._loads:
                raise InvalidRequest(f"Request id {request_id!r} already waits for KV on this worker.")
            self._loads[request_id] = load

    def discard(self, request_id: str) -> None:
        """The engine refused the request: forget its load."""
        load = self._pop(request_id)
        if load is not None:
            self._close(load)

    # ---- the engine's side (engine thread) ----------------------------------------------------

    def register_kv_cache(self, kv_cache) -> None:
        self._kv_cache = kv_cache  # [num_blocks, layers, 2, kv_heads, block_size, head_size]

    def start_load(self, load: KVLoad) -> None:
        with self._lock:
            waiting = self._loads.get(load.request_id)
        if waiting is None:
            self._report(load.request_id, failure="no transfer was announced for it on this worker")
            return
        waiting.block_ids = load.block_ids
        waiting.num_computed_tokens = load.num_computed_tokens
        waiting.num_tokens = load.num_external_tokens
        request_log(logger, load.request_id, waiting.transfer_id).debug(
            "Waiting for LMCache to hold the KV of %d of the prompt's %d tokens (%d cached here)",
            load.num_external_tokens, load.num_prompt_tokens, load.num_computed_tokens)
        with self._lock:
            waiting.started = time.monotonic()
            if self._poller is None and not self._stopped:
                self._poller = threading.Thread(target=self._poll, name="lmcache-loads", daemon=True)
                self._poller.start()
            self._started.notify_all()

    def save(self, save: KVSave) -> None:
        """A loader stores no KV: a save asked of it fails at once (the engine frees the blocks)."""
        with self._lock:
            self._events.failed_saves[save.request_id] = "an LMCache loader saves no KV"
        self.wake_engine()

    def request_finished(self, request_id: str) -> bool:
        """Close the request's load; waits for a retrieve in progress into its blocks to end."""
        load = self._pop(request_id)
        if load is not None:
            self._close(load)
        return False

    def get_finished(self) -> KVConnectorEvents:
        with self._lock:
            events, self._events = self._events, KVConnectorEvents()
        return events

    # ---- the poller thread ------------------------------------------------------------------------

    def _poll(self) -> None:
        """Look every started load up, retrieve those LMCache covers, fail those past their timeout; repeat."""
        while True:
            with self._lock:
                while not self._stopped and not any(load.started for load in self._loads.values()):
                    self._started.wait()
                if self._stopped:
                    return
                started = [load for load in self._loads.values() if load.started]
            for load in started:
                self._check(load)
            with self._lock:
                if not self._stopped:
                    self._started.wait(LOOKUP_INTERVAL_SECONDS)

    def _check(self, load: LMCacheLoad) -> None:
        """One look at a load: retrieve it if LMCache holds its tokens, fail it if its time is up; report."""
        try:
            covered = self.store.lookup(load.prompt_token_ids, load.cache_tag) >= load.num_tokens
            if covered:
                failure = self._retrieve(load)
            elif time.monotonic() - load.started >= load.timeout_seconds:
                failure = self._not_held(load)
            else:
                return
        except Exception as error:  # a closed store, a bad layout: reported like any failed load
            failure = f"the LMCache retrieve failed: {error}"
        if failure == "" or self._pop(load.request_id) is not load:
            return  # closed meanwhile: the engine no longer waits for it
        if failure is None:
            self._report(load.request_id, finished=True)
        else:
            self._report(load.request_id, failure=failure)

    @staticmethod
    def _not_held(load: LMCacheLoad) -> str:
        if load.whole_prompt:
            return (f"LMCache did not hold the prompt's KV ({load.num_tokens} tokens) within "
                    f"{load.timeout_seconds:.1f} s")
        return f"LMCache no longer held the KV of the prompt's first {load.num_tokens} tokens"

    def _retrieve(self, load: LMCacheLoad) -> str | None:
        """Retrieve the positions this worker lacks, under the load's lock: None when all are in place, a
        reason when LMCache returned fewer, "" when the load was closed first."""
        with load.lock:
            if load.closed:
                return ""
            loaded = self.store.retrieve(load.prompt_token_ids, self._kv_cache, list(load.block_ids),
                                         load.num_tokens, num_computed_tokens=load.num_computed_tokens,
                                         tag=load.cache_tag)
        if loaded < load.num_tokens:
            return (f"LMCache returned the KV of {loaded} of the prompt's first {load.num_tokens} tokens (Redis "
                    f"down, or its keys expired)")
        num_bytes = (load.num_tokens - load.num_computed_tokens) * self.token_num_bytes
        if self.counters is not None:
            self.counters.add(num_kv_transfers_received=1, num_kv_bytes=num_bytes)
        request_log(logger, load.request_id, load.transfer_id).info(
            "KV of %d tokens loaded from LMCache (%.1f MB, %.3f s after the request's blocks were reserved; %d more "
            "from the prefix cache)", load.num_tokens - load.num_computed_tokens, num_bytes / 1e6,
            time.monotonic() - load.started, load.num_computed_tokens)
        return None

    # ---- internals ---------------------------------------------------------------------

    def _report(self, request_id: str, finished: bool = False, failure: str | None = None) -> None:
        with self._lock:
            if finished:
                self._events.finished_loads[request_id] = None  # the engine recomputes the last prompt token
            else:
                self._events.failed_loads[request_id] = failure
        self.wake_engine()

    def _pop(self, request_id: str) -> LMCacheLoad | None:
        with self._lock:
            return self._loads.pop(request_id, None)

    @staticmethod
    def _close(load: LMCacheLoad) -> None:
        """No retrieve into the load's blocks after this returns (it waits for one in progress)."""
        with load.lock:
            load.closed = True
