"""Two models' KV in one Redis through LMCache, and LMCache's keys expiring.

Two clusters with ``--kv-transfer lmcache`` share one redis-server on a free loopback port: one serves the
default model (SmolLM2-135M), the other a random-weight Llama the test writes with the *same* KV layout (30
layers, 3 KV heads of 64, float32: 46,080 bytes a token) and the same tokenizer. Nothing but the model
fingerprint in LMCache's keys tells the two models' KV apart, so the same prompt gives the same chunk hashes
under two prefixes: a cluster that read the other's KV would load it without complaint and stream wrong
tokens. Each cluster must stream what transformers gives on its own model, every prompt's KV loaded from
LMCache and stored by its own prefill worker, and Redis must hold two key sets that differ only in the
fingerprint. A third cluster (its own Redis) stores keys with ``--lmcache-ttl 2``: they carry a TTL of at most
2 s and are gone after it; no key of ours is ever left without a TTL.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.launcher import LocalCluster
from tests.cluster_helpers import all_blocks_free, start_cluster, stream_tokens, wait_until, worker_status
from tests.fault_helpers import assert_redis_clean
from tests.reference import PROMPTS, hf_greedy

pytestmark = pytest.mark.timeout(300)

KEY_PREFIX = "splitserve:lmcache:"
CHUNK_SIZE = 256  # --lmcache-chunk-size's default
MAX_TOKENS = 16
DEFAULT_TTL_MILLISECONDS = 600_000  # --lmcache-ttl's default
SHORT_TTL_SECONDS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The random model's requests start at least this long after the default model's end, so that a read of the
# default model's keys on their behalf would show in those keys' idle time (1 s resolution).
UNTOUCHED_GAP_SECONDS = 3.0


def write_random_llama(directory: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Llama with SmolLM2-135M's KV layout and tokenizer, small everywhere else (about 9 M
    parameters): 30 layers of 3 query and 3 KV heads of 64 over a hidden size of 192, tied embeddings.

    Weights are drawn from N(0, 0.3) with a fixed seed: the default initialisation (0.02) gives near-flat
    logits that repeat one token; at 0.3 greedy choices are decisive (logits' spread about 1) and varied.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=192, intermediate_size=256, num_hidden_layers=30, num_attention_heads=3,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)  # safetensors, float32
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    assert list(directory.glob("*.safetensors")), sorted(path.name for path in directory.iterdir())
    return directory


@dataclass
class ModelCluster:
    """A started LMCache cluster serving one model, with what the test needs of it."""

    cluster: LocalCluster
    model_dir: Path
    fingerprint: str  # as the router reports it
    reference: list[list[int]]  # transformers' greedy tokens of each of the module's prompts, on this model

    @property
    def prefix(self) -> str:
        return f"{KEY_PREFIX}{self.fingerprint}@"

    def worker(self, role: str):
        return next(p for p in self.cluster.workers if p.name.startswith(role))


def start_lmcache_cluster(log_dir: Path, model: Path, redis_url: str | None, worker_args=()) -> LocalCluster:
    """A router, one prefill and one decode worker serving ``model`` with ``--kv-transfer lmcache`` on
    ``redis_url`` (None: a redis-server of its own)."""
    return start_cluster("lmcache", log_dir, router_args=["--model", str(model)],
                         worker_args=["--model", str(model), *worker_args], redis_url=redis_url)


def assert_untouched_since(redis_url: str, keys: list[str], since: float) -> None:
    """No client has read or written ``keys`` since ``since`` (``time.monotonic()``): Redis's idle time of each
    (``OBJECT IDLETIME``, whole seconds, untouched by SCAN, PTTL or EXISTS) covers that time, less 1 s of clock
    resolution. Reads more than 2 s after ``since`` would show."""
    server = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        idle = {key: server.object("idletime", key) for key in keys}
    finally:
        server.close()
    untouched_for = time.monotonic() - since
    assert idle and all(seconds is not None and seconds >= untouched_for - 1 for seconds in idle.values()), (
        f"keys read or written within the last {untouched_for:.1f} s: {idle}")


def our_keys(redis_url: str) -> list[str]:
    server = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return sorted(server.scan_iter(match=f"{KEY_PREFIX}*", count=1000))
    finally:
        server.close()


def keys_under(keys: list[str], prefix: str) -> set[str]:
    """The keys of one model, each without its model prefix (what stays: chunk hash, dtype, key kind)."""
    return {key[len(prefix):] for key in keys if key.startswith(prefix)}


def expected_num_keys(prompts: list[list[int]]) -> int:
    """Two keys (``kv_bytes`` and ``metadata``) per chunk of every prompt, its partial last chunk included
    (the module's prompts share no chunk)."""
    return 2 * sum(-(-len(ids) // CHUNK_SIZE) for ids in prompts)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """One prompt within a chunk, one of more than a chunk ending inside its second (a partial chunk)."""
    prompts = [tokenizer.encode(PROMPTS[1]), tokenizer.encode(PROMPTS[6])]
    assert len(prompts[0]) < CHUNK_SIZE < len(prompts[1]) and len(prompts[1]) % CHUNK_SIZE, [len(p) for p in prompts]
    return prompts


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory, model_dir) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random-llama"), Path(model_dir))


@pytest.fixture(scope="module")
def shared_redis_url(tmp_path_factory):
    """One redis-server (free loopback port) for both clusters, stopped after the module."""
    launcher = LocalCluster(log_dir=tmp_path_factory.mktemp("shared-redis"))
    url = launcher.start_redis()
    yield url
    launcher.redis.stop(5)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, model_dir, random_model_dir, shared_redis_url, prompts):
    """The default model's cluster and the random model's, both on the shared Redis; stopped after the module.

    transformers' references are computed on a thread meanwhile (the clusters start from this thread, which
    outlives them: see ``splitserve.launcher``), while the workers' start leaves a core idle.
    """
    paths = (Path(model_dir), random_model_dir)
    started: list[LocalCluster] = []
    with ThreadPoolExecutor(1) as pool:
        references = pool.submit(lambda: {path: [hf_greedy(str(path), ids, MAX_TOKENS) for ids in prompts]
                                          for path in paths})
        try:
            fingerprints = []
            for name, path in zip(("default", "random"), paths):
                cluster = start_lmcache_cluster(tmp_path_factory.mktemp(f"lmcache-{name}"), path, shared_redis_url)
                started.append(cluster)
                with Client(cluster.router.address) as client:
                    fingerprints.append(client.model_info().model_fingerprint)
            yield [ModelCluster(cluster, path, fingerprint, references.result()[path])
                   for cluster, path, fingerprint in zip(started, paths, fingerprints)]
        finally:
            for cluster in started:
                cluster.stop()


def run_prompts(model: ModelCluster, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt through the cluster at once; returns the greedy tokens, once all blocks are free again."""
    with Client(model.cluster.router.address) as client:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids: stream_tokens(client, ids, MAX_TOKENS)[0], prompts))
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")
    return results


def assert_loaded_from_lmcache(model: ModelCluster, num_requests: int) -> None:
    """The cluster's decode worker loaded ``num_requests`` prompts from LMCache (none recomputed or prefilled
    locally), all stored by its own prefill worker."""
    decode = worker_status(model.worker("decode").address, "decode").counters
    assert (decode.num_kv_transfers_received, decode.num_kv_recomputes, decode.num_local_prefills) == (
        num_requests, 0, 0), decode
    prefill = worker_status(model.worker("prefill").address, "prefill").counters
    assert prefill.num_kv_transfers_sent == num_requests, prefill


def test_two_models_on_one_redis_never_read_each_others_kv(two_models, prompts, shared_redis_url):
    default, random = two_models
    assert default.fingerprint and random.fingerprint and default.fingerprint != random.fingerprint
    assert default.reference != random.reference, "the two models must answer differently for the test to tell"
    assert our_keys(shared_redis_url) == []

    # The default model first: its KV, and only its, in Redis.
    assert run_prompts(default, prompts) == default.reference
    assert_loaded_from_lmcache(default, len(prompts))
    default_done = time.monotonic()
    keys = our_keys(shared_redis_url)
    default_keys = keys_under(keys, default.prefix)
    assert len(default_keys) == len(keys) == expected_num_keys(prompts), keys

    # The same prompts on the random model, with the default model's KV for them in Redis under the same chunk
    # hashes and the same layout: its decode worker must wait for its own prefill worker's KV, not load those.
    time.sleep(max(0.0, UNTOUCHED_GAP_SECONDS - (time.monotonic() - default_done)))
    assert run_prompts(random, prompts) == random.reference
    assert_loaded_from_lmcache(random, len(prompts))
    assert_untouched_since(shared_redis_url, [default.prefix + key for key in default_keys], default_done)
    keys = our_keys(shared_redis_url)
    assert keys_under(keys, default.prefix) == default_keys
    assert keys_under(keys, random.prefix) == default_keys  # the same chunks, only the fingerprint differs
    assert len(keys) == 2 * len(default_keys), keys

    # Both at once: each still streams its own model's tokens from its own KV; nothing new in Redis.
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda model: run_prompts(model, prompts), two_models))
    assert both == [default.reference, random.reference]
    assert_loaded_from_lmcache(default, 2 * len(prompts))
    assert_loaded_from_lmcache(random, 2 * len(prompts))
    assert sorted(our_keys(shared_redis_url)) == keys

    # Every key carries the default TTL.
    server = redis.Redis.from_url(shared_redis_url)
    try:
        ttls = {key: server.pttl(key) for key in keys}
    finally:
        server.close()
    assert all(0 < ttl <= DEFAULT_TTL_MILLISECONDS for ttl in ttls.values()), ttls
    assert_redis_clean(shared_redis_url)


def test_keys_written_with_a_short_ttl_expire(tmp_path, random_model_dir, prompts):
    """``--lmcache-ttl 2`` (seconds): the keys a prompt's store writes carry at most 2 s, the decode worker still
    loads the prompt from them, and then they are gone."""
    cluster = start_lmcache_cluster(tmp_path, random_model_dir, None,
                                    worker_args=["--lmcache-ttl", str(SHORT_TTL_SECONDS)])
    server = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        reference = hf_greedy(str(random_model_dir), prompts[1], MAX_TOKENS)
        tokens, ttls = [], None
        with Client(cluster.router.address) as client:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            for chunk in client.generate_stream(prompts[1], params, timeout=120):
                if ttls is None:  # the store has landed (the prefill answered): read the keys before they expire
                    ttls = {key: server.pttl(key) for key in our_keys(cluster.redis_url)}
                    first_token = time.monotonic()
                tokens.extend(chunk.token_ids)
        assert tokens == reference
        decode = next(p for p in cluster.workers if p.name.startswith("decode"))
        counters = worker_status(decode.address, "decode").counters
        assert (counters.num_kv_transfers_received, counters.num_kv_recomputes) == (1, 0), counters

        assert len(ttls) == expected_num_keys([prompts[1]]), ttls
        assert all(0 < ttl <= SHORT_TTL_SECONDS * 1000 for ttl in ttls.values()), ttls
        # Gone once the TTL has passed (EXISTS expires a key on access; SCAN must not list any either).
        wait_until(lambda: server.exists(*ttls) == 0 and not our_keys(cluster.redis_url),
                   SHORT_TTL_SECONDS + 3, interval=0.1, message="the keys expiring")
        print(f"\n{len(ttls)} keys with PTTL {min(ttls.values())}-{max(ttls.values())} ms at the first token, "
              f"gone {time.monotonic() - first_token:.1f} s later")
        assert server.dbsize() == 0, server.keys("*")
    finally:
        server.close()
        cluster.stop()
