"""The prefill worker's LMCache sender: the engine's KV connector on the saving side with ``--kv-transfer
lmcache``, which also loads the prefix of a prompt LMCache holds (prefix reuse across the cluster).

The servicer announces each request whose prompt KV goes out (:meth:`LMCacheSender.expect`, with the prompt's
token ids). The announcement looks the prompt up in LMCache: when it holds a prefix (chunks any prefill worker
stored before: another turn of the chat, a shared system prompt), the engine is told so
(:meth:`LMCacheSender.get_num_matched_tokens`), reserves the request's blocks, and the sender's
:class:`~splitserve.kvtransfer.lmcache_loads.LMCacheLoader` retrieves the prefix into them (past what this
worker's own prefix cache holds); the engine then computes only the rest. The prefix loaded is the stored one
cut to a block boundary and short of the prompt's last token (whose logits give the first token); a prefix
that vanished meanwhile (keys expired, Redis down) is a failed load, and the engine computes the prompt.

The engine calls :meth:`LMCacheSender.save` after every step with the blocks that step completed (the loaded
prefix's blocks included); they are collected in order, and the last save (the prompt's end) starts a thread
that stores in LMCache (Redis) the chunks it does not hold yet, from those blocks. LMCache's ``store`` returns once it has copied the chunks out of the
cache: the save is then reported finished and the engine frees the blocks. The thread then polls LMCache's
``lookup`` until Redis holds the whole prompt (its writes land asynchronously, with no flush to wait on), and
only then releases the servicer's wait: a store that Redis never receives (Redis down) fails the prefill with
a sentence (ABORTED), so the router has the decode worker prefill the prompt itself instead of waiting out
its KV timeout. The decode worker polls the same ``lookup`` before it retrieves.

LMCache keys chunks by a chain hash from the prompt's start, so the whole prompt is stored, never only what
the decode worker lacks: a chunk is found only after every chunk before it, and the stored prefix is what
later prompts on any worker reuse. The decode worker retrieves only the positions its prefix cache lacks.
"""

from __future__ import annotations

import logging
import threading
import time

from splitserve.common.errors import InvalidRequest
from splitserve.common.log_fields import request_log
from splitserve.common.types import KVConnectorKind
from splitserve.engine.kv_connector import KVConnectorBase, KVConnectorEvents, KVLoad, KVSave
from splitserve.engine.lora import kv_store_tag
from splitserve.kvtransfer.lmcache_loads import LMCacheLoader

logger = logging.getLogger(__name__)

# How long a store may take to land in Redis before the prefill fails; how often it is checked.
LANDED_TIMEOUT_SECONDS = 10.0
LOOKUP_INTERVAL_SECONDS = 0.015


