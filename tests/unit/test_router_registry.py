"""The router's worker registry, with an injected clock (no sleeps)."""

from __future__ import annotations

import threading

import pytest

from splitserve.common.errors import AlreadyExists, FailedPrecondition, InvalidRequest, NotFound
from splitserve.common.load import WorkerLoad
from splitserve.common.types import WorkerRole, WorkerState
from splitserve.router.registry import WorkerRegistry
from splitserve.router.worker import (
    KV_CACHE_DTYPES,
    FingerprintMismatch,
    InvalidRegistration,
    KVCacheLayout,
    KVConnectorMismatch,
    KVLayoutMismatch,
    RegistrationInUse,
    UnknownLease,
    UnknownWorker,
    Worker,
    WorkerIdInUse,
)

LAYOUT = KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype="float32", block_size=16)
PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
SERVING, DRAINING, STARTING, UNREACHABLE = (WorkerState.SERVING, WorkerState.DRAINING, WorkerState.STARTING,
                                            WorkerState.UNREACHABLE)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def registry(clock):
    # Unreachable after 2 s of silence (two heartbeat intervals), removed after 10 s.
    return WorkerRegistry(lease_duration_seconds=10, heartbeat_interval_seconds=1, model_fingerprint="m", clock=clock)


def ids(workers: list[Worker]) -> list[str]:
    return [worker.worker_id for worker in workers]


def beat(registry: WorkerRegistry, worker: Worker, state: WorkerState = SERVING, **load) -> WorkerState:
    return registry.heartbeat(worker.lease_id, WorkerLoad(**load), state)[0]


def test_enums_carry_the_proto_numbers():
    assert [(r.name, r.value) for r in WorkerRole] == [("PREFILL", 1), ("DECODE", 2), ("BOTH", 3)]
    assert [(s.name, s.value) for s in WorkerState] == [("STARTING", 1), ("SERVING", 2), ("DRAINING", 3),
                                                        ("UNREACHABLE", 4)]


def test_registry_errors_are_domain_errors():
    """So the gRPC interceptor answers INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION and NOT_FOUND."""
    assert issubclass(InvalidRegistration, InvalidRequest) and issubclass(InvalidRegistration, ValueError)
    assert issubclass(WorkerIdInUse, AlreadyExists) and not issubclass(WorkerIdInUse, InvalidRequest)
    assert issubclass(FingerprintMismatch, FailedPrecondition)
    assert issubclass(KVLayoutMismatch, FailedPrecondition)
    assert issubclass(UnknownLease, NotFound) and issubclass(UnknownWorker, NotFound)


def test_kv_block_usage():
    assert WorkerLoad().kv_block_usage == 0.0
    assert WorkerLoad(num_total_kv_blocks=8, num_free_kv_blocks=2).kv_block_usage == 0.75


def test_register_assigns_ids_and_routes_in_registration_order(registry):
    a = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    b = registry.register(DECODE, "h:2", worker_id="mine", model_fingerprint="m", kv_layout=LAYOUT)
    p = registry.register(PREFILL, "h:3", model_fingerprint="m", kv_layout=LAYOUT)
    c = registry.register(BOTH, "h:4")
    assert ids([a, b, p, c]) == ["decode-1", "mine", "prefill-2", "worker-3"]
    assert ids(registry.routable(DECODE)) == ["decode-1", "mine"]
    assert ids(registry.routable(PREFILL)) == ["prefill-2"]
    assert ids(registry.routable(BOTH)) == ["worker-3"]
    assert len({a.lease_id, b.lease_id, p.lease_id, c.lease_id}) == 4
    assert (a.registered_at, a.last_heard, a.is_static, a.num_in_flight) == (100.0, 100.0, False, 0)


def test_assigned_ids_skip_ids_taken_by_name(registry):
    registry.register(DECODE, "h:1", worker_id="decode-1", model_fingerprint="m", kv_layout=LAYOUT)
    assert registry.register(DECODE, "h:2", model_fingerprint="m", kv_layout=LAYOUT).worker_id == "decode-2"


