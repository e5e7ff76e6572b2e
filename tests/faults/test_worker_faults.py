"""Workers and the router failing under traffic: killed, stopped, restarted, rolled.

One cluster (a router, one prefill and two decode workers, KV over p2p) for the whole module; each test puts the
pool back in shape first. After each fault every request ended right or as documented, every worker's blocks
are free and the router has no call open; at the end no process of the cluster is left.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from splitserve.client import Client
from tests.cluster_helpers import wait_until, worker_status
from tests.fault_helpers import (
    Load,
    assert_nothing_lost,
    assert_settled,
    cluster_workers,
    resume_if_stopped,
)
from tests.faults.conftest import MAX_TOKENS, PROMPTS, expected_tokens, start_fault_cluster

pytestmark = pytest.mark.timeout(180)

LEASE_SECONDS = 3.0  # ROUTER_ARGS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ledger):
    cluster = start_fault_cluster("p2p", tmp_path_factory.mktemp("worker-faults"), prefill=1, decode=2, ledger=ledger)
    yield cluster
    for process in cluster.workers:
        resume_if_stopped(process)
    cluster.stop()


@pytest.fixture(scope="module")
def expected(cluster, client):
    return expected_tokens(cluster.router.address)


def live(cluster, role: str) -> list:
    return [p for p in cluster.workers if p.name.startswith(role) and p.alive()]


def in_shape(cluster, client, ledger, prefill: int = 1, decode: int = 2) -> None:
    """Start workers until the pool has ``prefill`` and ``decode`` live ones, all listed by the router."""
    for role, count in (("prefill", prefill), ("decode", decode)):
        missing = count - len(live(cluster, role))
        if missing > 0:
            cluster.start_workers(role, missing)
    ledger.note(cluster)
    wait_until(lambda: len(cluster_workers(client)) == prefill + decode, 20, message="the pool back in shape")


def busy(process, role: str) -> bool:
    load = worker_status(process.address, role).status.load
    return load.num_running_requests + load.num_waiting_requests > 0


def decode_counters(cluster):
    return [worker_status(p.address, "decode").counters for p in live(cluster, "decode")]


def busiest_decode_worker(cluster):
    """The live decode worker with the most running requests (it must have some)."""
    running = {p.name: worker_status(p.address, "decode").status.load.num_running_requests for p in live(cluster, "decode")}
    victim = max(live(cluster, "decode"), key=lambda p: running[p.name])
    assert running[victim.name] > 0, f"no decode worker is streaming: {running}"
    return victim


def after_tokens(num_tokens: int):
    """An ``on_token`` hook and the event it sets once any stream has ``num_tokens`` tokens."""
    reached = threading.Event()

    def on_token(outcome, call) -> None:
        if len(outcome.token_ids) >= num_tokens:
            reached.set()

    return on_token, reached


def test_prefill_worker_sigkilled_mid_transfer(cluster, client, expected, ledger):
    """The prefills in flight fail; the router falls back to prefilling on the decode workers: right tokens."""
    in_shape(cluster, client, ledger)
    [prefill] = live(cluster, "prefill")
    before = sum(c.num_local_prefills + c.num_kv_recomputes for c in decode_counters(cluster))
    load = Load(cluster.router.address, PROMPTS, [0, 1, 2], MAX_TOKENS, timeout=90).start()
    wait_until(lambda: busy(prefill, "prefill"), 30, interval=0.05, message="the prefill worker prefilling")
    prefill.kill()
    assert_nothing_lost(load.join(), expected, at_least_completed=3)
    after = sum(c.num_local_prefills + c.num_kv_recomputes for c in decode_counters(cluster))
    assert after > before, "no request was prefilled again on a decode worker: the kill hit no transfer"
    assert_settled(cluster, client, num_workers=2)


def test_prefill_worker_sigstopped_mid_transfer(cluster, client, expected, ledger):
    """Stopped past its lease: new requests prefill on the decode workers meanwhile; the stopped ones finish once
    it runs again (or recompute after the decode worker's KV timeout); it registers again."""
    in_shape(cluster, client, ledger)
    [prefill] = live(cluster, "prefill")
    load = Load(cluster.router.address, PROMPTS, [0, 1], MAX_TOKENS, timeout=90).start()
    wait_until(lambda: busy(prefill, "prefill"), 30, interval=0.05, message="the prefill worker prefilling")
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: all(w.worker_id != prefill.worker_id for w in cluster_workers(client)), LEASE_SECONDS + 10,
                   message="the stopped prefill worker dropped from the registry")
        meanwhile = Load(cluster.router.address, PROMPTS, [2, 3], MAX_TOKENS, timeout=90, label="meanwhile").start()
        meanwhile_outcomes = meanwhile.join()
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert_nothing_lost(meanwhile_outcomes, expected, at_least_completed=2)
    assert_nothing_lost(load.join(), expected, at_least_completed=2)
    assert_settled(cluster, client, num_workers=3)


def test_decode_worker_sigkilled_mid_stream_migrates_its_streams(cluster, client, expected, ledger):
    """Two decode workers; the one streaming is killed. Expected: the router carries each stream on the other
    worker (prompt + the tokens already streamed), and the client sees one uninterrupted, right stream."""
    in_shape(cluster, client, ledger)
    on_token, reached = after_tokens(2)
    load = Load(cluster.router.address, PROMPTS, [0, 1, 2, 3], MAX_TOKENS, timeout=90, on_token=on_token).start()
    assert reached.wait(60), "no stream got its first tokens"
    victim = busiest_decode_worker(cluster)
    victim.kill()
    outcomes = load.join()
    assert_nothing_lost(outcomes, expected, at_least_completed=4)
    assert "migrating it" in cluster.router.log(), "no stream was carried over: the kill hit no stream mid-way"
    assert_settled(cluster, client, num_workers=2)