class LMCacheSave:
    """One prompt's KV on its way into LMCache; the servicer waits on it (the attributes it reads are those of
    ``prefill_service.sender.TransferSender``).

    Args:
        request_id, transfer_id, prompt_token_ids: what the servicer announced.
        token_num_bytes: KV bytes of one token in the worker's cache.
        lora_request: its LoRA adapter (None: the base model); cache_salt: its cache salt (None: none). Its KV
            goes under their tag (``kv_store_tag``).
    """

    def __init__(self, request_id: str, transfer_id: str, prompt_token_ids: list[int], token_num_bytes: int,
                 lora_request=None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.lora_request, self.cache_salt = lora_request, cache_salt
        self.cache_tag = kv_store_tag(lora_request, cache_salt)
        self.transfer_id = transfer_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_num_bytes = token_num_bytes
        # Leading prompt tokens whose KV LMCache held when the request came (loaded, not computed).
        self.num_matched_tokens = 0
        # The request's blocks in token order, as the engine's saves hand them over.
        self.block_ids: list[int] = []
        self.num_collected_tokens = 0
        self.num_sent_tokens = 0
        self.num_sent_blocks = 0
        self.num_sent_bytes = 0
        self.num_sends = 0  # stores handed to LMCache: 1 once stored
        self.error: Exception | str | None = None
        self.finished = threading.Event()
        # When Redis held the whole prompt (None until then).
        self.last_handed_over: float | None = None
        self.cancelled = False
        self.storing = False
        self.lock = threading.Lock()

    @property
    def succeeded(self) -> bool:
        return self.last_handed_over is not None and self.error is None

    def wait(self, timeout: float | None) -> bool:
        """Block until Redis holds the prompt, or the store failed or was cancelled; False on timeout."""
        return self.finished.wait(timeout)

    def fail(self, error: Exception | str) -> None:
        if self.error is None:
            self.error = error
        self.finished.set()


class LMCacheSender(KVConnectorBase):
    """Stores the prompts' KV of one prefill worker's requests in LMCache, a thread per prompt once computed.

    Args:
        store: the worker's ``LMCacheKVStore`` (``splitserve.kvtransfer.lmcache_connector``); closed by the
            worker, not here.
    """

    def __init__(self, store) -> None:
        self.store = store
        self.block_size = store.layout.block_size
        self.token_num_bytes = store.layout.block_num_bytes // self.block_size
        self._kv_cache = None
        self._saves: dict[str, LMCacheSave] = {}
        self._events = KVConnectorEvents()
        self._lock = threading.Lock()
        # Stored prefixes on their way into the requests' blocks.
        self._prefixes = LMCacheLoader(store)

    def stop(self) -> None:
        """End the prefix loads (the worker closes the store)."""
        self._prefixes.stop()

    # ---- the servicer's side ----------------------------------------------------------------

    def expect(self, request_id: str, transfer_id: str, destination, num_prompt_tokens: int, *,
               prompt_token_ids: list[int] | None = None, lora_request=None,
               cache_salt: str | None = None) -> LMCacheSave:
        """A request's prompt KV goes into LMCache as ``transfer_id``, under the tag of its LoRA adapter and cache
        salt (``kv_store_tag``; neither: the base model's); wait on the returned save.

        Raises:
            InvalidRequest: the request id is being saved from here already, the destination does not load from
                LMCache, or the prompt's token ids are missing.
        """
        if destination is not None and destination.connector != KVConnectorKind.LMCACHE:
            raise InvalidRequest(f"The decode worker receives KV over {destination.connector}; this prefill worker "
                                 "stores it in LMCache: both pools must use the same --kv-transfer.")
        if prompt_token_ids is None or len(prompt_token_ids) != num_prompt_tokens:
            raise InvalidRequest("An LMCache store needs the prompt's token ids (LMCache keys KV by them).")
        save = LMCacheSave(request_id, transfer_id, list(prompt_token_ids), self.token_num_bytes, lora_request,
                           cache_salt)
        with self._lock:
            if request_id in self._saves:
                raise InvalidRequest(f"Request id {request_id!r} is already being prefilled here.")
            self._saves[request_id] = save
        save.num_matched_tokens = self._stored_prefix(save)
        return save

    def _stored_prefix(self, save: LMCacheSave) -> int:
        """How many leading prompt tokens to load: what LMCache holds, cut to a block boundary short of the
        prompt's last token. Looked up here, on the RPC's thread, so the engine's thread does no I/O."""
        try:
            held = self.store.lookup(save.prompt_token_ids, save.cache_tag)
        except RuntimeError:  # the store closed: the worker shuts down
            return 0
        return min(held, save.num_prompt_tokens - 1) // self.block_size * self.block_size

    @staticmethod
    def num_skip_tokens(num_destination_cached_tokens: int) -> int:
        """0: the whole prompt is stored, even what the decode worker caches (LMCache keys chunks from the
        prompt's start, and the stored prefix is what other prompts reuse; the decode worker retrieves only what
        it lacks)."""
        return 0

    def is_sending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._saves

    def discard(self, request_id: str) -> None:
        """The engine refused the request: forget its save (nothing was read) and its prefix load."""
        self._prefixes.discard(request_id)
        with self._lock:
            save = self._saves.pop(request_id, None)
        if save is not None:
            self._cancel(save)

    # ---- the engine's side (engine thread) -----------------------------------------------------

    def register_kv_cache(self, kv_cache) -> None:
        self._kv_cache = kv_cache  # [num_blocks, layers, 2, kv_heads, block_size, head_size]
        self._prefixes.register_kv_cache(kv_cache)

    def set_wakeup(self, wakeup) -> None:
        super().set_wakeup(wakeup)
        self._prefixes.set_wakeup(wakeup)

    def get_num_matched_tokens(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """The stored prefix ``expect`` found for the request (0 for one it did not announce)."""
        with self._lock:
            save = self._saves.get(request_id)
        return save.num_matched_tokens if save is not None else 0

    def start_load(self, load: KVLoad) -> None:
        """Retrieve the stored prefix into the request's blocks (one lookup confirms it is still there)."""
        with self._lock:
            save = self._saves.get(load.request_id)
        if save is None:
            self._prefixes.start_load(load)  # reported failed: nothing was announced
            return
        self._prefixes.expect(load.request_id, save.transfer_id, save.num_prompt_tokens, 0.0,
                              prompt_token_ids=save.prompt_token_ids, lora_request=save.lora_request,
                              cache_salt=save.cache_salt)
        self._prefixes.start_load(load)

    def save(self, save: KVSave) -> None:
        """Collect the blocks a step completed; the last save starts the store."""
        with self._lock:
            pending = self._saves.get(save.request_id)
        if pending is None:  # discarded or cancelled: nothing goes out
            return
        with pending.lock:
            if pending.cancelled:
                return
            if save.first_token_position != pending.num_collected_tokens:
                problem = (f"the engine saved tokens from {save.first_token_position}, the next expected is "
                           f"{pending.num_collected_tokens}")
                pending.cancelled = True
            else:
                problem = None
                pending.block_ids.extend(save.block_ids)
                pending.num_collected_tokens += save.num_tokens
                if save.is_last:
                    pending.storing = True
        if problem is not None:
            self._ended(pending, problem)
        elif save.is_last:
            threading.Thread(target=self._store, args=(pending,), name=f"lmcache-store-{pending.transfer_id[:8]}",
                             daemon=True).start()

    def request_finished(self, request_id: str) -> bool:
        """The request was aborted or failed: its prefix load ends (a retrieve in progress first) and nothing
        more is stored. True while a store still reads its blocks (the engine keeps them until it is reported)."""
        self._prefixes.request_finished(request_id)
        with self._lock:
            save = self._saves.get(request_id)
        if save is None:
            return False
        if self._cancel(save):
            return True
        with self._lock:
            self._saves.pop(request_id, None)
        return False

    def get_finished(self) -> KVConnectorEvents:
        loads = self._prefixes.get_finished()
        with self._lock:
            events, self._events = self._events, KVConnectorEvents()
        events.finished_loads, events.failed_loads = loads.finished_loads, loads.failed_loads
        return events

    # ---- a store's thread -------------------------------------------------------------------------

    def _store(self, save: LMCacheSave) -> None:
        """Store the chunks LMCache lacks from the prompt's blocks, free them, then wait until Redis holds the
        whole prompt."""
        log = request_log(logger, save.request_id, save.transfer_id)
        started = time.monotonic()
        try:
            # Looked up again: chunks stored since the request came (or gone since) are counted right.
            held = self.store.lookup(save.prompt_token_ids, save.cache_tag)
            if held < save.num_prompt_tokens:
                self.store.store(save.prompt_token_ids, self._kv_cache, save.block_ids,
                                 first_position=held // self.store.chunk_size * self.store.chunk_size,
                                 tag=save.cache_tag)
        except Exception as error:  # reported to the engine (frees the blocks) and to the waiting Prefill call
            log.warning("Storing the prompt's KV in LMCache failed: %s", error)
            self._ended(save, f"storing the prompt's KV in LMCache failed: {error}")
            return
        save.num_sent_tokens = save.num_prompt_tokens
        save.num_sent_blocks = len(save.block_ids)
        save.num_sent_bytes = save.num_prompt_tokens * self.token_num_bytes
        save.num_sends = 1
        copied = time.monotonic()
        if not self._ended(save):  # the blocks are free now; a cancelled request waits no further
            return
        problem = self._wait_until_landed(save)
        if problem is not None:
            log.warning("%s", problem)
            save.fail(problem)
            return
        save.last_handed_over = time.monotonic()
        log.debug("Prompt of %d tokens stored in LMCache: copied out in %.3f s, in Redis %.3f s later",
                  save.num_prompt_tokens, copied - started, save.last_handed_over - copied)
        save.finished.set()

    def _wait_until_landed(self, save: LMCacheSave) -> str | None:
        """None once LMCache's lookup finds the whole prompt in Redis; else why not."""
        deadline = time.monotonic() + LANDED_TIMEOUT_SECONDS
        # The deadline is checked before each lookup: one lookup against a Redis that stopped answering blocks
        # for up to the store's socket timeout, so the whole wait is bounded by the two together.
        while time.monotonic() < deadline:
            try:
                if self.store.lookup(save.prompt_token_ids, save.cache_tag) >= save.num_prompt_tokens:
                    return None
            except RuntimeError as error:  # the store closed: the worker shuts down
                return f"LMCache closed before the prompt's KV reached Redis ({error})"
            time.sleep(LOOKUP_INTERVAL_SECONDS)
        return (f"the prompt's KV did not reach Redis through LMCache within {LANDED_TIMEOUT_SECONDS:.0f} s "
                f"(is Redis at {self.store.url} up?)")

    # ---- internals -------------------------------------------------------------------------------

    def _cancel(self, save: LMCacheSave) -> bool:
        """Store nothing more; True while a store still reads the blocks (``_ended`` reports it later)."""
        with save.lock:
            save.cancelled = True
            storing = save.storing
        if not storing:
            save.fail("cancelled")
        return storing

    def _ended(self, save: LMCacheSave, problem: str | None = None) -> bool:
        """The blocks are no longer read: report the save finished (or failed) so the engine frees them. Returns
        False when the request is gone or was cancelled (its waiter is released here)."""
        with save.lock:
            save.storing = False
            cancelled = save.cancelled
        with self._lock:
            if self._saves.get(save.request_id) is not save:
                return False  # discarded, or the engine already took its blocks back
            del self._saves[save.request_id]
            if problem is None and not cancelled:
                self._events.finished_saves.add(save.request_id)
            else:
                self._events.failed_saves[save.request_id] = problem or "cancelled"
        self.wake_engine()
        if problem is not None or cancelled:
            save.fail(problem or "cancelled")
            return False
        return True