def test_bad_registrations_are_refused_with_a_sentence(registry):
    with pytest.raises(InvalidRegistration, match="address is required: the host:port"):
        registry.register(DECODE, "", model_fingerprint="m", kv_layout=LAYOUT)
    with pytest.raises(InvalidRegistration, match="role must be a WorkerRole"):
        registry.register(2, "h:1")
    with pytest.raises(InvalidRegistration, match="registers as STARTING, SERVING or DRAINING"):
        registry.register(DECODE, "h:1", state=UNREACHABLE, model_fingerprint="m", kv_layout=LAYOUT)
    assert isinstance(InvalidRegistration("x"), ValueError)
    assert registry.pools() == {PREFILL: [], DECODE: [], BOTH: []}


def test_fingerprint_mismatch_is_refused_with_the_sentence(registry):
    with pytest.raises(FingerprintMismatch) as refused:
        registry.register(DECODE, "h:1", model_fingerprint="other", kv_layout=LAYOUT)
    assert str(refused.value) == ("The worker at h:1 serves model other, but this cluster serves m: "
                                  "start it with the same --model and --dtype as the rest of the cluster.")
    assert registry.by_address("h:1") is None


def test_without_a_fixed_fingerprint_the_registered_workers_set_it(clock):
    registry = WorkerRegistry(clock=clock)
    assert registry.model_fingerprint is None
    first = registry.register(DECODE, "h:1", model_fingerprint="x", kv_layout=LAYOUT)
    with pytest.raises(FingerprintMismatch, match="serves model y, but this cluster serves x"):
        registry.register(PREFILL, "h:2", model_fingerprint="y", kv_layout=LAYOUT)
    # The only worker restarting with other weights is the cluster now.
    registry.register(DECODE, "h:1", model_fingerprint="y", kv_layout=LAYOUT, previous_lease_id=first.lease_id)
    assert registry.model_fingerprint == "y"
    registry.deregister(registry.by_address("h:1").lease_id)
    assert registry.model_fingerprint is None
    assert registry.register(PREFILL, "h:2", model_fingerprint="z", kv_layout=LAYOUT).model_fingerprint == "z"
    assert first.lease_id != registry.by_address("h:2").lease_id


def test_with_dtype_auto_the_first_worker_picks_one_of_the_models_fingerprints(clock):
    # A router started with --dtype auto allows its model in float32 or bfloat16; the first worker picks one.
    registry = WorkerRegistry(clock=clock, allowed_fingerprints=frozenset({"m-f32", "m-bf16"}))
    with pytest.raises(FingerprintMismatch) as refused:
        registry.register(DECODE, "h:1", model_fingerprint="other", kv_layout=LAYOUT)
    assert str(refused.value) == ("The worker at h:1 serves model other, which is not the router's model in float32 "
                                  "or bfloat16 (m-bf16, m-f32): start it with the router's --model.")
    registry.register(DECODE, "h:1", model_fingerprint="m-bf16", kv_layout=LAYOUT)
    assert registry.model_fingerprint == "m-bf16"
    with pytest.raises(FingerprintMismatch, match="serves model m-f32, but this cluster serves m-bf16"):
        registry.register(PREFILL, "h:2", model_fingerprint="m-f32", kv_layout=LAYOUT)


def layout(block_size: int = 16, dtype: str = "float32") -> KVCacheLayout:
    return KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype=dtype, block_size=block_size)


def test_a_kv_exchanging_worker_without_a_fingerprint_is_refused(registry):
    for role in (PREFILL, DECODE):
        with pytest.raises(InvalidRegistration, match="model_fingerprint is required"):
            registry.register(role, "h:1", kv_layout=layout())
    assert registry.pools() == {PREFILL: [], DECODE: [], BOTH: []}
    assert registry.register(BOTH, "h:2").worker_id == "worker-1"  # colocated: exchanges no KV


