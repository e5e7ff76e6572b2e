"""The decode worker's KV receiver: arriving payloads -> the blocks reserved for their request.

A request waiting for remote KV is registered here with its transfer id and
reserved block ids. The connector's threads call :meth:`KVReceiver.on_payload`;
each verified payload is range-checked against the request and copied into its
blocks. After the last one the engine is told (on its own thread) that the KV
is in place. A watchdog applies the failure policy to transfers that are late;
refused payloads and broken peers apply it at once.

Blocks are written only while the transfer is live: cancelling (abort,
timeout, failure) happens under the transfer's lock before the engine may free
or reuse the blocks, so a late payload can never land in someone else's blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from splitserve.engine.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    """One prompt's KV on its way in."""

    transfer_id: str
    request_id: str
    num_prompt_tokens: int
    deadline: float
    fail_on_kv_failure: bool
    block_ids: list[int] = field(default_factory=list)
    # Prompt tokens whose KV is in place: the cached prefix, then what arrived.
    num_received_tokens: int = 0
    num_transferred_tokens: int = 0
    num_received_bytes: int = 0
    num_payloads: int = 0
    started: float = field(default_factory=time.monotonic)
    # Set when the KV is complete, or the transfer was given up; no more writes.
    closed: bool = False
    # How it ended: "received", "recomputed", "failed" or "cancelled".
    outcome: str = ""
    first_token_id: int | None = None
    wait_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    done: threading.Event = field(default_factory=threading.Event, repr=False)


class KVReceiver:
    """Routes incoming payloads of one decode worker to their requests.

    Args:
        loop: the worker's engine loop (the engine is only touched through it).
        connector: the worker's KV connector; ``start`` makes it deliver here.
        counters: the worker's Counters.
    """

    def __init__(self, loop: EngineLoop, connector, counters) -> None:
        self.loop = loop
        self.connector = connector
        self.counters = counters
        self.block_size = loop.engine.config.block_size
        self._kv_cache = loop.engine.model_runner.kv_cache
        self._transfers: dict[str, Transfer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kv-watchdog", daemon=True)

    def start(self) -> None:
        self.connector.start_receiving(self.on_payload, self.on_error)
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    # ---- requests --------------------------------------------------------------

    def expect(self, transfer: Transfer, source) -> None:
        """Wait for ``transfer`` (its block ids set); the connector pairs with ``source`` if it needs to."""
        with self._lock:
            if transfer.transfer_id in self._transfers:
                raise ValueError(f"Transfer id {transfer.transfer_id!r} is already in use on this worker.")
            self._transfers[transfer.transfer_id] = transfer
        self.connector.expect(transfer.transfer_id, source)

    def cancel(self, transfer_id: str) -> bool:
        """Give up a transfer (its request is being aborted); True if it was still open."""
        transfer = self._pop(transfer_id)
        if transfer is None:
            return False
        opened = self._close(transfer, "cancelled")
        self.connector.cancel(transfer_id)
        return opened

    # ---- connector callbacks (connector threads) --------------------------------

    def on_payload(self, received) -> None:
        header, payload = received.header, received.payload
        with self._lock:
            transfer = self._transfers.get(header.transfer_id)
        if transfer is None:
            logger.warning("Dropping a KV payload of unknown or finished transfer %s", header.transfer_id)
            self.connector.cancel(header.transfer_id)
            return
        with transfer.lock:
            if transfer.closed:
                return
            problem = self._check_range(transfer, header)
            if problem is None:
                first_block = header.first_token_position // self.block_size
                block_ids = transfer.block_ids[first_block : first_block + header.num_blocks]
                from splitserve.kvtransfer.base import scatter_blocks

                scatter_blocks(self._kv_cache, block_ids, payload)
                transfer.num_received_tokens += header.num_tokens
                transfer.num_transferred_tokens += header.num_tokens
                transfer.num_received_bytes += header.payload_num_bytes
                transfer.num_payloads += 1
                self.counters.add(num_kv_bytes=header.payload_num_bytes)
                if not header.is_last:
                    return
                transfer.first_token_id = header.first_token_id
                transfer.closed = True
                transfer.outcome = "received"
                transfer.wait_seconds = time.monotonic() - transfer.started
        if problem is not None:
            self.counters.add(num_kv_payloads_refused=1)
            self._give_up(header.transfer_id, f"KV payload refused: {problem}")
            return
        self._pop(transfer.transfer_id)
        self.counters.add(num_kv_transfers_received=1)
        logger.info(
            "Request %s: KV of %d tokens received through the connector (%d payloads, %.1f MB, %.3f s; "
            "%d more from the prefix cache); WAITING_FOR_REMOTE_KVS -> WAITING",
            transfer.request_id, transfer.num_transferred_tokens, transfer.num_payloads,
            transfer.num_received_bytes / 1e6, transfer.wait_seconds,
            transfer.num_received_tokens - transfer.num_transferred_tokens,
        )
        request_id, first_token_id = transfer.request_id, transfer.first_token_id
        self.loop.post(lambda engine: _finish_remote_kv(engine, request_id, first_token_id))
        transfer.done.set()

    def on_error(self, transfer_id: str | None, error: Exception) -> None:
        if transfer_id is None:
            logger.warning("KV connector error: %s", error)
            return
        self.counters.add(num_kv_payloads_refused=1)
        self._give_up(transfer_id, str(error))

    # ---- failures -----------------------------------------------------------------

    def _check_range(self, transfer: Transfer, header) -> str | None:
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

    def _give_up(self, transfer_id: str, reason: str) -> None:
        """Apply the failure policy: recompute the prompt here, or fail the request."""
        transfer = self._pop(transfer_id)
        if transfer is None or not self._close(transfer, "failed" if transfer.fail_on_kv_failure else "recomputed"):
            return
        self.connector.cancel(transfer_id)
        request_id = transfer.request_id
        if transfer.fail_on_kv_failure:
            message = f"The prompt's KV could not be loaded ({reason}); --kv-load-failure is fail."
            logger.warning("Request %s: %s", request_id, message)
            self.loop.post(lambda engine: engine.fail_request(request_id, message))
        else:
            logger.warning("Request %s: %s; recomputing the prompt locally", request_id, reason)
            self.counters.add(num_kv_recomputes=1)
            self.loop.post(lambda engine: _recompute(engine, request_id))
        transfer.done.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                late = [t for t in self._transfers.values() if t.deadline <= now]
            for transfer in late:
                waited = now - transfer.started
                self._give_up(transfer.transfer_id, f"it did not arrive within {waited:.1f} s")

    def _pop(self, transfer_id: str) -> Transfer | None:
        with self._lock:
            return self._transfers.pop(transfer_id, None)

    @staticmethod
    def _close(transfer: Transfer, outcome: str) -> bool:
        with transfer.lock:
            if transfer.closed:
                return False
            transfer.closed = True
            transfer.outcome = outcome
            transfer.wait_seconds = time.monotonic() - transfer.started
            return True


def _finish_remote_kv(engine, request_id: str, first_token_id: int | None) -> None:
    try:
        engine.finish_remote_kv(request_id, first_token_id)
    except KeyError:  # aborted meanwhile
        pass


def _recompute(engine, request_id: str) -> None:
    try:
        engine.recompute_remote_kv(request_id)
    except KeyError:
        pass
