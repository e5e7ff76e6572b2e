"""KV transfer: both connectors moving real bytes (p2p across processes, a real Redis)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch

from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource, gather_blocks, scatter_blocks
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.errors import KVTransferError
from tests.kv_helpers import FINGERPRINT, LAYOUT, SHAPE, header_for, seeded_cache

pytestmark = pytest.mark.timeout(120)

class Inbox:
    """Collects what a receiving connector delivers."""

    def __init__(self) -> None:
        self.payloads, self.errors = [], []
        self.event = threading.Condition()

    def on_payload(self, received) -> None:
        # The payload tensor is valid only during the callback: keep a copy.
        received.payload = received.payload.clone()
        with self.event:
            self.payloads.append(received)
            self.event.notify_all()

    def on_error(self, transfer_id, error) -> None:
        with self.event:
            self.errors.append((transfer_id, error))
            self.event.notify_all()

    def wait(self, num_payloads: int = 0, num_errors: int = 0, timeout: float = 30) -> None:
        with self.event:
            assert self.event.wait_for(
                lambda: len(self.payloads) >= num_payloads and len(self.errors) >= num_errors, timeout
            ), f"got {len(self.payloads)} payloads and {len(self.errors)} errors"


# ---- p2p across processes -----------------------------------------------------------------

SENDER = r"""
import sys, torch
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource, gather_blocks
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.header import TransferHeader, payload_checksum
from splitserve.kvtransfer.layout import KVLayout
import time
address, worker_id, seed, transfer_id, fingerprint, chunk_bytes, head_size, checksum, plane, pause = sys.argv[1:11]
head_size = int(head_size)
layout = KVLayout(4, 2, head_size, torch.float32, 4)
cache = torch.randn((16, 4, 2, 2, 4, head_size), generator=torch.Generator().manual_seed(int(seed)))
if plane == "shm":
    cache.share_memory_()  # the receiver maps the cache itself, as it maps a GPU's over CUDA IPC
connector = create_connector("p2p", worker_id, fingerprint, layout, connect_timeout_seconds=10,
                             chunk_bytes=int(chunk_bytes), checksum=checksum, cpu_data_plane=plane)
destination = KVEndpointInfo("p2p", address, "receiver")
# Prompt of 11 tokens in blocks [3, 7, 1]: two payloads, the last with the first token.
# The first as the prefill worker sends (blocks gathered by the connector, which fills in the checksum).
for blocks, position, num_tokens, last in (([3, 7], 0, 8, False), ([1], 8, 3, True)):
    if last:
        payload = gather_blocks(cache, blocks)
        checksum = payload_checksum(payload)
    else:
        payload, checksum = BlockSource(cache, blocks), None
    header = TransferHeader(transfer_id, fingerprint, layout, position, num_tokens, 11,
                            len(blocks) * layout.block_num_bytes, checksum, last, 99 if last else None)
    connector.send(destination, header, payload)
    if not last:
        time.sleep(float(pause))  # the prefill worker's next step