def test_a_kv_layout_other_than_the_clusters_is_refused_with_both_layouts(registry):
    registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=layout(16))
    with pytest.raises(KVLayoutMismatch) as refused:
        registry.register(PREFILL, "h:2", model_fingerprint="m", kv_layout=layout(32))
    assert str(refused.value) == (
        "The worker at h:2 has another KV layout than this cluster's prefill and decode workers (block size 32 "
        "vs 16): no KV could move between them. Start it with the same --model, --dtype and --block-size as the "
        "rest of the cluster."
    )
    with pytest.raises(KVLayoutMismatch, match=r"\(dtype bfloat16 vs float32, block size 32 vs 16\)"):
        registry.register(DECODE, "h:3", model_fingerprint="m", kv_layout=layout(32, "bfloat16"))
    with pytest.raises(KVLayoutMismatch, match="block size 32 vs 16"):
        registry.add_static(DECODE, "h:4", model_fingerprint="m", kv_layout=layout(32))
    assert ids(registry.pools()[PREFILL] + registry.pools()[DECODE]) == ["decode-1"]
    # The same layout joins; colocated workers exchange no KV and keep none.
    assert registry.register(PREFILL, "h:5", model_fingerprint="m", kv_layout=layout(16)).kv_layout == layout(16)
    assert registry.register(BOTH, "h:6", model_fingerprint="m", kv_layout=layout(32)).kv_layout is None


def test_the_first_kv_exchanging_worker_sets_the_layout(registry):
    registry.register(BOTH, "h:0", model_fingerprint="m", kv_layout=layout(8))
    only = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=layout(32))
    # The only KV-exchanging worker restarting with another layout is the cluster's layout now.
    registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=layout(16), previous_lease_id=only.lease_id)
    with pytest.raises(KVLayoutMismatch, match="block size 32 vs 16"):
        registry.register(PREFILL, "h:2", model_fingerprint="m", kv_layout=layout(32))
    registry.deregister(registry.by_address("h:1").lease_id)
    assert registry.register(PREFILL, "h:2", model_fingerprint="m", kv_layout=layout(32)).worker_id != only.worker_id


def test_kv_layout_from_the_proto_message():
    from splitserve.v1 import worker_pb2

    message = worker_pb2.KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64,
                                       dtype=worker_pb2.KV_CACHE_DTYPE_BFLOAT16, block_size=32)
    assert KVCacheLayout.from_pb(message) == layout(32, "bfloat16")
    assert KV_CACHE_DTYPES == {worker_pb2.KVCacheDtype.Value(f"KV_CACHE_DTYPE_{name.upper()}"): name
                               for name in ("float32", "float16", "bfloat16")}


def test_lease_expiry_removes_exactly_the_silent_worker(registry, clock):
    quiet = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    busy = registry.register(DECODE, "h:2", model_fingerprint="m", kv_layout=LAYOUT)
    states, removed_at = [], {}
    for second in range(1, 13):
        clock.now = 100 + second
        beat(registry, busy, num_running_requests=second)
        for worker in registry.expire():
            removed_at[worker.worker_id] = second
        current = registry.get(quiet.worker_id)
        states.append(current.state if current else None)
        assert ids(registry.routable(DECODE)) == ([busy.worker_id] if second >= 2 else ["decode-1", "decode-2"])
    assert states == [SERVING] + [UNREACHABLE] * 8 + [None] * 3
    assert removed_at == {quiet.worker_id: 10}
    assert registry.get(busy.worker_id).load.num_running_requests == 12
    with pytest.raises(UnknownLease, match="unknown or expired: register again"):
        beat(registry, quiet)


