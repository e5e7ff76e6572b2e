"""TLS (splitserve.rpc.tls): configuration from files, and real TLS handshakes against an in-process server."""

from __future__ import annotations

import grpc
import pytest

from splitserve.client import Client
from splitserve.rpc.auth import API_KEY_REFUSAL, Credentials
from splitserve.rpc.membership import Membership
from splitserve.rpc.server import start_server
from splitserve.rpc.tls import TLSConfig, open_channel, peer_identity
from splitserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.tls_helpers import issue, make_ca

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server and a client certificate, a second CA with its own, and a certificate of another name."""
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory)
    other_ca = make_ca(directory, "other CA")
    return {
        "ca": str(ca.cert_file),
        "server": issue(ca, directory, "router-1"),
        "client": issue(ca, directory, "worker-7"),
        "other_ca": str(other_ca.cert_file),
        "stranger": issue(other_ca, directory, "stranger"),
        "renamed": issue(ca, directory, "renamed", names=("router.splitserve.internal",)),
    }


# ---- configuration -----------------------------------------------------------------


def test_no_flags_mean_plaintext():
    assert TLSConfig.from_flags(None, None, None) is None
    assert TLSConfig.from_flags("", "", "") is None


def test_server_name_without_tls_is_refused():
    with pytest.raises(ValueError, match="--tls-server-name needs TLS"):
        TLSConfig.from_flags(None, None, None, "router.internal")


@pytest.mark.parametrize("cert, key", [(True, False), (False, True)])
def test_cert_and_key_go_together(pki, cert, key):
    leaf = pki["server"]
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TLSConfig.from_flags(str(leaf.cert_file) if cert else None, str(leaf.key_file) if key else None, pki["ca"])


def test_a_config_with_nothing_is_refused():
    with pytest.raises(ValueError, match="TLS needs --tls-ca"):
        TLSConfig()


def test_unreadable_files_are_named(pki, tmp_path):
    leaf = pki["server"]
    with pytest.raises(ValueError, match=r"Cannot read the TLS CA certificate file .*absent\.pem: No such file"):
        TLSConfig(ca_file=str(tmp_path / "absent.pem"))
    with pytest.raises(ValueError, match=r"Cannot read the TLS private key file .*gone\.key"):
        TLSConfig(str(leaf.cert_file), str(tmp_path / "gone.key"))


def test_files_that_are_not_pem_are_named_without_their_content(pki, tmp_path):
    leaf = pki["server"]
    not_a_key = tmp_path / "swapped.key"
    not_a_key.write_text("hunter2-not-a-key\n")
    with pytest.raises(ValueError) as caught:
        TLSConfig(str(leaf.cert_file), str(not_a_key))
    assert str(not_a_key) in str(caught.value) and "holds no PEM private key" in str(caught.value)
    assert "hunter2" not in str(caught.value)
    # A key file given as the certificate: the certificate check names it.
    with pytest.raises(ValueError, match=r"The TLS certificate file .*router-1\.key holds no PEM certificate"):
        TLSConfig(str(leaf.key_file), str(leaf.key_file))


def test_repr_shows_paths_only(pki):
    leaf = pki["server"]
    config = TLSConfig(str(leaf.cert_file), str(leaf.key_file), pki["ca"])
    key_pem = leaf.key_file.read_text()
    body = "".join(key_pem.splitlines()[1:-1])
    assert str(leaf.key_file) in repr(config) and body[:40] not in repr(config) and "PRIVATE" not in repr(config)
    assert config.is_mutual and not TLSConfig(str(leaf.cert_file), str(leaf.key_file)).is_mutual
    # Built once: equal configurations compare by their paths.
    assert config == TLSConfig(str(leaf.cert_file), str(leaf.key_file), pki["ca"])


def test_a_server_needs_a_certificate(pki):
    with pytest.raises(ValueError, match="A TLS server needs --tls-cert and --tls-key"):
        TLSConfig(ca_file=pki["ca"]).server_credentials()


# ---- handshakes against a server from start_server ---------------------------------


class IdentityEcho(inference_pb2_grpc.InferenceServicer):
    """Answers GetModelInfo with the caller's verified identity ("<none>" without one)."""

    def GetModelInfo(self, request, context):
        return inference_pb2.GetModelInfoResponse(model_name=peer_identity(context) or "<none>")


def _serve(tls: TLSConfig | None, credentials: Credentials | None = None):
    return start_server("127.0.0.1:0", [
        (inference_pb2_grpc.add_InferenceServicer_to_server, IdentityEcho(), "splitserve.v1.Inference"),
    ], max_workers=8, credentials=credentials, tls=tls)


def _identity(address: str, tls: TLSConfig | None) -> str:
    with open_channel(address, tls) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10).model_name


def _refused_unavailable(address: str, tls: TLSConfig | None) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _identity(address, tls)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def tls_server(pki):
    """A server presenting router-1's certificate, asking no client certificate."""
    server = _serve(TLSConfig(str(pki["server"].cert_file), str(pki["server"].key_file)))
    yield f"127.0.0.1:{server.port}"
    server.stop(0)


@pytest.fixture(scope="module")
def mutual_server(pki):
    """A server presenting router-1's certificate and requiring a client certificate signed by the CA."""
    server = _serve(TLSConfig(str(pki["server"].cert_file), str(pki["server"].key_file), pki["ca"]))
    yield f"127.0.0.1:{server.port}"
    server.stop(0)