def test_a_seeded_stream_migrated_through_the_prefill_worker_keeps_its_random_stream(cluster, client, ledger):
    """A seeded sampled stream whose decode worker is killed mid-way: its continuation (the prompt plus the tokens
    sent) is prefilled on the prefill worker, which samples the next token with the draw the undisturbed stream
    took for it (num_resumed_tokens), and the new decode worker goes on from the draw after: the client gets the
    undisturbed stream. (top_k 20: over the whole vocabulary the recomputed prompt's rounding now and then moves
    a draw onto its neighbour.)"""
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.v1 import inference_pb2

    in_shape(cluster, client, ledger)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=60, ignore_eos=True)
    undisturbed = client.generate(PROMPTS[0], params, timeout=120)
    migrations = cluster.router.log().count("migrating it")
    token_ids, last, killed = [], None, None
    for chunk in client.generate_stream(PROMPTS[0], params, timeout=120):
        token_ids.extend(chunk.token_ids)
        last = chunk
        if killed is None and len(token_ids) >= 8:
            killed = busiest_decode_worker(cluster)
            killed.kill()
    assert killed is not None and last.finish_reason == inference_pb2.FINISH_REASON_LENGTH, last
    assert token_ids == list(undisturbed.token_ids) and len(set(token_ids)) > 10
    assert cluster.router.log().count("migrating it") == migrations + 1
    assert_settled(cluster, client, num_workers=2)


def test_decode_worker_sigstopped_mid_stream(cluster, client, expected, ledger):
    """A decode worker stopped mid-stream (its lease lapses): its streams end as documented (or go on elsewhere)
    by the client's deadline, never hang; once it runs again it frees everything and serves again."""
    in_shape(cluster, client, ledger)
    on_token, reached = after_tokens(2)
    deadline = 15.0  # well past the lease (LEASE_SECONDS) the router drops a silent worker after
    load = Load(cluster.router.address, PROMPTS, [0, 1, 2, 3], MAX_TOKENS, timeout=deadline, on_token=on_token).start()
    assert reached.wait(60), "no stream got its first tokens"
    victim = busiest_decode_worker(cluster)
    os.kill(victim.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        wait_until(lambda: all(w.worker_id != victim.worker_id for w in cluster_workers(client)), LEASE_SECONDS + 10,
                   message="the stopped decode worker dropped from the registry")
        outcomes = load.join()
        assert time.monotonic() - started < deadline + 10
        after = Load(cluster.router.address, PROMPTS, [3], MAX_TOKENS, timeout=60, label="while stopped").start().join()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert_nothing_lost(outcomes, expected, allow=frozenset({"error"}))
    assert_nothing_lost(after, expected, at_least_completed=1)
    assert_settled(cluster, client, num_workers=3)


def test_rolling_restart_of_the_decode_pool_under_traffic(cluster, client, expected, ledger):
    """Each decode worker in turn: a replacement starts, then the old one gets SIGTERM, drains its streams and
    exits 0. Traffic runs throughout; every request completes with the right tokens."""
    in_shape(cluster, client, ledger)
    stop = threading.Event()
    outcomes, waves = [], []

    def traffic() -> None:
        wave = 0
        while not stop.is_set():
            indexes = [wave % len(PROMPTS), (wave + 1) % len(PROMPTS)]
            outcomes.extend(Load(cluster.router.address, PROMPTS, indexes, MAX_TOKENS, timeout=120,
                                 label=f"wave {wave}").start().join())
            waves.append(wave)
            wave += 1

    runner = threading.Thread(target=traffic, daemon=True)
    runner.start()
    try:
        for old in live(cluster, "decode"):
            cluster.start_workers("decode", 1)
            ledger.note(cluster)
            old.stop(timeout=60)
            assert old.popen.returncode == 0, f"{old.name} ended with {old.exit_description()}"
    finally:
        stop.set()
        runner.join(180)
    assert not runner.is_alive()
    assert len(waves) >= 2
    assert_nothing_lost(outcomes, expected, at_least_completed=len(outcomes))
    assert_settled(cluster, client, num_workers=3)


def test_router_sigkilled_and_restarted_under_traffic(cluster, client, expected, ledger):
    """Streams on the killed router end with UNAVAILABLE; a router started on the same port gets every worker
    back (they register again) and serves new requests right; the workers freed what the old one held."""
    in_shape(cluster, client, ledger)
    on_token, reached = after_tokens(2)
    load = Load(cluster.router.address, PROMPTS, [0, 1, 2], MAX_TOKENS, timeout=60, on_token=on_token).start()
    assert reached.wait(60), "no stream got its first tokens"
    old = cluster.router
    port = int(old.address.rsplit(":", 1)[1])
    old.kill()
    assert_nothing_lost(load.join(), expected)
    cluster.router_port = port
    cluster.start_router()
    ledger.note(cluster)
    with Client(cluster.router.address) as fresh:
        wait_until(lambda: len(cluster_workers(fresh)) == 3, 20, message="every worker registered with the new router")
        after = Load(cluster.router.address, PROMPTS, [1, 3], MAX_TOKENS, timeout=90, label="after").start().join()
        assert_nothing_lost(after, expected, at_least_completed=2)
        assert_settled(cluster, fresh, num_workers=3)


def test_nothing_of_the_cluster_is_left_after_stop(cluster, ledger):
    for process in cluster.workers:
        resume_if_stopped(process)
    ledger.note(cluster)
    cluster.stop()
    ledger.assert_none_left()
