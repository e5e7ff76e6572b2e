"""KV transfer security: the p2p rendezvous binds its host and pairs only peers proving the cluster token;
Redis with a password, an ACL user and TLS, the password never advertised."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil
import pytest
import redis
import torch

from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import gather_blocks, scatter_blocks
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.rendezvous_client import connect_rendezvous
from splitserve.kvtransfer.rendezvous_protocol import MAGIC, HandshakeRefused, receive_frame, send_frame
from splitserve.launcher import free_port
from tests.integration.test_kvtransfer import Inbox
from tests.kv_helpers import FINGERPRINT, LAYOUT, SHAPE, header_for, seeded_cache

pytestmark = pytest.mark.timeout(120)

TOKEN = "the-cluster-token-of-these-tests"

# A prefill worker in its own process: one send of blocks [3, 7, 1] of seeded_cache(seed), then it prints the
# addresses its sockets listen on. The token comes through the environment, as the workers' does.
SENDER = r"""
import json, os, sys, psutil, torch
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import gather_blocks
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.header import TransferHeader, payload_checksum
from splitserve.kvtransfer.layout import KVLayout
address, seed, transfer_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layout = KVLayout(4, 2, 8, torch.float32, 4)
cache = torch.randn((16, 4, 2, 2, 4, 8), generator=torch.Generator().manual_seed(seed))
connector = create_connector("p2p", "prefill-" + transfer_id, "model-a", layout, connect_timeout_seconds=10,
                             cluster_token=os.environ.get("KV_TEST_TOKEN") or None)
payload = gather_blocks(cache, [3, 7, 1])
header = TransferHeader(transfer_id, "model-a", layout, 0, 11, 11, payload.numel() * 4, payload_checksum(payload),
                        True, 99)
try:
    connector.send(KVEndpointInfo("p2p", address, "receiver"), header, payload)
