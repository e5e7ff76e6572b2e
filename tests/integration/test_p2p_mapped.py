"""The shared-memory data plane of a p2p pair (kvtransfer/p2p_mapped.py): the one-GPU path's protocol (CUDA IPC)
run on CPU with shared-memory files, over a real two-rank Gloo group in this process (one thread per end).
Across processes, whole sends: tests/integration/test_kvtransfer.py (``shared-memory``); on a GPU:
tests/integration/test_kvtransfer_cuda.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.header import TransferHeader
from splitserve.kvtransfer.p2p_mapped import (
    MAX_MAPPED,
    MappedData,
    decode_descriptor,
    descriptor_bytes,
    encode_descriptor,
)

pytestmark = pytest.mark.timeout(60)
TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def pair():
    """(sender, receiver): the two ends' MappedData over one Gloo group of two ranks, built side by side."""
    store, groups = dist.HashStore(), [None, None]

    def build(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, options)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    yield MappedData(groups[0], torch.device("cpu")), MappedData(groups[1], torch.device("cpu"))


FRAME = descriptor_bytes(8)


def move(sender: MappedData, receiver: MappedData, cache: torch.Tensor, *block_ids: int) -> torch.Tensor:
    """Blocks ``block_ids`` of ``cache`` from sender to receiver as one chunk (the receive posted first, as the
    receiver posts it ahead), gathered out of the sender's memory where the receiver found them."""
    block_bytes = cache[:1].numel() * cache.element_size()
    receive = receiver.recv(len(block_ids), 0, FRAME)
    sender.send(cache, list(block_ids), 1, FRAME).wait(TIMEOUT)
    source = receive.wait(TIMEOUT, block_bytes)
    assert source.num_blocks == len(block_ids) and source.block_num_bytes == block_bytes
    return torch.cat([source.block(index) for index in range(source.num_blocks)])


def test_descriptors_round_trip_and_unreadable_ones_are_refused():
    fields = (b"\x01" * 64, 1 << 40, 0, b"/torch_123", 7, b"", 1)
    offsets = [4096 * index for index in (7, 0, 3)]
    frame = encode_descriptor(3, 4096, offsets, fields, FRAME)
    assert frame.numel() == FRAME == 512 + 8 * 8
    assert decode_descriptor(frame.numpy().tobytes()) == (3, 4096, offsets, fields)
    assert decode_descriptor(encode_descriptor(0, 8, [], (), FRAME).numpy().tobytes()) == (0, 8, [], ())
    with pytest.raises(KVTransferError, match="export fields take 628 bytes, over 512"):
        encode_descriptor(0, 8, [0], (b"x" * 600,), FRAME)
    with pytest.raises(KVTransferError, match="60 blocks does not fit a frame of 576 bytes"):
        encode_descriptor(0, 8, [0] * 60, fields, FRAME)  # the frame a receiver posts for chunks of 8
    broken = bytearray(frame.numpy().tobytes())
    broken[25:27] = (4000).to_bytes(2, "little")  # the first field's length runs past the frame
    with pytest.raises(KVTransferError, match="unreadable block descriptor"):
        decode_descriptor(bytes(broken))
    broken = bytearray(frame.numpy().tobytes())
    broken[16:24] = (100).to_bytes(8, "little")  # more offsets than the frame holds
    with pytest.raises(KVTransferError, match="unreadable block descriptor"):
        decode_descriptor(bytes(broken))
    with pytest.raises(KVTransferError, match="unreadable block descriptor"):
        decode_descriptor(b"\x00" * 10)


