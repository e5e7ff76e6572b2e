"""Scheduler: budgets, chunked prefill, preemption, remote-KV waiting, every exit frees blocks."""

from __future__ import annotations

import itertools

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import Request, RequestStatus
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
