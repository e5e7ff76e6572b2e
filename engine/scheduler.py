"""Continuous batching: which requests run in the next step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running requests
come first, in arrival order: a decode takes one token, an unfinished prompt
takes what is left of it (or of the budget, with chunked prefill). Waiting
requests join while budget, ``max_num_seqs`` and free blocks allow. When a
running request cannot get a block, the most recently started request is
preempted (its blocks freed, to be recomputed later from the queue's front).

A request with a ``kv_fork`` (beam search, parallel sampling) whose parent is still held, or running, takes the
parent's KV when it starts (``KVCacheManager.fork``): the step's ``block_copies`` say which partial blocks the model
runner copies first. Blocks held only for forks (``keep_kv``) are a cache: when nothing can start for want of
blocks, the oldest such hold is freed, and its forks compute what they lose.

Requests in ``WAITING_FOR_REMOTE_KVS`` hold the blocks reserved for their
prompt and are skipped until :meth:`Scheduler.finish_remote_kv`.

With a ``proposer`` (speculative decoding, ``engine/speculative.py``) a running
request's decode also takes the drafts proposed for it, as far as the budget
and free blocks allow (drafts are dropped before anything is preempted for
them); the model runner records how many it rejected, and
:meth:`Scheduler.update_after_step` counts only the KV of accepted ones.

With ``max_loras`` (LoRA adapters, ``engine/lora.py``) the running batch holds
requests of at most that many adapters: a waiting request of another adapter is
passed over, keeping its place, until one of them has no request running (as
vLLM's scheduler skips it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequest, Overloaded
from splitserve.common.log_fields import request_log
from splitserve.engine.kv_cache_manager import BlockCopy, KVCacheManager
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.request_queue import RequestQueue, priority_key, request_queue

logger = logging.getLogger(__name__)


class KVCacheFullError(Overloaded):
    """The KV cache has too few free blocks to reserve a remote request's prompt."""


@dataclass
class ScheduledRequest:
    request: Request
    # Tokens computed in this step: all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens].
    num_new_tokens: int
    # Whether the step ends at the request's last known token (or its drafts), so its logits are sampled.
    sample: bool
    # Speculative decoding: the drafts computed after the request's last token in this step (the last
    # len(spec_token_ids) of num_new_tokens), and how many of them the model rejected (set by the model runner).
    spec_token_ids: list[int] = field(default_factory=list)
    num_rejected: int = 0


