"""Access control (splitserve.rpc.auth): secrets files, and the guards against an in-process server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client
from splitserve.rpc.auth import (
    API_KEY_REFUSAL,
    CLUSTER_TOKEN_REFUSAL,
    Credentials,
    load_credentials,
    read_secrets,
    with_cluster_token,
)
from splitserve.rpc.server import start_server
from splitserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

KEY = "key-one"
TOKEN = "cluster-token-xyz"


# ---- secrets from files and the environment ----------------------------------------


def test_key_file_skips_blank_lines_and_comments(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team A\n\n  key-one  \n#key-commented\nkey-two\n\n")
    assert read_secrets(str(path), {}, "SPLITSERVE_API_KEYS", "API key") == {"key-one", "key-two"}


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n\n"])
def test_empty_key_file_is_an_error_not_open(tmp_path, content):
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"holds no API key: write one a line"):
        read_secrets(str(path), {"SPLITSERVE_API_KEYS": "from-env"}, "SPLITSERVE_API_KEYS", "API key")


def test_missing_key_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"Cannot read the API key file .*absent"):
        read_secrets(str(tmp_path / "absent"), {}, "SPLITSERVE_API_KEYS", "API key")


def test_keys_from_the_environment_are_comma_separated():
    assert read_secrets(None, {"SPLITSERVE_API_KEYS": " a, b ,,c"}, "SPLITSERVE_API_KEYS", "API key") == {"a", "b", "c"}
    assert read_secrets(None, {}, "SPLITSERVE_API_KEYS", "API key") == frozenset()


def test_credentials_file_wins_and_repr_hides_secrets(tmp_path):
    path = tmp_path / "token"
    path.write_text("# the cluster's\nfrom-file\n")
    credentials = load_credentials(None, str(path), {"SPLITSERVE_CLUSTER_TOKEN": "from-env",
                                                     "SPLITSERVE_API_KEYS": "k1,k2"})
    assert credentials == Credentials(frozenset({"k1", "k2"}), "from-file")
    assert "from-file" not in repr(credentials) and "k1" not in repr(credentials)
    assert repr(credentials) == "Credentials(api_keys=<2 keys>, cluster_token=<set>)"


def test_two_cluster_tokens_are_refused():
    with pytest.raises(ValueError, match="exactly one cluster token"):
        load_credentials(None, None, {"SPLITSERVE_CLUSTER_TOKEN": "a,b"})


# ---- the guards, against a server from start_server --------------------------------


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def GetModelInfo(self, request, context):
        return inference_pb2.GetModelInfoResponse(model_name="fake")

    def GenerateStream(self, request, context):
        yield inference_pb2.GenerateStreamResponse(text="a")
        yield inference_pb2.GenerateStreamResponse(text="b")


class FakeRegistry(worker_pb2_grpc.WorkerRegistryServicer):
    def __init__(self):
        self.drained = []

    def Drain(self, request, context):
        self.drained.append(request.worker_id)
        return worker_pb2.DrainResponse()


@pytest.fixture(scope="module")
def guarded():
    registry = FakeRegistry()
    server = start_server("127.0.0.1:0", [
        (inference_pb2_grpc.add_InferenceServicer_to_server, FakeInference(), "splitserve.v1.Inference"),
        (worker_pb2_grpc.add_WorkerRegistryServicer_to_server, registry, "splitserve.v1.WorkerRegistry"),
    ], max_workers=8, credentials=Credentials(frozenset({KEY, "key-two"}), TOKEN))
    yield f"127.0.0.1:{server.port}", registry
    server.stop(0)


def _refused(call, message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == message


@pytest.mark.parametrize("api_key", [None, "wrong-key", KEY + "x", ""])
def test_calls_without_a_valid_key_are_unauthenticated(guarded, api_key, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    address, _ = guarded
    with Client(address, timeout=10, api_key=api_key) as client:
        _refused(client.model_info, API_KEY_REFUSAL)
        _refused(lambda: list(client.generate_stream("Hi")), API_KEY_REFUSAL)


def test_the_refusal_never_echoes_what_was_sent(guarded):
    address, _ = guarded
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), metadata=[("authorization", "Bearer sekrit-99")],
                              timeout=10)
    assert "sekrit-99" not in caught.value.details()


def test_calls_with_a_valid_key_pass(guarded, monkeypatch):
    address, _ = guarded
    with Client(address, timeout=10, api_key="key-two") as client:
        assert client.model_info().model_name == "fake"
        assert [chunk.text for chunk in client.generate_stream("Hi")] == ["a", "b"]
    monkeypatch.setenv("SPLITSERVE_API_KEY", KEY)  # the client's fallback
    with Client(address, timeout=10) as client:
        assert client.model_info().model_name == "fake"
    assert KEY not in repr(client)


def test_the_key_must_come_as_a_bearer_token(guarded):
    address, _ = guarded
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        _refused(lambda: stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), metadata=[("authorization", KEY)],
                                           timeout=10), API_KEY_REFUSAL)


def test_health_stays_open(guarded):
    address, _ = guarded
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_registry_calls_need_the_cluster_token_not_an_api_key(guarded):
    address, registry = guarded
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerRegistryStub(channel)
        _refused(lambda: stub.Drain(worker_pb2.DrainRequest(worker_id="w1"), timeout=10), CLUSTER_TOKEN_REFUSAL)
        _refused(lambda: stub.Drain(worker_pb2.DrainRequest(worker_id="w2"), timeout=10,
                                    metadata=[("authorization", f"Bearer {KEY}")]), CLUSTER_TOKEN_REFUSAL)
        _refused(lambda: worker_pb2_grpc.WorkerRegistryStub(with_cluster_token(channel, "wrong")).Drain(
            worker_pb2.DrainRequest(worker_id="w3"), timeout=10), CLUSTER_TOKEN_REFUSAL)
        assert registry.drained == []
        worker_pb2_grpc.WorkerRegistryStub(with_cluster_token(channel, TOKEN)).Drain(
            worker_pb2.DrainRequest(worker_id="w4"), timeout=10)
    assert registry.drained == ["w4"]


def test_no_credentials_configured_is_open_with_a_warning(caplog):
    server = start_server("127.0.0.1:0", [
        (inference_pb2_grpc.add_InferenceServicer_to_server, FakeInference(), "splitserve.v1.Inference"),
    ], max_workers=4, credentials=Credentials())
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=10, api_key="anything") as client:
            assert client.model_info().model_name == "fake"
    finally:
        server.stop(0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["splitserve.v1.Inference is open to anyone who reaches this port: no API key is configured "
                        "(--api-key-file or SPLITSERVE_API_KEYS)."]
