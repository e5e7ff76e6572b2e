"""The shared-memory data plane of a p2p pair (kvtransfer/p2p_mapped.py): the one-GPU path's protocol (CUDA IPC)
run on CPU with shared-memory files, over a real two-rank Gloo group in this process (one thread per end).
Across processes, whole sends: tests/integration/test_kvtransfer.py (``shared-memory``); on a GPU:
tests/integration/test_kvtransfer_cuda.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.p2p_mapped import (
    DESCRIPTOR_BYTES,
    MAX_MAPPED,
    MappedData,
    decode_descriptor,
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


def move(sender: MappedData, receiver: MappedData, block: torch.Tensor) -> torch.Tensor:
    """One block from sender to receiver: the receive posted first, as the ring posts it."""
    landed = torch.zeros(block.numel() * block.element_size(), dtype=torch.uint8)
    receive = receiver.recv([landed], 0, 2)
    sender.send([block.view(-1).view(torch.uint8)], 1, 2).wait(TIMEOUT)
    receive.wait(TIMEOUT)
    return landed


def test_descriptors_round_trip_and_unreadable_ones_are_refused():
    fields = (b"\x01" * 64, 1 << 40, 0, b"/torch_123", 7, b"", 1)
    frame = encode_descriptor(3, 4096, 512, fields)
    assert frame.numel() == DESCRIPTOR_BYTES
    assert decode_descriptor(frame.numpy().tobytes()) == (3, 4096, 512, fields)
    assert decode_descriptor(encode_descriptor(0, 0, 8, ()).numpy().tobytes()) == (0, 0, 8, ())
    with pytest.raises(KVTransferError, match="exceeds 512"):
        encode_descriptor(0, 0, 8, (b"x" * 600,))
    broken = bytearray(frame.numpy().tobytes())
    broken[25:27] = (4000).to_bytes(2, "little")  # the first field's length runs past the frame
    with pytest.raises(KVTransferError, match="unreadable block descriptor"):
        decode_descriptor(bytes(broken))
    with pytest.raises(KVTransferError, match="unreadable block descriptor"):
        decode_descriptor(b"\x00" * 10)


def test_blocks_are_copied_out_of_the_senders_memory_and_both_ends_map_the_same_few(pair):
    sender, receiver = pair
    cache = torch.randn(8, 3, 5)
    assert torch.equal(move(sender, receiver, cache[2]).view(torch.float32).view(3, 5), cache[2])
    assert cache.is_shared() and len(receiver._mapped) == 1  # moved into shared memory in place, then mapped
    cache[5] = 7.0  # written after the first send: the receiver reads the sender's memory as it is now
    assert torch.equal(move(sender, receiver, cache[5]).view(torch.float32).view(3, 5), cache[5])
    assert len(receiver._mapped) == 1  # the cache: exported once
    payloads = [torch.randn(2, 4) for _ in range(MAX_MAPPED + 2)]  # each a memory of its own
    for payload in payloads:
        assert torch.equal(move(sender, receiver, payload).view(torch.float32).view(2, 4), payload)
        assert [key for key, _ in sender._sent.values()] == list(receiver._mapped)  # dropped in step
    assert len(receiver._mapped) == MAX_MAPPED
    # The cache was dropped on both ends: it is exported again, under a new key, and lands right.
    assert torch.equal(move(sender, receiver, cache[0]).view(torch.float32).view(3, 5), cache[0])
    assert [key for key, _ in sender._sent.values()] == list(receiver._mapped)
    receiver.release()
    assert not receiver._mapped


def test_a_descriptor_the_receiver_cannot_honour_breaks_the_pair_with_a_sentence(pair):
    sender, receiver = pair
    cache = torch.randn(4, 16)
    move(sender, receiver, cache[1])
    key = next(iter(receiver._mapped))
    landed = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(KVTransferError, match="names memory 9, which it never shared"):
        receiver.land(encode_descriptor(9, 0, 64, ()), landed)
    with pytest.raises(KVTransferError, match="a block of 64 bytes at 256 of 256"):
        receiver.land(encode_descriptor(key, 256, 64, ()), landed)  # past the end
    with pytest.raises(KVTransferError, match="a block of 32 bytes at 0 of 256; this worker posted 64"):
        receiver.land(encode_descriptor(key, 0, 32, ()), landed)
    with pytest.raises(KVTransferError, match="a block of 64 bytes at -8"):
        receiver.land(encode_descriptor(key, -8, 64, ()), landed)
    with pytest.raises(KVTransferError, match="Cannot map the KV peer's memory"):
        receiver.land(encode_descriptor(11, 0, 64, (2**22 + 12345, 3, 64)), landed)  # no such process
    assert not landed.any()