def test_a_heartbeat_after_the_lease_ran_out_is_refused_even_before_expire(registry, clock):
    worker = registry.register(PREFILL, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    clock.now += 9.99
    beat(registry, worker)
    clock.now += 10
    with pytest.raises(UnknownLease, match="expired"):
        beat(registry, worker)
    assert registry.get(worker.worker_id) is None


def test_an_unreachable_worker_serves_again_after_a_heartbeat(registry, clock):
    worker = registry.register(PREFILL, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    clock.now += 3
    assert registry.routable(PREFILL) == []
    assert registry.get(worker.worker_id).state == UNREACHABLE
    assert registry.heartbeat(worker.lease_id, WorkerLoad(), SERVING) == (SERVING, 10)
    assert ids(registry.routable(PREFILL)) == [worker.worker_id]
    # A failed call marks it too, until its next heartbeat.
    registry.mark_unreachable(worker.worker_id)
    assert registry.routable(PREFILL) == []
    assert beat(registry, worker, state=UNREACHABLE) == SERVING
    assert ids(registry.routable(PREFILL)) == [worker.worker_id]


def test_drain_sticks_and_stops_routing(registry):
    worker = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    registry.begin_request(worker.worker_id)
    registry.begin_request(worker.worker_id)
    assert registry.drain(worker.lease_id) == 2
    assert beat(registry, worker, state=SERVING) == DRAINING
    registry.mark_unreachable(worker.worker_id)
    assert registry.get(worker.worker_id).state == DRAINING
    assert registry.routable(DECODE) == []


def test_only_the_worker_itself_can_drain_it(registry):
    """A drain needs the worker's lease: knowing its public id (GetClusterStatus lists it) is not enough."""
    worker = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    other = registry.register(DECODE, "h:2", model_fingerprint="m", kv_layout=LAYOUT)
    with pytest.raises(InvalidRegistration, match="lease_id is required"):
        registry.drain("", worker.worker_id)
    with pytest.raises(UnknownLease, match="unknown or expired"):
        registry.drain("guessed-lease", worker.worker_id)
    with pytest.raises(UnknownLease, match="not the named worker's"):
        registry.drain(other.lease_id, worker.worker_id)
    assert [w.state for w in registry.pools()[DECODE]] == [SERVING, SERVING]
    assert registry.drain(worker.lease_id, worker.worker_id) == 0
    assert [w.state for w in registry.pools()[DECODE]] == [DRAINING, SERVING]


def test_a_worker_that_says_it_drains_stays_draining(registry):
    worker = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    assert beat(registry, worker, state=DRAINING) == DRAINING
    assert beat(registry, worker, state=SERVING) == DRAINING
    assert registry.routable(DECODE) == []


def test_a_starting_worker_is_routed_to_once_it_says_serving(registry):
    worker = registry.register(PREFILL, "h:1", state=STARTING, model_fingerprint="m", kv_layout=LAYOUT)
    assert registry.routable(PREFILL) == []
    assert beat(registry, worker, state=SERVING) == SERVING
    assert ids(registry.routable(PREFILL)) == [worker.worker_id]


def test_registering_again_from_the_same_address_replaces(registry):
    old = registry.register(DECODE, "h:1", worker_id="d", model_fingerprint="m", kv_layout=LAYOUT)
    registry.begin_request("d")
    new = registry.register(DECODE, "h:1", worker_id="d", kv_endpoint="kv-2", model_fingerprint="m", kv_layout=LAYOUT,
                            previous_lease_id=old.lease_id)
    assert ids(registry.pools()[DECODE]) == ["d"]
    assert registry.get("d").kv_endpoint == "kv-2"
    assert registry.get("d").num_in_flight == 1  # the old calls still end through end_request("d")
    with pytest.raises(UnknownLease):
        beat(registry, old)
    beat(registry, new)
    # Under an assigned id the old id is gone, and its calls' ends are no-ops.
    renamed = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT, previous_lease_id=new.lease_id)
    assert ids(registry.pools()[DECODE]) == [renamed.worker_id] and renamed.num_in_flight == 0
    registry.deregister(renamed.lease_id)
    assert registry.pools()[DECODE] == []
    with pytest.raises(UnknownLease):
        registry.deregister(renamed.lease_id)


def test_a_live_registration_is_replaced_only_by_whoever_made_it(registry, clock):
    """Nobody but the worker (its lease, or its certificate identity) replaces a live registration; a restarted
    worker replaces its old one once that is silent."""
    live = registry.register(DECODE, "h:1", worker_id="d", kv_endpoint="kv-1", model_fingerprint="m",
                             kv_layout=LAYOUT, identity="decode-host-1")
    for impostor in ({}, {"previous_lease_id": "guessed"}, {"identity": "someone-else"}):
        with pytest.raises(RegistrationInUse, match="registered and alive, and only it can register there again"):
            registry.register(DECODE, "h:1", kv_endpoint="bogus", model_fingerprint="m", kv_layout=LAYOUT, **impostor)
        with pytest.raises(WorkerIdInUse, match="'d' is in use by the live worker at h:1"):
            registry.register(DECODE, "h:2", worker_id="d", kv_endpoint="bogus", model_fingerprint="m",
                              kv_layout=LAYOUT, **impostor)
    assert [(w.address, w.kv_endpoint, w.lease_id) for w in registry.pools()[DECODE]] == [("h:1", "kv-1",
                                                                                            live.lease_id)]
    same = registry.register(DECODE, "h:1", worker_id="d", kv_endpoint="kv-2", model_fingerprint="m",
                             kv_layout=LAYOUT, identity="decode-host-1")
    assert registry.get("d").kv_endpoint == "kv-2" and same.lease_id != live.lease_id
    clock.now += 2  # silent for two heartbeat intervals: a restarted worker takes its place
    restarted = registry.register(DECODE, "h:1", worker_id="d", kv_endpoint="kv-3", model_fingerprint="m",
                                  kv_layout=LAYOUT)
    assert (registry.get("d").kv_endpoint, restarted.identity) == ("kv-3", None)


def test_a_worker_id_held_by_a_live_worker_elsewhere_is_refused(registry, clock):
    registry.register(PREFILL, "h:1", worker_id="p", model_fingerprint="m", kv_layout=LAYOUT)
    with pytest.raises(WorkerIdInUse, match="'p' is in use by the live worker at h:1"):
        registry.register(PREFILL, "h:2", worker_id="p", model_fingerprint="m", kv_layout=LAYOUT)
    # Once the holder is silent (a restart on another port), the id moves.
    clock.now += 2
    moved = registry.register(PREFILL, "h:2", worker_id="p", model_fingerprint="m", kv_layout=LAYOUT)
    assert [(w.worker_id, w.address) for w in registry.pools()[PREFILL]] == [("p", "h:2")]
    assert moved.lease_id == registry.get("p").lease_id


def test_static_workers_never_expire_and_are_polled(registry, clock):
    static = registry.add_static(BOTH, "h:9", model_fingerprint="m")
    assert (static.worker_id, static.lease_id, static.is_static) == ("worker-1", None, True)
    clock.now += 1000
    assert registry.expire() == []
    assert ids(registry.routable(BOTH)) == ["worker-1"]
    registry.mark_unreachable("worker-1")
    assert registry.routable(BOTH) == []
    registry.update_static("worker-1", WorkerLoad(num_total_kv_blocks=4, num_free_kv_blocks=1), SERVING)
    heard = registry.get("worker-1")
    assert (heard.state, heard.last_heard, heard.load.kv_block_usage) == (SERVING, 1100.0, 0.75)
    registry.update_static("gone", WorkerLoad(), SERVING)  # no-op


def test_add_static_is_idempotent_per_address_and_yields_to_registrations(registry):
    first = registry.add_static(DECODE, "h:1", worker_id="decode-h:1")
    assert registry.add_static(DECODE, "h:1", worker_id="other").worker_id == first.worker_id
    assert registry.add_static(DECODE, "h:2", worker_id="decode-h:1").worker_id == "decode-h:1-1"
    # The worker at h:1 registers itself: its lease replaces the static entry, and polling keeps it.
    leased = registry.register(DECODE, "h:1", worker_id="decode-h:1", model_fingerprint="m", kv_layout=LAYOUT)
    assert registry.add_static(DECODE, "h:1").lease_id == leased.lease_id
    assert [(w.worker_id, w.is_static) for w in registry.pools()[DECODE]] == [("decode-h:1-1", True),
                                                                              ("decode-h:1", False)]
    with pytest.raises(InvalidRegistration, match="address is required"):
        registry.add_static(DECODE, "")
    with pytest.raises(FingerprintMismatch):
        registry.add_static(DECODE, "h:3", model_fingerprint="other")


def test_readers_get_copies(registry):
    worker = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    beat(registry, worker, num_running_requests=3)
    copy = registry.routable(DECODE)[0]
    copy.state, copy.num_in_flight, copy.load.num_running_requests = DRAINING, 7, 99
    registry.pools()[DECODE][0].load.num_free_kv_blocks = 5
    registry.by_address("h:1").load.num_waiting_requests = 5
    held = registry.get(worker.worker_id)
    assert (held.state, held.num_in_flight, held.load) == (SERVING, 0, WorkerLoad(num_running_requests=3))


def test_in_flight_counters(registry):
    a = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    b = registry.register(DECODE, "h:2", model_fingerprint="m", kv_layout=LAYOUT)
    for _ in range(3):
        registry.begin_request(a.worker_id)
    registry.begin_request(b.worker_id)
    registry.end_request(a.worker_id)
    assert [w.num_in_flight for w in registry.routable(DECODE)] == [2, 1]
    registry.end_request(b.worker_id)
    registry.end_request(b.worker_id)  # never below zero
    assert registry.get(b.worker_id).num_in_flight == 0
    registry.deregister(a.lease_id)
    registry.end_request(a.worker_id)  # removed: no-op
    registry.begin_request(a.worker_id)
    assert registry.get(a.worker_id) is None


def test_pools_lists_every_role_in_registration_order(registry):
    registry.register(PREFILL, "h:1", model_fingerprint="m", kv_layout=LAYOUT)
    registry.add_static(DECODE, "h:2")
    registry.register(DECODE, "h:3", state=STARTING, model_fingerprint="m", kv_layout=LAYOUT)
    pools = registry.pools()
    assert {role: ids(workers) for role, workers in pools.items()} == {
        PREFILL: ["prefill-1"], DECODE: ["decode-2", "decode-3"], BOTH: []}
    assert registry.by_address("h:3").state == STARTING and registry.by_address("h:4") is None


def test_concurrent_use_keeps_the_registry_consistent(registry, clock):
    errors = []
    start = threading.Barrier(6)

    def hammer(index: int) -> None:
        try:
            start.wait(5)
            lease_id = ""
            for round_index in range(50):
                worker = registry.register(DECODE, f"h:{index}", worker_id=f"d{index}", model_fingerprint="m",
                                           kv_layout=LAYOUT, previous_lease_id=lease_id)
                lease_id = worker.lease_id
                registry.begin_request(worker.worker_id)
                assert beat(registry, worker, num_running_requests=round_index) == SERVING
                assert worker.worker_id in ids(registry.routable(DECODE))
                registry.pools()
                registry.end_request(worker.worker_id)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    workers = registry.pools()[DECODE]
    assert sorted((w.worker_id, w.address) for w in workers) == [(f"d{i}", f"h:{i}") for i in range(6)]
    assert [w.num_in_flight for w in workers] == [0] * 6
    assert [w.load.num_running_requests for w in workers] == [49] * 6


def test_the_registry_servicer_converts_the_kv_layout_and_refuses_another(registry):
    from splitserve.router.registry_servicer import RegistryServicer
    from splitserve.v1 import inference_pb2, worker_pb2

    def request(address: str, block_size: int, role=inference_pb2.WORKER_ROLE_DECODE, fingerprint="m",
                connector=worker_pb2.KV_CONNECTOR_TYPE_P2P):
        return worker_pb2.RegisterRequest(
            role=role, address=address, kv_endpoint=worker_pb2.KVEndpoint(connector=connector, address=address),
            model_fingerprint=fingerprint, state=inference_pb2.WORKER_STATE_SERVING,
            kv_layout=worker_pb2.KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64,
                                               dtype=worker_pb2.KV_CACHE_DTYPE_FLOAT32, block_size=block_size),
        )

    class PlainContext:  # a call without mutual TLS: no certificate identity
        def peer_identities(self):
            return None

    servicer = RegistryServicer(registry)
    servicer.Register(request("h:1", 16), PlainContext())
    assert registry.by_address("h:1").kv_layout == layout(16)
    with pytest.raises(KVLayoutMismatch, match="block size 32 vs 16"):
        servicer.Register(request("h:2", 32, role=inference_pb2.WORKER_ROLE_PREFILL), PlainContext())
    with pytest.raises(InvalidRegistration, match="model_fingerprint is required"):
        servicer.Register(request("h:3", 16, fingerprint=""), PlainContext())
    no_layout = request("h:4", 16)
    no_layout.ClearField("kv_layout")
    with pytest.raises(InvalidRegistration, match="kv_layout is required"):
        servicer.Register(no_layout, PlainContext())
    # KV moves between the pools only over the same connector: another one is refused, an unset one too.
    with pytest.raises(KVConnectorMismatch, match="moves KV over lmcache, but this cluster's prefill and decode "
                                                  "workers use p2p"):
        servicer.Register(request("h:5", 16, role=inference_pb2.WORKER_ROLE_PREFILL,
                                  connector=worker_pb2.KV_CONNECTOR_TYPE_LMCACHE), PlainContext())
    with pytest.raises(InvalidRegistration, match="connector 0 is not P2P, REDIS or LMCACHE"):
        servicer.Register(request("h:6", 16, connector=worker_pb2.KV_CONNECTOR_TYPE_UNSPECIFIED), PlainContext())
    assert servicer.Register(request("h:7", 16, role=inference_pb2.WORKER_ROLE_PREFILL), PlainContext()).worker_id
    assert registry.by_address("h:7").kv_connector == "p2p"


