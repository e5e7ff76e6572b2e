"""The prefill worker's KV sender: blocks of one transfer, in order, through the connector.

The engine thread (its after-step hook) queues runs of completed blocks as
they are computed; a thread per transfer gathers each run from the KV cache,
puts a header in front and hands it to the connector, so chunks of a long
prompt travel while later chunks are still being computed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PayloadPlan:
    """One payload to send: blocks holding prompt tokens [first_token_position, +num_tokens)."""

    block_ids: tuple[int, ...]
    first_token_position: int
    num_tokens: int
    is_last: bool = False
    first_token_id: int | None = None


class TransferSender:
    """Sends one transfer's payloads in order on its own thread.

    Args:
        connector: the worker's KV connector.
        kv_cache: the engine's KV cache tensor ``[blocks, layers, 2, kv_heads, block_size, head_size]``.
        transfer_id, destination, model_fingerprint, layout, num_prompt_tokens: header fields.
    """

    def __init__(self, connector, kv_cache, transfer_id: str, destination, model_fingerprint: str, layout,
                 num_prompt_tokens: int) -> None:
        self.connector = connector
        self.kv_cache = kv_cache
        self.transfer_id = transfer_id
        self.destination = destination
        self.model_fingerprint = model_fingerprint
        self.layout = layout
        self.num_prompt_tokens = num_prompt_tokens
        # Engine-thread state: prompt tokens already queued for sending.
        self.num_queued_tokens = 0
        self.num_sent_blocks = 0
        self.num_sent_bytes = 0
        # Engine payloads handed to the connector (one per step that completed blocks; the connector
        # may split each into smaller wire payloads).
        self.num_sends = 0
        self.error: Exception | None = None
        self.finished = threading.Event()
        self.cancelled = False
        self.last_handed_over: float | None = None
        self._plans: queue.Queue[PayloadPlan | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{transfer_id[:8]}", daemon=True)
        self._thread.start()

    def queue_payload(self, plan: PayloadPlan) -> None:
        self.num_queued_tokens = plan.first_token_position + plan.num_tokens
        self._plans.put(plan)

    def cancel(self) -> None:
        """Send nothing more (the prefill was aborted)."""
        self.cancelled = True
        self._plans.put(None)

    def wait(self, timeout: float | None) -> bool:
        """Block until the last payload was handed over, or failed, or cancelled; False on timeout."""
        return self.finished.wait(timeout)

    def _run(self) -> None:
        from splitserve.kvtransfer.base import BlockSource, TransferHeader

        try:
            while True:
                plan = self._plans.get()
                if plan is None or self.cancelled:
                    return
                # The blocks themselves: the connector reads them from the cache and fills in the checksum.
                payload = BlockSource(self.kv_cache, list(plan.block_ids))
                header = TransferHeader(
                    transfer_id=self.transfer_id, model_fingerprint=self.model_fingerprint, layout=self.layout,
                    first_token_position=plan.first_token_position, num_tokens=plan.num_tokens,
                    num_prompt_tokens=self.num_prompt_tokens,
                    payload_num_bytes=payload.num_bytes, checksum=None,
                    is_last=plan.is_last, first_token_id=plan.first_token_id,
                )
                self.connector.send(self.destination, header, payload)
                self.num_sent_blocks += len(plan.block_ids)
                self.num_sent_bytes += header.payload_num_bytes
                self.num_sends += 1
                if plan.is_last:
                    self.last_handed_over = time.monotonic()
                    return
        except Exception as error:  # reported to the Prefill call, which fails with UNAVAILABLE
            logger.warning("KV transfer %s failed: %s", self.transfer_id, error)
            self.error = error
        finally:
            self.finished.set()