@dataclass
class SchedulerOutput:
    # Requests of this step, in batch order; their token ranges are contiguous in the flattened batch.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Total tokens of the step (sum of num_new_tokens).
    num_batched_tokens: int = 0
    # Requests preempted while making room in this step.
    preempted: list[Request] = field(default_factory=list)
    # Blocks to copy before the step's forward pass (forked requests' copies of their parents' partial blocks).
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns every unfinished request of one engine and decides each step's batch.

    Args:
        kv_cache: the block tables; the scheduler is the only one that allocates and frees.
        max_num_seqs: most requests in the running set.
        max_num_batched_tokens: per-step token budget.
        enable_chunked_prefill: split prompts longer than the remaining budget.
        policy: the waiting queue's order (``engine/request_queue.py``): "fcfs", or "priority" (lower
            ``request.priority`` first), where a request that needs blocks preempts the running request latest
            in that order rather than the newest.
        proposer: speculative decoding: ``proposer(request, max_drafts)`` gives the drafts to verify after a
            running request's next token (``SpeculativeConfig.propose``); None: one token a step.
        disable_speculation_at: no drafts in a step that starts with this many running requests or more
            (``SpeculativeConfig.disable_by_batch_size``); None: at any number.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        proposer: Callable[[Request, int], list[int]] | None = None,
        disable_speculation_at: int | None = None,
        max_loras: int | None = None,
        long_rope_context: int | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        # A LongRoPE model's original context: a running request that grows past it is computed again with the long
        # factors throughout (_rotate_long); None: no such model.
        self.long_rope_context = long_rope_context
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.proposer = proposer
        self.disable_speculation_at = disable_speculation_at
        self.max_loras = max_loras
        self.waiting: RequestQueue = request_queue(policy)
        self.running: list[Request] = []
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # Finished requests whose blocks are kept: for a KV transfer (prefill role), or for requests that fork them.
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        # Held requests whose blocks were freed for a queue that could not start (see _drop_a_fork_hold).
        self.num_dropped_fork_holds = 0

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request, num_external_tokens: int = 0) -> None:
        """Queue a request.

        With ``num_external_tokens`` (its first tokens' KV comes from outside: a prefill worker, a shared
        cache), blocks for them are reserved now and the request waits in ``WAITING_FOR_REMOTE_KVS``;
        raises :class:`KVCacheFullError` (changing nothing) when they cannot be reserved. Blocks this
        engine already caches for the prompt's prefix are taken as they are: only the rest needs to come
        from outside (``request.num_cached_tokens`` says how much that is).
        """
        if request.request_id in self.requests:
            raise InvalidRequest(f"Request id {request.request_id!r} is already in use.")
        cached_block_ids, num_cached = [], 0
        if num_external_tokens:
            cached_block_ids, num_cached = self.kv_cache.find_cached_prefix(request)
        num_new = num_external_tokens - num_cached
        if num_new > 0:
            if not self.kv_cache.allocate_slots(request, num_new, cached_block_ids, cache_blocks=False):
                raise KVCacheFullError(
                    f"Cannot reserve {self.kv_cache.num_blocks_for(num_new)} KV blocks "
                    f"for request {request.request_id!r}: {self.kv_cache.free_block_count} are free."
                )
            request.num_cached_tokens = num_cached
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote_kvs[request.request_id] = request
        else:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        self.requests[request.request_id] = request

    def finish_remote_kv(self, request_id: str, num_computed_tokens: int) -> Request:
        """The KV of the first ``num_computed_tokens`` tokens is in the request's blocks.

        Moves the request from ``WAITING_FOR_REMOTE_KVS`` to the waiting queue;
        its blocks enter the prefix cache.
        """
        request = self.waiting_for_remote_kvs.pop(request_id, None)
        if request is None:
            raise KeyError(f"Request {request_id!r} is not waiting for remote KV.")
        if not 0 <= num_computed_tokens <= request.num_prompt_tokens:
            raise ValueError(f"num_computed_tokens must be within the prompt, got {num_computed_tokens}.")
        request.num_computed_tokens = num_computed_tokens
        self.kv_cache.cache_full_blocks(request, num_computed_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        return request

    def finish_request(self, request: Request, status: RequestStatus, hold_blocks: bool = False) -> None:
        """End a request in any state with a finished ``status``; its blocks return to the pool, or with
        ``hold_blocks`` stay in :attr:`held` (their KV is still being saved, or forked) until :meth:`release_held`."""
        assert RequestStatus.is_finished(status), status
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_remote_kvs[request.request_id]
        else:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        if hold_blocks:
            self.held[request.request_id] = request
        else:
            self.kv_cache.free(request)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a finished request held for a KV transfer or forks; False if none are held."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv_cache.free(request)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose the next step's batch; allocates blocks (and may preempt) to fit it."""
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        if not output.preempted:
            self._schedule_waiting(output, budget)
            while not output.scheduled and self.waiting and self._drop_a_fork_hold():
                self._schedule_waiting(output, budget)
        output.num_batched_tokens = sum(item.num_new_tokens for item in output.scheduled)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        limit = self.disable_speculation_at
        speculate = self.proposer is not None and (limit is None or len(self.running) < limit)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if (self.long_rope_context is not None and not request.long_rope
                    and request.num_tokens > self.long_rope_context):
                self._rotate_long(request)
                output.preempted.append(request)
                continue
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                index += 1
                continue
            drafts = self._drafts(request, num_new, budget) if speculate else []
            if drafts:
                if self.kv_cache.allocate_slots(request, 1 + len(drafts)):
                    output.scheduled.append(self._scheduled(request, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    index += 1
                    continue
                # no blocks for the drafts: the token alone, as without speculation
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self._victim()
                if self.running.index(victim) < index:  # scheduled earlier this step (priority): taken back
                    index -= 1
                    taken = next(item for item in output.scheduled if item.request is victim)
                    output.scheduled.remove(taken)
                    budget += taken.num_new_tokens
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Start waiting requests in the queue's order while budget, max_num_seqs and blocks allow; a request whose
        LoRA adapter would make more than max_loras in the running batch is passed over (it keeps its place), as is
        a fork whose running parent has not computed its tokens yet."""
        adapters = {request.lora_request.lora_int_id for request in self.running if request.lora_request}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            lora = request.lora_request
            if (lora is not None and lora.lora_int_id not in adapters and self.max_loras is not None
                    and len(adapters) >= self.max_loras):
                skipped.append(self.waiting.pop())
                continue
            if self._waits_for_parent(request):
                skipped.append(self.waiting.pop())
                continue
            cached_block_ids: list[int] = []
            num_computed = request.num_computed_tokens
            parent = None
            if not self.kv_cache.block_ids(request.request_id):
                cached_block_ids, num_computed = self.kv_cache.find_cached_prefix(request)
                parent, num_forked = self._fork_parent(request)
                if num_forked > num_computed:
                    cached_block_ids, num_computed = [], num_forked
                else:
                    parent = None
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if parent is not None:
                take_tail = request.kv_fork.take_tail and parent.is_finished
                copies = self.kv_cache.fork(request, parent, num_computed, num_new, take_tail)
                if copies is None:
                    break
                output.block_copies += copies
            elif not self.kv_cache.allocate_slots(request, num_new, cached_block_ids):
                break
            self.waiting.pop()
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if logger.isEnabledFor(logging.DEBUG):
                request_log(logger, request.request_id).debug("%s -> RUNNING (%d tokens to compute, %d cached)",
                                                              request.status.name, num_new, num_computed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _drop_a_fork_hold(self) -> bool:
        """Free the blocks of the oldest finished request held only for forks (``keep_kv``): they are a cache, and a
        queue that cannot start for want of blocks must not wait for them (its forks compute what they lose).
        False when none is held."""
        request_id = next((request_id for request_id, request in self.held.items() if request.keep_kv), None)
        if request_id is None:
            return False
        self.release_held(request_id)
        self.num_dropped_fork_holds += 1
        return True

    def _fork_parent(self, request: Request) -> tuple[Request | None, int]:
        """The request whose KV the request forks (``request.kv_fork``: held, or running), and how many of the
        request's tokens it holds (:meth:`KVCacheManager.forkable_tokens`); (None, 0) when there is none."""
        if request.kv_fork is None:
            return None, 0
        parent_id = request.kv_fork.parent_id
        parent = self.held.get(parent_id) or self.requests.get(parent_id)
        if parent is None:
            return None, 0
        return parent, self.kv_cache.forkable_tokens(request, parent)

    def _waits_for_parent(self, request: Request) -> bool:
        """Whether a forking request that holds no blocks waits for its unfinished parent to compute its tokens, or
        to receive their KV from a remote prefill (parallel sampling: the prompt is computed, or sent, once, for
        the first completion, then forked), as a request of an adapter over ``max_loras`` waits, keeping its
        place."""
        fork = request.kv_fork
        if (fork is None or request.num_computed_tokens or request.wants_prompt_logprobs
                or self.kv_cache.block_ids(request.request_id)):
            return False
        parent = self.requests.get(fork.parent_id)
        needed = request.num_tokens - 1
        return (parent is not None and parent.num_computed_tokens < needed and parent.num_tokens >= needed
                and parent.all_token_ids[:needed] == request.all_token_ids[:needed])

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if num_new <= budget:
            return num_new
        return budget if self.enable_chunked_prefill else 0

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Drafts to verify after a decode's token: within the budget, and leaving room for the token the
        verification itself gives, within the request's output limit."""
        if self.proposer is None or num_new != 1:
            return []
        room = min(budget - 1, request.max_output_tokens - request.num_output_tokens - 1)
        return self.proposer(request, room) if room > 0 else []

    @staticmethod
    def _scheduled(request: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledRequest:
        drafts = drafts or []
        sample = request.num_computed_tokens + num_new - len(drafts) == request.num_tokens
        return ScheduledRequest(request, num_new, sample, drafts)

    def _rotate_long(self, request: Request) -> None:
        """A running request that grew past a LongRoPE model's original context: every position takes the long
        factors now, as transformers' generate runs the whole sequence again there, so its KV is computed again
        (preempted: its short-rotated blocks stay in the prefix cache under their own hashes)."""
        request.rotate_long()
        self._preempt(request, "past the original context of LongRoPE: recomputed with its long factors")

    def _preempt(self, request: Request, reason: str = "out of KV blocks; to be recomputed") -> None:
        request_log(logger, request.request_id).debug("RUNNING -> PREEMPTED (%s)", reason)
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _victim(self) -> Request:
        """The running request to preempt when blocks run out: the newest (fcfs), or the latest in priority
        order (priority: the least urgent, the newest among equals)."""
        if self.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def lora_requests(self) -> dict[str, tuple[int, int]]:
        """Per LoRA adapter name, its requests (running, waiting): those of adapters with any."""
        counts: dict[str, list[int]] = {}
        for index, requests in enumerate((self.running, self.waiting)):
            for request in requests:
                if request.lora_request is not None:
                    counts.setdefault(request.lora_request.lora_name, [0, 0])[index] += 1
        return {name: (running, waiting) for name, (running, waiting) in counts.items()}

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` of every request the step computed (by its accepted drafts only: the
        KV of rejected ones is overwritten later)."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens - item.num_rejected
