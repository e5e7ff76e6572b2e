"""Routing policies: which worker of a pool gets the next request.

Chosen per pool by name (``--prefill-policy``, ``--decode-policy``):

* ``round_robin``: rotate.
* ``least_loaded``: prefill pool: fewest requests the router has in flight on
  the worker, then the smallest reported prefill backlog (queued prompt tokens);
  decode pool: lowest ``kv_block_usage + (running + waiting + in flight) /
  max_num_seqs``. The router's own in-flight count is exact and current; the
  reported load is up to one heartbeat old, so it breaks ties. Equal workers
  take turns.
* ``prefix_aware``: prompts whose first blocks are equal go to the same prefill
  worker, whose prefix cache then holds them, by rendezvous hashing of the
  chained hash of the first ``prefix_blocks`` full blocks (the engine's block
  hash), so adding or removing a worker moves only that worker's share. If the
  chosen worker has ``max_imbalance`` more requests in flight than the least
  loaded one it falls back to least loaded, as SGLang's cache-aware router
  balances when load is skewed; unlike SGLang's it keeps no radix tree of
  what each worker has cached (a stateless approximation: exact for shared
  system prompts and multi-turn chats that extend the same prefix).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from abc import ABC, abstractmethod

from splitserve.engine.kv_cache_manager import hash_block_tokens
from splitserve.router.registry import Worker, WorkerRole


class NoWorkerAvailable(Exception):
    """The pool has no worker to choose from (UNAVAILABLE)."""


class RoutingPolicy(ABC):
    @abstractmethod
    def choose(self, workers: list[Worker], prompt_token_ids: list[int]) -> Worker:
        """One of ``workers`` for a prompt. Raises NoWorkerAvailable for an empty list."""


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def choose(self, workers: list[Worker], prompt_token_ids: list[int]) -> Worker:
        if not workers:
            raise NoWorkerAvailable("No worker to route to.")
        with self._lock:
            return workers[next(self._counter) % len(workers)]


class LeastLoaded(RoutingPolicy):
    def __init__(self, role: WorkerRole) -> None:
        self.role = role
        self._turn = RoundRobin()

    def score(self, worker: Worker) -> tuple:
        load = worker.load
        if self.role == WorkerRole.PREFILL:
            return (worker.num_in_flight, load.num_queued_prefill_tokens)
        max_num_seqs = getattr(worker.capacity, "max_num_seqs", 0) or 64
        requests = load.num_running_requests + load.num_waiting_requests + worker.num_in_flight
        return (round(load.kv_block_usage + requests / max_num_seqs, 6),)

    def choose(self, workers: list[Worker], prompt_token_ids: list[int]) -> Worker:
        if not workers:
            raise NoWorkerAvailable("No worker to route to.")
        best = min(self.score(worker) for worker in workers)
        return self._turn.choose([w for w in workers if self.score(w) == best], prompt_token_ids)


class PrefixAware(RoutingPolicy):
    def __init__(self, block_size: int = 16, prefix_blocks: int = 8, max_imbalance: int = 4) -> None:
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.max_imbalance = max_imbalance
        self._fallback = LeastLoaded(WorkerRole.PREFILL)

    def prefix_key(self, prompt_token_ids: list[int]) -> bytes | None:
        """Chained hash of the prompt's first full blocks (up to ``prefix_blocks``); None under one block."""
        num_blocks = min(len(prompt_token_ids) // self.block_size, self.prefix_blocks)
        key = None
        for index in range(num_blocks):
            key = hash_block_tokens(key, prompt_token_ids[index * self.block_size : (index + 1) * self.block_size])
        return key

    def choose(self, workers: list[Worker], prompt_token_ids: list[int]) -> Worker:
        if not workers:
            raise NoWorkerAvailable("No worker to route to.")
        key = self.prefix_key(prompt_token_ids)
        if key is None:
            return self._fallback.choose(workers, prompt_token_ids)
        chosen = max(workers, key=lambda w: hashlib.sha256(key + w.worker_id.encode()).digest())
        least = min(w.num_in_flight for w in workers)
        if chosen.num_in_flight - least > self.max_imbalance:
            return self._fallback.choose(workers, prompt_token_ids)
        return chosen


def make_policy(name: str, role: WorkerRole, block_size: int = 16, **options) -> RoutingPolicy:
    """A policy by its flag name: round_robin, least_loaded or prefix_aware."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(role)
    if name == "prefix_aware":
        if role != WorkerRole.PREFILL:
            # Decode workers receive KV rather than reuse a prefix cache: balance them by load.
            return LeastLoaded(role)
        return PrefixAware(block_size=block_size, **options)
    raise ValueError(f"Unknown routing policy {name!r}; choose round_robin, least_loaded or prefix_aware.")