def test_blocks_are_copied_out_of_the_senders_memory_and_both_ends_map_the_same_few(pair):
    sender, receiver = pair
    cache = torch.randn(8, 3, 5)
    assert torch.equal(move(sender, receiver, cache, 2).view(torch.float32).view(3, 5), cache[2])
    assert cache.is_shared() and len(receiver._mapped) == 1  # moved into shared memory in place, then mapped
    cache[5] = 7.0  # written after the first send: the receiver reads the sender's memory as it is now
    assert torch.equal(move(sender, receiver, cache, 5).view(torch.float32).view(3, 5), cache[5])
    # A chunk of blocks in any order: rows of the sender's memory itself (whole blocks of it), not copied.
    receive = receiver.recv(3, 0, FRAME)
    sender.send(cache, [6, 1, 5], 1, FRAME).wait(TIMEOUT)
    source = receive.wait(TIMEOUT, 60)
    assert source.block_ids == [6, 1, 5] and source.kv_cache.shape == (8, 60)
    cache[1] = -3.0  # the receiver sees the sender's memory as it is now
    assert torch.equal(source.kv_cache[1].view(torch.float32).view(3, 5), cache[1])
    # Rows of the cache as blocks: whole rows of the memory too.
    rows = move(sender, receiver, cache.view(-1, 5), 4 * 3 + 2, 1).view(torch.float32).view(2, 5)
    assert torch.equal(rows, torch.stack([cache[4, 2], cache[0, 1]]))
    # Blocks that are not whole blocks of the memory (a view one float in): copied one by one.
    shifted = cache.view(-1)[1:81].view(4, 20)
    assert torch.equal(move(sender, receiver, shifted, 3, 0).view(torch.float32).view(2, 20), shifted[[3, 0]])
    assert len(receiver._mapped) == 1  # the cache: exported once
    payloads = [torch.randn(2, 4) for _ in range(MAX_MAPPED + 2)]  # each a memory of its own
    for payload in payloads:
        assert torch.equal(move(sender, receiver, payload.view(1, 2, 4), 0).view(torch.float32).view(2, 4), payload)
        assert [key for key, _ in sender._sent.values()] == list(receiver._mapped)  # dropped in step
    assert len(receiver._mapped) == MAX_MAPPED
    # The cache was dropped on both ends: it is exported again, under a new key, and lands right.
    assert torch.equal(move(sender, receiver, cache, 0).view(torch.float32).view(3, 5), cache[0])
    assert [key for key, _ in sender._sent.values()] == list(receiver._mapped)
    receiver.release()
    assert not receiver._mapped


def test_a_descriptor_the_receiver_cannot_honour_breaks_the_pair_with_a_sentence(pair):
    sender, receiver = pair
    cache = torch.randn(4, 16)
    move(sender, receiver, cache, 1)
    key = next(iter(receiver._mapped))

    def land(key, block_bytes, offsets, fields=()):
        receiver.land(encode_descriptor(key, block_bytes, offsets, fields, FRAME), 2, 64)  # announced: 2 of 64

    with pytest.raises(KVTransferError, match="names memory 9, which it never shared"):
        land(9, 64, [0, 64])
    with pytest.raises(KVTransferError, match="a block outside the 256 bytes it shared"):
        land(key, 64, [0, 256])  # past the end
    with pytest.raises(KVTransferError, match="a block outside"):
        land(key, 64, [-8, 0])
    with pytest.raises(KVTransferError, match="describes 2 blocks of 32 bytes; it announced 2 of 64"):
        land(key, 32, [0, 32])
    with pytest.raises(KVTransferError, match="describes 1 blocks of 64 bytes"):
        land(key, 64, [0])
    with pytest.raises(KVTransferError, match="Cannot map the KV peer's memory"):
        land(11, 64, [0, 64], (2**22 + 12345, 3, 64))  # no such process
    with pytest.raises(KVTransferError, match="descriptors of 2097664 bytes, over 1048576"):
        receiver.recv(2, 0, descriptor_bytes(1 << 18))


def test_a_closing_sender_waits_until_the_receiver_has_let_go_of_its_memory():
    # On a GPU an exporter that exits while its memory is mapped keeps it from being freed (and torch warns): the
    # goodbye on a mapped pair is acknowledged once the receiver has dropped its mappings.
    from splitserve.kvtransfer import create_connector
    from splitserve.kvtransfer.blocks import BlockSource
    from tests.kv_helpers import FINGERPRINT, LAYOUT, SHAPE

    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, cpu_data_plane="shm")
    delivered, hold = threading.Event(), threading.Event()

    def on_payload(received) -> None:  # keeps the receive thread busy while the sender closes
        delivered.set()
        hold.wait(5)

    receiver.start_receiving(on_payload, lambda transfer_id, error: None)
    sender = create_connector("p2p", "sender", FINGERPRINT, LAYOUT, cpu_data_plane="shm")
    sent: list = []
    try:
        cache = torch.randn(SHAPE)
        header = TransferHeader("t", FINGERPRINT, LAYOUT, 0, 8, 8, 2 * LAYOUT.block_num_bytes, None, True, 3)
        # The send is acknowledged once its payload is delivered: it returns only when on_payload does.
        sending = threading.Thread(target=lambda: sent.append(
            sender.send(receiver.endpoint(), header, BlockSource(cache, [3, 7]))))
        sending.start()
        assert delivered.wait(10)
        (channels,) = receiver._receive_groups
        assert channels.mapped and len(channels.data._mapped) == 1 and sending.is_alive()
        threading.Timer(0.2, hold.set).start()  # the receive thread reads the goodbye 0.2 s after it was sent
        started = time.monotonic()
        sender.close()  # waits for the send, says goodbye, waits for the receiver to let go
        assert not channels.data._mapped and 0.2 <= time.monotonic() - started < 2
        sending.join(5)
        assert sent == [None]
    finally:
        sender.close()
        receiver.close()
