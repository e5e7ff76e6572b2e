"""The ``p2p`` connector: torch.distributed point to point, one process group per prefill/decode pair.

No global process group and nothing external. The decode worker hosts a
``TCPStore`` (its KV endpoint address, ``host:port``). A prefill worker that
first sends to it connects to that store, takes a pair number (``add`` on a
counter), and both build a two-rank ``ProcessGroupGloo`` over the store under
that pair's prefix (prefill rank 0, decode rank 1): the decode side learns of
new pairs by watching the counter, so it needs no hint from the router. On
GPUs the same shape works with ``ProcessGroupNCCL`` when both caches are on
CUDA (chosen by the tensor's device); only Gloo runs on this CPU build.

One message per payload, on the pair in order: int64 [segments, segment
bytes], the payload in segments (one per layer), the header's length, then
the header (it follows the payload because its checksum is computed on the
way). Gathering, checksumming and the wire overlap: the sender gathers
layer i+1 (into a reused staging buffer) and checksums it while layer i is in
flight; the receiver posts every segment's receive into a reused buffer and
checksums segment i while later ones arrive. The receiver acknowledges once
the payload is in its memory, which is when ``send`` returns; it verifies
(fingerprint, layout, size, CRC-32) before the callback. A peer that dies
mid-transfer breaks only its pair.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.base import (BlockSource, KVConnector, KVEndpointInfo, KVLayout, KVTransferError, OnError,
                                        OnPayload, ReceivedPayload, TransferHeader, payload_layers, payload_num_bytes,
                                        payload_tensor, verify)

logger = logging.getLogger(__name__)

_PEERS_KEY = "splitserve/kv/peers"
_TAG_META, _TAG_HEADER, _TAG_PAYLOAD, _TAG_ACK, _TAG_HEADER_LENGTH = 0, 1, 2, 3, 4
_SENDER, _RECEIVER = 0, 1
_MIN_SEGMENT_BYTES = 2 << 20


class _RunningChecksum:
    """CRC-32 fed in order by one thread."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)


class _Pair:
    """One process group to one peer, used by one thread at a time."""

    def __init__(self, group, peer: str) -> None:
        self.group = group
        self.peer = peer
        self.lock = threading.Lock()
        self.broken = False
        # Reused for gathering BlockSource payloads (no page faults after the first sends).
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.checksummer = ThreadPoolExecutor(1, thread_name_prefix="p2p-crc")