print("SENT", flush=True)
connector.close()
"""


def run_sender(address: str, worker_id: str, seed: int, transfer_id: str, fingerprint: str = FINGERPRINT,
               chunk_bytes: int = 4 << 20, head_size: int = 8, checksum: str = "xxh3",
               plane: str = "control", pause: float = 0.0):
    """A process sending one transfer of two payloads, ``pause`` seconds apart."""
    return subprocess.Popen([sys.executable, "-c", SENDER, address, worker_id, str(seed), transfer_id, fingerprint,
                             str(chunk_bytes), str(head_size), checksum, plane, str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_sender_blocks(payloads, source: torch.Tensor) -> None:
    """The two payloads of a sender's transfer (blocks [3, 7], then [1] of its cache ``source``), written into
    other blocks of a cache here, hold exactly those blocks."""
    target = torch.zeros(SHAPE)
    scatter_blocks(target, [10, 2], payloads[0].payload)
    scatter_blocks(target, [5], payloads[1].payload)
    assert torch.equal(target[[10, 2, 5]], source[[3, 7, 1]])


@pytest.fixture
def p2p_receiver(request):
    """A receiving p2p connector on CPU caches: blocks on the control group itself, or (parametrized) on a data
    group of their own ("gloo": the two-GPU protocol, whose data NCCL carries there) or out of the sender's
    shared memory ("shm": the one-GPU protocol, whose memory CUDA IPC maps there)."""
    connector = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT,
                                 cpu_data_plane=getattr(request, "param", "control"))
    inbox = Inbox()
    connector.start_receiving(inbox.on_payload, inbox.on_error)
    yield connector, inbox
    started = time.monotonic()
    connector.close()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("p2p_receiver", ["control", "gloo", "shm"], ids=["one-group", "control+data", "shared-memory"],
                         indirect=True)
def test_p2p_across_processes_is_bit_exact(p2p_receiver):
    connector, inbox = p2p_receiver
    address = connector.endpoint().address
    senders = [run_sender(address, f"prefill-{seed}", seed, f"transfer-{seed}",
                          plane=connector.cpu_data_plane) for seed in (11, 12)]
    for sender in senders:
        out, err = sender.communicate(timeout=90)
        assert "SENT" in out, err
    inbox.wait(num_payloads=4)
    assert not inbox.errors
    for seed in (11, 12):
        received = [p for p in inbox.payloads if p.header.transfer_id == f"transfer-{seed}"]
        assert [p.header.first_token_position for p in received] == [0, 8]
        assert received[-1].header.is_last and received[-1].header.first_token_id == 99
        assert_sender_blocks(received, seeded_cache(seed))


@pytest.mark.parametrize("p2p_receiver", ["control", "gloo", "shm"], ids=["one-group", "control+data", "shared-memory"],
                         indirect=True)
def test_p2p_splits_sends_into_chunks_and_refuses_another_layout(p2p_receiver):
    connector, inbox = p2p_receiver
    address = connector.endpoint().address
    # Chunks of one block: the first send (2 blocks) arrives as two payloads, each with its own header. On mapped
    # memory, whose chunks cost a frame and a descriptor each but no wire, the same ring bytes come in two slots:
    # chunks of receive_slots (8) / 2 = 4 blocks, so that send arrives whole.
    mapped = connector.cpu_data_plane == "shm"
    out, err = run_sender(address, "prefill-c", 15, "chunked", chunk_bytes=LAYOUT.block_num_bytes,
                          plane=connector.cpu_data_plane).communicate(timeout=90)
    assert "SENT" in out, err
    expected = [(0, 8), (8, 3)] if mapped else [(0, 4), (4, 4), (8, 3)]
    inbox.wait(num_payloads=len(expected))
    assert [(p.header.first_token_position, p.header.num_tokens) for p in inbox.payloads] == expected
    target = torch.zeros(SHAPE)
    for payload, blocks in zip(inbox.payloads, [[10, 2], [5]] if mapped else [[10], [2], [5]]):
        scatter_blocks(target, blocks, payload.payload)
    assert torch.equal(target[[10, 2, 5]], seeded_cache(15)[[3, 7, 1]])
    # A sender whose blocks are twice as large (head size 16): refused by the header check, and the
    # receiver, which sized its receives from the sender's announcement, goes on.
    out, err = run_sender(address, "prefill-w", 16, "wide", head_size=16,
                          plane=connector.cpu_data_plane).communicate(timeout=90)
    assert "SENT" in out, err
    inbox.wait(num_payloads=len(expected), num_errors=1)
    assert inbox.errors[0][0] == "wide" and "layout" in str(inbox.errors[0][1])
    out, err = run_sender(address, "prefill-c", 17, "after", plane=connector.cpu_data_plane).communicate(timeout=90)
    assert "SENT" in out, err
    inbox.wait(num_payloads=len(expected) + 2)
    assert [p.header.transfer_id for p in inbox.payloads[len(expected):]] == ["after", "after"]
    assert len(inbox.errors) == 1


def test_p2p_without_checksums_needs_both_sides_to_agree(p2p_receiver):
    connector, inbox = p2p_receiver
    out, err = run_sender(connector.endpoint().address, "prefill-n", 18, "unchecked", checksum="none").communicate(timeout=90)
    assert "SENT" in out, err
    inbox.wait(num_errors=1)
    assert inbox.errors[0][0] == "unchecked" and "without a checksum" in str(inbox.errors[0][1])
    relaxed = create_connector("p2p", "relaxed", FINGERPRINT, LAYOUT, checksum="none")
    relaxed_inbox = Inbox()
    relaxed.start_receiving(relaxed_inbox.on_payload, relaxed_inbox.on_error)
    try:
        out, err = run_sender(relaxed.endpoint().address, "prefill-n", 19, "unchecked", checksum="none").communicate(timeout=90)
        assert "SENT" in out, err
        relaxed_inbox.wait(num_payloads=2)
        assert not relaxed_inbox.errors
        assert_sender_blocks(relaxed_inbox.payloads, seeded_cache(19))
    finally:
        relaxed.close()


@pytest.mark.parametrize("p2p_receiver", ["gloo"], ids=["control+data"], indirect=True)
def test_p2p_ends_of_different_planes_are_refused_and_the_receiver_goes_on(p2p_receiver):
    # A pair's two ends must carry blocks the same way (a CPU cache against a CUDA one cannot form an NCCL group):
    # the sender is refused with a sentence naming both, at once, and the receiver takes the next sender.
    connector, inbox = p2p_receiver
    assert connector.endpoint().options == {"backend": "gloo+gloo"}
    started = time.monotonic()
    out, err = run_sender(connector.endpoint().address, "prefill-one", 22, "mismatched").communicate(timeout=90)
    assert "SENT" not in out
    assert "moves blocks over gloo+gloo, this worker over gloo" in err and "same kind of device" in err, err
    assert time.monotonic() - started < 30
    out, err = run_sender(connector.endpoint().address, "prefill-two", 23, "matched",
                          plane="gloo").communicate(timeout=90)
    assert "SENT" in out, err
    inbox.wait(num_payloads=2)
    assert [p.header.transfer_id for p in inbox.payloads] == ["matched", "matched"] and not inbox.errors


LONG_SENDER = r"""
import sys, torch
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.header import TransferHeader
from splitserve.kvtransfer.layout import KVLayout
layout = KVLayout(4, 2, 8, torch.float32, 4)
cache = torch.randn((16, 4, 2, 2, 4, 8))
connector = create_connector("p2p", "prefill-long", "model-a", layout, chunk_bytes=layout.block_num_bytes,
                             cpu_data_plane=sys.argv[2])
