"""The decode worker's KV receiver: the engine's KV connector on the loading side.

The servicer announces each request whose prompt KV will arrive
(:meth:`KVReceiver.expect`: its transfer id, the sender, its deadline). The
engine reserves the request's blocks and calls :meth:`KVReceiver.start_load`
with their ids. The transport connector's threads (p2p, redis) deliver
verified payloads to :meth:`KVReceiver.on_payload`; each is range-checked
against the request and copied into its blocks of the cache the engine
registered. After the last one the load is reported finished (with the first
token it carried); a late transfer (the watchdog), a refused payload or a
broken peer is reported failed with a sentence, and the engine applies the
request's failure policy. Both wake the engine loop.

Blocks are written only while the transfer is open: the engine calls
:meth:`KVReceiver.request_finished` before it frees or reuses a request's
blocks, and that closes the transfer under the lock every write holds, so a
late payload can never land in someone else's blocks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequest
from splitserve.common.log_fields import request_log
from splitserve.engine.kv_connector import KVConnectorBase, KVConnectorEvents, KVLoad, KVSave

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    EXPECTED = "expected"  # announced by the servicer; the engine has not reserved its blocks yet
    LOADING = "loading"  # blocks reserved: payloads are written into them
    RECEIVED = "received"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class Transfer:
    """One prompt's KV on its way in."""

    transfer_id: str
    request_id: str
    num_prompt_tokens: int
    timeout_seconds: float
    source: object = None  # the sender's KVEndpointInfo, a pairing hint for the transport
    state: TransferState = TransferState.EXPECTED
    block_ids: tuple[int, ...] = ()
    # Prompt tokens whose KV is in place: the cached prefix, then what arrived.
    num_received_tokens: int = 0
    num_transferred_tokens: int = 0
    num_received_bytes: int = 0
    num_payloads: int = 0
    started: float = 0.0
    deadline: float = float("inf")
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def is_open(self) -> bool:
        return self.state in (TransferState.EXPECTED, TransferState.LOADING)


