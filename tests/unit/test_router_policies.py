"""Routing policies: exact choices on constructed pools (no processes, no sleeps)."""

from __future__ import annotations

import collections
import random
import threading
from types import SimpleNamespace

import pytest

from splitserve.common.errors import NoWorkerAvailable, Unavailable
from splitserve.common.load import WorkerLoad
from splitserve.common.types import WorkerRole, WorkerState
from splitserve.router.policies import LeastLoaded, PrefixAware, RoundRobin, make_policy
from splitserve.router.registry import WorkerRegistry
from splitserve.router.worker import KVCacheLayout, Worker

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH

LAYOUT = KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype="float32", block_size=16)


def pool(count: int, role: WorkerRole = PREFILL) -> list[Worker]:
    return [Worker(f"w{index}", role, f"h:{index}") for index in range(count)]


def picks(policy, workers, prompt=(1,), times=1) -> list[str]:
    return [policy.choose(workers, list(prompt)).worker_id for _ in range(times)]


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(length)]


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoaded(PREFILL), LeastLoaded(DECODE), PrefixAware()])
def test_an_empty_pool_raises(policy):
    with pytest.raises(NoWorkerAvailable, match="No worker to route to") as raised:
        policy.choose([], [1] * 40)
    assert isinstance(raised.value, Unavailable)  # the interceptor answers UNAVAILABLE


# ---- round robin -----------------------------------------------------------------------------


def test_round_robin_rotates_exactly():
    workers = pool(3)
    assert picks(RoundRobin(), workers, times=7) == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_round_robin_stays_fair_when_the_list_changes():
    policy, workers = RoundRobin(), pool(4)
    assert picks(policy, workers[:3], times=4) == ["w0", "w1", "w2", "w0"]
    assert picks(policy, workers, times=3) == ["w3", "w1", "w2"]  # the newcomer first, then who waited longest
    assert picks(policy, [workers[0], workers[2]], times=2) == ["w0", "w2"]  # w1 and w3 away: no repeats
    assert picks(policy, workers, times=4) == ["w3", "w1", "w0", "w2"]