def test_every_worker_has_the_clusters_reasoning_parser(registry, clock):
    """Grammars wait out think blocks on workers with --reasoning-parser: a prefill worker samples the first token
    as its decode worker's grammar expects only when both have the same flag, so the registry pins the first
    worker's (none included), for every role; the router's model info reports it."""
    from splitserve.router.registry_servicer import RegistryServicer
    from splitserve.router.worker import ReasoningParserMismatch
    from splitserve.v1 import inference_pb2, worker_pb2

    assert registry.reasoning_parser == ""
    first = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT, reasoning_parser="qwen3")
    assert registry.reasoning_parser == "qwen3"
    for role, address, parser, said in ((PREFILL, "h:2", "", "no --reasoning-parser"),
                                        (BOTH, "h:3", "deepseek_r1", "--reasoning-parser deepseek_r1")):
        with pytest.raises(ReasoningParserMismatch, match=f"The worker at {address} has {said}, but this cluster's "
                                                          "workers have --reasoning-parser qwen3"):
            registry.register(role, address, model_fingerprint="m", kv_layout=LAYOUT, reasoning_parser=parser)
    with pytest.raises(ReasoningParserMismatch, match="has no --reasoning-parser"):
        registry.add_static(DECODE, "h:4", model_fingerprint="m", kv_layout=LAYOUT)
    registry.register(PREFILL, "h:5", model_fingerprint="m", kv_layout=LAYOUT, reasoning_parser="qwen3")
    # The only worker may come back with another flag (it replaces itself); a name not known is refused unquoted.
    registry.deregister(registry.by_address("h:5").lease_id)
    again = registry.register(DECODE, "h:1", model_fingerprint="m", kv_layout=LAYOUT, previous_lease_id=first.lease_id)
    assert again.reasoning_parser == "" and registry.reasoning_parser == ""
    with pytest.raises(InvalidRegistration, match="reasoning_parser must be empty or one of deepseek_r1, qwen3, got "
                                                  "'xxxx"):
        registry.register(DECODE, "h:6", model_fingerprint="m", kv_layout=LAYOUT, reasoning_parser="x" * 10_000)

    class PlainContext:
        def peer_identities(self):
            return None

    message = worker_pb2.RegisterRequest(
        role=inference_pb2.WORKER_ROLE_PREFILL, address="h:7",
        kv_endpoint=worker_pb2.KVEndpoint(connector=worker_pb2.KV_CONNECTOR_TYPE_P2P, address="h:7"),
        model_fingerprint="m", state=inference_pb2.WORKER_STATE_SERVING, reasoning_parser="deepseek_r1",
        kv_layout=worker_pb2.KVCacheLayout(num_layers=30, num_kv_heads=3, head_size=64,
                                           dtype=worker_pb2.KV_CACHE_DTYPE_FLOAT32, block_size=16))
    with pytest.raises(ReasoningParserMismatch):
        RegistryServicer(registry).Register(message, PlainContext())
    message.reasoning_parser = ""
    assert RegistryServicer(registry).Register(message, PlainContext()).worker_id
    assert registry.by_address("h:7").reasoning_parser == ""
