"""The decode worker's LMCache receiver: the engine's KV connector on the loading side with ``--kv-transfer
lmcache``.

The prefill worker stores the whole prompt's KV in LMCache (Redis); nothing is sent to this worker. The
servicer announces each request whose prompt KV will be there (:meth:`LMCacheReceiver.expect`, with the
prompt's token ids). The engine reserves the request's blocks and calls :meth:`LMCacheReceiver.start_load`; a
thread of that load then polls LMCache's ``lookup`` until it holds the whole prompt (its store returns before
Redis has the data, and there is no flush to wait on), retrieves the KV of the positions this worker does not
cache into the reserved blocks, and reports the load finished with no first token: the engine recomputes the
last prompt token for its logits. A prompt LMCache does not hold in full before the request's KV timeout, or a
retrieve that comes back short (Redis down, keys expired), is reported failed with a sentence, and the engine
applies ``--kv-load-failure``.

Blocks are written only while the load is open: a retrieve runs under the load's lock, and
:meth:`LMCacheReceiver.request_finished` (which the engine calls before it frees or reuses the blocks) closes
the load under that same lock, so it waits for a retrieve in progress and none starts after it. The engine
keeps no blocks for a load after ``request_finished``, so holding them longer is not an option; the wait is
bounded by one retrieve (Redis errors end a retrieve within the store's socket timeouts).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequest
from splitserve.common.log_fields import request_log
from splitserve.engine.kv_connector import KVConnectorBase, KVConnectorEvents, KVLoad, KVSave

logger = logging.getLogger(__name__)

# How often a waiting load asks LMCache whether the whole prompt has landed.
LOOKUP_INTERVAL_SECONDS = 0.015


@dataclass
class LMCacheLoad:
    """One prompt's KV on its way in from LMCache."""

    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    timeout_seconds: float
    block_ids: tuple[int, ...] = ()
    # Leading prompt tokens this worker's prefix cache holds: not written.
    num_computed_tokens: int = 0
    started: float = 0.0
    # Closed by request_finished, discard or stop: no retrieve starts (or writes) after that.
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Set when closed, so a waiting lookup loop ends at once.
    closed_event: threading.Event = field(default_factory=threading.Event, repr=False)


class LMCacheReceiver(KVConnectorBase):
    """Loads the prompts' KV of one decode worker's requests from LMCache into the blocks the engine reserved.

    Args:
        store: the worker's ``LMCacheKVStore`` (``splitserve.kvtransfer.lmcache_connector``); closed by the
            worker, not here.
        counters: the worker's Counters (``num_kv_transfers_received`` and ``num_kv_bytes`` per load).
    """

    def __init__(self, store, counters) -> None:
        self.store = store
        self.counters = counters
        self.token_num_bytes = store.layout.block_num_bytes // store.layout.block_size
        self._kv_cache = None
        self._loads: dict[str, LMCacheLoad] = {}
        self._events = KVConnectorEvents()
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Close every open load (their threads end; no retrieve starts after this returns)."""
        with self._lock:
            loads = list(self._loads.values())
            self._loads.clear()
        for load in loads:
            self._close(load)

    # ---- the servicer's side ---------------------------------------------------------------

    def expect(self, request_id: str, transfer_id: str, num_prompt_tokens: int, timeout_seconds: float,
               source=None, *, prompt_token_ids: list[int] | None = None) -> None:
        """A request's prompt KV will be in LMCache (``source``, the prefill worker's endpoint, is not needed).

        Raises:
            InvalidRequest: the request id already waits for KV here, or the prompt's token ids are missing.
        """
        if prompt_token_ids is None or len(prompt_token_ids) != num_prompt_tokens:
            raise InvalidRequest("An LMCache load needs the prompt's token ids (LMCache keys KV by them).")
        load = LMCacheLoad(request_id, transfer_id, list(prompt_token_ids), timeout_seconds)
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
        waiting.started = time.monotonic()
        request_log(logger, load.request_id, waiting.transfer_id).debug(
            "Waiting for LMCache to hold the prompt's KV (%d prompt tokens, %d cached here)",
            load.num_prompt_tokens, load.num_computed_tokens)
        threading.Thread(target=self._run, args=(waiting,), name=f"lmcache-load-{waiting.transfer_id[:8]}",
                         daemon=True).start()

    def save(self, save: KVSave) -> None:
        """A decode worker stores no KV: a save asked of it fails at once (the engine frees the blocks)."""
        with self._lock:
            self._events.failed_saves[save.request_id] = "a decode worker's receiver saves no KV"
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

    # ---- a load's thread ------------------------------------------------------------------------

    def _run(self, load: LMCacheLoad) -> None:
        """Wait until LMCache holds the whole prompt, retrieve it, and report how it went."""
        try:
            failure = self._wait_until_stored(load)
            if failure is None:
                failure = self._retrieve(load)
        except Exception as error:  # a bad store state or layout: reported like any failed load
            failure = f"the LMCache retrieve failed: {error}"
        if failure == "":  # closed meanwhile: the engine no longer waits for it
            return
        if self._pop(load.request_id) is not load:
            return
        if failure is None:
            self._report(load.request_id, finished=True)
        else:
            self._report(load.request_id, failure=failure)

    def _wait_until_stored(self, load: LMCacheLoad) -> str | None:
        """None once LMCache holds the whole prompt; a reason when the timeout passed; "" when closed."""
        deadline = load.started + load.timeout_seconds
        num_prompt_tokens = len(load.prompt_token_ids)
        while True:
            if load.closed:
                return ""
            if self.store.lookup(load.prompt_token_ids) >= num_prompt_tokens:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return (f"LMCache did not hold the prompt's KV ({num_prompt_tokens} tokens) within "
                        f"{load.timeout_seconds:.1f} s")
            load.closed_event.wait(min(LOOKUP_INTERVAL_SECONDS, remaining))

    def _retrieve(self, load: LMCacheLoad) -> str | None:
        """Retrieve the positions this worker lacks, under the load's lock: None when all are in place, a
        reason when LMCache returned fewer, "" when the load was closed first."""
        num_prompt_tokens = len(load.prompt_token_ids)
        with load.lock:
            if load.closed:
                return ""
            loaded = self.store.retrieve(load.prompt_token_ids, self._kv_cache, list(load.block_ids),
                                         num_prompt_tokens, num_computed_tokens=load.num_computed_tokens)
        if loaded < num_prompt_tokens:
            return (f"LMCache returned the KV of {loaded} of the prompt's {num_prompt_tokens} tokens (Redis down, "
                    f"or its keys expired)")
        num_bytes = (num_prompt_tokens - load.num_computed_tokens) * self.token_num_bytes
        self.counters.add(num_kv_transfers_received=1, num_kv_bytes=num_bytes)
        request_log(logger, load.request_id, load.transfer_id).info(
            "KV of %d tokens loaded from LMCache (%.1f MB, %.3f s after the request's blocks were reserved; %d more "
            "from the prefix cache)", num_prompt_tokens - load.num_computed_tokens, num_bytes / 1e6,
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
        load.closed_event.set()
        with load.lock:
            load.closed = True