class P2PConnector(KVConnector):
    """Options: ``host`` the store binds (decode side), ``connect_timeout_seconds`` (default 10),
    ``send_timeout_seconds`` (default 120)."""

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout, host: str = "127.0.0.1",
                 connect_timeout_seconds: float = 10.0, send_timeout_seconds: float = 120.0) -> None:
        super().__init__(worker_id, model_fingerprint, layout)
        self.host = host
        self.connect_timeout = timedelta(seconds=float(connect_timeout_seconds))
        self.send_timeout = timedelta(seconds=float(send_timeout_seconds))
        self._store: dist.TCPStore | None = None
        self._store_lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}  # sender side, by destination address
        self._pair_locks: dict[str, threading.Lock] = {}
        self._pairs_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._closed = threading.Event()
        self._on_payload: OnPayload | None = None
        self._on_error: OnError | None = None

    # ---- decode side ---------------------------------------------------------------------

    def endpoint(self) -> KVEndpointInfo:
        return KVEndpointInfo("p2p", f"{self.host}:{self._master_store().port}", self.worker_id, {"backend": "gloo"})

    def _master_store(self) -> dist.TCPStore:
        with self._store_lock:
            if self._store is None:
                self._store = dist.TCPStore(self.host, 0, None, True, timedelta(seconds=30), wait_for_workers=False)
                self._store.add(_PEERS_KEY, 0)
            return self._store

    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        self._on_payload, self._on_error = on_payload, on_error
        store = self._master_store()
        threading.Thread(target=self._watch_peers, args=(store,), name="p2p-peers", daemon=True).start()

    def cancel(self, transfer_id: str) -> None:
        with self._pairs_lock:
            self._cancelled.add(transfer_id)
            if len(self._cancelled) > 100_000:
                self._cancelled.clear()

    def _watch_peers(self, store: dist.TCPStore) -> None:
        known = 0
        while not self._closed.wait(0.02):
            try:
                count = store.add(_PEERS_KEY, 0)
            except Exception:  # the store is gone: closing
                return
            for index in range(known, count):
                threading.Thread(target=self._receive_from, args=(store, index), name=f"p2p-recv-{index}",
                                 daemon=True).start()
            known = count

    def _receive_from(self, store: dist.TCPStore, index: int) -> None:
        try:
            peer = store.get(f"splitserve/kv/peer/{index}").decode()
            # An idle pair must not time out: the receiver waits as long as the sender lives.
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"splitserve/kv/pair/{index}", store), _RECEIVER, 2,
                                          timedelta(days=1))
        except Exception as error:
            logger.warning("KV pair %d could not be set up: %s", index, error)
            return
        logger.info("KV pair %d with %s ready", index, peer)
        open_transfers: set[str] = set()  # transfers on this pair whose last payload has not come yet
        buffer = torch.empty(0, dtype=torch.uint8)  # reused: after the first payloads no page faults
        while not self._closed.is_set():
            try:
                meta = torch.empty(2, dtype=torch.int64)
                group.recv([meta], _SENDER, _TAG_META).wait()
                num_segments, segment_bytes = (int(value) for value in meta)
                if buffer.numel() < num_segments * segment_bytes:
                    buffer = torch.empty(num_segments * segment_bytes, dtype=torch.uint8)
                segments = [buffer[i * segment_bytes : (i + 1) * segment_bytes] for i in range(num_segments)]
                works = [group.recv([segment], _SENDER, _TAG_PAYLOAD) for segment in segments]
                header_length = torch.empty(1, dtype=torch.int64)
                length_work = group.recv([header_length], _SENDER, _TAG_HEADER_LENGTH)
                checksum = 0
                for work, segment in zip(works, segments):  # checksum segment i while later ones arrive
                    work.wait()
                    checksum = zlib.crc32(memoryview(segment.numpy()), checksum)
                length_work.wait()
                header_buffer = torch.empty(int(header_length), dtype=torch.uint8)
                group.recv([header_buffer], _SENDER, _TAG_HEADER).wait()
                header = TransferHeader.from_bytes(header_buffer.numpy().tobytes())
                open_transfers.add(header.transfer_id)
                group.send([torch.zeros(1, dtype=torch.int64)], _SENDER, _TAG_ACK).wait()
            except Exception as error:
                if self._closed.is_set():
                    return
                if not open_transfers:  # the sender went away between transfers: not an error
                    logger.info("KV pair %d with %s closed by the peer", index, peer)
                    return
                logger.warning("KV pair %d with %s broke mid-transfer: %s", index, peer, error)
                for transfer_id in open_transfers:
                    self._on_error(transfer_id, KVTransferError(f"the connection to {peer} broke: {error}"))
                return
            if header.is_last:
                open_transfers.discard(header.transfer_id)
            self._deliver(header, buffer[: num_segments * segment_bytes], checksum)

    def _deliver(self, header: TransferHeader, buffer: torch.Tensor, checksum: int) -> None:
        with self._pairs_lock:
            if header.transfer_id in self._cancelled:
                return
        try:
            data = memoryview(buffer.numpy())
            verify(header, data, self.model_fingerprint, self.layout, checksum=checksum)
            payload = payload_tensor(header, data)
        except KVTransferError as error:
            self._on_error(header.transfer_id, error)
            return
        try:
            self._on_payload(ReceivedPayload(header, payload))
        except Exception:
            logger.exception("KV payload handler failed for transfer %s", header.transfer_id)

    # ---- prefill side ----------------------------------------------------------------------

    def send(self, destination: KVEndpointInfo, header: TransferHeader, payload) -> None:
        for attempt in range(2):  # a pair the peer dropped (idle timeout, restart) is rebuilt once
            pair = self._pair_to(destination)
            try:
                with pair.lock:
                    if pair.broken:
                        raise KVTransferError("pair broken")
                    self._send_on(pair, header, payload)
                return
            except Exception as error:
                pair.broken = True
                self._drop_pair(destination.address, pair)
                if attempt == 1 or self._closed.is_set():
                    raise KVTransferError(f"Sending KV to {destination.address} failed: {error}") from None

    @staticmethod
    def _send_on(pair: _Pair, header: TransferHeader, payload) -> None:
        """Segments (one per layer) go out as they are gathered and checksummed; the header follows."""
        num_bytes = payload_num_bytes(payload)
        num_segments = payload.num_layers if isinstance(payload, BlockSource) else payload.shape[0]
        staging = None
        if isinstance(payload, BlockSource):
            if pair.staging.numel() < num_bytes:
                pair.staging = torch.empty(num_bytes, dtype=torch.uint8)
            staging = pair.staging
        header.payload_num_bytes = num_bytes
        layer_bytes = num_bytes // num_segments
        # Small layers go out a few at a time: fewer messages, same overlap.
        layers_per_segment = next(d for d in range(1, num_segments + 1)
                                  if num_segments % d == 0 and (d * layer_bytes >= _MIN_SEGMENT_BYTES or d == num_segments))
        num_segments //= layers_per_segment
        checksum = 0
        works = []
        pair.group.send([torch.tensor([num_segments, layer_bytes * layers_per_segment])], _RECEIVER, _TAG_META).wait()
        segment_start = None
        # The checksum runs on another thread (zlib releases the GIL), segment by segment in order,
        # while this one gathers and writes to the socket (Gloo writes a large send inline).
        running = _RunningChecksum()
        crc_future = None
        for index, layer in enumerate(payload_layers(payload, staging)):
            crc_future = pair.checksummer.submit(running.update, memoryview(layer.numpy()))
            if index % layers_per_segment == 0:
                segment_start = layer
            if index % layers_per_segment == layers_per_segment - 1:
                # Consecutive layers are adjacent in memory: the segment is one span from the first.
                span = torch.as_strided(segment_start, (layer_bytes * layers_per_segment,), (1,))
                works.append(pair.group.send([span], _RECEIVER, _TAG_PAYLOAD))
        crc_future.result()  # the single checksum thread runs the updates in order
        checksum = running.value
        if header.checksum is None:
            header.checksum = checksum & 0xFFFFFFFF
        header_bytes = header.to_bytes()
        works.append(pair.group.send([torch.tensor([len(header_bytes)])], _RECEIVER, _TAG_HEADER_LENGTH))
        works.append(pair.group.send([torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8)], _RECEIVER,
                                     _TAG_HEADER))
        for work in works:
            work.wait()
        pair.group.recv([torch.empty(1, dtype=torch.int64)], _RECEIVER, _TAG_ACK).wait()

    def _pair_to(self, destination: KVEndpointInfo) -> _Pair:
        address = destination.address
        with self._pairs_lock:
            pair = self._pairs.get(address)
            if pair is not None:
                return pair
            creation_lock = self._pair_locks.setdefault(address, threading.Lock())
        with creation_lock:
            with self._pairs_lock:
                if address in self._pairs:
                    return self._pairs[address]
            pair = self._connect(address)
            with self._pairs_lock:
                self._pairs[address] = pair
            return pair

    def _connect(self, address: str) -> _Pair:
        host, _, port = address.rpartition(":")
        started = time.monotonic()
        try:
            store = dist.TCPStore(host, int(port), None, False, self.connect_timeout)
            index = store.add(_PEERS_KEY, 1) - 1
            store.set(f"splitserve/kv/peer/{index}", self.worker_id)
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"splitserve/kv/pair/{index}", store), _SENDER, 2,
                                          self.send_timeout)
        except Exception as error:
            raise KVTransferError(f"Cannot reach the KV endpoint {address}: {error}") from None
        logger.info("KV pair %d to %s ready in %.2f s", index, address, time.monotonic() - started)
        pair = _Pair(group, address)
        pair.store = store  # keep the client connection alive with the group
        return pair

    def _drop_pair(self, address: str, pair: _Pair) -> None:
        with self._pairs_lock:
            if self._pairs.get(address) is pair:
                del self._pairs[address]

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._pairs_lock:
            self._pairs.clear()
        with self._store_lock:
            self._store = None
