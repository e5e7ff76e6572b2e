"""A real cluster on mutual TLS: router, a prefill and a decode worker as processes, each with its own
certificate-holding flags, with the cluster token and API keys on top.

Its greedy answer is token-identical to transformers; plaintext clients, clients without a certificate
and workers without one are refused; no key material reaches a log.
"""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from splitserve.client import Client
from splitserve.rpc.auth import CLUSTER_TOKEN_ENV, with_cluster_token
from splitserve.rpc.membership import Membership
from splitserve.rpc.tls import TLSConfig, open_channel
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster_helpers import WORKER_ARGS, start_cluster, stream_tokens
from tests.reference import MAX_TOKENS, hf_greedy
from tests.tls_helpers import issue, make_ca

pytestmark = pytest.mark.timeout(900)

PROMPT = "The capital of France is"


def _unavailable(call) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def _decode_counters(address: str, tls: TLSConfig, cluster_token: str):
    with open_channel(address, tls) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(with_cluster_token(channel, cluster_token))
        return stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=30).counters


def test_a_cluster_on_mutual_tls(tmp_path, model_dir, tokenizer, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki)
    node = issue(ca, pki, "splitserve-node")  # one certificate for every process, server and client alike
    tls = TLSConfig(str(node.cert_file), str(node.key_file), str(ca.cert_file))
    cluster = start_cluster("p2p", tmp_path / "logs", tls=tls, credentials=True)
    try:
        address = cluster.router.address
        prefill, decode = cluster.workers

        # Both workers registered over mutual TLS, and the router reaches them over it.
        with Client(address, api_key=cluster.api_key, tls=tls) as client:
            status = client.cluster_status()
            workers = {worker.worker_id for pool in status.pools for worker in pool.workers}
            assert workers == {prefill.worker_id, decode.worker_id}
            assert str(node.key_file) not in str(status) and cluster.cluster_token not in str(status)

            # A greedy request through the TLS channels, its KV handed from prefill to decode: as transformers.
            before = _decode_counters(decode.address, tls, cluster.cluster_token)
            prompt_token_ids = tokenizer.encode(PROMPT)
            token_ids, text, last = stream_tokens(client, prompt_token_ids, MAX_TOKENS)
            assert token_ids == hf_greedy(str(model_dir), prompt_token_ids, MAX_TOKENS)
            assert text.startswith(" Paris")
            after = _decode_counters(decode.address, tls, cluster.cluster_token)
            assert after.num_kv_transfers_received == before.num_kv_transfers_received + 1

        # Clients: plaintext, or TLS without a client certificate, never get past the handshake.
        for client_tls in (None, TLSConfig(ca_file=str(ca.cert_file))):
            with Client(address, api_key=cluster.api_key, tls=client_tls, timeout=10) as stranger:
                _unavailable(stranger.model_info)
                _unavailable(lambda: list(stranger.generate_stream(PROMPT)))
        # The workers' ports are mutual TLS too.
        with open_channel(decode.address, None) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(with_cluster_token(channel, cluster.cluster_token))
            _unavailable(lambda: stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=10))

        # A worker without a client certificate cannot register, even with the cluster token.
        uncertified = Membership(
            address, lambda: worker_pb2.RegisterRequest(role=inference_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1"),
            lambda: inference_pb2.WorkerLoad(), cluster_token=cluster.cluster_token,
            tls=TLSConfig(ca_file=str(ca.cert_file)))
        with pytest.raises(RuntimeError, match="no TLS connection within 3 s"):
            uncertified.start(timeout=3)
        uncertified.stop()

        # Nor can a worker process started without TLS flags: it exits, saying why.
        log_path = tmp_path / "plaintext-worker.log"
        with open(log_path, "w") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "decode", "--router", address, "--model", str(model_dir),
                 *WORKER_ARGS, "--register-timeout", "3"], stdout=subprocess.DEVNULL, stderr=log,
                env={**os.environ, CLUSTER_TOKEN_ENV: cluster.cluster_token})
        try:
            assert worker.wait(240) != 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
        assert "Cannot register with the router at" in log_path.read_text()

        with Client(address, api_key=cluster.api_key, tls=tls) as client:
            workers = {worker.worker_id for pool in client.cluster_status().pools for worker in pool.workers}
            assert workers == {prefill.worker_id, decode.worker_id}
    finally:
        cluster.stop()

    # Every process served TLS with client certificates required, and no key material reached a log.
    key_body = "".join(node.key_file.read_text().splitlines()[1:-1])
    for process in [cluster.router, *cluster.workers]:
        log = process.log()
        assert "Serving TLS on" in log and "client certificates signed by the CA required" in log, process.name
        assert key_body[:32] not in log and "PRIVATE KEY" not in log, process.name
        assert "--tls-key" in process.popen.args and key_body[:32] not in " ".join(process.popen.args)
