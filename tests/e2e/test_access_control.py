"""Access control on a real cluster: API keys on the public API, the cluster token between router and workers."""

from __future__ import annotations

import grpc
import pytest

from splitserve.client import Client
from splitserve.rpc.auth import API_KEY_REFUSAL, CLUSTER_TOKEN_REFUSAL
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster_helpers import assert_secrets_kept, stream_tokens


def _unauthenticated(call, message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == message


def test_keys_and_cluster_token_guard_a_cluster(shared_cluster, monkeypatch):
    """On the e2e tier's shared cluster (tests/e2e/conftest.py), which checks after the tier that neither secret
    reached a log and that every process stopped cleanly."""
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    cluster = shared_cluster
    address = cluster.router.address
    prefill, decode = cluster.workers
    assert cluster.api_key and cluster.cluster_token

    # The public API: no key or a wrong one is refused; the generated key streams a greedy answer.
    for api_key in ("", "not-the-key"):
        with Client(address, api_key=api_key) as stranger:
            _unauthenticated(lambda: list(stranger.generate_stream("Hi", timeout=30)), API_KEY_REFUSAL)
            _unauthenticated(lambda: stranger.embed("Hi", timeout=30), API_KEY_REFUSAL)
            _unauthenticated(stranger.cluster_status, API_KEY_REFUSAL)
    with Client(address, api_key=cluster.api_key) as client:
        token_ids, text, last = stream_tokens(client, "The capital of France is", max_tokens=8)
        assert len(token_ids) == 8 and text and last.usage.completion_tokens == 8
        assert len(client.embed("The capital of France is", timeout=30)) == 576  # SmolLM2-135M's hidden size

        # The registry: Register and Drain without the token are refused and change nothing.
        with grpc.insecure_channel(address) as channel:
            registry = worker_pb2_grpc.WorkerRegistryStub(channel)
            _unauthenticated(lambda: registry.Register(worker_pb2.RegisterRequest(
                worker_id="intruder", role=inference_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1"), timeout=10),
                CLUSTER_TOKEN_REFUSAL)
            _unauthenticated(lambda: registry.Drain(worker_pb2.DrainRequest(worker_id=decode.worker_id), timeout=10,
                                                    metadata=[("authorization", f"Bearer {cluster.api_key}")]),
                             CLUSTER_TOKEN_REFUSAL)
        status = client.cluster_status()
        workers = {worker.worker_id: worker for pool in status.pools for worker in pool.workers}
        assert set(workers) == {prefill.worker_id, decode.worker_id}
        assert all(worker.state == inference_pb2.WORKER_STATE_SERVING for worker in workers.values())
        assert cluster.api_key not in str(status) and cluster.cluster_token not in str(status)

    # A worker: a Decode straight to it without the token is refused.
    with grpc.insecure_channel(decode.address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        _unauthenticated(lambda: list(stub.Decode(worker_pb2.DecodeRequest(request_id="r1"), timeout=10)),
                         CLUSTER_TOKEN_REFUSAL)

    # Neither secret is in any log so far or on any command line; no process says it is open (the logs are
    # checked again once the cluster stopped: tests/e2e/conftest.py).
    assert_secrets_kept(cluster)