destination = KVEndpointInfo("p2p", sys.argv[1], "receiver")
print("SENDING", flush=True)
if sys.argv[2] == "shm":  # a mapped pair sends a payload as one chunk: 12 sends of a block, as 12 prefill steps would
    for block in range(12):
        header = TransferHeader("long", "model-a", layout, 4 * block, 4, 48, layout.block_num_bytes, None,
                                block == 11, 5 if block == 11 else None)
        connector.send(destination, header, BlockSource(cache, [block]))
else:
    header = TransferHeader("long", "model-a", layout, 0, 48, 48, 12 * layout.block_num_bytes, None, True, 5)
    connector.send(destination, header, BlockSource(cache, range(12)))
print("SENT", flush=True)
"""


@pytest.mark.parametrize("plane", ["control", "shm"], ids=["one-group", "shared-memory"])
def test_p2p_transfer_waits_out_a_slow_step_between_its_sends(plane):
    """The sends of one transfer come as the sender's prefill steps finish them; a step may take longer than
    the pair's connect timeout (a bfloat16 prompt chunk on a 2-core AVX2 CPU took 7 s, beside a 10 s timeout),
    and the receiver waits up to its receive timeout for the next send instead of breaking the pair."""
    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, connect_timeout_seconds=2,
                                receive_timeout_seconds=30, cpu_data_plane=plane)
    inbox = Inbox()
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    try:
        out, err = run_sender(receiver.endpoint().address, "prefill-slow", 3, "slow", plane=plane,
                              pause=4).communicate(timeout=90)
        assert "SENT" in out, err
        inbox.wait(num_payloads=2)
        assert [p.header.transfer_id for p in inbox.payloads] == ["slow", "slow"] and not inbox.errors
        assert_sender_blocks(inbox.payloads, seeded_cache(3))
    finally:
        receiver.close()


IDLE_SENDER = r"""
import logging, sys, time, torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.header import TransferHeader
from tests.kv_helpers import FINGERPRINT, LAYOUT, seeded_cache
connector = create_connector("p2p", "prefill-idle", FINGERPRINT, LAYOUT, cpu_data_plane=sys.argv[2])
cache = seeded_cache(4)
if sys.argv[2] == "shm":
    cache.share_memory_()
