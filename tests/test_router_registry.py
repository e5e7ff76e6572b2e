"""The router's worker registry and routing policies, with an injected clock (no sleeps)."""

from __future__ import annotations

import collections
import random
import threading

import pytest

from splitserve.router.policies import LeastLoaded, NoWorkerAvailable, PrefixAware, RoundRobin, make_policy
from splitserve.router.registry import (FingerprintMismatch, InvalidRegistration, UnknownLease, UnknownWorker,
                                        WorkerLoad, WorkerRegistry, WorkerRole, WorkerState)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry(clock):
    return WorkerRegistry(lease_duration_seconds=10, heartbeat_interval_seconds=1, model_fingerprint="m", clock=clock)


def ids(workers) -> list[str]:
    return [worker.worker_id for worker in workers]


def test_register_assigns_ids_and_routes_in_registration_order(registry):
    a = registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="m")
    b = registry.register(WorkerRole.DECODE, "h:2", model_fingerprint="m", worker_id="mine")
    p = registry.register(WorkerRole.PREFILL, "h:3", model_fingerprint="m")
    assert (a.worker_id, b.worker_id, p.worker_id) == ("decode-1", "mine", "prefill-2")
    assert ids(registry.routable(WorkerRole.DECODE)) == ["decode-1", "mine"]
    assert ids(registry.routable(WorkerRole.PREFILL)) == ["prefill-2"]
    assert a.lease_id and a.lease_id != b.lease_id


def test_bad_registrations_are_refused_with_a_sentence(registry):
    with pytest.raises(InvalidRegistration, match="address is required"):
        registry.register(WorkerRole.DECODE, "")
    with pytest.raises(InvalidRegistration, match="WorkerRole"):
        registry.register(2, "h:1")
    with pytest.raises(FingerprintMismatch, match="serves model other, but this cluster serves m"):
        registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="other")


def test_first_worker_fixes_the_fingerprint_when_none_is_given(clock):
    registry = WorkerRegistry(clock=clock)
    registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="x")
    with pytest.raises(FingerprintMismatch):
        registry.register(WorkerRole.PREFILL, "h:2", model_fingerprint="y")


def test_lease_expiry_removes_exactly_the_silent_worker(registry, clock):
    quiet = registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="m")
    busy = registry.register(WorkerRole.DECODE, "h:2", model_fingerprint="m")
    for _ in range(12):
        clock.now += 1
        registry.heartbeat(busy.lease_id, WorkerLoad(num_running_requests=1), WorkerState.SERVING)
        removed = registry.expire()
        if clock.now - 100 < 2:
            assert registry.get(quiet.worker_id).state == WorkerState.SERVING
        elif clock.now - 100 < 10:
            # Silent for two heartbeat intervals: not routed to, but still listed.
            assert registry.get(quiet.worker_id).state == WorkerState.UNREACHABLE
            assert ids(registry.routable(WorkerRole.DECODE)) == [busy.worker_id]
        if clock.now - 100 == 10:
            assert ids(removed) == [quiet.worker_id]
    assert registry.get(quiet.worker_id) is None
    assert registry.get(busy.worker_id).load.num_running_requests == 1
    with pytest.raises(UnknownLease, match="register again"):
        registry.heartbeat(quiet.lease_id, WorkerLoad(), WorkerState.SERVING)


def test_unreachable_worker_serves_again_after_a_heartbeat(registry, clock):
    worker = registry.register(WorkerRole.PREFILL, "h:1", model_fingerprint="m")
    registry.mark_unreachable(worker.worker_id)
    assert registry.routable(WorkerRole.PREFILL) == []
    state, lease = registry.heartbeat(worker.lease_id, WorkerLoad(), WorkerState.SERVING)
    assert (state, lease) == (WorkerState.SERVING, 10)
    assert ids(registry.routable(WorkerRole.PREFILL)) == [worker.worker_id]


def test_drain_sticks_and_stops_routing(registry):
    worker = registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="m")
    registry.begin_request(worker.worker_id)
    registry.begin_request(worker.worker_id)
    assert registry.drain(worker.worker_id) == 2
    state, _ = registry.heartbeat(worker.lease_id, WorkerLoad(), WorkerState.SERVING)
    assert state == WorkerState.DRAINING
    assert registry.routable(WorkerRole.DECODE) == []
    registry.end_request(worker.worker_id)
    assert registry.get(worker.worker_id).num_in_flight == 1
    with pytest.raises(UnknownWorker):
        registry.drain("nobody")


def test_registering_again_from_the_same_address_replaces(registry):
    old = registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="m", worker_id="d")
    new = registry.register(WorkerRole.DECODE, "h:1", model_fingerprint="m", worker_id="d")
    assert ids(registry.pools()[WorkerRole.DECODE]) == ["d"]
    with pytest.raises(UnknownLease):
        registry.heartbeat(old.lease_id, WorkerLoad(), WorkerState.SERVING)
    registry.heartbeat(new.lease_id, WorkerLoad(), WorkerState.SERVING)
    registry.deregister(new.lease_id)
    assert registry.pools()[WorkerRole.DECODE] == []