def picks_from_threads(num_threads: int, pick) -> collections.Counter:
    """Run ``pick()`` (a list of worker names) on ``num_threads`` threads at once; count all names."""
    chosen = collections.Counter()
    lock = threading.Lock()

    def run() -> None:
        names = pick()
        with lock:
            chosen.update(names)

    threads = [threading.Thread(target=run) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return chosen


def test_round_robin_is_exact_under_threads():
    policy, workers = RoundRobin(), pool(4)
    chosen = picks_from_threads(4, lambda: picks(policy, workers, times=250))
    assert chosen == {"w0": 250, "w1": 250, "w2": 250, "w3": 250}


# ---- least loaded -----------------------------------------------------------------------------


def test_least_loaded_prefill_adds_the_tokens_it_routed_since_the_last_report():
    workers = pool(3)
    for worker, queued in zip(workers, (500, 100, 100)):
        worker.load = WorkerLoad(num_queued_prefill_tokens=queued)
    policy = LeastLoaded(PREFILL)
    assert policy.choose(workers, [7] * 300).worker_id == "w1"  # w1 and w2 tie at 100: w1 first
    assert [policy.load(w) for w in workers] == [500, 400, 100]
    assert policy.choose(workers, [7] * 350).worker_id == "w2"  # backlogs 500, 400, 450 after this one
    assert policy.choose(workers, [7] * 10).worker_id == "w1"
    assert [policy.load(w) for w in workers] == [500, 410, 450]
    # A newer report (later last_heard) replaces the router's own estimate for that worker only.
    workers[1].last_heard, workers[1].load = 5.0, WorkerLoad(num_queued_prefill_tokens=480)
    assert [policy.load(w) for w in workers] == [500, 480, 450]
    # A copy taken before that report still counts the routed tokens.
    stale = Worker("w2", PREFILL, "h:2", load=WorkerLoad(num_queued_prefill_tokens=100), last_heard=-1.0)
    assert policy.load(stale) == 450


def test_least_loaded_prefill_resets_on_heartbeats_through_the_registry():
    now = [0.0]
    registry = WorkerRegistry(lease_duration_seconds=10, heartbeat_interval_seconds=1, clock=lambda: now[0])
    leases = [registry.register(PREFILL, f"h:{i}", worker_id=f"w{i}", model_fingerprint="m", kv_layout=LAYOUT).lease_id for i in range(2)]
    policy = LeastLoaded(PREFILL)
    assert picks(policy, registry.routable(PREFILL), prompt=[1] * 1000) == ["w0"]
    assert picks(policy, registry.routable(PREFILL), prompt=[1] * 10) == ["w1"]
    assert picks(policy, registry.routable(PREFILL), prompt=[1] * 10) == ["w1"]  # 1000 vs 20
    now[0] = 1.0
    registry.heartbeat(leases[0], WorkerLoad(num_queued_prefill_tokens=0), WorkerState.SERVING)  # w0 finished
    assert [policy.load(w) for w in registry.routable(PREFILL)] == [0, 20]
    assert picks(policy, registry.routable(PREFILL), prompt=[1] * 10) == ["w0"]


def test_least_loaded_prefill_spreads_a_concurrent_burst():
    workers = pool(4)  # one snapshot, shared by every thread, as between two heartbeats
    policy = LeastLoaded(PREFILL)
    start = threading.Barrier(8)

    def pick() -> list[str]:
        start.wait(5)
        return picks(policy, workers, prompt=[1] * 100, times=25)

    chosen = picks_from_threads(8, pick)
    assert chosen == {"w0": 50, "w1": 50, "w2": 50, "w3": 50}
    assert [policy.load(w) for w in workers] == [5000] * 4


def test_least_loaded_decode_score():
    workers = pool(4, DECODE)
    # (free of 100 KV blocks, running, waiting, waiting for KV, in flight, max_num_seqs)
    cases = [(10, 0, 0, 0, 0, 0),  # 0.9 + 0/64
             (90, 4, 1, 1, 2, 0),  # 0.1 + max(6, 2)/64 = 0.19375
             (80, 0, 0, 0, 3, 32),  # 0.2 + max(0, 3)/32 = 0.29375
             (70, 1, 0, 0, 0, 16)]  # 0.3 + 1/16 = 0.3625
    for worker, (free, running, waiting, remote, in_flight, max_num_seqs) in zip(workers, cases):
        worker.load = WorkerLoad(num_running_requests=running, num_waiting_requests=waiting,
                                 num_waiting_for_remote_kvs_requests=remote, num_total_kv_blocks=100,
                                 num_free_kv_blocks=free)
        worker.num_in_flight = in_flight
        worker.capacity = SimpleNamespace(max_num_seqs=max_num_seqs)
    policy = LeastLoaded(DECODE)
    assert [policy.load(w) for w in workers] == pytest.approx([0.9, 0.19375, 0.29375, 0.3625])
    assert policy.choose(workers, [1]).worker_id == "w1"
    workers[1].num_in_flight = 13  # the router's own count is newer than the report: 0.1 + 13/64 = 0.303125
    assert policy.choose(workers, [1]).worker_id == "w2"
    assert policy.choose(workers[:2] + workers[3:], [1]).worker_id == "w1"  # routing a decode adds nothing


def test_least_loaded_equal_workers_share_traffic():
    for role in (PREFILL, DECODE):
        workers = pool(3, role)
        policy = LeastLoaded(role)
        chosen = collections.Counter(picks(policy, workers, prompt=[] if role == PREFILL else [1], times=30))
        assert chosen == {"w0": 10, "w1": 10, "w2": 10}


# ---- prefix aware ---------------------------------------------------------------------------


def test_prefix_key_hashes_whole_blocks_like_the_engine():
    from splitserve.common.block_hash import hash_block_tokens

    policy = PrefixAware(block_size=4, prefix_blocks=2)
    assert policy.prefix_key([1, 2, 3]) is None
    assert policy.prefix_key([1, 2, 3, 4, 5]) == hash_block_tokens(None, [1, 2, 3, 4])
    two_blocks = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert policy.prefix_key([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == two_blocks
    assert policy.prefix_key([9, 2, 3, 4, 5, 6, 7, 8]) != two_blocks


def test_prefix_aware_keeps_a_shared_prefix_on_one_worker():
    rng = random.Random(1)
    workers = pool(4)
    policy = PrefixAware(block_size=4, prefix_blocks=4)
    system = random_prompt(rng, 16)
    chosen = collections.Counter(picks(policy, workers, prompt=system + random_prompt(rng, 20))[0]
                                 for _ in range(20))
    assert len(chosen) == 1
    # Different first blocks: spread.
    others = {picks(policy, workers, prompt=random_prompt(rng, 16) + system)[0] for _ in range(20)}
    assert len(others) == 4


def test_prefix_aware_spreads_random_prefixes_evenly():
    rng = random.Random(2)
    workers = pool(4)
    policy = PrefixAware(block_size=16, max_imbalance=10**9)  # hashing only
    chosen = collections.Counter(picks(policy, workers, prompt=random_prompt(rng, 40))[0] for _ in range(200))
    assert sorted(chosen) == ["w0", "w1", "w2", "w3"]
    assert 30 <= min(chosen.values()) and max(chosen.values()) <= 70  # 50 each expected, sd ~6


def test_removing_or_adding_a_worker_moves_only_its_share():
    rng = random.Random(3)
    workers = pool(5)
    policy = PrefixAware(block_size=16, max_imbalance=10**9)
    prompts = [random_prompt(rng, 32) for _ in range(200)]
    before = [picks(policy, workers[:4], prompt=p)[0] for p in prompts]
    without_w3 = [picks(policy, workers[:3], prompt=p)[0] for p in prompts]
    moved = [(b, a) for b, a in zip(before, without_w3) if b != a]
    assert {b for b, _ in moved} == {"w3"} and len(moved) == before.count("w3")
    assert len({a for _, a in moved}) == 3  # its prompts spread over the rest
    with_w4 = [picks(policy, workers, prompt=p)[0] for p in prompts]
    moved = [(b, a) for b, a in zip(before, with_w4) if b != a]
    assert {a for _, a in moved} == {"w4"} and 20 <= len(moved) <= 60  # about a fifth


def test_prefix_aware_overload_falls_back():
    rng = random.Random(4)
    workers = pool(3)
    policy = PrefixAware(block_size=4, max_imbalance=1000)
    prompt = random_prompt(rng, 32)
    favourite = policy.ranking(workers, policy.prefix_key(prompt))
    first, second, third = favourite
    queued = lambda w, tokens: setattr(w, "load", WorkerLoad(num_queued_prefill_tokens=tokens))  # noqa: E731
    # Within max_imbalance of the least loaded: still the favourite.
    queued(first, 1000), queued(second, 0), queued(third, 0)
    assert policy.choose(workers, prompt) is first
    # Beyond it (1000 + the 32 tokens just routed): the next worker in the prefix's ranking...
    assert picks(policy, workers, prompt=prompt, times=3) == [second.worker_id] * 3
    # ...unless that one is overloaded too: then the least loaded.
    queued(second, 1500)
    assert policy.choose(workers, prompt) is third
    # The ranking's runner-up is where the prefix goes when its favourite is gone.
    assert PrefixAware(block_size=4).choose([w for w in pool(3) if w.worker_id != first.worker_id],
                                            prompt).worker_id == second.worker_id


def test_prefix_aware_short_prompts_go_to_the_least_loaded():
    workers = pool(3)
    for worker, queued in zip(workers, (300, 50, 200)):
        worker.load = WorkerLoad(num_queued_prefill_tokens=queued)
    policy = PrefixAware(block_size=16)
    assert picks(policy, workers, prompt=[1] * 15, times=2) == ["w1", "w1"]  # 50, then 65
    workers[1].last_heard, workers[1].load = 1.0, WorkerLoad(num_queued_prefill_tokens=250)
    assert picks(policy, workers, prompt=[1] * 15, times=2) == ["w2", "w2"]  # 200, then 215 < 250


def test_prefix_aware_decode_pool_measures_imbalance_in_score():
    rng = random.Random(5)
    workers = pool(2, DECODE)
    prompt = random_prompt(rng, 64)
    policy = make_policy("prefix_aware", DECODE, block_size=16)
    first, second = policy.ranking(workers, policy.prefix_key(prompt))
    first.load = WorkerLoad(num_total_kv_blocks=100, num_free_kv_blocks=75)  # score 0.25: within 0.25
    assert policy.choose(workers, prompt) is first
    first.num_in_flight = 1  # 0.25 + 1/64
    assert policy.choose(workers, prompt) is second


# ---- make_policy ------------------------------------------------------------------------------


def test_make_policy_by_name():
    assert isinstance(make_policy("round_robin", PREFILL, block_size=32), RoundRobin)
    least = make_policy("least_loaded", DECODE, block_size=32)
    assert isinstance(least, LeastLoaded) and least.role == DECODE
    prefix = make_policy("prefix_aware", BOTH, block_size=32, prefix_blocks=2, max_imbalance=0.5)
    assert (type(prefix), prefix.role, prefix.block_size, prefix.prefix_blocks, prefix.max_imbalance) == (
        PrefixAware, BOTH, 32, 2, 0.5)
    assert make_policy("prefix_aware", PREFILL).max_imbalance == 2048


def test_make_policy_refuses_unknown_names_and_options():
    with pytest.raises(ValueError, match="Unknown routing policy 'random'; choose round_robin, least_loaded or "
                                         "prefix_aware"):
        make_policy("random", DECODE)
    with pytest.raises(ValueError, match="The round_robin policy does not take prefix_blocks; it takes: no options"):
        make_policy("round_robin", DECODE, prefix_blocks=2)
    with pytest.raises(ValueError, match="does not take bogus; it takes: max_imbalance, prefix_blocks"):
        make_policy("prefix_aware", PREFILL, bogus=1)
