"""The decode end of one ``p2p`` pair: a thread that receives its sends through a ring of chunks.

META, header frames and the acknowledgement go on the pair's control group,
the blocks on its data plane, into a ring where the cache is (host memory,
or the GPU for a CUDA cache: ``p2p_channels.py``). On one GPU (a mapped
plane, ``p2p_mapped.py``) there is no ring: each chunk's blocks are delivered
where they lie in the sender's mapped cache, and the decode worker copies
them into its own. Gloo (and NCCL) move a message only once the receiver has posted a buffer
for it, so
the receiver posts a ring of chunks ahead (``receive_slots``) as soon as META
(``p2p_wire.py``) tells their sizes (its own layout never sizes a receive: a
mismatched size would abort the process inside Gloo; the header check refuses
the payload instead). It verifies and delivers chunk i while later ones land.
(A header after its blocks measured no faster, and would leave a receiver
that loses its peer mid-chunk not knowing which transfer broke.) A peer that
dies or stalls mid-send breaks only its pair: the receiver reports the
transfers that were open on it. A META of another protocol version breaks the
pair at once (the two workers run different splitserve versions).
"""

from __future__ import annotations

import logging
import struct
import time
from typing import TYPE_CHECKING

import torch

from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.header import TransferHeader
from splitserve.kvtransfer.p2p_pairs import SENDER
from splitserve.kvtransfer.p2p_wire import (
    ACK_CLOSING,
    ACK_OK,
    FLAG_GOODBYE,
    GOODBYE_WAIT,
    MAX_CHUNK_BYTES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    TAG_ACK,
    TAG_HEADER,
    TAG_META,
    TAG_PAYLOAD,
)

if TYPE_CHECKING:
    from splitserve.kvtransfer.p2p import P2PConnector
    from splitserve.kvtransfer.p2p_channels import PairChannels

logger = logging.getLogger(__name__)


