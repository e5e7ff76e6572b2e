"""The prefill worker's KV sender: the engine's KV connector on the saving side.

The servicer announces each request whose prompt KV goes out
(:meth:`KVSender.expect`: its transfer id and the decode worker's KV
endpoint). The engine calls :meth:`KVSender.save` after every step with the
blocks that step completed; a thread per transfer puts a header in front of
each run of blocks and hands it to the transport connector (p2p, redis),
which reads the blocks straight from the cache, so a long prompt's KV travels
while its later chunks are still computed. The last save carries the first
token. When the last payload is handed over (or the transfer fails), the save
is reported to the engine, which frees the blocks, and the servicer waiting
on the transfer hears of it.

With ``WorkerConfig.kv_faults`` set (tests only), each payload may be failed,
stamped with a foreign model's fingerprint or corrupted on its way to the
transport (``faults.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from splitserve.common.errors import InvalidRequest
from splitserve.common.log_fields import request_log
from splitserve.engine.kv_connector import KVConnectorBase, KVConnectorEvents, KVLoad, KVSave
from splitserve.prefill_service.faults import KVFault, KVFaultInjector, KVFaults, foreign_fingerprint, send_corrupted

logger = logging.getLogger(__name__)


class TransferSender:
    """Sends one transfer's payloads in order on its own thread.

    Args:
        transport: the worker's transport connector.
        kv_cache: the engine's KV cache tensor ``[blocks, layers, 2, kv_heads, block_size, head_size]``.
        request_id, transfer_id, destination, num_prompt_tokens: what the servicer announced.
        on_end: called on the sender's thread when it stops, with itself.
        faults: draws the fault each payload gets (tests only; None: every payload goes untouched).
    """

    def __init__(self, transport, kv_cache, request_id: str, transfer_id: str, destination,
                 num_prompt_tokens: int, on_end, faults: KVFaultInjector | None = None) -> None:
        self.transport = transport
        self.kv_cache = kv_cache
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.destination = destination
        self.num_prompt_tokens = num_prompt_tokens
        self.num_sent_tokens = 0
        self.num_sent_blocks = 0
        self.num_sent_bytes = 0
        # Engine saves handed to the transport (one per step that completed blocks; the transport may
        # split each into smaller wire payloads).
        self.num_sends = 0
        self.error: Exception | None = None
        self.finished = threading.Event()
        self.last_handed_over: float | None = None
        self._on_end = on_end
        self._faults = faults
        self._cancelled = False
        self._sending = False
        self._lock = threading.Lock()
        self._saves: queue.Queue[KVSave | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{transfer_id[:8]}", daemon=True)
        self._thread.start()

    @property
    def succeeded(self) -> bool:
        return self.last_handed_over is not None and self.error is None

    def queue(self, save: KVSave) -> None:
        self._saves.put(save)

    def cancel(self) -> bool:
        """Send nothing more. Returns True while a send is still reading the blocks (it ends on its own)."""
        with self._lock:
            self._cancelled = True
            sending = self._sending
        self._saves.put(None)
        return sending

    def wait(self, timeout: float | None) -> bool:
        """Block until the last payload was handed over, or failed, or cancelled; False on timeout."""
        return self.finished.wait(timeout)

    def _run(self) -> None:
        try:
            while True:
                save = self._saves.get()
                with self._lock:
                    if save is None or self._cancelled:
                        return
                    self._sending = True
                try:
                    self._send(save)
                finally:
                    with self._lock:
                        self._sending = False
                if save.is_last:
                    self.last_handed_over = time.monotonic()
                    return
        except Exception as error:  # reported to the engine (frees the blocks) and to the waiting Prefill call
            request_log(logger, self.request_id, self.transfer_id).warning("KV transfer failed: %s", error)
            self.error = error
        finally:
            self.finished.set()
            self._on_end(self)

    def _send(self, save: KVSave) -> None:
        from splitserve.kvtransfer.blocks import BlockSource
        from splitserve.kvtransfer.header import TransferHeader

        transport = self.transport
        # The blocks themselves: the transport reads them from the cache and fills in the checksum.
        payload = BlockSource(self.kv_cache, list(save.block_ids))
        header = TransferHeader(
            transfer_id=self.transfer_id, model_fingerprint=transport.model_fingerprint, layout=transport.layout,
            first_token_position=save.first_token_position, num_tokens=save.num_tokens,
            num_prompt_tokens=save.num_prompt_tokens, payload_num_bytes=payload.num_bytes, checksum=None,
            is_last=save.is_last, first_token_id=save.first_token_id,
        )
        self._hand_over(header, payload)
        self.num_sent_tokens = save.first_token_position + save.num_tokens
        self.num_sent_blocks += len(save.block_ids)
        self.num_sent_bytes += header.payload_num_bytes
        self.num_sends += 1

    def _hand_over(self, header, payload) -> None:
        """Give one payload to the transport: the one place a payload leaves, and where faults are injected."""
        fault = self._faults.draw() if self._faults is not None else None
        if fault is None:
            self.transport.send(self.destination, header, payload)
            return
        from splitserve.kvtransfer.errors import KVTransferError

        request_log(logger, self.request_id, self.transfer_id).warning(
            "Injecting KV fault %r into the payload of tokens %d..%d", fault.value, header.first_token_position,
            header.first_token_position + header.num_tokens)
        if fault is KVFault.FAIL_SEND:
            raise KVTransferError("Injected KV fault: the connection to the decode worker broke before the payload "
                                  "was sent.")
        if fault is KVFault.FOREIGN_MODEL:
            header = dataclasses.replace(header, model_fingerprint=foreign_fingerprint(header.model_fingerprint))
            self.transport.send(self.destination, header, payload)
            return
        send_corrupted(self.transport, self.destination, header, payload)


class KVSender(KVConnectorBase):
    """Sends the KV of one prefill worker's requests, a :class:`TransferSender` per request.

    Args:
        transport: the worker's transport connector (``splitserve.kvtransfer``).
        faults: faults to inject into the payloads sent (tests only; ``WorkerConfig.kv_faults``); None: none.
    """

    def __init__(self, transport, faults: KVFaults | None = None) -> None:
        self.transport = transport
        self._faults = KVFaultInjector(faults) if faults is not None and faults.enabled else None
        if self._faults is not None:
            logger.warning("KV fault injection is ON (%s): payloads sent from this worker may fail, name another "
                           "model or arrive corrupted. For fault-injection tests only.", faults.describe())
        self._kv_cache = None
        self._transfers: dict[str, TransferSender] = {}
        self._events = KVConnectorEvents()
        self._lock = threading.Lock()

    # ---- the servicer's side ----------------------------------------------------------------

    def expect(self, request_id: str, transfer_id: str, destination, num_prompt_tokens: int, *,
               prompt_token_ids: list[int] | None = None, lora_request=None,
               cache_salt: str | None = None) -> TransferSender:
        """A request's prompt KV goes to ``destination`` as ``transfer_id``; wait on the returned sender.
        ``prompt_token_ids``, ``lora_request`` and ``cache_salt`` are not needed here (the LMCache sender's ``expect``
        takes them).

        Raises:
            InvalidRequest: the request id is being sent from here already.
        """
        with self._lock:
            if request_id in self._transfers:
                raise InvalidRequest(f"Request id {request_id!r} is already being prefilled here.")
            sender = TransferSender(self.transport, self._kv_cache, request_id, transfer_id, destination,
                                    num_prompt_tokens, self._ended, self._faults)
            self._transfers[request_id] = sender
        return sender

    @staticmethod
    def num_skip_tokens(num_destination_cached_tokens: int) -> int:
        """Leading prompt tokens not to send: those the decode worker caches already."""
        return num_destination_cached_tokens

    def is_sending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._transfers

    def discard(self, request_id: str) -> None:
        """The engine refused the request: stop its sender (it read nothing)."""
        with self._lock:
            sender = self._transfers.pop(request_id, None)
        if sender is not None:
            sender.cancel()

    # ---- the engine's side (engine thread) -----------------------------------------------------

    def register_kv_cache(self, kv_cache) -> None:
        self._kv_cache = kv_cache  # [num_blocks, layers, 2, kv_heads, block_size, head_size]

    def start_load(self, load: KVLoad) -> None:
        """A prefill worker receives no KV: a load asked of it fails at once (the engine applies the request's
        failure policy: recompute, or fail)."""
        with self._lock:
            self._events.failed_loads[load.request_id] = "a prefill worker's sender loads no KV"
        self.wake_engine()

    def save(self, save: KVSave) -> None:
        with self._lock:
            sender = self._transfers.get(save.request_id)
        if sender is None:  # its transfer failed or was cancelled: nothing more goes out
            request_log(logger, save.request_id).debug("No open transfer for the KV of tokens %d..%d",
                                                       save.first_token_position,
                                                       save.first_token_position + save.num_tokens)
            return
        sender.queue(save)

    def request_finished(self, request_id: str) -> bool:
        with self._lock:
            sender = self._transfers.get(request_id)
        if sender is None:
            return False
        if sender.cancel():
            return True  # the send in flight still reads the blocks; _ended reports when it is over
        with self._lock:
            self._transfers.pop(request_id, None)
        return False

    def get_finished(self) -> KVConnectorEvents:
        with self._lock:
            events, self._events = self._events, KVConnectorEvents()
        return events

    # ---- a sender's thread ends ------------------------------------------------------------------

    def _ended(self, sender: TransferSender) -> None:
        with self._lock:
            if self._transfers.get(sender.request_id) is not sender:
                return  # discarded, or the engine already took its blocks back
            del self._transfers[sender.request_id]
            if sender.succeeded:
                self._events.finished_saves.add(sender.request_id)
            else:
                self._events.failed_saves[sender.request_id] = str(sender.error or "cancelled")
        self.wake_engine()
