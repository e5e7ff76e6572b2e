"""Prefix reuse across prefill workers through LMCache: a cluster with ``--kv-transfer lmcache``, two prefill
workers taking turns (``--prefill-policy round_robin``), one decode worker, and a private redis-server.

The first prompt's KV is stored in LMCache by the prefill worker that computed it; a second prompt sharing its
first 1,000 tokens lands on the other prefill worker, which finds the three whole 256-token chunks of the shared
prefix in LMCache, loads them (768 tokens) instead of computing them, and computes only the rest. Both outputs
are token-identical to transformers, and the final ``usage`` and ``timing`` say what was loaded.
"""

from __future__ import annotations

import re

import pytest
import redis

from splitserve.client import Client
from tests.cluster_helpers import all_blocks_free, start_cluster, stream_tokens, wait_until, worker_status
from tests.reference import _long_story, hf_greedy

pytestmark = pytest.mark.timeout(300)

CHUNK_SIZE = 256
SHARED = 1000
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster("lmcache", tmp_path_factory.mktemp("lmcache-reuse"), prefill=2,
                            router_args=["--prefill-policy", "round_robin"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    story = tokenizer.encode(_long_story(40))
    assert len(story) > SHARED
    shared = story[:SHARED]
    first = shared + tokenizer.encode("\nWhich animal did the naturalist watch for the longest time?")
    second = shared + tokenizer.encode("\nName the three places visited most often, in order:")
    return first, second


def sent_by_worker(cluster) -> dict[str, int]:
    return {worker.name: worker_status(worker.address, "prefill").counters.num_kv_transfers_sent
            for worker in cluster.workers if worker.name.startswith("prefill")}


def test_a_prompt_sharing_a_stored_prefix_loads_it_on_another_prefill_worker(cluster, prompts, model_dir):
    first, second = prompts
    with Client(cluster.router.address) as client:
        tokens, _, last = stream_tokens(client, first, MAX_TOKENS)
        assert tokens == hf_greedy(str(model_dir), first, MAX_TOKENS)
        assert last.usage.prompt_tokens == len(first)
        assert last.usage.loaded_tokens == 0 and last.usage.cached_tokens == 0  # nothing stored before it
        after_first = sent_by_worker(cluster)
        computed_first = next(name for name, count in after_first.items() if count == 1)

        tokens, _, last = stream_tokens(client, second, MAX_TOKENS)
        assert tokens == hf_greedy(str(model_dir), second, MAX_TOKENS)
        after_second = sent_by_worker(cluster)
        assert after_second[computed_first] == 1, "round robin sent the second prompt to the same worker"
        loaded = SHARED // CHUNK_SIZE * CHUNK_SIZE
        # The shared prefix's whole chunks came from LMCache; the rest of the prompt was computed.
        assert last.usage.loaded_tokens == loaded, last.usage
        assert last.usage.cached_tokens == loaded
        assert last.usage.prompt_tokens - last.usage.cached_tokens == len(second) - loaded
        assert last.timing.prefix_load_seconds > 0
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")
    other = next(worker for worker in cluster.workers if worker.name.startswith("prefill")
                 and worker.name != computed_first)
    found = re.findall(r"KV of (\d+) tokens loaded from LMCache", other.log())
    assert found == [str(loaded)], other.log()[-3000:]
    # The decode worker loaded both whole prompts from LMCache: the second one's partial and new chunks were
    # stored by the worker that loaded its prefix.
    decode = next(worker for worker in cluster.workers if worker.name.startswith("decode"))
    counters = worker_status(decode.address, "decode").counters
    assert counters.num_kv_transfers_received == 2 and counters.num_kv_recomputes == 0


def test_a_prompt_whose_stored_prefix_is_gone_from_redis_is_computed_whole(cluster, tokenizer, model_dir):
    # A prefix neither worker has seen (its first tokens differ from the story's), stored with the first prompt.
    prefix = tokenizer.encode("Notes kept at the harbor office. " + _long_story(40))[:SHARED]
    first = prefix + tokenizer.encode("\nThe otter and the heron are", add_special_tokens=False)
    second = prefix + tokenizer.encode("\nLater that summer,", add_special_tokens=False)
    with Client(cluster.router.address) as client:
        before = sent_by_worker(cluster)
        assert stream_tokens(client, first, MAX_TOKENS)[0] == hf_greedy(str(model_dir), first, MAX_TOKENS)
        server = redis.Redis.from_url(cluster.redis_url)
        try:
            assert server.flushall()  # LMCache loses every chunk, the prefix's too
        finally:
            server.close()
        tokens, _, last = stream_tokens(client, second, MAX_TOKENS)
        assert tokens == hf_greedy(str(model_dir), second, MAX_TOKENS)
        after = sent_by_worker(cluster)
        assert sorted(after[name] - before[name] for name in after) == [1, 1], "both workers took one prompt"
        # The other worker found nothing in LMCache and nothing in its own prefix cache: it computed it all.
        assert last.usage.loaded_tokens == 0 and last.usage.cached_tokens == 0, last.usage
        assert last.timing.prefix_load_seconds == 0
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")


def test_a_salted_prompts_kv_in_lmcache_is_found_only_under_its_salt(cluster, tokenizer, model_dir):
    """vLLM's cache_salt through LMCache: chunks stored under one salt are loaded by the other prefill worker for
    that salt only, never for another salt or for an unsalted request; every output stays transformers'."""
    from splitserve.common.sampling_params import SamplingParams

    shared = 2 * CHUNK_SIZE + 40  # two whole chunks, and a part of a third
    prefix = tokenizer.encode("Letters from the lighthouse keeper. " + _long_story(40))[:shared]
    first = prefix + tokenizer.encode("\nThe keeper counted", add_special_tokens=False)
    last_prompt = prefix + tokenizer.encode("\nIn the spring,", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with Client(cluster.router.address) as client:
        before = sent_by_worker(cluster)

        def run(prompt, salt):
            return client.generate(prompt, greedy, timeout=300, cache_salt=salt)

        # Round robin: the workers take turns; the first one stores the prefix under tenant-a.
        reference = hf_greedy(str(model_dir), first, MAX_TOKENS)
        assert list(run(first, "tenant-a").token_ids) == reference
        for salt in ("tenant-b", None):  # the other worker, then the first: nothing found under either
            answer = run(first, salt)
            assert list(answer.token_ids) == reference
            assert answer.usage.loaded_tokens == 0 and answer.usage.cached_tokens == 0, (salt, answer.usage)
        answer = run(last_prompt, "tenant-a")  # the other worker, tenant-a's chunks
        assert list(answer.token_ids) == hf_greedy(str(model_dir), last_prompt, MAX_TOKENS)
        assert answer.usage.loaded_tokens == 2 * CHUNK_SIZE, answer.usage
        after = sent_by_worker(cluster)
        assert sorted(after[name] - before[name] for name in after) == [2, 2], "the workers took turns"
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")