def test_a_client_with_the_ca_is_served_without_a_verified_identity(pki, tls_server):
    assert _identity(tls_server, TLSConfig(ca_file=pki["ca"])) == "<none>"
    with Client(tls_server, timeout=10, tls=TLSConfig(ca_file=pki["ca"])) as client:
        assert client.model_info().model_name == "<none>"


def test_plaintext_and_wrong_ca_clients_are_unavailable(pki, tls_server):
    _refused_unavailable(tls_server, None)
    _refused_unavailable(tls_server, TLSConfig(ca_file=pki["other_ca"]))


def test_a_plaintext_server_is_unavailable_to_a_tls_client(pki):
    server = _serve(None)
    try:
        address = f"127.0.0.1:{server.port}"
        assert _identity(address, None) == "<none>"  # plaintext works, and has no identity
        _refused_unavailable(address, TLSConfig(ca_file=pki["ca"]))
    finally:
        server.stop(0)


def test_hostname_is_verified_unless_a_server_name_is_given(pki):
    renamed = pki["renamed"]  # names router.splitserve.internal only, not 127.0.0.1
    server = _serve(TLSConfig(str(renamed.cert_file), str(renamed.key_file)))
    try:
        address = f"127.0.0.1:{server.port}"
        _refused_unavailable(address, TLSConfig(ca_file=pki["ca"]))
        assert _identity(address, TLSConfig(ca_file=pki["ca"], server_name="router.splitserve.internal")) == "<none>"
    finally:
        server.stop(0)


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(pki, mutual_server):
    _refused_unavailable(mutual_server, None)
    _refused_unavailable(mutual_server, TLSConfig(ca_file=pki["ca"]))  # no client certificate
    stranger = pki["stranger"]  # a certificate of another CA
    _refused_unavailable(mutual_server, TLSConfig(str(stranger.cert_file), str(stranger.key_file), pki["ca"]))


def test_mutual_tls_names_the_client_by_its_certificate(pki, mutual_server):
    client = pki["client"]
    assert _identity(mutual_server, TLSConfig(str(client.cert_file), str(client.key_file), pki["ca"])) == "worker-7"
    server = pki["server"]  # one certificate per process: the router's own, as a client
    assert _identity(mutual_server, TLSConfig(str(server.cert_file), str(server.key_file), pki["ca"])) == "router-1"


def test_tls_composes_with_api_keys(pki):
    client_tls = TLSConfig(str(pki["client"].cert_file), str(pki["client"].key_file), pki["ca"])
    server = _serve(TLSConfig(str(pki["server"].cert_file), str(pki["server"].key_file), pki["ca"]),
                    Credentials(frozenset({"key-one"})))
    try:
        address = f"127.0.0.1:{server.port}"
        with Client(address, timeout=10, api_key="wrong", tls=client_tls) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.model_info()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert caught.value.details() == API_KEY_REFUSAL
        with Client(address, timeout=10, api_key="key-one", tls=client_tls) as client:
            assert client.model_info().model_name == "worker-7"
    finally:
        server.stop(0)


class RecordingRegistry(worker_pb2_grpc.WorkerRegistryServicer):
    """Grants every registration a lease, recording the caller's verified identity."""

    def __init__(self):
        self.identities = []

    def Register(self, request, context):
        self.identities.append(peer_identity(context))
        return worker_pb2.RegisterResponse(worker_id="w", lease_id="lease", heartbeat_interval_seconds=30)


def test_membership_registers_over_mutual_tls_only_with_a_certificate(pki):
    registry = RecordingRegistry()
    server = start_server("127.0.0.1:0", [
        (worker_pb2_grpc.add_WorkerRegistryServicer_to_server, registry, "splitserve.v1.WorkerRegistry"),
    ], max_workers=8, tls=TLSConfig(str(pki["server"].cert_file), str(pki["server"].key_file), pki["ca"]))
    address = f"127.0.0.1:{server.port}"

    def member(tls):
        return Membership(address, lambda: worker_pb2.RegisterRequest(address="127.0.0.1:1"),
                          lambda: inference_pb2.WorkerLoad(), tls=tls)

    try:
        refused = member(TLSConfig(ca_file=pki["ca"]))
        with pytest.raises(RuntimeError, match=r"Cannot register with the router at .*: no TLS connection within 2 s"):
            refused.start(timeout=2)
        refused.stop()
        client = pki["client"]
        accepted = member(TLSConfig(str(client.cert_file), str(client.key_file), pki["ca"])).start(timeout=10)
        accepted.stop()
        assert registry.identities == ["worker-7"]
    finally:
        server.stop(0)


# ---- the command line ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["router", "prefill", "decode", "colocated", "up", "generate"])
def test_every_command_documents_the_tls_flags(command, capsys):
    from splitserve.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--tls-cert PATH", "--tls-key PATH", "--tls-ca PATH", "--tls-server-name NAME"):
        assert flag in text, flag
    assert "mutual TLS" in text


def test_the_command_line_names_a_bad_tls_file(pki, tmp_path, capsys):
    from splitserve.cli import main

    assert main(["generate", "--server", "127.0.0.1:1", "--tls-cert", str(pki["client"].cert_file), "Hi"]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert main(["generate", "--server", "127.0.0.1:1", "--tls-ca", str(tmp_path / "nope.pem"), "Hi"]) == 2
    assert f"Cannot read the TLS CA certificate file {tmp_path / 'nope.pem'}" in capsys.readouterr().err
    assert main(["generate", "--tls-ca", pki["ca"], "Hi"]) == 2  # no --server: the model would run here
    assert "The --tls-* flags are for --server" in capsys.readouterr().err
