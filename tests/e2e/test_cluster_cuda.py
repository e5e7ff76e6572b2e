"""A cluster on one GPU: router, a prefill and a decode worker as separate processes sharing the GPU, KV over p2p
(copied within the GPU over CUDA IPC, where NCCL would refuse two ranks on one device) and over Redis (through
pinned host memory on each side). Greedy outputs in float32
are compared with transformers, as on CPU (tests/e2e/test_cluster.py). Needs CUDA; CI has none: the skip says so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.cluster_helpers import all_blocks_free, start_cluster, stream_tokens, wait_until, worker_status
from tests.reference import MAX_TOKENS

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is "
                                                             "False): the cluster on a GPU needs one"),
]


@pytest.fixture(scope="module", params=["p2p", "redis"])
def cluster(request, tmp_path_factory):
    cluster = start_cluster(request.param, tmp_path_factory.mktemp(f"cuda-cluster-{request.param}"),
                            worker_args=["--device", "cuda", "--dtype", "float32"])
    cluster.kv_transfer = request.param
    yield cluster
    cluster.stop()


def test_on_one_gpu_the_disaggregated_greedy_is_token_identical_to_transformers(cluster, client, prompt_token_ids,
                                                                                hf_reference):
    decode = next(process for process in cluster.workers if process.name.startswith("decode"))
    with ThreadPoolExecutor(len(prompt_token_ids)) as pool:
        results = list(pool.map(lambda ids: stream_tokens(client, ids, MAX_TOKENS), prompt_token_ids))
    assert [token_ids for token_ids, _text, _last in results] == hf_reference
    counters = worker_status(decode.address, "decode").counters
    assert counters.num_kv_transfers_received == len(prompt_token_ids)  # every prompt's KV came over the pair
    assert counters.num_kv_recomputes == 0 and counters.num_local_prefills == 0
    if cluster.kv_transfer == "p2p":
        assert "ready (gloo+cuda-ipc)" in decode.log()
    wait_until(lambda: all_blocks_free(client), 15, message="all KV blocks free")