class KVReceiver(KVConnectorBase):
    """Routes incoming payloads of one decode worker into the blocks the engine reserved.

    Args:
        transport: the worker's transport connector (``splitserve.kvtransfer``); ``start`` makes it deliver here.
        counters: the worker's Counters.
    """

    def __init__(self, transport, counters) -> None:
        self.transport = transport
        self.counters = counters
        self._kv_cache = None
        self.block_size = transport.layout.block_size
        self._by_transfer: dict[str, Transfer] = {}
        self._by_request: dict[str, Transfer] = {}
        self._events = KVConnectorEvents()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kv-watchdog", daemon=True)

    def start(self) -> None:
        self.transport.start_receiving(self.on_payload, self.on_error)
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    # ---- the servicer's side ---------------------------------------------------------------

    def expect(self, request_id: str, transfer_id: str, num_prompt_tokens: int, timeout_seconds: float,
               source=None, *, prompt_token_ids: list[int] | None = None, lora_request=None,
               cache_salt: str | None = None) -> None:
        """A request's prompt KV will arrive as ``transfer_id`` (from ``source``, a hint; may be None).
        ``prompt_token_ids``, ``lora_request`` and ``cache_salt`` are not needed here (the LMCache receiver's
        ``expect`` takes them).

        Raises:
            InvalidRequest: the transfer id or the request id is in use on this worker.
        """
        transfer = Transfer(transfer_id, request_id, num_prompt_tokens, timeout_seconds, source)
        with self._lock:
            if transfer_id in self._by_transfer:
                raise InvalidRequest(f"Transfer id {transfer_id!r} is already in use on this worker.")
            if request_id in self._by_request:
                raise InvalidRequest(f"Request id {request_id!r} already waits for KV on this worker.")
            self._by_transfer[transfer_id] = transfer
            self._by_request[request_id] = transfer

    def discard(self, request_id: str) -> None:
        """The engine refused the request: forget its transfer."""
        transfer = self._pop(request_id)
        if transfer is not None:
            self._close(transfer, TransferState.CANCELLED)
            self.transport.cancel(transfer.transfer_id)

    # ---- the engine's side (engine thread) ----------------------------------------------------

    def register_kv_cache(self, kv_cache) -> None:
        self._kv_cache = kv_cache  # [num_blocks, layers, 2, kv_heads, block_size, head_size]

    def start_load(self, load: KVLoad) -> None:
        with self._lock:
            transfer = self._by_request.get(load.request_id)
        if transfer is None:
            self._report_failed_load(load.request_id, "no transfer was announced for it on this worker")
            return
        with transfer.lock:
            transfer.block_ids = load.block_ids
            transfer.num_received_tokens = load.num_computed_tokens
            transfer.started = time.monotonic()
            transfer.deadline = transfer.started + transfer.timeout_seconds
            transfer.state = TransferState.LOADING
        request_log(logger, load.request_id, transfer.transfer_id).debug(
            "Waiting for the prompt's KV (%d prompt tokens, %d cached here)", load.num_prompt_tokens,
            load.num_computed_tokens)
        self.transport.expect(transfer.transfer_id, transfer.source)

    def save(self, save: KVSave) -> None:
        """A decode worker sends no KV: a save asked of it fails at once (the engine frees the blocks)."""
        with self._lock:
            self._events.failed_saves[save.request_id] = "a decode worker's receiver saves no KV"
        self.wake_engine()

    def request_finished(self, request_id: str) -> bool:
        transfer = self._pop(request_id)
        if transfer is not None and self._close(transfer, TransferState.CANCELLED):
            self.transport.cancel(transfer.transfer_id)  # its later payloads are dropped
        return False

    def get_finished(self) -> KVConnectorEvents:
        with self._lock:
            events, self._events = self._events, KVConnectorEvents()
        return events

    # ---- the transport's callbacks (its threads) --------------------------------------------------

    def on_payload(self, received) -> None:
        header = received.header
        with self._lock:
            transfer = self._by_transfer.get(header.transfer_id)
        if transfer is None:
            request_log(logger, "-", header.transfer_id).warning("Dropping a KV payload of an unknown or ended transfer")
            self.transport.cancel(header.transfer_id)
            return
        with transfer.lock:
            if not transfer.is_open:
                return
            problem = self._check_range(transfer, header)
            if problem is None:
                self._write(transfer, received)
                if not header.is_last:
                    return
                transfer.state = TransferState.RECEIVED
        if problem is not None:
            self.counters.add(num_kv_payloads_refused=1)
            self._give_up(transfer, f"KV payload refused: {problem}")
            return
        self._pop(transfer.request_id)
        self.counters.add(num_kv_transfers_received=1)
        request_log(logger, transfer.request_id, transfer.transfer_id).info(
            "KV of %d tokens received (%d payloads, %.1f MB, %.3f s; %d more from the prefix cache)",
            transfer.num_transferred_tokens, transfer.num_payloads,
            transfer.num_received_bytes / 1e6, time.monotonic() - transfer.started,
            transfer.num_received_tokens - transfer.num_transferred_tokens,
        )
        with self._lock:
            self._events.finished_loads[transfer.request_id] = header.first_token_id
        self.wake_engine()

    def on_error(self, transfer_id: str | None, error: Exception) -> None:
        if transfer_id is None:
            logger.warning("KV connector error: %s", error)
            return
        with self._lock:
            transfer = self._by_transfer.get(transfer_id)
        if transfer is not None:
            self.counters.add(num_kv_payloads_refused=1)
            self._give_up(transfer, str(error))

    # ---- internals ---------------------------------------------------------------------

    def _write(self, transfer: Transfer, received) -> None:
        """Copy a verified payload into its blocks (under the transfer's lock)."""
        header = received.header
        first_block = header.first_token_position // self.block_size
        received.write_to(self._kv_cache, list(transfer.block_ids[first_block : first_block + header.num_blocks]))
        transfer.num_received_tokens += header.num_tokens
        transfer.num_transferred_tokens += header.num_tokens
        transfer.num_received_bytes += header.payload_num_bytes
        transfer.num_payloads += 1
        self.counters.add(num_kv_bytes=header.payload_num_bytes)

    def _check_range(self, transfer: Transfer, header) -> str | None:
        if transfer.state != TransferState.LOADING:
            return "it arrived before the request's blocks were reserved."
        if header.num_prompt_tokens != transfer.num_prompt_tokens:
            return (f"it is for a prompt of {header.num_prompt_tokens} tokens; request "
                    f"{transfer.request_id} has {transfer.num_prompt_tokens}.")
        if header.first_token_position != transfer.num_received_tokens:
            return (f"it starts at token {header.first_token_position}; the next expected is "
                    f"{transfer.num_received_tokens}.")
        end = header.first_token_position + header.num_tokens
        if header.num_tokens <= 0 or end > transfer.num_prompt_tokens:
            return f"its tokens {header.first_token_position}..{end} are outside the prompt."
        if header.is_last and end != transfer.num_prompt_tokens:
            return f"the last payload ends at token {end}, before the prompt's end ({transfer.num_prompt_tokens})."
        return None

    def _give_up(self, transfer: Transfer, reason: str) -> None:
        """Report the load failed (the engine applies the request's policy); no more writes."""
        if not self._close(transfer, TransferState.FAILED):
            return
        self._pop(transfer.request_id)
        self.transport.cancel(transfer.transfer_id)
        self._report_failed_load(transfer.request_id, reason)

    def _report_failed_load(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._events.failed_loads[request_id] = reason
        self.wake_engine()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                late = [t for t in self._by_transfer.values() if t.deadline <= now]
            for transfer in late:
                self._give_up(transfer, f"it did not arrive within {now - transfer.started:.1f} s")

    def _pop(self, request_id: str) -> Transfer | None:
        with self._lock:
            transfer = self._by_request.pop(request_id, None)
            if transfer is not None:
                self._by_transfer.pop(transfer.transfer_id, None)
            return transfer

    @staticmethod
    def _close(transfer: Transfer, state: TransferState) -> bool:
        with transfer.lock:
            if not transfer.is_open:
                return False
            transfer.state = state
            return True