except KVTransferError as error:
    print("REFUSED", error, flush=True)
    sys.exit(0)
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN})
print("SENT", json.dumps(listening), flush=True)
connector.close()
"""


def run_sender(address: str, seed: int, transfer_id: str, token: str | None) -> tuple[str, str]:
    env = {**os.environ, "KV_TEST_TOKEN": token or ""}
    done = subprocess.run([sys.executable, "-c", SENDER, address, str(seed), transfer_id], capture_output=True,
                          text=True, env=env, timeout=90)
    return done.stdout, done.stderr


def assert_received(inbox: Inbox, transfer_id: str, seed: int) -> None:
    received = [p for p in inbox.payloads if p.header.transfer_id == transfer_id]
    assert len(received) == 1 and received[0].header.is_last
    target = torch.zeros(SHAPE)
    scatter_blocks(target, [10, 2, 5], received[0].payload)
    assert torch.equal(target[[10, 2, 5]], seeded_cache(seed)[[3, 7, 1]])


def listening_addresses(port: int | None = None) -> set[str]:
    """The addresses this process listens on (on ``port`` only, if given)."""
    return {c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and (port is None or c.laddr.port == port)}


def other_local_address() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


@pytest.fixture
def receiver():
    connector = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, host="127.0.0.1", cluster_token=TOKEN,
                                 connect_timeout_seconds=3, max_pairs=4)
    inbox = Inbox()
    connector.start_receiving(inbox.on_payload, inbox.on_error)
    yield connector, inbox
    connector.close()


# ---- p2p --------------------------------------------------------------------------------------------


def test_the_rendezvous_and_gloo_listen_only_on_the_configured_host(receiver):
    connector, inbox = receiver
    address = connector.endpoint().address
    port = int(address.rpartition(":")[2])
    assert listening_addresses(port) == {"127.0.0.1"}
    out, err = run_sender(address, 31, "bound", TOKEN)
    assert out.startswith("SENT"), err
    inbox.wait(num_payloads=1)
    assert_received(inbox, "bound", 31)
    # Both ends: the rendezvous and every Gloo socket of the pair listen on loopback only.
    assert json.loads(out.split(maxsplit=1)[1]) == ["127.0.0.1"]
    assert listening_addresses() == {"127.0.0.1"}
    assert len([c for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]) >= 2
    other = other_local_address()
    if other is not None:  # the same port on another address of this machine: nobody there
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=2).close()


def _garbage_peer(address: tuple[str, int], kind: int, results: list) -> None:
    """One unauthenticated peer; records what the rendezvous did with it."""
    started = time.monotonic()
    try:
        with socket.create_connection(address, timeout=10) as sock:
            if kind == 0:  # a well-formed proof made with the wrong token
                receive_frame(sock)
                send_frame(sock, MAGIC + os.urandom(32) + os.urandom(32) + b"intruder")
                results.append(("proof", receive_frame(sock, 4096)))
                return
            if kind == 1:
                sock.sendall(os.urandom(4096))  # noise
            elif kind == 2:
                sock.sendall(b"\xff\xff\xff\xff" + b"x" * 1024)  # a frame of 4 GiB announced
            elif kind == 3:
                hello = receive_frame(sock)
                sock.sendall(b"\x00\x00\x01\x00" + hello)  # a replay of the server's own hello
            try:
                while sock.recv(65536):  # the hello, then nothing more: the server closes
                    pass
            except OSError:
                pass
            results.append(("dropped", time.monotonic() - started))
    except ConnectionRefusedError as error:
        results.append(("error", error))
    except ConnectionError:  # cut mid-way, evicted by newer handshakes
        results.append(("dropped", time.monotonic() - started))
    except OSError as error:
        results.append(("error", error))


def test_a_flood_without_the_token_is_refused_bounded_and_does_not_stop_a_real_sender(receiver):
    connector, inbox = receiver
    address = connector.endpoint().address
    host, port = address.rsplit(":", 1)
    rendezvous = connector._rendezvous
    num_threads_before = threading.active_count()
    num_os_threads_before = psutil.Process().num_threads()

    # 20 connections that say nothing, held open for the whole test ...
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
    # ... and 50 that send garbage, oversized frames, replays or a proof made without the token.
    results: list = []
    peers = [threading.Thread(target=_garbage_peer, args=((host, int(port)), index % 4, results))
             for index in range(50)]
    for peer in peers:
        peer.start()
    peak_threads = 0
    while any(peer.is_alive() for peer in peers):
        peak_threads = max(peak_threads, threading.active_count() - len(peers) - num_threads_before)
        time.sleep(0.01)
    # The rendezvous runs at most max_pending_handshakes threads for them (+1 evicted one on its way out).
    assert peak_threads <= rendezvous.max_pending_handshakes + 2, peak_threads
    assert len(results) == 50
    proofs = [reply for kind, reply in results if kind == "proof"]
    assert len(proofs) >= 1 and all(reply.startswith(b"NO") and b"cluster token does not match" in reply
                                    for reply in proofs)
    assert all(kind != "error" for kind, _ in results), [r for r in results if r[0] == "error"][:3]
    assert all(seconds < rendezvous.handshake_timeout + 1 for kind, seconds in results if kind == "dropped")
    assert rendezvous.num_pairs == 0 and not inbox.payloads and not inbox.errors

    # A prefill worker with the token pairs and transfers byte-exact while the silent ones still hang on.
    out, err = run_sender(address, 32, "after-flood", TOKEN)
    assert out.startswith("SENT"), err
    inbox.wait(num_payloads=1)
    assert_received(inbox, "after-flood", 32)
    assert threading.active_count() <= num_threads_before + rendezvous.max_pending_handshakes + 3
    assert psutil.Process().num_threads() <= num_os_threads_before + rendezvous.max_pending_handshakes + 16
    for sock in silent:
        sock.close()


def test_a_sender_without_the_right_token_cannot_pair(receiver):
    connector, inbox = receiver
    address = connector.endpoint().address
    for token in ("not-the-token", None):
        out, err = run_sender(address, 33, "intruder", token)
        assert out.startswith("REFUSED") and "cluster token does not match" in out, (out, err)
        assert "not-the-token" not in out and TOKEN not in out
    assert connector._rendezvous.num_pairs == 0 and not inbox.payloads
    # A receiver of an open cluster cannot prove a token: a sender holding one does not send to it.
    open_receiver = create_connector("p2p", "open", FINGERPRINT, LAYOUT)
    open_receiver.start_receiving(inbox.on_payload, inbox.on_error)
    try:
        sender = create_connector("p2p", "prefill-t", FINGERPRINT, LAYOUT, cluster_token=TOKEN,
                                  connect_timeout_seconds=3)
        payload = gather_blocks(seeded_cache(0), [0])
        with pytest.raises(KVTransferError, match="did not prove the cluster token|does not match"):
            sender.send(open_receiver.endpoint(), header_for(payload, "t", 0, 4, 4, True), payload)
        sender.close()
    finally:
        open_receiver.close()
    assert not inbox.payloads


def test_peers_holding_the_token_get_at_most_max_pairs(receiver):
    connector, inbox = receiver
    address = connector.endpoint().address
    # Four handshakes that never build their group hold the four pairs ...
    held = [connect_rendezvous(address, f"greedy-{index}", TOKEN, timedelta(seconds=5)) for index in range(4)]
    assert [store.pair_index for store in held] == [0, 1, 2, 3]
    with pytest.raises(HandshakeRefused, match="max_pairs"):
        connect_rendezvous(address, "one-too-many", TOKEN, timedelta(seconds=5))
    assert connector._rendezvous.num_pairs == 4
    # ... until their groups time out (connect_timeout_seconds=3): then a real sender pairs.
    deadline = time.monotonic() + 30
    while connector._rendezvous.num_pairs and time.monotonic() < deadline:
        time.sleep(0.1)
    assert connector._rendezvous.num_pairs == 0
    out, err = run_sender(address, 34, "after-greedy", TOKEN)
    assert out.startswith("SENT"), err
    inbox.wait(num_payloads=1)
    assert_received(inbox, "after-greedy", 34)
    for store in held:
        store.close()


# ---- redis ------------------------------------------------------------------------------------------

PASSWORD = "redis-password-of-these-tests"
ACL_USER, ACL_PASSWORD = "kv-user", "kv-user-password"


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory):
    """A redis-server requiring PASSWORD, with an ACL user and a TLS port; its configuration goes in on stdin,
    so no secret is on its command line. Yields (redis:// URL, rediss:// URL, CA file, client cert, client key)."""
    from tests.tls_helpers import issue, make_ca

    directory = tmp_path_factory.mktemp("redis-tls")
    ca = make_ca(directory)
    server, client = issue(ca, directory, "redis-server"), issue(ca, directory, "kv-client")
    # A port free when asked may be taken before redis-server binds it (an ephemeral port of some connection: CI
    # once lost the TLS port so): then it exits saying so, and it starts again on two fresh ports.
    for attempt in range(3):
        port, tls_port = free_port(), free_port()
        process, output = _start_secured_redis(port, tls_port, server, ca)
        if process is not None:
            break
        if "Address already in use" not in output or attempt == 2:
            raise RuntimeError(f"redis-server did not start: {output[-2000:]}")
    yield (f"redis://127.0.0.1:{port}/0", f"rediss://127.0.0.1:{tls_port}/0", str(ca.cert_file),
           str(client.cert_file), str(client.key_file))
    process.terminate()
    process.wait(10)


def _start_secured_redis(port: int, tls_port: int, server, ca) -> tuple[subprocess.Popen | None, str]:
    """(the running redis-server, "") once it answers a PING on ``port``; (None, its output) if it exited."""
    config = "\n".join([
        f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"requirepass {PASSWORD}",
        f"user {ACL_USER} on >{ACL_PASSWORD} ~splitserve:* &* +@all",
        f"tls-port {tls_port}", f"tls-cert-file {server.cert_file}", f"tls-key-file {server.key_file}",
        f"tls-ca-cert-file {ca.cert_file}", "tls-auth-clients optional", "",
    ])
    process = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    process.stdin.write(config)
    process.stdin.close()
    admin = redis.Redis(port=port, password=PASSWORD)
    deadline = time.monotonic() + 20
    while True:
        try:
            admin.ping()
            return process, ""
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                process.wait()
                return None, process.stdout.read()
            time.sleep(0.05)


def _redis_pair(receiver_url: str, sender_options: dict, **receiver_options):
    receiver = create_connector("redis", "decode-s", FINGERPRINT, LAYOUT, url=receiver_url, **receiver_options)
    sender = create_connector("redis", "prefill-s", FINGERPRINT, LAYOUT, url=receiver_url, **sender_options)
    return receiver, sender


def _transfer(receiver, sender, transfer_id: str, seed: int) -> None:
    inbox = Inbox()
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    payload = gather_blocks(seeded_cache(seed), [3, 7, 1])
    sender.send(receiver.endpoint(), header_for(payload, transfer_id, 0, 11, 11, True, 99), payload)
    inbox.wait(num_payloads=1)
    assert not inbox.errors
    assert_received(inbox, transfer_id, seed)


def test_redis_with_a_password_or_an_acl_user_transfers_and_without_fails_with_a_sentence(secured_redis):
    url = secured_redis[0]
    receiver, sender = _redis_pair(url, {"password": PASSWORD}, password=PASSWORD)
    try:
        _transfer(receiver, sender, "with-password", 41)
        endpoint = receiver.endpoint()
        assert endpoint.address == url and PASSWORD not in str(endpoint.to_pb())
        assert PASSWORD not in repr(receiver._access) and "password=<set>" in repr(receiver._access)
    finally:
        receiver.close()
        sender.close()

    # An ACL user named in the URL: the advertised URL drops the name; the sender uses its own credentials.
    host_part = url.split("//", 1)[1]
    receiver, sender = _redis_pair(f"redis://{ACL_USER}@{host_part}", {"username": ACL_USER, "password": ACL_PASSWORD},
                                   password=ACL_PASSWORD)
    try:
        assert receiver.endpoint().address == url
        _transfer(receiver, sender, "with-acl-user", 42)
    finally:
        receiver.close()
        sender.close()

    # Without the password, or a wrong one: a sentence that says what to set, and never a password.
    for options in ({}, {"password": "wrong-password"}):
        stranger = create_connector("redis", "prefill-x", FINGERPRINT, LAYOUT, url=url, **options)
        payload = gather_blocks(seeded_cache(0), [0])
        with pytest.raises(KVTransferError) as caught:
            stranger.send(KVEndpointInfo("redis", url, "decode-s", {"inbox": "splitserve:kv:inbox:x"}),
                          header_for(payload, "refused", 0, 4, 4, True), payload)
        message = str(caught.value)
        assert "refused this worker" in message and "SPLITSERVE_REDIS_PASSWORD" in message
        assert "wrong-password" not in message and PASSWORD not in message
        stranger.close()
        receiving = create_connector("redis", "decode-x", FINGERPRINT, LAYOUT, url=url, **options)
        with pytest.raises(KVTransferError, match="refused this worker"):
            receiving.start_receiving(lambda received: None, lambda transfer_id, error: None)
        receiving.close()

    # A password in the URL is refused before anything could advertise it, and the sentence does not repeat it.
    with pytest.raises(ValueError, match="SPLITSERVE_REDIS_PASSWORD") as caught:
        create_connector("redis", "decode-u", FINGERPRINT, LAYOUT, url=f"redis://:{PASSWORD}@{host_part}")
    assert PASSWORD not in str(caught.value)


def test_rediss_transfers_with_the_ca_and_fails_without_it(secured_redis):
    _, tls_url, ca_file, cert_file, key_file = secured_redis
    options = {"password": PASSWORD, "tls_ca_file": ca_file}
    receiver, sender = _redis_pair(tls_url, {**options, "tls_cert_file": cert_file, "tls_key_file": key_file},
                                   **options)
    try:
        _transfer(receiver, sender, "over-tls", 43)
    finally:
        receiver.close()
        sender.close()
    untrusting = create_connector("redis", "decode-n", FINGERPRINT, LAYOUT, url=tls_url, password=PASSWORD)
    with pytest.raises(KVTransferError, match="--redis-tls-ca"):
        untrusting.start_receiving(lambda received: None, lambda transfer_id, error: None)
    untrusting.close()


@pytest.mark.timeout(400)
def test_a_cluster_moves_kv_through_a_password_protected_redis(secured_redis, tmp_path, monkeypatch):
    """Workers get the Redis password through their environment only; every prompt's KV comes through Redis."""
    import grpc

    from splitserve.client import Client
    from splitserve.launcher import LocalCluster
    from splitserve.rpc.auth import CLUSTER_TOKEN_HEADER
    from splitserve.v1 import worker_pb2, worker_pb2_grpc
    from tests.cluster_helpers import ROUTER_ARGS, WORKER_ARGS, stream_tokens

    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    cluster = LocalCluster(kv_transfer="redis", redis_url=secured_redis[0], worker_args=WORKER_ARGS,
                           router_args=ROUTER_ARGS, log_dir=tmp_path, env={"SPLITSERVE_REDIS_PASSWORD": PASSWORD},
                           generate_cluster_token=True, require_api_key=True)
    try:
        cluster.start_router()
        cluster.start_workers("prefill")
        (decode,) = cluster.start_workers("decode")
        with Client(cluster.router.address, api_key=cluster.api_key) as client:
            token_ids, text, _ = stream_tokens(client, "The capital of France is", max_tokens=4)
            assert len(token_ids) == 4 and text
            status = client.cluster_status()
        assert PASSWORD not in str(status)
        with grpc.insecure_channel(decode.address) as channel:
            decode_status = worker_pb2_grpc.DecodeWorkerStub(channel).GetStatus(
                worker_pb2.GetWorkerStatusRequest(), timeout=30, metadata=[(CLUSTER_TOKEN_HEADER, cluster.cluster_token)])
        assert decode_status.kv_endpoint.address == secured_redis[0]
        assert decode_status.counters.num_kv_transfers_received >= 1 and decode_status.counters.num_kv_recomputes == 0
    finally:
        cluster.stop()
    for process in [cluster.router, *cluster.workers]:
        assert PASSWORD not in process.log() and PASSWORD not in " ".join(process.popen.args), process.name


@pytest.mark.timeout(400)
def test_a_cluster_with_a_token_pairs_over_the_authenticated_rendezvous(tmp_path, monkeypatch):
    """Every prompt's KV crosses the token-guarded p2p rendezvous (no silent recompute), and the decode
    worker listens on its host only."""
    import grpc

    from splitserve.client import Client
    from splitserve.rpc.auth import CLUSTER_TOKEN_HEADER
    from splitserve.v1 import worker_pb2, worker_pb2_grpc
    from tests.cluster_helpers import start_cluster, stream_tokens

    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    cluster = start_cluster("p2p", tmp_path, credentials=True)
    try:
        _, decode = cluster.workers
        with Client(cluster.router.address, api_key=cluster.api_key) as client:
            token_ids, _, _ = stream_tokens(client, "The capital of France is", max_tokens=4)
            assert len(token_ids) == 4
        with grpc.insecure_channel(decode.address) as channel:
            status = worker_pb2_grpc.DecodeWorkerStub(channel).GetStatus(
                worker_pb2.GetWorkerStatusRequest(), timeout=30, metadata=[(CLUSTER_TOKEN_HEADER, cluster.cluster_token)])
        assert status.counters.num_kv_transfers_received >= 1 and status.counters.num_kv_recomputes == 0
        listening = {c.laddr.ip for c in psutil.Process(decode.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}  # gRPC's own is v4-mapped
    finally:
        cluster.stop()
