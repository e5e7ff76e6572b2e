"""Redis, the KV store between the pools, killed under traffic and started again on its port.

The cluster (a router, one prefill and one decode worker, KV over Redis) has a redis-server of its own, not
the session's. The transfers in flight fail and their prompts are prefilled again on the decode worker; once
Redis is back, both connectors reconnect and KV goes through it again; no key of ours is left without a TTL.
"""

from __future__ import annotations

import time

import pytest

from splitserve.client import Client
from tests.cluster_helpers import wait_until, worker_status
from tests.fault_helpers import Load, assert_nothing_lost, assert_redis_clean, assert_settled
from tests.faults.conftest import MAX_TOKENS, PROMPTS, expected_tokens, start_fault_cluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ledger):
    cluster = start_fault_cluster("redis", tmp_path_factory.mktemp("redis-faults"), prefill=1, decode=1, ledger=ledger)
    yield cluster
    cluster.stop()


def worker(cluster, role: str):
    return next(p for p in cluster.workers if p.name.startswith(role) and p.alive())


def test_redis_sigkilled_and_restarted_under_traffic(cluster, ledger):
    assert cluster.redis is not None  # its own redis-server
    with Client(cluster.router.address) as client:
        expected = expected_tokens(cluster.router.address)
        prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
        load = Load(cluster.router.address, PROMPTS, [0, 1, 2], MAX_TOKENS, timeout=90).start()
        wait_until(lambda: worker_status(prefill.address, "prefill").status.load.num_running_requests > 0, 30,
                   interval=0.05, message="the prefill worker prefilling")
        port = int(cluster.redis.address.rsplit(":", 1)[1])
        cluster.redis.kill()
        time.sleep(1.0)
        cluster.start_redis(port)
        ledger.note(cluster)
        assert_nothing_lost(load.join(), expected, at_least_completed=3)

        # Back: KV travels through the new Redis again.
        before = worker_status(decode.address, "decode").counters.num_kv_transfers_received
        after = Load(cluster.router.address, PROMPTS, [3, 0], MAX_TOKENS, timeout=90, label="after").start().join()
        assert_nothing_lost(after, expected, at_least_completed=2)
        received = worker_status(decode.address, "decode").counters.num_kv_transfers_received - before
        assert received == 2, f"{received} of 2 transfers came through the restarted Redis"
        assert_settled(cluster, client, num_workers=2)
    assert_redis_clean(cluster.redis_url)


def test_nothing_of_the_cluster_is_left_after_stop(cluster, ledger):
    ledger.note(cluster)
    cluster.stop()
    ledger.assert_none_left()
