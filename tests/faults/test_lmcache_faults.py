"""A cluster with ``--kv-transfer lmcache`` under faults: its Redis stopped mid-run, its prefill worker sent
SIGTERM while busy.

The cluster (a router, one prefill and one decode worker, the fault suite's flags) has a redis-server of its
own as LMCache's backend. With Redis stopped (SIGSTOP: it accepts connections and never answers, which only
LMCache's socket timeouts end), no store lands: the prefill worker answers ABORTED once its wait for Redis
runs out, the router has the decode worker prefill the prompt itself, and every request completes with the
undisturbed run's tokens. Once Redis runs again, prompts go through LMCache again. A prefill worker sent
SIGTERM under traffic exits within 5 s and the requests it held still complete.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import redis

from tests.cluster_helpers import wait_until, worker_status
from tests.fault_helpers import Load, assert_nothing_lost, assert_redis_clean, assert_settled, resume_if_stopped
from tests.faults.conftest import MAX_TOKENS, PROMPTS, expected_tokens, start_fault_cluster

pytestmark = pytest.mark.timeout(240)

LMCACHE_KEYS = "splitserve:lmcache:*"
SIGTERM_EXIT_SECONDS = 5.0
# Workers finish in-flight requests for at most 1 s after SIGTERM, then abort them after the engine step in
# progress: a busy worker's exit is bounded by that and a step or two (of at most 32 tokens), not by how much
# work it holds. Steps that small also keep three prompts' prefills (about 1,800 tokens) from all finishing
# within that second, so the SIGTERM test has prefills to abort (at 128 tokens a step they once did finish).
WORKER_ARGS = ["--drain-timeout", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "32"]
# Decode workers wait up to 30 s for a prompt's KV: one prefill worker on a shared core takes several seconds a
# prompt, and a request's wait starts before its prefill is queued (a fault's requests wait on the prefill's
# answer, not on this).
ROUTER_ARGS = ["--kv-timeout", "30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ledger):
    cluster = start_fault_cluster("lmcache", tmp_path_factory.mktemp("lmcache-faults"), prefill=1, decode=1,
                                  ledger=ledger, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS)
    yield cluster
    if cluster.redis is not None:
        resume_if_stopped(cluster.redis)
    cluster.stop()


@pytest.fixture(scope="module")
def expected(cluster, client):
    """Each prompt's undisturbed tokens; then LMCache's keys are deleted, so that every later request needs its
    prompt stored anew (a prompt still in Redis would be loaded whatever the prefill worker does). The tokens may
    come from another fault module's cluster, run before this one (``expected_tokens``): then there is nothing
    to delete."""
    expected = expected_tokens(cluster.router.address)
    delete_lmcache_keys(cluster.redis_url)
    return expected


def delete_lmcache_keys(redis_url: str) -> None:
    server = redis.Redis.from_url(redis_url)
    try:
        keys = list(server.scan_iter(match=LMCACHE_KEYS, count=1000))
        if keys:
            server.delete(*keys)
    finally:
        server.close()


def lmcache_keys(redis_url: str) -> list[bytes]:
    server = redis.Redis.from_url(redis_url)
    try:
        return list(server.scan_iter(match=LMCACHE_KEYS, count=1000))
    finally:
        server.close()


def worker(cluster, role: str):
    return next(p for p in cluster.workers if p.name.startswith(role) and p.alive())


def counters(process, role: str):
    return worker_status(process.address, role).counters


def busy(process, role: str) -> bool:
    load = worker_status(process.address, role).status.load
    return load.num_running_requests + load.num_waiting_requests > 0


class FirstTokenClock:
    """An ``on_token`` hook that notes when each request's first token arrived (seconds after ``start``)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, outcome, call) -> None:
        with self._lock:
            self.seconds.setdefault(outcome.label, time.monotonic() - self.start)