destination = KVEndpointInfo("p2p", sys.argv[1], "receiver")
for index, pause in enumerate(map(float, sys.argv[3:])):
    time.sleep(pause)  # no transfer open: the pair is idle
    header = TransferHeader(f"t{index}", FINGERPRINT, LAYOUT, 0, 4, 4, LAYOUT.block_num_bytes, None, True, 1)
    connector.send(destination, header, BlockSource(cache, [index]))
print("SENT", flush=True)
connector.close()
"""


@pytest.mark.parametrize("plane", ["control", "shm"], ids=["one-group", "shared-memory"])
def test_p2p_pair_stays_open_while_idle_until_the_idle_timeout(plane, caplog):
    """Between transfers a pair is idle: it stays open past the connect timeout (it used to close after it, so
    that a sender sending every few seconds paired again for every transfer), and the receiver closes it once
    it has been idle for the idle timeout; the sender then pairs again when it next sends."""
    caplog.set_level(logging.INFO, logger="splitserve.kvtransfer.p2p_receiver")
    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, connect_timeout_seconds=1,
                                idle_timeout_seconds=4, cpu_data_plane=plane)
    inbox = Inbox()
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    try:
        # Idle 2 s (past the connect timeout, inside the idle one), then 6 s (past both).
        out, err = subprocess.Popen([sys.executable, "-c", IDLE_SENDER, receiver.endpoint().address, plane,
                                     "0", "2", "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True).communicate(timeout=90)
        assert "SENT" in out, err
        inbox.wait(num_payloads=3)
        assert [p.header.transfer_id for p in inbox.payloads] == ["t0", "t1", "t2"] and not inbox.errors
        target = seeded_cache(4)
        assert all(torch.equal(p.payload.view(torch.float32).view(SHAPE[1:]), target[index])
                   for index, p in enumerate(inbox.payloads))
        assert err.count("ready in") == 2 and err.count("broke while idle") == 1, err  # paired twice, not three times
        assert len(receiver._receive_groups) == 2
        assert "idle for" in caplog.text and "closed (the sender pairs again" in caplog.text
    finally:
        receiver.close()


@pytest.mark.parametrize("plane", ["control", "shm"], ids=["one-group", "shared-memory"])
def test_p2p_sender_lost_mid_transfer_fails_that_transfer_and_the_receiver_goes_on(plane):
    # On shared memory the receiver has the dead sender's memory mapped: it drops the mapping with the pair.
    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, receive_slots=2, cpu_data_plane=plane)
    inbox, first_arrived, release = Inbox(), threading.Event(), threading.Event()

    def on_payload(received) -> None:  # holds the receive thread on the first payload
        first_arrived.set()
        release.wait(30)
        inbox.on_payload(received)

    receiver.start_receiving(on_payload, inbox.on_error)
    sender = subprocess.Popen([sys.executable, "-c", LONG_SENDER, receiver.endpoint().address, plane],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first_arrived.wait(60), sender.stderr.read() if sender.poll() is not None else "no payload"
        sender.kill()  # 12 one-block chunks (or sends), 2 posted at a time: the transfer is far from done
        sender.wait(10)
        release.set()
        inbox.wait(num_errors=1)
        assert inbox.errors[0][0] == "long" and "broke mid-transfer" in str(inbox.errors[0][1])
        assert len(inbox.payloads) < 12
        # Another sender reaches the same receiver on a new pair.
        num_before = len(inbox.payloads)
        out, err = run_sender(receiver.endpoint().address, "prefill-b", 20, "next", plane=plane).communicate(timeout=90)
        assert "SENT" in out, err
        inbox.wait(num_payloads=num_before + 2)
        assert [p.header.transfer_id for p in inbox.payloads[-2:]] == ["next", "next"]
        assert not getattr(receiver._receive_groups[0].data, "_mapped", {})  # the dead pair's mappings: dropped
    finally:
        release.set()
        if sender.poll() is None:
            sender.kill()
        receiver.close()


RAW_PEER = r"""
import sys, time, torch
from datetime import timedelta
from splitserve.kvtransfer import p2p_channels, p2p_wire
from splitserve.kvtransfer.rendezvous_client import connect_rendezvous
store = connect_rendezvous(sys.argv[1], "raw-peer", None, timedelta(seconds=10))
channels = p2p_channels.build_channels(store, store.pair_index, 0, timedelta(seconds=10), torch.device("cpu"),
                                       store.local_host)
