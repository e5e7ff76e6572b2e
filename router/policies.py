"""Routing policies: which worker of a pool gets the next request.

Chosen per pool by name (``--prefill-policy``, ``--decode-policy``) through
:func:`make_policy`. A policy sees the copies ``WorkerRegistry.routable()``
returns (maybe filtered by the caller), so lists change between calls; every
policy is thread-safe.

* ``round_robin``: the least recently chosen worker (exact rotation, stable
  when workers come and go).
* ``least_loaded``: the lowest load, equal loads take turns. Prefill pool:
  backlog tokens (see :class:`LeastLoaded`); decode and colocated pools:
  ``kv_block_usage + requests / max_num_seqs``.
* ``prefix_aware``: prompts with the same first blocks go to the same worker
  (its prefix cache holds them) by rendezvous hashing, with bounded load.

What a router engineer from SGLang or vLLM's production stack would expect, and
where this differs:

* SGLang's cache-aware router keeps an approximate radix tree of the text each
  worker has seen and routes to the longest match above a match ratio. Here the
  affinity is stateless: a hash of the first ``prefix_blocks`` blocks. Every
  router replica and a restarted router agree without sharing state, and
  memory is zero; the price is that prompts sharing fewer than
  ``prefix_blocks`` blocks are not recognised as related.
* Both balance on load when the cache choice is overloaded (SGLang: absolute
  and relative thresholds on queue length). Here the threshold is in the
  pool's own load unit (prefill: tokens), and the spill follows the rendezvous
  ranking (consistent hashing with bounded loads), so the spilled prefix also
  lands on one predictable second worker instead of whichever is idlest.
* vLLM's production-stack router reads engine metrics scraped every few
  seconds. Those are stale under bursts; here the reported load is corrected by
  what this router sent since the report (prefill) or by its own exact
  in-flight count (decode).
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from splitserve.common.block_hash import hash_block_tokens
from splitserve.common.errors import NoWorkerAvailable
from splitserve.common.types import WorkerRole
from splitserve.router.worker import Worker

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware")
# A worker whose capacity does not say: the engine's default max_num_seqs.
DEFAULT_MAX_NUM_SEQS = 64
_PREFIX_AWARE_OPTIONS = {"prefix_blocks", "max_imbalance"}


class RoutingPolicy(ABC):
    """Chooses a worker for a prompt. Implementations are thread-safe."""

    @abstractmethod
    def choose(self, workers: list[Worker], prompt_token_ids: list[int], hash_root: bytes | None = None) -> Worker:
        """One of ``workers`` for the prompt (may update the policy's own bookkeeping, never the workers).
        ``hash_root``: the hash the workers chain the prompt's blocks from (``block_hash.request_root_hash``: its
        LoRA adapter's, cache salt's or LongRoPE's; None the base model's), for policies that key on them.

        Raises:
            NoWorkerAvailable: ``workers`` is empty.
        """


def _require(workers: list[Worker]) -> None:
    if not workers:
        raise NoWorkerAvailable("No worker to route to: the pool is empty or every worker is draining or unreachable.")


def _forget_absent(per_worker: dict, workers: list[Worker]) -> None:
    """Bound per-worker bookkeeping: drop ids not in ``workers`` once it outgrows them."""
    if len(per_worker) > 2 * len(workers) + 16:
        present = {w.worker_id for w in workers}
        for worker_id in [i for i in per_worker if i not in present]:
            del per_worker[worker_id]


class RoundRobin(RoutingPolicy):
    """The least recently chosen worker; never-chosen ones first, in list order.

    On a fixed list this is an exact rotation. Unlike ``counter % len`` it stays
    fair when the list changes between calls (a worker joins, drains, or the
    caller excludes one it already tried): a new worker is chosen next, and
    no worker is chosen twice while another waits.
    """

    def __init__(self) -> None:
        self._last_chosen: dict[str, int] = {}  # worker id -> tick of its last choice
        self._tick = 0
        self._lock = threading.Lock()

    def choose(self, workers: list[Worker], prompt_token_ids: list[int] = (), hash_root: bytes | None = None) -> Worker:
        _require(workers)
        with self._lock:
            worker = min(workers, key=lambda w: self._last_chosen.get(w.worker_id, -1))
            self._tick += 1
            self._last_chosen[worker.worker_id] = self._tick
            _forget_absent(self._last_chosen, workers)
            return worker


class LeastLoaded(RoutingPolicy):
    """The worker with the lowest ``load()``; equal loads take turns (:class:`RoundRobin`).

    Prefill pool, ``load = backlog tokens = num_queued_prefill_tokens +
    prompt tokens this policy routed to the worker since its last report``.
    The report (at ``worker.last_heard``) already counts what was routed
    before it, so only later routings are added, and a newer report (a later
    ``last_heard``) resets them; no finish callback is needed. Overestimates by
    at most one heartbeat interval's routed tokens (prefills that finished
    before the next report).

    Decode and colocated pools, ``load = kv_block_usage + requests /
    max_num_seqs`` with ``requests = max(running + waiting +
    waiting_for_remote_kvs, num_in_flight)``: the worker's report, or the
    router's own exact in-flight count when larger (newer than the report).
    ``max`` rather than a sum: the two count the same requests. Both terms are
    fractions of what the worker holds (KV blocks, batch slots); ``max_num_seqs``
    comes from ``worker.capacity`` (64, the engine's default, when unset).
    """

    def __init__(self, role: WorkerRole) -> None:
        self.role = role
        self._turns = RoundRobin()
        self._routed: dict[str, tuple[float, int]] = {}  # worker id -> (last_heard seen, tokens routed since)
        self._lock = threading.RLock()

    def load(self, worker: Worker) -> float:
        """The worker's load in this pool's unit (prefill: tokens; decode: a fraction, ~[0, 2])."""
        if self.role == WorkerRole.PREFILL:
            with self._lock:
                return worker.load.num_queued_prefill_tokens + self._routed_since_report(worker)
        load = worker.load
        reported = load.num_running_requests + load.num_waiting_requests + load.num_waiting_for_remote_kvs_requests
        max_num_seqs = getattr(worker.capacity, "max_num_seqs", 0) or DEFAULT_MAX_NUM_SEQS
        return round(load.kv_block_usage + max(reported, worker.num_in_flight) / max_num_seqs, 9)

    def choose(self, workers: list[Worker], prompt_token_ids: list[int], hash_root: bytes | None = None) -> Worker:
        return self.route(workers, len(prompt_token_ids), self._least)

    def route(self, workers: list[Worker], num_tokens: int,
              pick: Callable[[list[Worker], list[float]], Worker]) -> Worker:
        """``pick(workers, their loads)``, then count ``num_tokens`` into its backlog, in one step.

        Atomic, so concurrent requests see each other's tokens (a burst spreads).
        """
        _require(workers)
        with self._lock:
            _forget_absent(self._routed, workers)
            worker = pick(workers, [self.load(w) for w in workers])
            self.note_routed(worker, num_tokens)
            return worker

    def note_routed(self, worker: Worker, num_tokens: int) -> None:
        """Count ``num_tokens`` into the worker's prefill backlog until its next report (prefill pool only)."""
        if self.role != WorkerRole.PREFILL:
            return
        with self._lock:
            tokens = self._routed_since_report(worker)
            seen = max(self._routed.get(worker.worker_id, (worker.last_heard, 0))[0], worker.last_heard)
            self._routed[worker.worker_id] = (seen, tokens + num_tokens)

    def _least(self, workers: list[Worker], loads: list[float]) -> Worker:
        least = min(loads)
        return self._turns.choose([w for w, load in zip(workers, loads) if load == least])

    def _routed_since_report(self, worker: Worker) -> int:
        seen, tokens = self._routed.get(worker.worker_id, (worker.last_heard, 0))
        # A copy older than what we saw (taken before a heartbeat) still counts our tokens.
        return tokens if seen >= worker.last_heard else 0


class PrefixAware(RoutingPolicy):
    """Prompts that start with the same blocks go to the same worker, unless it is overloaded.

    The key is the workers' chained block hash (``hash_block_tokens``) of the
    prompt's first ``min(full blocks, prefix_blocks)`` blocks; workers are
    ranked for a key by rendezvous (highest random weight) hashing,
    ``sha256(key + worker_id)``, so adding or removing a worker moves only the
    keys it wins or held. The prompt goes to the first worker in that ranking
    whose load exceeds the least loaded worker's by at most ``max_imbalance``
    (the least loaded one always qualifies). ``max_imbalance`` is in the pool's
    load unit (see :class:`LeastLoaded`): prefill tokens, default 2048 (waiting
    behind X more queued tokens costs about as much as recomputing X prompt
    tokens, so this pays for cached prefixes up to ~2k tokens); decode score, default 0.25 (a quarter of the KV cache
    or of the batch slots). Prompts under one block go to the least loaded.

    No memory of past assignments is kept: the ranking already makes the spill
    deterministic (a hot prefix overflows onto one second worker, whose cache
    then holds it too), and state would diverge between router replicas and be
    lost on restart.

    Decode and colocated pools benefit too: decode workers reuse cached prompt
    blocks (less KV to transfer) and colocated workers skip that prefill.
    """

    def __init__(self, role: WorkerRole = WorkerRole.PREFILL, block_size: int = 16, prefix_blocks: int = 8,
                 max_imbalance: float | None = None) -> None:
        if block_size < 1 or prefix_blocks < 1:
            raise ValueError(f"block_size and prefix_blocks must be >= 1, got {block_size} and {prefix_blocks}.")
        if max_imbalance is None:
            max_imbalance = 2048 if role == WorkerRole.PREFILL else 0.25
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}.")
        self.role = role
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.max_imbalance = max_imbalance
        self.least_loaded = LeastLoaded(role)

    def prefix_key(self, prompt_token_ids: list[int], hash_root: bytes | None = None) -> bytes | None:
        """Chained hash of the prompt's first full blocks (at most ``prefix_blocks``) from ``hash_root``, as the
        workers hash them (so an adapter's or a salt's prompts are keyed apart from the same tokens' on the base
        model, whose cached blocks they could not use); None under one block."""
        num_blocks = min(len(prompt_token_ids) // self.block_size, self.prefix_blocks)
        key = None
        for start in range(0, num_blocks * self.block_size, self.block_size):
            key = hash_block_tokens(key if start else hash_root, list(prompt_token_ids[start : start + self.block_size]))
        return key

    def ranking(self, workers: list[Worker], key: bytes) -> list[Worker]:
        """``workers`` by descending rendezvous weight for ``key`` (ties cannot happen: ids are unique)."""
        return sorted(workers, key=lambda w: hashlib.sha256(key + w.worker_id.encode()).digest(), reverse=True)

    def choose(self, workers: list[Worker], prompt_token_ids: list[int], hash_root: bytes | None = None) -> Worker:
        key = self.prefix_key(prompt_token_ids, hash_root)
        if key is None:
            return self.least_loaded.choose(workers, prompt_token_ids)

        def first_not_overloaded(workers: list[Worker], loads: list[float]) -> Worker:
            by_id = dict(zip((w.worker_id for w in workers), loads))
            bound = min(loads) + self.max_imbalance
            return next(w for w in self.ranking(workers, key) if by_id[w.worker_id] <= bound)

        return self.least_loaded.route(workers, len(prompt_token_ids), first_not_overloaded)


def make_policy(name: str, role: WorkerRole, block_size: int = 16, **options) -> RoutingPolicy:
    """A policy by its flag name for the pool of ``role``.

    Args:
        name: round_robin, least_loaded or prefix_aware.
        block_size: the workers' KV block size (used by prefix_aware, ignored by the others).
        options: prefix_aware's ``prefix_blocks``, ``max_imbalance``.
    Raises:
        ValueError: unknown name, or options the policy does not take.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"Unknown routing policy {name!r}; choose round_robin, least_loaded or prefix_aware.")
    accepted = _PREFIX_AWARE_OPTIONS if name == "prefix_aware" else set()
    if set(options) - accepted:
        raise ValueError(f"The {name} policy does not take {', '.join(sorted(set(options) - accepted))}; "
                         f"it takes: {', '.join(sorted(accepted)) or 'no options'}.")
    if name == "prefix_aware":
        return PrefixAware(role, block_size=block_size, **options)
    return RoundRobin() if name == "round_robin" else LeastLoaded(role)
