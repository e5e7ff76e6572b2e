"""Scheduler: budgets, chunked prefill, preemption, remote-KV waiting, forks of held requests' KV, every exit frees
blocks."""

from __future__ import annotations

import itertools

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv_cache_manager import BlockCopy, KVCacheManager
from splitserve.engine.request import KVFork, Request, RequestStatus
from splitserve.engine.scheduler import KVCacheFullError, Scheduler


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, budget=16, chunked=True, caching=False,
                   policy="fcfs"):
    manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(manager, max_num_seqs, budget, enable_chunked_prefill=chunked, policy=policy)


_arrivals = itertools.count()


def make_request(request_id: str, num_prompt: int, first_token: int = 0, priority: int = 0) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(request_id, prompt, SamplingParams(max_tokens=100), priority=priority,
                   arrival_number=next(_arrivals))


def run_step(scheduler: Scheduler, next_token: int = 7):
    """Schedule, pretend the forward ran, append a token to requests that sample."""
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    for item in output.scheduled:
        if item.sample:
            item.request.append_output_token(next_token)
    return output


def plan(output):
    return [(item.request.request_id, item.num_new_tokens, item.sample) for item in output.scheduled]


def test_new_requests_share_the_token_budget_then_decode_together():
    scheduler = make_scheduler(budget=16)
    for request_id, length in (("a", 6), ("b", 6), ("c", 6)):
        scheduler.add_request(make_request(request_id, length))
    # a and b fit; c gets the remaining 4 tokens as a chunk.
    assert plan(run_step(scheduler)) == [("a", 6, True), ("b", 6, True), ("c", 4, False)]
    # Running requests first: decodes of a and b, then the rest of c.
    assert plan(run_step(scheduler)) == [("a", 1, True), ("b", 1, True), ("c", 2, True)]
    assert plan(run_step(scheduler)) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(budget=16, chunked=False)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    assert plan(run_step(scheduler)) == [("a", 10, True)]
    # 15 tokens left after a's decode: b (10) now fits.
    assert plan(run_step(scheduler)) == [("a", 1, True), ("b", 10, True)]


def test_max_num_seqs_limits_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2, budget=16)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 2))
    assert [item[0] for item in plan(run_step(scheduler))] == ["a", "b"]
    assert len(scheduler.waiting) == 1


def test_preemption_frees_the_newest_request_and_recomputes_it_later():
    # 4 blocks of 4 tokens; two requests of 8 tokens fill the pool.
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a, b = make_request("a", 8), make_request("b", 8, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert plan(run_step(scheduler)) == [("a", 8, True), ("b", 8, True)]
    assert scheduler.kv_cache.free_block_count == 0
    # a's 9th token needs a new block: b (the newest) is preempted.
    output = run_step(scheduler)
    assert plan(output) == [("a", 1, True)]
    assert output.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b
    assert b.num_preemptions == 1
    # Finish a: b is recomputed, prompt and its generated token together.
    scheduler.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert plan(run_step(scheduler)) == [("b", 9, True)]
    assert b.output_token_ids == [7, 7]
    scheduler.finish_request(b, RequestStatus.FINISHED_LENGTH)
    assert scheduler.kv_cache.free_block_count == 4


def test_running_request_preempts_itself_when_alone_and_out_of_blocks():
    scheduler = make_scheduler(num_blocks=2, block_size=4, budget=32)
    request = make_request("a", 8)
    scheduler.add_request(request)
    run_step(scheduler)
    output = run_step(scheduler)  # needs a 3rd block, none exists
    assert output.preempted == [request] and plan(output) == []
    scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache.free_block_count == 2


def test_remote_kv_request_holds_blocks_and_is_skipped_until_released():
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=16, caching=True)
    remote = make_request("remote", 10)
    local = make_request("local", 3, first_token=50)
    scheduler.add_request(remote, remote.num_prompt_tokens)
    scheduler.add_request(local)
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.kv_cache.block_ids("remote") == [0, 1, 2]
    # Reserved blocks are not in the prefix cache before their KV is there.
    assert scheduler.kv_cache.pool.cached_block_count == 0
    assert plan(run_step(scheduler)) == [("local", 3, True)]
    assert plan(run_step(scheduler)) == [("local", 1, True)]
    # All 10 prompt tokens arrived: the next step decodes a token appended from outside.
    scheduler.finish_remote_kv("remote", 10)
    remote.append_output_token(42)
    hashes = [scheduler.kv_cache.pool.blocks[block_id].block_hash for block_id in (0, 1, 2)]
    assert hashes[0] is not None and hashes[1] is not None and hashes[2] is None  # 2 full blocks
    assert plan(run_step(scheduler)) == [("local", 1, True), ("remote", 1, True)]
    assert scheduler.kv_cache.block_ids("remote") == [0, 1, 2]