def test_static_workers_never_expire(registry, clock):
    static = registry.add_static(WorkerRole.BOTH, "h:9", model_fingerprint="m")
    clock.now += 1000
    assert registry.expire() == []
    assert ids(registry.routable(WorkerRole.BOTH)) == [static.worker_id]
    registry.mark_unreachable(static.worker_id)
    assert registry.routable(WorkerRole.BOTH) == []
    registry.update_static(static.worker_id, WorkerLoad(num_total_kv_blocks=4, num_free_kv_blocks=1), WorkerState.SERVING)
    assert registry.get(static.worker_id).load.kv_block_usage == pytest.approx(0.75)


def test_concurrent_use_keeps_the_registry_consistent(registry):
    errors = []

    def hammer(index: int) -> None:
        try:
            for round_index in range(50):
                worker = registry.register(WorkerRole.DECODE, f"h:{index}", model_fingerprint="m")
                registry.heartbeat(worker.lease_id, WorkerLoad(num_running_requests=round_index), WorkerState.SERVING)
                registry.begin_request(worker.worker_id)
                registry.routable(WorkerRole.DECODE)
                registry.end_request(worker.worker_id)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    workers = registry.pools()[WorkerRole.DECODE]
    assert sorted(w.address for w in workers) == [f"h:{index}" for index in range(6)]
    assert all(w.num_in_flight == 0 for w in workers)


# ---- policies ---------------------------------------------------------------------------------


def make_workers(registry, role, count):
    for index in range(count):
        registry.register(role, f"h:{index}", model_fingerprint="m", worker_id=f"w{index}")
    return registry.routable(role)


def test_round_robin_rotates_exactly(registry):
    workers = make_workers(registry, WorkerRole.DECODE, 3)
    policy = RoundRobin()
    assert [policy.choose(workers, [1]).worker_id for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    with pytest.raises(NoWorkerAvailable):
        policy.choose([], [1])


def test_least_loaded_prefill_and_decode(registry):
    prefill = make_workers(registry, WorkerRole.PREFILL, 3)
    prefill[0].num_in_flight, prefill[1].num_in_flight, prefill[2].num_in_flight = 2, 1, 1
    prefill[1].load.num_queued_prefill_tokens, prefill[2].load.num_queued_prefill_tokens = 900, 100
    assert LeastLoaded(WorkerRole.PREFILL).choose(prefill, [1]).worker_id == "w2"

    decode = [w for w in prefill]
    for worker, (usage_free, running) in zip(decode, ((10, 0), (90, 1), (50, 0))):
        worker.role, worker.num_in_flight = WorkerRole.DECODE, 0
        worker.load = WorkerLoad(num_running_requests=running, num_total_kv_blocks=100, num_free_kv_blocks=usage_free)
    # Scores: w0 0.9 + 0, w1 0.1 + 1/64, w2 0.5 + 0.
    assert LeastLoaded(WorkerRole.DECODE).choose(decode, [1]).worker_id == "w1"
    for worker in decode:
        worker.load = WorkerLoad()
    policy = LeastLoaded(WorkerRole.DECODE)
    choices = collections.Counter(policy.choose(decode, [1]).worker_id for _ in range(30))
    assert choices == {"w0": 10, "w1": 10, "w2": 10}  # equal workers take turns


def test_prefix_aware_keeps_prefixes_together_and_spreads_the_rest(registry):
    workers = make_workers(registry, WorkerRole.PREFILL, 4)
    policy = make_policy("prefix_aware", WorkerRole.PREFILL, block_size=4)
    assert isinstance(policy, PrefixAware)
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(64)]
    chosen = {policy.choose(workers, system + [rng.randrange(1000) for _ in range(20)]).worker_id for _ in range(20)}
    assert len(chosen) == 1  # a shared 16-block system prompt: always the same worker
    prompts = [[rng.randrange(1000) for _ in range(40)] for _ in range(200)]
    spread = collections.Counter(policy.choose(workers, prompt).worker_id for prompt in prompts)
    assert len(spread) == 4 and min(spread.values()) >= 25
    # Removing one worker moves only the prompts it had.
    before = {tuple(p): policy.choose(workers, p).worker_id for p in prompts}
    after = {tuple(p): policy.choose(workers[:3], p).worker_id for p in prompts}
    moved = [p for p in before if before[p] != after[p]]
    assert moved and all(before[p] == "w3" for p in moved)
    # An overloaded favourite gives way to the least loaded worker.
    favourite = policy.choose(workers, system)
    for worker in workers:
        worker.num_in_flight = 10 if worker.worker_id == favourite.worker_id else 1
    assert policy.choose(workers, system).worker_id != favourite.worker_id
    # Under one block: least loaded.
    assert policy.choose(workers, [1, 2]).num_in_flight == 1


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="round_robin, least_loaded or prefix_aware"):
        make_policy("random", WorkerRole.DECODE)
