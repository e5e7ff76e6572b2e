"""WorkerLoad: one worker's queues and KV usage, as the engine reports it and the router stores it.

The proto form (``splitserve.v1.WorkerLoad``) is converted at the edge, in
``splitserve.rpc.convert`` (``worker_load_to_pb`` / ``worker_load_from_pb``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerLoad:
    """A worker's load at one moment (the engine's after a step; the router's at the last report)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_waiting_for_remote_kvs_requests: int = 0
    # Prompt tokens scheduled but not computed yet (the prefill backlog).
    num_queued_prefill_tokens: int = 0
    num_total_kv_blocks: int = 0
    # Evictable prefix-cache blocks count as free.
    num_free_kv_blocks: int = 0

    @property
    def kv_block_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]; 0 before the first report (no blocks known)."""
        if self.num_total_kv_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_total_kv_blocks