def test_remote_kv_release_with_last_token_to_recompute():
    scheduler = make_scheduler(num_blocks=8, block_size=4, budget=16)
    remote = make_request("remote", 10)
    scheduler.add_request(remote, remote.num_prompt_tokens)
    assert plan(run_step(scheduler)) == []
    scheduler.finish_remote_kv("remote", 9)
    assert plan(run_step(scheduler)) == [("remote", 1, True)]


def test_remote_kv_reservation_fails_cleanly_when_cache_is_full():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(KVCacheFullError, match="Cannot reserve 3 KV blocks"):
        big = make_request("big", 10)
        scheduler.add_request(big, big.num_prompt_tokens)
    assert scheduler.kv_cache.free_block_count == 2
    assert scheduler.num_unfinished == 0


def test_abort_in_every_state_returns_all_blocks():
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=8)
    running = make_request("running", 4)
    chunked = make_request("chunked", 12, first_token=20)
    waiting = make_request("waiting", 4, first_token=40)
    remote = make_request("remote", 6, first_token=60)
    scheduler.add_request(running)
    scheduler.add_request(chunked)
    scheduler.add_request(waiting)
    scheduler.add_request(remote, remote.num_prompt_tokens)
    run_step(scheduler)  # running: 4, chunked: first 4 of 12
    assert chunked.status == RequestStatus.RUNNING and chunked.num_computed_tokens == 4
    assert waiting.status == RequestStatus.WAITING
    for request in (running, chunked, waiting, remote):
        scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.free_block_count == 16
    assert scheduler.num_unfinished == 0
    assert not scheduler.running and not scheduler.waiting and not scheduler.waiting_for_remote_kvs


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 2))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 2))


def test_prefix_cache_hit_schedules_only_the_uncached_tail():
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=32, caching=True)
    first = make_request("a", 10)
    scheduler.add_request(first)
    run_step(scheduler)
    second = make_request("b", 10)
    scheduler.add_request(second)
    output = run_step(scheduler)
    assert ("b", 2, True) in plan(output)
    assert second.num_cached_tokens == 8
    assert scheduler.kv_cache.block_ids("b")[:2] == scheduler.kv_cache.block_ids("a")[:2]


def test_priority_orders_the_waiting_queue_ties_by_arrival():
    scheduler = make_scheduler(max_num_seqs=1, budget=16, policy="priority")
    for request_id, priority in (("late", 5), ("first", -1), ("second", 0), ("third", 0)):
        scheduler.add_request(make_request(request_id, 2, priority=priority))
    assert [request.request_id for request in scheduler.waiting] == ["first", "second", "third", "late"]
    order = []
    for _ in range(4):
        output = run_step(scheduler)
        [item] = output.scheduled
        order.append(item.request.request_id)
        scheduler.finish_request(item.request, RequestStatus.FINISHED_STOPPED)
    assert order == ["first", "second", "third", "late"]
    # First come, first served: arrival order, whatever the priority.
    fcfs = make_scheduler(max_num_seqs=4, budget=16)
    for request_id, priority in (("late", 5), ("first", -1)):
        fcfs.add_request(make_request(request_id, 2, priority=priority))
    assert [request.request_id for request in fcfs.waiting] == ["late", "first"]


