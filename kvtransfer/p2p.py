"""The ``p2p`` connector: torch.distributed point to point, one process group per prefill/decode pair.

No global process group and nothing external. The decode worker hosts a
``TCPStore`` (its KV endpoint address, ``host:port``). A prefill worker that
first sends to it connects to that store, takes a pair number (``add`` on a
counter), writes its worker id under that number, and builds a two-rank
``ProcessGroupGloo`` over the store under the pair's own prefix (prefill rank
0, decode rank 1). A watcher thread on the decode side sees the counter grow,
builds its end of the group and starts a receive thread for the pair, so it
needs no hint from the router. With CUDA caches the same shape works with
``ProcessGroupNCCL``; only Gloo is built here (see ``_new_pair_group``).

One send on a pair: the payload's blocks, grouped in chunks of whole blocks
(``chunk_bytes``), each chunk a payload of its own with its own header:

    META     int64[5]  num_blocks, blocks_per_chunk, block_bytes, header_frame_bytes,
                       flags (bit 0: goodbye; bits 8-15: this wire protocol's version, 2)
    per chunk: HEADER  uint8[header_frame_bytes]  the chunk's length-prefixed KVTransferHeader, zero padded
               BLOCK   uint8[block_bytes]         one message per block, straight from the cache
    ACK      int64[1]  from the decode side once every chunk is in its memory: 0, or 1 if it is closing

A block of the block-major cache is one contiguous piece, so the sender hands
Gloo the cache's own memory: nothing is gathered or copied on the prefill
side. Gloo moves a message only once the receiver has posted a buffer for it,
so the receiver posts a ring of chunks ahead (``receive_slots``) as soon as
META tells their sizes (its own layout never sizes a receive: a mismatched
size would abort the process inside Gloo; the header check refuses the
payload instead). The sender checksums chunk i+1 while chunk i's blocks are
on the wire; the receiver verifies and delivers chunk i while later ones
land. (A header after its blocks measured no faster, and would leave a
receiver that loses its peer mid-chunk not knowing which transfer broke.) A
peer that dies or stalls mid-send breaks only its pair: the receiver reports
the transfers that were open on it, the sender raises. A META of another
protocol version breaks the pair at once (the two workers run different
splitserve versions).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.base import (
    DroppedTransfers,
    KVConnector,
    KVEndpointInfo,
    KVLayout,
    KVTransferError,
    OnError,
    OnPayload,
    ReceivedPayload,
    TransferHeader,
    payload_tensor,
    verify,
)
from splitserve.kvtransfer.blocks import BlockSource, checksum_of_pieces

logger = logging.getLogger(__name__)

_PEERS_KEY = "splitserve/kv/peers"
_TAG_META, _TAG_HEADER, _TAG_PAYLOAD, _TAG_ACK = 0, 1, 2, 3
_SENDER, _RECEIVER = 0, 1
_FLAG_GOODBYE = 1
_PROTOCOL_VERSION = 2  # of the messages above; in META's flags, bits 8-15
# Bounds on what a META may ask the receiver to buffer (a ring holds receive_slots chunks).
_MAX_CHUNK_BYTES = 1 << 30
_MAX_FRAME_BYTES = 1 << 16
_ACK_OK, _ACK_CLOSING = 0, 1
_IDLE_TIMEOUT = timedelta(days=7)  # a pair may stay idle as long as both workers live


def _new_pair_group(store: dist.Store, index: int, rank: int, timeout: timedelta, device: torch.device):
    """The two-rank group of pair ``index``. Gloo for CPU caches; for CUDA caches the same call shape is
    ``ProcessGroupNCCL(prefix_store, rank, 2, options)``, which this CPU build does not have."""
    if device.type != "cpu":
        raise KVTransferError(f"The p2p connector runs Gloo on CPU caches only in this build, not {device}.")
    return dist.ProcessGroupGloo(dist.PrefixStore(f"splitserve/kv/pair/{index}", store), rank, 2, timeout)


class _PairBroken(Exception):
    def __init__(self, error: Exception, data_sent: bool) -> None:
        super().__init__(str(error))
        self.data_sent = data_sent


class _SenderPair:
    """The prefill end of one pair; one send at a time (``lock``)."""

    def __init__(self, group, store: dist.TCPStore, address: str) -> None:
        self.group = group
        self.store = store  # keeps the store connection alive with the group
        self.address = address
        self.lock = threading.Lock()


class P2PConnector(KVConnector):
    """Options: ``host`` the store binds (decode side, default 127.0.0.1), ``connect_timeout_seconds``
    (default 10), ``send_timeout_seconds`` (a send's operations and its acknowledgement, default 120),
    ``receive_timeout_seconds`` (a sender silent mid-send, default 60), ``chunk_bytes`` (default 4 MiB),
    ``receive_slots`` (chunks the receiver posts ahead, default 8), ``checksum`` ("xxh3" or "none",
    see ``base.CHECKSUM_TYPES``)."""

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout, host: str = "127.0.0.1",
                 connect_timeout_seconds: float = 10.0, send_timeout_seconds: float = 120.0,
                 receive_timeout_seconds: float = 60.0, chunk_bytes: int = 4 << 20, receive_slots: int = 8,
                 checksum: str = "xxh3") -> None:
        super().__init__(worker_id, model_fingerprint, layout, checksum)
        self.host = host
        self.connect_timeout = timedelta(seconds=float(connect_timeout_seconds))
        self.send_timeout = timedelta(seconds=float(send_timeout_seconds))
        self.receive_timeout = timedelta(seconds=float(receive_timeout_seconds))
        self.blocks_per_chunk = max(1, int(chunk_bytes) // layout.block_num_bytes)
        self.receive_slots = max(2, int(receive_slots))
        self._store: dist.TCPStore | None = None
        self._store_lock = threading.Lock()
        self._pairs: dict[str, _SenderPair] = {}  # by destination address
        self._pair_creation_locks: dict[str, threading.Lock] = {}
        self._pairs_lock = threading.Lock()
        self._dropped = DroppedTransfers()
        # Receiving groups stay referenced here: a Gloo group destroyed on a daemon thread while the
        # process exits can abort it ("terminate called without an active exception").
        self._receive_groups: list = []
        self._closed = threading.Event()
        self._on_payload: OnPayload | None = None
        self._on_error: OnError | None = None

    # ---- decode side ---------------------------------------------------------------------

    def endpoint(self) -> KVEndpointInfo:
        return KVEndpointInfo("p2p", f"{self.host}:{self._master_store().port}", self.worker_id, {"backend": "gloo"})

    def _master_store(self) -> dist.TCPStore:
        with self._store_lock:
            if self._closed.is_set():
                raise KVTransferError("The p2p connector is closed.")
            if self._store is None:
                self._store = dist.TCPStore(self.host, 0, None, True, timedelta(seconds=30), wait_for_workers=False)
                self._store.add(_PEERS_KEY, 0)
            return self._store

    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        self._on_payload, self._on_error = on_payload, on_error
        store = self._master_store()
        threading.Thread(target=self._watch_peers, args=(store,), name="p2p-peers", daemon=True).start()

    def cancel(self, transfer_id: str) -> None:
        self._dropped.add(transfer_id)

    def _watch_peers(self, store: dist.TCPStore) -> None:
        """Start a receive thread for every pair a prefill worker announces."""
        num_known = 0
        while not self._closed.wait(0.02):
            try:
                num_peers = store.add(_PEERS_KEY, 0)
            except Exception:  # the store is gone: closing
                return
            for index in range(num_known, num_peers):
                threading.Thread(target=self._receive_pair, args=(store, index), name=f"p2p-recv-{index}",
                                 daemon=True).start()
            num_known = num_peers

    def _receive_pair(self, store: dist.TCPStore, index: int) -> None:
        try:
            store.wait([f"splitserve/kv/peer/{index}"], self.connect_timeout)
            peer = store.get(f"splitserve/kv/peer/{index}").decode()
            group = _new_pair_group(store, index, _RECEIVER, self.connect_timeout, torch.device("cpu"))
            group._set_default_timeout(_IDLE_TIMEOUT)
            self._receive_groups.append(group)
        except Exception as error:
            logger.warning("KV pair %d could not be set up: %s", index, error)
            return
        logger.info("KV pair %d with %s ready", index, peer)
        _PairReceiver(self, group, f"{peer} (pair {index})").run()

    def _deliver(self, header: TransferHeader, data: torch.Tensor) -> None:
        """Verify one received payload (uint8 ``data``) and hand it to the callback; refusals go to on_error,
        once per transfer."""
        if header.transfer_id in self._dropped or self._closed.is_set():
            return
        try:
            view = memoryview(data.numpy())
            verify(header, view, self.model_fingerprint, self.layout, checksum_type=self.checksum_type)
            payload = payload_tensor(header, view)
        except KVTransferError as error:
            self._dropped.add(header.transfer_id)
            self._on_error(header.transfer_id, error)
            return
        try:
            self._on_payload(ReceivedPayload(header, payload))
        except Exception:
            logger.exception("KV payload handler failed for transfer %s", header.transfer_id)

    def _report_broken(self, peer: str, transfer_ids: set[str], error: Exception) -> None:
        if not transfer_ids:
            self._on_error(None, KVTransferError(f"The KV connection to {peer} broke: {error}"))
        for transfer_id in transfer_ids:
            if transfer_id not in self._dropped:
                self._dropped.add(transfer_id)
                self._on_error(transfer_id, KVTransferError(f"The KV connection to {peer} broke mid-transfer: "
                                                            f"{error}"))

    # ---- prefill side ----------------------------------------------------------------------

    def send(self, destination: KVEndpointInfo, header: TransferHeader, payload: torch.Tensor | BlockSource) -> None:
        source = BlockSource.of(payload)
        if source.num_blocks != header.num_blocks:
            raise KVTransferError(f"The header says {header.num_tokens} tokens ({header.num_blocks} blocks of "
                                  f"{header.layout.block_size}); the payload holds {source.num_blocks} blocks.")
        for _attempt in range(2):  # a cached pair whose peer went away (restart) is rebuilt once
            pair, reused = self._pair_to(destination)
            with pair.lock:
                try:
                    _send_on(pair, header, source, self.blocks_per_chunk, self.send_timeout, self.checksum_type)
                    return
                except _PairBroken as error:
                    self._drop_pair(pair)
                    if not reused or error.data_sent or self._closed.is_set():
                        raise KVTransferError(f"Sending KV to {destination.address} failed: {error}") from None
                    logger.info("KV pair to %s broke while idle (%s); building a new one", destination.address, error)

    def _pair_to(self, destination: KVEndpointInfo) -> tuple[_SenderPair, bool]:
        """The pair to ``destination``, and whether it existed already."""
        address = destination.address
        with self._pairs_lock:
            if self._closed.is_set():
                raise KVTransferError("The p2p connector is closed.")
            if address in self._pairs:
                return self._pairs[address], True
            creation_lock = self._pair_creation_locks.setdefault(address, threading.Lock())
        with creation_lock:
            with self._pairs_lock:
                if address in self._pairs:
                    return self._pairs[address], True
            pair = self._connect(address)
            with self._pairs_lock:
                self._pairs[address] = pair
            return pair, False

    def _connect(self, address: str) -> _SenderPair:
        host, _, port = address.rpartition(":")
        started = time.monotonic()
        timeout = self.connect_timeout.total_seconds()
        try:
            # A plain probe first: TCPStore retries a refused connection for 2.5x its timeout, loudly.
            socket.create_connection((host, int(port)), timeout).close()
            store = dist.TCPStore(host, int(port), None, False, self.connect_timeout)
            index = store.add(_PEERS_KEY, 1) - 1
            store.set(f"splitserve/kv/peer/{index}", self.worker_id)
            group = _new_pair_group(store, index, _SENDER, self.connect_timeout, torch.device("cpu"))
            group._set_default_timeout(self.send_timeout)
        except Exception as error:
            raise KVTransferError(f"Cannot reach the KV endpoint {address} within {timeout:g} s: {error}") from None
        logger.info("KV pair %d to %s ready in %.2f s", index, address, time.monotonic() - started)
        return _SenderPair(group, store, address)

    def _drop_pair(self, pair: _SenderPair) -> None:
        with self._pairs_lock:
            if self._pairs.get(pair.address) is pair:
                del self._pairs[pair.address]

    def close(self) -> None:
        """Say goodbye on idle sender pairs (their receive threads end), stop the watcher; returns within about
        a second. Receive threads that wait on a live peer end when it sends or goes away."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._pairs_lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            if pair.lock.acquire(timeout=0.5):
                try:
                    goodbye = torch.tensor([0, 0, 0, 0, _FLAG_GOODBYE], dtype=torch.int64)
                    pair.group.send([goodbye], _RECEIVER, _TAG_META).wait(timedelta(seconds=0.5))
                except Exception:
                    pass
                finally:
                    pair.lock.release()
        with self._store_lock:
            self._store = None


def _send_on(pair: _SenderPair, header: TransferHeader, source: BlockSource, blocks_per_chunk: int,
             timeout: timedelta, checksum_type: str) -> None:
    """One send on a pair (see the module docstring). Raises _PairBroken when the group fails."""
    if checksum_type == "none":
        header = dataclasses.replace(header, checksum=0, checksum_type="none")
    headers = _chunk_headers(header, source, blocks_per_chunk)
    compute_checksums = checksum_type != "none" and (len(headers) > 1 or header.checksum is None)
    # The checksum is fixed64: a nonzero value always takes the same bytes; 1 stands for any nonzero one.
    frame_bytes = max(len(dataclasses.replace(chunk, checksum=1).to_bytes()) for chunk in headers)
    flags = _PROTOCOL_VERSION << 8
    meta = torch.tensor([source.num_blocks, blocks_per_chunk, source.block_num_bytes, frame_bytes, flags],
                        dtype=torch.int64)
    try:
        pair.group.send([meta], _RECEIVER, _TAG_META).wait()
    except Exception as error:
        raise _PairBroken(error, data_sent=False) from None
    try:
        works, keep = [], []  # frames and blocks stay referenced until their sends complete
        for index, chunk in enumerate(headers):
            first_block = index * blocks_per_chunk
            blocks = [source.block(first_block + offset).contiguous().view(-1).view(torch.uint8)
                      for offset in range(chunk.num_blocks)]
            if compute_checksums:  # while the previous chunk's blocks are on the wire
                chunk.checksum = checksum_of_pieces(memoryview(block.numpy()) for block in blocks)
            keep.append((_frame(chunk, frame_bytes), blocks))
            works.append(pair.group.send([keep[-1][0]], _RECEIVER, _TAG_HEADER))
            works.extend(pair.group.send([block], _RECEIVER, _TAG_PAYLOAD) for block in blocks)
        for work in works:
            work.wait()
        status = torch.empty(1, dtype=torch.int64)
        pair.group.recv([status], _RECEIVER, _TAG_ACK).wait(timeout)
    except Exception as error:
        raise _PairBroken(error, data_sent=True) from None
    if int(status) == _ACK_CLOSING:
        raise _PairBroken(RuntimeError("the receiver is closing"), data_sent=True)


def _frame(header: TransferHeader, frame_bytes: int) -> torch.Tensor:
    """The length-prefixed header, zero padded to ``frame_bytes``."""
    encoded = header.to_bytes()
    frame = torch.zeros(frame_bytes, dtype=torch.uint8)
    frame[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return frame


def _chunk_headers(header: TransferHeader, source: BlockSource, blocks_per_chunk: int) -> list[TransferHeader]:
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


class _PairReceiver:
    """The decode end of one pair: receives sends in order on its own thread until the pair ends."""

    def __init__(self, connector: P2PConnector, group, peer: str) -> None:
        self.connector = connector
        self.group = group
        self.peer = peer
        self.ring = torch.empty(0, dtype=torch.uint8)  # receive_slots chunks, reused
        self.frames = torch.empty(0, dtype=torch.uint8)
        self.open_transfers: set[str] = set()  # seen on this pair, last payload not yet
        self.in_send = False  # between a META and the last chunk of its send

    def run(self) -> None:
        connector = self.connector
        meta = torch.empty(5, dtype=torch.int64)
        meta_work = self.group.recv([meta], _SENDER, _TAG_META)
        while True:
            try:
                meta_work.wait()  # idle: as long as the peer lives
                num_blocks, blocks_per_chunk, block_bytes, frame_bytes, flags = (int(value) for value in meta)
                if flags & _FLAG_GOODBYE:
                    logger.info("KV pair with %s closed by the peer", self.peer)
                    return
                if (flags >> 8) & 0xFF != _PROTOCOL_VERSION:
                    raise KVTransferError(f"The peer speaks p2p wire protocol {(flags >> 8) & 0xFF}, this worker "
                                          f"{_PROTOCOL_VERSION}: run the same splitserve version on both.")
                if not (num_blocks >= 0 and blocks_per_chunk >= 1 and 0 < block_bytes
                        and blocks_per_chunk * block_bytes <= _MAX_CHUNK_BYTES and 4 <= frame_bytes <= _MAX_FRAME_BYTES):
                    raise KVTransferError(f"The peer announced a send this worker will not buffer: {num_blocks} blocks "
                                          f"of {block_bytes} bytes, {blocks_per_chunk} a chunk, headers of "
                                          f"{frame_bytes} bytes.")
                next_meta = torch.empty(5, dtype=torch.int64)
                meta_work = self.group.recv([next_meta], _SENDER, _TAG_META)  # posted ahead: no bubble
                self.in_send = True
                self._receive_send(num_blocks, blocks_per_chunk, block_bytes, frame_bytes)
                self.in_send = False
                meta = next_meta
            except Exception as error:
                if not self.open_transfers and not self.in_send and not isinstance(error, KVTransferError):
                    logger.info("KV pair with %s closed by the peer", self.peer)
                else:
                    logger.warning("KV pair with %s broke: %s", self.peer, error)
                    if not connector._closed.is_set():
                        connector._report_broken(self.peer, self.open_transfers, error)
                return
            if connector._closed.is_set():
                return

    def _receive_send(self, num_blocks: int, blocks_per_chunk: int, block_bytes: int, frame_bytes: int) -> None:
        """Receive one send's chunks through the ring, delivering each as it lands; acknowledge the last."""
        num_chunks = max(1, -(-num_blocks // blocks_per_chunk))
        chunk_bytes = blocks_per_chunk * block_bytes
        num_slots = min(self.connector.receive_slots, num_chunks)
        if self.ring.numel() < num_slots * chunk_bytes:
            self.ring = torch.empty(num_slots * chunk_bytes, dtype=torch.uint8)
        if self.frames.numel() < num_slots * frame_bytes:
            self.frames = torch.empty(num_slots * frame_bytes, dtype=torch.uint8)

        def post(index: int):
            """Post chunk ``index``'s receives into ring slot ``index % num_slots``, header then blocks: (frame,
            its work, payload bytes, the works of its blocks)."""
            slot = index % num_slots
            chunk_blocks = min(blocks_per_chunk, num_blocks - index * blocks_per_chunk)
            frame = self.frames[slot * frame_bytes : (slot + 1) * frame_bytes]
            data = self.ring[slot * chunk_bytes : slot * chunk_bytes + chunk_blocks * block_bytes]
            frame_work = self.group.recv([frame], _SENDER, _TAG_HEADER)
            block_works = [self.group.recv([data[block * block_bytes : (block + 1) * block_bytes]], _SENDER,
                                           _TAG_PAYLOAD) for block in range(chunk_blocks)]
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
                work.wait(timeout)
            if index == num_chunks - 1:
                closing = self.connector._closed.is_set()
                status = torch.tensor([_ACK_CLOSING if closing else _ACK_OK], dtype=torch.int64)
                self.group.send([status], _SENDER, _TAG_ACK).wait(timeout)
            if header is not None:
                if header.is_last:
                    self.open_transfers.discard(header.transfer_id)
                self.connector._deliver(header, data)
            if index + num_slots < num_chunks:  # the slot is free again: post a later chunk into it
                posted[index % num_slots] = post(index + num_slots)

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
