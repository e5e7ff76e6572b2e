"""A worker's counters since it started (the proto's WorkerCounters), updated by any thread."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from splitserve.v1 import worker_pb2


@dataclass
class Counters:
    """Mirror of worker_pb2.WorkerCounters; updated under ``lock`` by any thread."""

    num_requests: int = 0
    num_finished_requests: int = 0
    num_kv_transfers_received: int = 0
    num_local_prefills: int = 0
    num_kv_recomputes: int = 0
    num_kv_payloads_refused: int = 0
    num_kv_transfers_sent: int = 0
    num_kv_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def to_pb(self) -> worker_pb2.WorkerCounters:
        with self.lock:
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lock"}
        return worker_pb2.WorkerCounters(**values)
