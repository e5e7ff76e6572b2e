"""The KV payload contract: header, gather/scatter, block sources, verification (no processes, no model)."""

from __future__ import annotations

import pytest
import torch
import xxhash

from splitserve.kvtransfer.blocks import BlockSource, copy_blocks, gather_blocks, scatter_blocks
from splitserve.kvtransfer.connector import ReceivedPayload
from splitserve.kvtransfer.errors import KVTransferError, KVVerificationError
from splitserve.kvtransfer.header import TransferHeader, verify
from splitserve.kvtransfer.layout import KVLayout
from tests.kv_helpers import FINGERPRINT, LAYOUT, SHAPE, header_for, seeded_cache


def test_header_round_trip_and_garbage():
    payload = gather_blocks(seeded_cache(0), [3, 7])
    header = header_for(payload, "t1", 8, 7, 15, True, first_token_id=42)
    parsed = TransferHeader.from_bytes(header.to_bytes())
    assert parsed == header and parsed.num_blocks == 2
    without_first = header_for(payload, "t1", 0, 8, 15, False)
    assert TransferHeader.from_bytes(without_first.to_bytes()).first_token_id is None
    with pytest.raises(KVTransferError, match="4 bytes"):
        TransferHeader.from_bytes(b"\x01")
    with pytest.raises(KVTransferError, match="follow"):
        TransferHeader.from_bytes(b"\xff\x00\x00\x00abc")
    for other_version in (1, 3):  # the head-major payload of version 1, and a future one
        other = header_for(payload, "t1", 0, 8, 15, False)
        other.format_version = other_version
        with pytest.raises(KVVerificationError, match=f"format version {other_version} is not supported"):
            TransferHeader.from_bytes(other.to_bytes())


def test_gather_scatter_round_trip_into_other_blocks():
    source, target = seeded_cache(1), torch.zeros(SHAPE)
    payload = gather_blocks(source, [3, 7, 1])
    assert payload.shape == (3, 4, 2, 2, 4, 8) and payload.is_contiguous()
    scatter_blocks(target, [10, 2, 5], payload)
    assert torch.equal(target[[10, 2, 5]], source[[3, 7, 1]])
    untouched = [b for b in range(16) if b not in (10, 2, 5)]
    assert not target[untouched].any()


def test_a_payload_received_as_blocks_of_a_peers_memory_is_verified_and_copied_in_one_pass():
    # What a mapped p2p pair delivers: the sender's blocks where they lie, its memory seen as rows of bytes.
    source_cache = seeded_cache(4)
    memory = source_cache.view(16, -1).view(torch.uint8)
    blocks = BlockSource(memory, [3, 7, 1])
    header = header_for(gather_blocks(source_cache, [3, 7, 1]), "t", 0, 11, 11, True)
    verify(header, blocks, FINGERPRINT, LAYOUT)  # the checksum over the blocks where they lie
    source_cache[7, 0, 0, 0, 0, 0] += 1.0
    with pytest.raises(KVVerificationError, match="Checksum mismatch"):
        verify(header, blocks, FINGERPRINT, LAYOUT)
    received = ReceivedPayload(header, source=blocks)
    target = torch.zeros(SHAPE)
    received.write_to(target, [10, 2, 5])
    assert torch.equal(target[[10, 2, 5]], source_cache[[3, 7, 1]])
    assert not target[[b for b in range(16) if b not in (10, 2, 5)]].any()
    assert torch.equal(received.payload, source_cache[[3, 7, 1]])  # gathered on first use
    received.payload = received.payload.clone()  # kept past the callback: no longer the peer's memory
    assert received.source is None
    with pytest.raises(KVVerificationError, match="holds 3 blocks; 2 were reserved"):
        copy_blocks(memory, [3, 7, 1], target, [0, 1])
    with pytest.raises(IndexError, match="outside the 16 blocks"):
        copy_blocks(memory, [3, 16], target, [0, 1])
    with pytest.raises(IndexError, match="outside the 16 blocks"):
        copy_blocks(memory, [3, 4], target, [-1, 1])
    with pytest.raises(ValueError, match="one of the two"):
        ReceivedPayload(header)


def test_block_source_pieces_are_the_payload_without_copies():
    cache = seeded_cache(2)
    source = BlockSource(cache, [3, 4, 5, 9, 10, 2])
    pieces = source.pieces(2 * LAYOUT.block_num_bytes)  # runs of consecutive blocks, two at most
    assert [len(piece) // LAYOUT.block_num_bytes for piece in pieces] == [2, 1, 2, 1]
    assert b"".join(bytes(piece) for piece in pieces) == gather_blocks(cache, [3, 4, 5, 9, 10, 2]).numpy().tobytes()
    cache[4] = 0.0  # views of the cache, not copies
    assert bytes(pieces[0][LAYOUT.block_num_bytes :]) == bytes(LAYOUT.block_num_bytes)


def test_verify_names_what_differs():
    payload = gather_blocks(seeded_cache(2), [0, 1])
    data = memoryview(payload.view(-1).view(torch.uint8).numpy())
    header = header_for(payload, "t", 0, 8, 8, True)
    verify(header, data, FINGERPRINT, LAYOUT)
    with pytest.raises(KVVerificationError, match="fingerprint model-a differs from this worker's model-b"):
        verify(header, data, "model-b", LAYOUT)
    other = KVLayout(4, 2, 8, torch.bfloat16, 4)
    with pytest.raises(KVVerificationError, match="layout .* differs"):
        verify(header, data, FINGERPRINT, other)
    corrupted = bytearray(data)
    corrupted[5] ^= 0xFF
    with pytest.raises(KVVerificationError, match="Checksum mismatch"):
        verify(header, corrupted, FINGERPRINT, LAYOUT)
    with pytest.raises(KVVerificationError, match="bytes"):
        verify(header, bytes(data)[:-4], FINGERPRINT, LAYOUT)
    assert header.checksum == xxhash.xxh3_64_intdigest(bytes(data))


def test_a_payload_without_checksum_is_refused_unless_this_worker_takes_none():
    payload = gather_blocks(seeded_cache(0), [3, 7])
    header = header_for(payload, "t1", 0, 8, 11, False)
    header.checksum, header.checksum_type = 0, "none"
    header = TransferHeader.from_bytes(header.to_bytes())
    assert header.checksum_type == "none"
    data = bytearray(payload.numpy().tobytes())
    with pytest.raises(KVVerificationError, match="without a checksum .* same --kv-checksum"):
        verify(header, data, FINGERPRINT, LAYOUT)
    verify(header, data, FINGERPRINT, LAYOUT, checksum_type="none")
    # A worker that takes no checksums still checks everything else.
    with pytest.raises(KVVerificationError, match="layout .* differs"):
        verify(header, data, FINGERPRINT, KVLayout(4, 2, 8, torch.bfloat16, 4), checksum_type="none")