def test_priority_preempts_the_least_urgent_running_request_not_the_newest():
    # 4 blocks of 4 tokens; two requests of 8 tokens fill the pool. The newer one is the more urgent.
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=32, policy="priority")
    background = make_request("background", 8, priority=10)
    urgent = make_request("urgent", 8, first_token=100, priority=0)
    scheduler.add_request(background)
    scheduler.add_request(urgent)
    assert plan(run_step(scheduler)) == [("urgent", 8, True), ("background", 8, True)]
    # urgent's 9th token needs a block: background is preempted though it is the older (fcfs would take urgent,
    # the newest), and waits by its priority.
    output = run_step(scheduler)
    assert plan(output) == [("urgent", 1, True)] and output.preempted == [background]
    assert background.status == RequestStatus.PREEMPTED and background.num_computed_tokens == 0
    scheduler.finish_request(urgent, RequestStatus.FINISHED_STOPPED)
    assert plan(run_step(scheduler)) == [("background", 9, True)]
    scheduler.finish_request(background, RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv_cache.free_block_count == 4


def test_a_victim_scheduled_earlier_in_the_step_is_taken_back_with_its_tokens():
    # The less urgent request runs first in the running list; the urgent one, after it, runs out of blocks: the
    # first one's place in this step's plan and its token budget are given back before it is preempted.
    scheduler = make_scheduler(num_blocks=5, block_size=4, budget=32, policy="priority")
    background = make_request("background", 4, priority=3)
    scheduler.add_request(background)
    assert plan(run_step(scheduler)) == [("background", 4, True)]
    urgent = make_request("urgent", 12, first_token=100, priority=1)
    scheduler.add_request(urgent)
    assert plan(run_step(scheduler)) == [("background", 1, True), ("urgent", 12, True)]
    assert scheduler.kv_cache.free_block_count == 0
    output = run_step(scheduler)  # background's 6th token fits its 2nd block; urgent's 13th needs a 4th block
    assert output.preempted == [background] and plan(output) == [("urgent", 1, True)]
    assert output.num_batched_tokens == 1
    scheduler.finish_request(urgent, RequestStatus.FINISHED_STOPPED)
    scheduler.finish_request(background, RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv_cache.free_block_count == 5


def held_parent(scheduler: Scheduler, request_id: str, num_prompt: int) -> Request:
    """A request run to its one token and held (keep_kv), as a beam search step leaves it."""
    parent = Request(request_id, list(range(num_prompt)), SamplingParams(max_tokens=1), max_output_tokens=1)
    scheduler.add_request(parent)
    run_step(scheduler)
    scheduler.finish_request(parent, RequestStatus.FINISHED_LENGTH, hold_blocks=True)
    return parent


def fork_of(parent: Request, request_id: str, next_token: int, take_tail: bool = False, length: int | None = None):
    tokens = parent.all_token_ids[: parent.num_computed_tokens if length is None else length] + [next_token]
    return Request(request_id, tokens, SamplingParams(max_tokens=1), kv_fork=KVFork(parent.request_id, take_tail))


@pytest.mark.parametrize("caching", [False, True])
def test_forks_share_full_blocks_copy_the_partial_one_and_the_last_takes_it(caching):
    scheduler = make_scheduler(num_blocks=16, block_size=4, caching=caching)
    kv = scheduler.kv_cache
    parent = held_parent(scheduler, "parent", 6)  # blocks: 4 tokens, then 2 of the partial block
    full, tail = kv.block_ids("parent")
    copying, taking = fork_of(parent, "copying", 40), fork_of(parent, "taking", 41, take_tail=True)
    scheduler.add_request(copying)
    scheduler.add_request(taking)
    output = run_step(scheduler)
    assert plan(output) == [("copying", 1, True), ("taking", 1, True)]  # one token each: the parent's 6 are there
    copy_block = kv.block_ids("copying")[1]
    assert kv.block_ids("copying") == [full, copy_block] and copy_block not in (full, tail)
    assert output.block_copies == [BlockCopy(tail, copy_block, 2)]
    assert kv.block_ids("taking") == [full, tail]
    # The parent keeps its full block only, and counts only its tokens as computed: a later fork computes the rest.
    assert kv.block_ids("parent") == [full] and parent.num_computed_tokens == 4
    assert kv.pool.blocks[full].ref_count == 3 and kv.pool.blocks[tail].ref_count == 1
    for request in (copying, taking):
        scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
    late = fork_of(parent, "late", 42, length=6)
    scheduler.add_request(late)
    output = run_step(scheduler)
    assert plan(output) == [("late", 3, True)] and output.block_copies == []
    assert kv.block_ids("late")[0] == full
    scheduler.finish_request(late, RequestStatus.FINISHED_LENGTH)
    assert scheduler.release_held("parent") and kv.free_block_count == 16


def test_a_fork_of_a_parent_on_a_block_boundary_copies_nothing():
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    parent = held_parent(scheduler, "parent", 8)
    child = fork_of(parent, "child", 9, take_tail=True)
    scheduler.add_request(child)
    output = run_step(scheduler)
    assert plan(output) == [("child", 1, True)] and output.block_copies == []
    assert scheduler.kv_cache.block_ids("child")[:2] == scheduler.kv_cache.block_ids("parent")
    assert parent.num_computed_tokens == 8  # nothing taken: its blocks are all full
    scheduler.finish_request(child, RequestStatus.FINISHED_LENGTH)
    scheduler.release_held("parent")
    assert scheduler.kv_cache.free_block_count == 8


def test_a_fork_computes_its_tokens_when_its_parent_is_released_or_holds_other_tokens():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    parent = held_parent(scheduler, "parent", 6)
    other = Request("other", [99] + parent.all_token_ids[1:6] + [5], SamplingParams(max_tokens=1),
                    kv_fork=KVFork("parent"))
    scheduler.add_request(other)
    assert plan(run_step(scheduler)) == [("other", 7, True)]  # its first token differs: nothing to take
    scheduler.finish_request(other, RequestStatus.FINISHED_LENGTH)
    scheduler.release_held("parent")
    orphan = fork_of(parent, "orphan", 5)
    scheduler.add_request(orphan)
    assert plan(run_step(scheduler)) == [("orphan", 7, True)]
    scheduler.finish_request(orphan, RequestStatus.FINISHED_LENGTH)
    assert scheduler.kv_cache.free_block_count == 16


def test_a_fork_without_free_blocks_waits_and_changes_nothing():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    parent = held_parent(scheduler, "parent", 6)  # 2 blocks held, 1 free
    blocker = make_request("blocker", 3, first_token=50)
    scheduler.add_request(blocker)
    run_step(scheduler)  # takes the free block
    child = fork_of(parent, "child", 40)  # needs a block for its copy of the partial one
    scheduler.add_request(child)
    output = run_step(scheduler)
    assert plan(output) == [("blocker", 1, True)] and output.block_copies == []
    assert child.status == RequestStatus.WAITING and scheduler.kv_cache.block_ids("child") == []
    assert scheduler.kv_cache.pool.blocks[scheduler.kv_cache.block_ids("parent")[0]].ref_count == 1
    scheduler.finish_request(blocker, RequestStatus.FINISHED_STOPPED)
    output = run_step(scheduler)
    assert plan(output) == [("child", 1, True)] and len(output.block_copies) == 1
    scheduler.finish_request(child, RequestStatus.FINISHED_LENGTH)
    scheduler.release_held("parent")
    assert scheduler.kv_cache.free_block_count == 3


def test_taking_the_tail_frees_the_blocks_the_parent_held_past_it():
    kv = KVCacheManager(8, 4, enable_caching=False)
    parent = Request("parent", list(range(6)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(parent, 10)  # 3 blocks, as drafts rejected after its 6th token would leave them
    parent.num_computed_tokens = 6
    child = fork_of(parent, "child", 40, take_tail=True)
    assert kv.forkable_tokens(child, parent) == 6
    first, tail, _ = kv.block_ids("parent")
    assert kv.fork(child, parent, 6, 1, take_tail=True) == []
    assert kv.block_ids("child") == [first, tail] and kv.block_ids("parent") == [first]
    assert kv.free_block_count == 6
    kv.free(child)
    kv.free(parent)
    assert kv.free_block_count == 8


def test_a_fork_of_a_running_request_waits_for_its_prompt_then_shares_it_and_never_takes_its_tail():
    # Parallel sampling: the other completions of a prompt wait (in their place) while the first computes it.
    scheduler = make_scheduler(num_blocks=16, block_size=4, budget=16)
    first = make_request("first", 10)
    other = Request("other", list(first.prompt_token_ids), SamplingParams(max_tokens=100),
                    kv_fork=KVFork("first", take_tail=True), arrival_number=next(_arrivals))
    later = make_request("later", 2, first_token=60)
    for request in (first, other, later):
        scheduler.add_request(request)
    assert plan(run_step(scheduler)) == [("first", 10, True), ("later", 2, True)]
    assert other.status == RequestStatus.WAITING and scheduler.waiting.peek() is other
    output = run_step(scheduler)
    # The prompt's 9 first tokens are taken (two full blocks, one token of the third copied); its last computed.
    assert plan(output) == [("first", 1, True), ("later", 1, True), ("other", 1, True)]
    blocks = scheduler.kv_cache.block_ids("first")
    assert scheduler.kv_cache.block_ids("other")[:2] == blocks[:2]
    assert output.block_copies == [BlockCopy(blocks[2], scheduler.kv_cache.block_ids("other")[2], 1)]
    assert first.num_computed_tokens == 11 and blocks == scheduler.kv_cache.block_ids("first")
    for request in (first, other, later):
        scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv_cache.free_block_count == 16


def test_a_queue_that_cannot_start_frees_fork_holds_oldest_first_but_never_a_transfer_s():
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=16)
    saving = held_parent(scheduler, "saving", 8)  # held for a KV transfer (keep_kv false): 2 blocks
    older = held_parent(scheduler, "older", 8)
    older.keep_kv = True
    newer = held_parent(scheduler, "newer", 4)
    newer.keep_kv = True
    assert scheduler.kv_cache.free_block_count == 1 and not saving.keep_kv
    scheduler.add_request(make_request("big", 8, first_token=70))  # needs 2 blocks
    output = run_step(scheduler)
    assert plan(output) == [("big", 8, True)]
    assert list(scheduler.held) == ["saving", "newer"] and scheduler.num_dropped_fork_holds == 1
    scheduler.add_request(make_request("huge", 16, first_token=80))  # 4 blocks: newer goes, saving stays
    assert plan(run_step(scheduler)) == [("big", 1, True)]  # something ran: no hold is freed for the queue
    scheduler.finish_request(scheduler.requests["big"], RequestStatus.FINISHED_STOPPED)
    assert plan(run_step(scheduler)) == [("huge", 16, True)] and list(scheduler.held) == ["saving"]
    assert scheduler.num_dropped_fork_holds == 2
    scheduler.finish_request(scheduler.requests["huge"], RequestStatus.FINISHED_STOPPED)
    assert scheduler.release_held("saving") and scheduler.kv_cache.free_block_count == 6
