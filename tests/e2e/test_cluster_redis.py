"""The cluster with KV over Redis: a real redis-server on a free loopback port, started for these tests."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from splitserve.client import Client
from tests.cluster_helpers import (
    all_blocks_free,
    check_two_completions_take_one_transfer,
    start_cluster,
    stream_tokens,
    wait_until,
    worker_status,
)
from tests.reference import MAX_TOKENS

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster("redis", tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


def test_redis_kv_transfer_is_token_identical_to_transformers(cluster, prompt_token_ids, hf_reference):
    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    assert cluster.redis is not None and cluster.redis_url.startswith("redis://127.0.0.1:")
    with Client(cluster.router.address) as client:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda ids: stream_tokens(client, ids, MAX_TOKENS)[0], prompt_token_ids))
        assert results == hf_reference
        counters = worker_status(decode.address, "decode").counters
        assert counters.num_kv_transfers_received == len(prompt_token_ids)
        assert counters.num_kv_recomputes == 0 and counters.num_local_prefills == 0
        # One line per transfer, with the request's ids as fields.
        assert len(re.findall(r"request=\S+ transfer=\S+ KV of \d+ tokens received \(", decode.log())) == len(prompt_token_ids)
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")
    # Consumed payloads were deleted, and the inbox list is empty: nothing accumulates.
    server = redis.Redis.from_url(cluster.redis_url)
    assert server.dbsize() == 0
    server.close()


def test_n_completions_over_redis_take_one_transfer(cluster, prompt_token_ids, hf_reference):
    """Two greedy completions of the 343-token prompt: one KV transfer through Redis, forked on the decode worker
    for the second, both transformers' continuation; nothing left in Redis or in the KV pools."""
    check_two_completions_take_one_transfer(cluster, prompt_token_ids[6], MAX_TOKENS, hf_reference[6])
    server = redis.Redis.from_url(cluster.redis_url)
    assert server.dbsize() == 0
    server.close()