class PairReceiver:
    """The decode end of one pair: receives sends in order on its own thread until the pair ends."""

    def __init__(self, connector: P2PConnector, channels: PairChannels, peer: str) -> None:
        self.connector = connector
        self.channels = channels
        self.peer = peer
        self.ring = channels.buffer(0)  # receive_slots chunks, reused, on the cache's device
        self.frames = torch.empty(0, dtype=torch.uint8)
        self.open_transfers: set[str] = set()  # seen on this pair, last payload not yet
        self.in_send = False  # between a META and the last chunk of its send

    def run(self) -> None:
        connector = self.connector
        meta = torch.empty(5, dtype=torch.int64)
        meta_work = self.channels.control.recv([meta], SENDER, TAG_META)
        while True:
            idle_since = None
            try:
                if self.open_transfers:
                    # A transfer is part-way: its next send comes when the sender's next prefill step is done,
                    # which on a slow or busy worker takes longer than the group's own (connect) timeout.
                    meta_work.wait(connector.receive_timeout)
                else:  # idle: up to the idle timeout, after which the pair closes (the sender builds a new one)
                    idle_since = time.monotonic()
                    meta_work.wait(connector.idle_timeout)
                num_blocks, blocks_per_chunk, block_bytes, frame_bytes, flags = (int(value) for value in meta)
                if flags & FLAG_GOODBYE:
                    logger.info("KV pair with %s closed by the peer", self.peer)
                    self._release_for_goodbye()
                    return
                if (flags >> 8) & 0xFF != PROTOCOL_VERSION:
                    raise KVTransferError(f"The peer speaks p2p wire protocol {(flags >> 8) & 0xFF}, this worker "
                                          f"{PROTOCOL_VERSION}: run the same splitserve version on both.")
                if not (num_blocks >= 0 and blocks_per_chunk >= 1 and 0 < block_bytes
                        and blocks_per_chunk * block_bytes <= MAX_CHUNK_BYTES and 4 <= frame_bytes <= MAX_FRAME_BYTES):
                    raise KVTransferError(f"The peer announced a send this worker will not buffer: {num_blocks} blocks "
                                          f"of {block_bytes} bytes, {blocks_per_chunk} a chunk, headers of "
                                          f"{frame_bytes} bytes.")
                next_meta = torch.empty(5, dtype=torch.int64)
                meta_work = self.channels.control.recv([next_meta], SENDER, TAG_META)  # posted ahead: no bubble
                self.in_send = True
                with self.channels.device_scope():
                    if self.channels.mapped:
                        self._receive_mapped_send(num_blocks, blocks_per_chunk, block_bytes, frame_bytes)
                    else:
                        self._receive_send(num_blocks, blocks_per_chunk, block_bytes, frame_bytes)
                self.in_send = False
                meta = next_meta
            except Exception as error:
                idle_for = None if idle_since is None else time.monotonic() - idle_since
                if idle_for is not None and idle_for >= connector.idle_timeout.total_seconds():
                    logger.info("KV pair with %s idle for %.0f s: closed (the sender pairs again when it next "
                                "sends)", self.peer, idle_for)
                elif not self.open_transfers and not self.in_send and not isinstance(error, KVTransferError):
                    logger.info("KV pair with %s closed by the peer", self.peer)
                else:
                    logger.warning("KV pair with %s broke: %s", self.peer, error)
                    if not connector._closed.is_set():
                        connector._report_broken(self.peer, self.open_transfers, error)
                return
            if connector._closed.is_set():
                return

    def _release_for_goodbye(self) -> None:
        """On a mapped plane, drop the peer's memory and say so before the peer exits: an exporter that leaves while
        its memory is mapped keeps it from being freed (CUDA: torch warns at its exit). A group has nothing to drop."""
        if not self.channels.mapped:
            return
        self.channels.release()
        try:
            self.channels.control.send([torch.tensor([ACK_OK], dtype=torch.int64)], SENDER, TAG_ACK).wait(GOODBYE_WAIT)
        except Exception:  # the peer did not wait for it
            pass

    def _receive_send(self, num_blocks: int, blocks_per_chunk: int, block_bytes: int, frame_bytes: int) -> None:
        """Receive one send's chunks through the ring, delivering each as it lands; acknowledge the last."""
        num_chunks = max(1, -(-num_blocks // blocks_per_chunk))
        chunk_bytes = blocks_per_chunk * block_bytes
        num_slots = min(self.connector.receive_slots, num_chunks)
        if self.ring.numel() < num_slots * chunk_bytes:
            self.ring = self.channels.buffer(num_slots * chunk_bytes)
        if self.frames.numel() < num_slots * frame_bytes:
            self.frames = torch.empty(num_slots * frame_bytes, dtype=torch.uint8)

        def post(index: int):
            """Post chunk ``index``'s receives into ring slot ``index % num_slots``, header then blocks: (frame,
            its work, payload bytes, the works of its blocks)."""
            slot = index % num_slots
            chunk_blocks = min(blocks_per_chunk, num_blocks - index * blocks_per_chunk)
            frame = self.frames[slot * frame_bytes : (slot + 1) * frame_bytes]
            data = self.ring[slot * chunk_bytes : slot * chunk_bytes + chunk_blocks * block_bytes]
            frame_work = self.channels.control.recv([frame], SENDER, TAG_HEADER)
            block_works = self.channels.recv_blocks(data, chunk_blocks, SENDER, TAG_PAYLOAD)
            return frame, frame_work, data, block_works

        posted = [post(index) for index in range(num_slots)]
        timeout = self.connector.receive_timeout
        for index in range(num_chunks):
            frame, frame_work, data, block_works = posted[index % num_slots]
            frame_work.wait(timeout)
            header = self._parse_frame(frame)
            if header is not None:  # known before its blocks land: a peer lost mid-chunk fails this transfer
                self.open_transfers.add(header.transfer_id)
            for work in block_works:
                self.channels.wait_data(work, timeout)
            if index == num_chunks - 1:
                self.channels.finish_data()  # every block in place before the sender may reuse its own
                closing = self.connector._closed.is_set()
                status = torch.tensor([ACK_CLOSING if closing else ACK_OK], dtype=torch.int64)
                self.channels.control.send([status], SENDER, TAG_ACK).wait(timeout)
            if header is not None:
                if header.is_last:
                    self.open_transfers.discard(header.transfer_id)
                self.connector._deliver(header, data)
            if index + num_slots < num_chunks:  # the slot is free again: post a later chunk into it
                posted[index % num_slots] = post(index + num_slots)

    def _receive_mapped_send(self, num_blocks: int, blocks_per_chunk: int, block_bytes: int, frame_bytes: int) -> None:
        """Receive one send on a mapped plane: each chunk's header and descriptor (posted a chunk ahead), its blocks
        delivered where they lie in the sender's memory (the callback copies them into the cache); acknowledged
        once every chunk is delivered and the copies have finished, since the blocks are the sender's until then."""
        num_chunks = max(1, -(-num_blocks // blocks_per_chunk))
        ahead = min(2, num_chunks)
        if self.frames.numel() < ahead * frame_bytes:
            self.frames = torch.empty(ahead * frame_bytes, dtype=torch.uint8)

        def post(index: int):
            frame = self.frames[index % ahead * frame_bytes : (index % ahead + 1) * frame_bytes]
            chunk_blocks = min(blocks_per_chunk, num_blocks - index * blocks_per_chunk)
            return (frame, self.channels.control.recv([frame], SENDER, TAG_HEADER),
                    self.channels.recv_described(chunk_blocks, SENDER, blocks_per_chunk))

        posted = [post(index) for index in range(ahead)]
        timeout = self.connector.receive_timeout
        for index in range(num_chunks):
            frame, frame_work, described = posted[index % ahead]
            frame_work.wait(timeout)
            header = self._parse_frame(frame)
            if header is not None:
                self.open_transfers.add(header.transfer_id)
            blocks = described.wait(timeout, block_bytes)
            if header is not None:
                self.connector._deliver(header, blocks)
                if header.is_last:
                    self.open_transfers.discard(header.transfer_id)
            if index + ahead < num_chunks:
                posted[index % ahead] = post(index + ahead)
        self.channels.finish_data()
        closing = self.connector._closed.is_set()
        status = torch.tensor([ACK_CLOSING if closing else ACK_OK], dtype=torch.int64)
        self.channels.control.send([status], SENDER, TAG_ACK).wait(timeout)

    def _parse_frame(self, frame: torch.Tensor) -> TransferHeader | None:
        """The header in a frame, or None after reporting why it is unreadable (its payload is dropped)."""
        data = frame.numpy().tobytes()
        try:
            (length,) = struct.unpack_from("<I", data)
            if 4 + length > len(data):
                raise KVTransferError(f"A KV header frame of {len(data)} bytes says {length} header bytes follow.")
            return TransferHeader.from_bytes(data[: 4 + length])
        except KVTransferError as error:
            transfer_id = getattr(error, "transfer_id", None)
            if transfer_id is None or transfer_id not in self.connector._dropped:
                if transfer_id is not None:
                    self.connector._dropped.add(transfer_id)
                self.connector._on_error(transfer_id, error)
            return None
