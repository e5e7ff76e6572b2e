"""The ``p2p`` connector's wire protocol (version 2), and the sending end of one send.

One send on a pair: the payload's blocks, grouped in chunks of whole blocks
(``chunk_bytes``), each chunk a payload of its own with its own header:

    META     int64[5]  num_blocks, blocks_per_chunk, block_bytes, header_frame_bytes,
                       flags (bit 0: goodbye; bits 8-15: this wire protocol's version, 2)
    per chunk: HEADER  uint8[header_frame_bytes]  the chunk's length-prefixed KVTransferHeader, zero padded
               BLOCK   uint8[block_bytes]         one message per block, straight from the cache
                                                  (on a mapped plane, one descriptor for the chunk's
                                                  blocks instead: p2p_mapped.py)
    ACK      int64[1]  from the decode side once every chunk is in its memory (on a mapped plane: once
                       every chunk is delivered and copied out of the sender's): 0, or 1 if it is closing

A sender that closes sends a META with the goodbye flag on each idle pair; on a
mapped plane the receiver drops the sender's memory and answers with an ACK,
which the sender waits for (briefly) before it may exit.

META, HEADER and ACK go on the pair's control group (Gloo, on the host), the
blocks on its data group (the same Gloo group for CPU caches, NCCL for CUDA
ones: ``p2p_channels.py``). A block of the block-major cache is one contiguous
piece, so the sender hands the group the cache's own memory: nothing is
gathered or copied on the prefill side. The sender checksums chunk i+1 while
chunk i's blocks are on the wire (CPU caches; on CUDA the blocks never reach
the host, and the connector sends without checksums). The receiving end is
``p2p_receiver.py``.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

from splitserve.kvtransfer.blocks import BlockSource, checksum_of_pieces
from splitserve.kvtransfer.header import TransferHeader
from splitserve.kvtransfer.p2p_pairs import RECEIVER, SenderPair

TAG_META, TAG_HEADER, TAG_PAYLOAD, TAG_ACK = 0, 1, 2, 3
FLAG_GOODBYE = 1
PROTOCOL_VERSION = 2  # of the messages above; in META's flags, bits 8-15
# Bounds on what a META may ask the receiver to buffer (a ring holds receive_slots chunks).
MAX_CHUNK_BYTES = 1 << 30
MAX_FRAME_BYTES = 1 << 16
ACK_OK, ACK_CLOSING = 0, 1
GOODBYE_WAIT = timedelta(seconds=0.5)  # for a goodbye to go out, and on a mapped plane for its acknowledgement


class PairBroken(Exception):
    """The pair's group failed during a send; ``data_sent`` is False only when the META itself did not go out."""

    def __init__(self, error: Exception, data_sent: bool) -> None:
        super().__init__(str(error))
        self.data_sent = data_sent


def send_on_pair(pair: SenderPair, header: TransferHeader, source: BlockSource, blocks_per_chunk: int,
                 timeout: timedelta, checksum_type: str) -> None:
    """One send on a pair (see the module docstring). Raises PairBroken when the group fails."""
    if checksum_type == "none":
        header = dataclasses.replace(header, checksum=0, checksum_type="none")
    headers = chunk_headers(header, source, blocks_per_chunk)
    compute_checksums = checksum_type != "none" and (len(headers) > 1 or header.checksum is None)
    # The checksum is fixed64: a nonzero value always takes the same bytes; 1 stands for any nonzero one.
    frame_bytes = max(len(dataclasses.replace(chunk, checksum=1).to_bytes()) for chunk in headers)
    flags = PROTOCOL_VERSION << 8
    meta = torch.tensor([source.num_blocks, blocks_per_chunk, source.block_num_bytes, frame_bytes, flags],
                        dtype=torch.int64)
    channels = pair.channels
    try:
        channels.control.send([meta], RECEIVER, TAG_META).wait()
    except Exception as error:
        raise PairBroken(error, data_sent=False) from None
    try:
        with channels.device_scope():
            channels.begin_data()
            control_works, data_works, keep = [], [], []  # frames and blocks stay referenced until sent
            for index, chunk in enumerate(headers):
                first_block = index * blocks_per_chunk
                blocks = [] if channels.mapped and not compute_checksums else [
                    source.block(first_block + offset).contiguous().view(-1).view(torch.uint8)
                    for offset in range(chunk.num_blocks)]
                if compute_checksums:  # while the previous chunk's blocks are on the wire
                    chunk.checksum = checksum_of_pieces(memoryview(block.numpy()) for block in blocks)
                keep.append((header_frame(chunk, frame_bytes), blocks))
                control_works.append(channels.control.send([keep[-1][0]], RECEIVER, TAG_HEADER))
                if channels.mapped:  # one descriptor: where the blocks lie in the cache
                    data_works.extend(channels.send_described(
                        source.kv_cache, source.block_ids[first_block : first_block + chunk.num_blocks], RECEIVER,
                        blocks_per_chunk))
                else:
                    data_works.extend(channels.send_blocks(blocks, RECEIVER, TAG_PAYLOAD))
            for work in control_works:
                work.wait()
            for work in data_works:
                channels.wait_data(work, timeout)
        status = torch.empty(1, dtype=torch.int64)
        channels.control.recv([status], RECEIVER, TAG_ACK).wait(timeout)
    except Exception as error:
        raise PairBroken(error, data_sent=True) from None
    if int(status) == ACK_CLOSING:
        raise PairBroken(RuntimeError("the receiver is closing"), data_sent=True)


def header_frame(header: TransferHeader, frame_bytes: int) -> torch.Tensor:
    """The length-prefixed header, zero padded to ``frame_bytes``."""
    encoded = header.to_bytes()
    frame = torch.zeros(frame_bytes, dtype=torch.uint8)
    frame[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return frame


def chunk_headers(header: TransferHeader, source: BlockSource, blocks_per_chunk: int) -> list[TransferHeader]:
    """The headers of the payloads ``header``'s payload is sent as: runs of ``blocks_per_chunk`` whole blocks."""
    block_size = header.layout.block_size
    headers = []
    for first_block in range(0, max(source.num_blocks, 1), blocks_per_chunk):
        num_blocks = min(blocks_per_chunk, source.num_blocks - first_block)
        first_token = first_block * block_size
        is_last = first_block + num_blocks >= source.num_blocks
        headers.append(dataclasses.replace(
            header, first_token_position=header.first_token_position + first_token,
            num_tokens=min(num_blocks * block_size, header.num_tokens - first_token),
            payload_num_bytes=num_blocks * source.block_num_bytes, is_last=header.is_last and is_last,
            first_token_id=header.first_token_id if is_last else None,
        ))
    return headers