meta = torch.tensor([int(value) for value in sys.argv[2:7]], dtype=torch.int64)
channels.control.send([meta], 1, p2p_wire.TAG_META).wait()
print("SENT", flush=True)
time.sleep(3)  # the receiver refuses while this end is still up
"""


@pytest.mark.parametrize("meta, message", [
    ([1, 1, 2048, 64, 1 << 8], "wire protocol 1"),  # an older splitserve
    ([1, 1, 1 << 40, 64, 2 << 8], "will not buffer"),  # sizes no receiver should allocate
])
def test_p2p_refuses_a_peer_of_another_protocol_or_absurd_sizes(p2p_receiver, meta, message):
    connector, inbox = p2p_receiver
    peer = subprocess.Popen([sys.executable, "-c", RAW_PEER, connector.endpoint().address, *map(str, meta)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = peer.communicate(timeout=60)
    assert "SENT" in out, err
    inbox.wait(num_errors=1)
    transfer_id, error = inbox.errors[0]
    assert transfer_id is None and message in str(error)
    # The receiver still takes a regular sender.
    out, err = run_sender(connector.endpoint().address, "prefill-ok", 21, "fine").communicate(timeout=90)
    assert "SENT" in out, err
    inbox.wait(num_payloads=2)


def test_p2p_refuses_another_model_and_drops_cancelled_transfers(p2p_receiver):
    connector, inbox = p2p_receiver
    address = connector.endpoint().address
    out, err = run_sender(address, "prefill-x", 13, "wrong-model", fingerprint="model-z").communicate(timeout=90)
    assert "SENT" in out, err
    inbox.wait(num_errors=1)
    time.sleep(0.5)  # the refused transfer's second payload is dropped, not reported again
    assert [transfer_id for transfer_id, _ in inbox.errors] == ["wrong-model"]
    assert "model-z differs" in str(inbox.errors[0][1])
    connector.cancel("cancelled")
    out, err = run_sender(address, "prefill-y", 14, "cancelled").communicate(timeout=90)
    assert "SENT" in out, err
    time.sleep(0.5)
    assert inbox.payloads == [] and len(inbox.errors) == 1


def test_p2p_send_to_nobody_fails_within_its_timeout():
    from splitserve.launcher import free_port

    sender = create_connector("p2p", "lonely", FINGERPRINT, LAYOUT, connect_timeout_seconds=2)
    payload = gather_blocks(seeded_cache(0), [0])
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="Cannot reach the KV endpoint"):
        sender.send(KVEndpointInfo("p2p", f"127.0.0.1:{free_port()}", "nobody"),
                    header_for(payload, "t", 0, 4, 4, True), payload)
    assert time.monotonic() - started < 15
    sender.close()


# ---- redis ----------------------------------------------------------------------------------


def test_redis_transfer_is_bit_exact_and_leaves_nothing(redis_url):
    receiver = create_connector("redis", "decode-r", FINGERPRINT, LAYOUT, url=redis_url)
    sender = create_connector("redis", "prefill-r", FINGERPRINT, LAYOUT, url=redis_url)
    inbox = Inbox()
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    source = seeded_cache(21)
    destination = receiver.endpoint()
    assert destination.options["inbox"]
    for blocks, position, num_tokens, last in (([3, 7], 0, 8, False), ([1], 8, 3, True)):
        payload = gather_blocks(source, blocks)
        header = header_for(payload, "r1", position, num_tokens, 11, last, 7 if last else None)
        if not last:  # as the prefill worker sends: gathered by the connector, checksum filled in
            payload, header.checksum = BlockSource(source, blocks), None
        sender.send(destination, header, payload)
    inbox.wait(num_payloads=2)
    assert_sender_blocks(inbox.payloads, source)
    assert inbox.payloads[1].header.first_token_id == 7

    # A corrupted piece is refused with the reason; a cancelled transfer is dropped; keys never linger.
    payload = gather_blocks(source, [4])
    header = header_for(payload, "corrupt", 0, 4, 4, True)
    header.checksum ^= 1
    sender.send(destination, header, payload)
    inbox.wait(num_errors=1)
    assert inbox.errors[0][0] == "corrupt" and "Checksum mismatch" in str(inbox.errors[0][1])
    receiver.cancel("dropped")
    sender.send(destination, header_for(payload, "dropped", 0, 4, 4, True), payload)
    server = redis.Redis.from_url(redis_url)
    wait_deadline = time.monotonic() + 10
    while server.dbsize() and time.monotonic() < wait_deadline:
        time.sleep(0.05)
    assert server.dbsize() == 0
    assert len(inbox.payloads) == 2 and len(inbox.errors) == 1
    for connector in (sender, receiver):
        started = time.monotonic()
        connector.close()
        assert time.monotonic() - started < 5
    server.close()


def test_redis_refuses_an_envelope_before_reading_its_pieces(redis_url):
    # Whoever can push onto a decode worker's inbox must not make it read or delete keys that are not the transfer's
    # own, nor read anything for a header it would refuse: both are checked before any piece is touched.
    import dataclasses
    import json

    receiver = create_connector("redis", "decode-envelopes", FINGERPRINT, LAYOUT, url=redis_url)
    inbox = Inbox()
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    server = redis.Redis.from_url(redis_url)
    payload = gather_blocks(seeded_cache(23), [2])
    server.set("victim", b"another service's value")
    refusals = [
        ({}, lambda own: ["victim"], "not this transfer's"),
        ({}, lambda own: [own, own], "2 pieces for 1 blocks"),
        ({"model_fingerprint": "model-b"}, lambda own: [own], "model fingerprint"),
        ({"payload_num_bytes": 1 << 40}, lambda own: [own], "need"),
    ]
    try:
        for number, (changes, keys, reason) in enumerate(refusals, 1):
            header = dataclasses.replace(header_for(payload, f"env{number}", 0, 4, 4, True), **changes)
            own = f"{receiver.key_prefix}env{number}:0:0"
            server.set(own, payload.numpy().tobytes(), px=60_000)
            server.rpush(receiver.inbox, header.to_bytes() + json.dumps(keys(own)).encode())
            inbox.wait(num_errors=number)
            assert inbox.errors[-1][0] == f"env{number}" and reason in str(inbox.errors[-1][1]), inbox.errors[-1]
            assert server.exists(own)  # not read: it expires with its TTL
            # A later envelope of a refused transfer is dropped, its own keys deleted, no one else's.
            server.rpush(receiver.inbox, header.to_bytes() + json.dumps(["victim", own]).encode())
        assert server.get("victim") == b"another service's value"
        header, own = header_for(payload, "env", 0, 4, 4, True), f"{receiver.key_prefix}env:0:0"
        server.set(own, payload.numpy().tobytes(), px=60_000)
        server.rpush(receiver.inbox, header.to_bytes() + json.dumps([own]).encode())  # as a sender writes it
        inbox.wait(num_payloads=1)
        assert torch.equal(inbox.payloads[0].payload, payload) and not server.exists(own)
        assert len(inbox.errors) == len(refusals) and server.get("victim") == b"another service's value"
    finally:
        receiver.close()
        server.delete("victim")
        server.close()


def test_redis_unreachable_raises():
    from splitserve.launcher import free_port

    sender = create_connector("redis", "p", FINGERPRINT, LAYOUT)
    payload = gather_blocks(seeded_cache(0), [0])
    destination = KVEndpointInfo("redis", f"redis://127.0.0.1:{free_port()}/0", "d", {"inbox": "x"})
    with pytest.raises(KVTransferError, match="failed"):
        sender.send(destination, header_for(payload, "t", 0, 4, 4, True), payload)
    sender.close()