def test_redis_stopped_mid_run_requests_complete_by_recompute(cluster, client, expected):
    redis_process = cluster.redis
    assert redis_process is not None  # its own redis-server
    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
    before = counters(decode, "decode")

    clock = FirstTokenClock()
    load = Load(cluster.router.address, PROMPTS, [0, 1], MAX_TOKENS, timeout=90, on_token=clock).start()
    wait_until(lambda: busy(prefill, "prefill"), 30, interval=0.05, message="the prefill worker prefilling")
    os.kill(redis_process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        outcomes = load.join()
        outage_seconds = time.monotonic() - stopped
        assert_nothing_lost(outcomes, expected, at_least_completed=2)
        # Redis still stopped: the prompts were computed on the decode worker, and its blocks are free again.
        during = counters(decode, "decode")
        recomputed = (during.num_local_prefills + during.num_kv_recomputes
                      - before.num_local_prefills - before.num_kv_recomputes)
        print(f"Redis stopped {stopped - clock.start:.1f} s into the load; first tokens at "
              f"{sorted(round(seconds, 1) for seconds in clock.seconds.values())} s; all done "
              f"{outage_seconds:.1f} s after the stop; {recomputed} prompts computed on the decode worker, "
              f"{during.num_kv_transfers_received - before.num_kv_transfers_received} loaded from LMCache")
        assert recomputed >= 1, "no prompt was computed on the decode worker: the stop hit no store"
        assert_settled(cluster, client, num_workers=2)
    finally:
        os.kill(redis_process.pid, signal.SIGCONT)
    assert redis_process.alive() and prefill.alive() and decode.alive()

    # Redis runs again: a prompt never stored before, and one the outage hit, go through LMCache.
    before = counters(decode, "decode")
    sent_before = counters(prefill, "prefill").num_kv_transfers_sent
    after = Load(cluster.router.address, PROMPTS, [3, 0], MAX_TOKENS, timeout=90, label="after").start().join()
    assert_nothing_lost(after, expected, at_least_completed=2)
    now = counters(decode, "decode")
    assert (now.num_kv_transfers_received - before.num_kv_transfers_received,
            now.num_local_prefills - before.num_local_prefills,
            now.num_kv_recomputes - before.num_kv_recomputes) == (2, 0, 0), now
    assert counters(prefill, "prefill").num_kv_transfers_sent - sent_before == 2
    assert lmcache_keys(cluster.redis_url), "nothing in Redis after Redis came back"
    assert_settled(cluster, client, num_workers=2)
    assert_redis_clean(cluster.redis_url)


def test_busy_prefill_worker_exits_within_5_s_of_sigterm(cluster, client, expected):
    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
    before = counters(decode, "decode")
    local_before = before.num_local_prefills + before.num_kv_recomputes
    load = Load(cluster.router.address, PROMPTS, [1, 2, 3], MAX_TOKENS, timeout=90, label="sigterm").start()
    wait_until(lambda: busy(prefill, "prefill"), 30, interval=0.05, message="the prefill worker prefilling")
    in_flight = worker_status(prefill.address, "prefill").status.load
    started = time.monotonic()
    prefill.terminate()
    code = prefill.popen.wait(30)
    seconds = time.monotonic() - started
    print(f"prefill worker exited {prefill.exit_description()} {seconds:.2f} s after SIGTERM "
          f"({in_flight.num_running_requests} running, {in_flight.num_waiting_requests} waiting)")
    assert code == 0, prefill.log()[-3000:]
    assert seconds < SIGTERM_EXIT_SECONDS, f"the prefill worker took {seconds:.1f} s to exit"
    assert "LMCache did not stop within" not in prefill.log()
    assert_nothing_lost(load.join(), expected, at_least_completed=3)
    # Its drain timeout ran out with prefills in flight, and it aborted them then: they were done again on the
    # decode worker (the router fell back). Before the abort was real, the server's 1 s grace let them run on,
    # and on a fast run all three finished there, sent their KV, and nothing fell back.
    aborted = re.search(r"(\d+) requests still in flight after 1 s; aborting them", prefill.log())
    assert aborted, "the prefills finished within the 1 s drain timeout: nothing was aborted (give it more work)"
    now = counters(decode, "decode")
    assert now.num_local_prefills + now.num_kv_recomputes - local_before >= 1, now
    assert "stopped this prefill when its drain timeout ran out" in cluster.router.log()
    assert_settled(cluster, client, num_workers=1)  # it left the cluster


def test_nothing_of_the_cluster_is_left_after_stop(cluster, ledger):
    ledger.note(cluster)
    cluster.stop()
    ledger.assert_none_left()
    # Every key left in Redis had a TTL (checked above); Redis itself is gone with the cluster.
    assert not cluster.redis.alive()
