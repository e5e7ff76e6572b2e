"""The ``p2p`` connector: torch.distributed point to point, one process group per prefill/decode pair.

No global process group and nothing external: the decode worker's KV endpoint
is a rendezvous server bound to its host, where each prefill worker that sends
to it proves the cluster token and gets a store of its own, over which the two
build a two-rank Gloo group for control and, for the blocks, the same group
(CPU caches) or an NCCL group (CUDA caches) (``p2p_pairs.py``,
``p2p_channels.py``, ``rendezvous_protocol.py``).
A send moves the payload's blocks straight from the cache in chunks of whole
blocks, each with its own header, and waits for the receiver's
acknowledgement (``p2p_wire.py``, which describes the messages). On the decode
side the rendezvous server starts one receive thread per pair (at most
``max_pairs``), which posts a ring
of chunks ahead and verifies and delivers each as it lands
(``p2p_receiver.py``). A peer that dies or stalls mid-send breaks only its
pair: the receiver reports the transfers that were open on it, the sender
raises.
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.blocks import BlockSource
from splitserve.kvtransfer.connector import (
    DroppedTransfers,
    KVConnector,
    KVEndpointInfo,
    OnError,
    OnPayload,
    ReceivedPayload,
)
from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.header import TransferHeader, payload_tensor, verify
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.p2p_channels import plane_name
from splitserve.kvtransfer.p2p_mapped import MAX_BLOCKS_PER_DESCRIPTOR
from splitserve.kvtransfer.p2p_pairs import RECEIVER, SenderPair, accept_pair, connect_pair
from splitserve.kvtransfer.p2p_receiver import PairReceiver
from splitserve.kvtransfer.p2p_wire import (
    FLAG_GOODBYE,
    GOODBYE_WAIT,
    MAX_CHUNK_BYTES,
    TAG_ACK,
    TAG_META,
    PairBroken,
    send_on_pair,
)
from splitserve.kvtransfer.rendezvous_server import RendezvousServer

logger = logging.getLogger(__name__)


class P2PConnector(KVConnector):
    """Options: ``host`` the rendezvous and Gloo bind (decode side, default 127.0.0.1; nothing listens on
    other addresses), ``cluster_token`` (the secret peers prove in the rendezvous; None: an open cluster, whose
    peers must be open too; never logged), ``max_pairs`` (prefill workers paired at once, default 64),
    ``connect_timeout_seconds``
    (default 10), ``send_timeout_seconds`` (a send's operations and its acknowledgement, default 120),
    ``receive_timeout_seconds`` (a sender silent mid-send or between the sends of a transfer, default 60),
    ``idle_timeout_seconds`` (a pair with no transfer open for this long is closed by the receiver, which frees
    what it holds of a sender gone without a word; the sender builds a new one for its next send; default 300),
    ``chunk_bytes`` (default 4 MiB),
    ``receive_slots`` (chunks the receiver posts ahead, default 8; a pair on mapped memory buffers nothing and
    sends a payload as one chunk, up to 1 GiB), ``checksum`` ("xxh3" or "none",
    see ``header.CHECKSUM_TYPES``), ``device`` (where the cache is: "cpu" or a CUDA device), ``cpu_data_plane``
    (how blocks between CPU caches travel, see ``p2p_channels.CPU_DATA_PLANES``: "control", the default; "gloo" and
    "shm" run the CUDA planes' protocols on CPU, for the tests)."""

    def __init__(self, worker_id: str, model_fingerprint: str, layout: KVLayout, host: str = "127.0.0.1",
                 connect_timeout_seconds: float = 10.0, send_timeout_seconds: float = 120.0,
                 receive_timeout_seconds: float = 60.0, idle_timeout_seconds: float = 300.0,
                 chunk_bytes: int = 4 << 20, receive_slots: int = 8,
                 checksum: str = "xxh3", cluster_token: str | None = None, max_pairs: int = 64,
                 device: str = "cpu", cpu_data_plane: str = "control") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            checksum = "none"
        self.cpu_data_plane = cpu_data_plane
        self.plane = plane_name(self.device, cpu_data_plane)  # refuses other devices and planes
        super().__init__(worker_id, model_fingerprint, layout, checksum)
        self.host = host
        self._cluster_token = cluster_token
        self.max_pairs = int(max_pairs)
        self.connect_timeout = timedelta(seconds=float(connect_timeout_seconds))
        self.send_timeout = timedelta(seconds=float(send_timeout_seconds))
        self.receive_timeout = timedelta(seconds=float(receive_timeout_seconds))
        self.idle_timeout = timedelta(seconds=float(idle_timeout_seconds))
        self.blocks_per_chunk = max(1, int(chunk_bytes) // layout.block_num_bytes)
        self.receive_slots = max(2, int(receive_slots))
        # On mapped memory nothing is buffered: a chunk is as large as a descriptor and the receiver allow.
        self.max_mapped_blocks_per_chunk = max(1, min(MAX_BLOCKS_PER_DESCRIPTOR,
                                                      MAX_CHUNK_BYTES // layout.block_num_bytes))
        self._rendezvous: RendezvousServer | None = None
        self._rendezvous_lock = threading.Lock()
        self._pairs: dict[str, SenderPair] = {}  # by destination address
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
        host = self.host if self.host not in ("0.0.0.0", "::", "") else socket.getfqdn()
        port = self._rendezvous_server().port
        return KVEndpointInfo("p2p", f"[{host}]:{port}" if ":" in host else f"{host}:{port}", self.worker_id,
                              {"backend": self.plane})

    def _rendezvous_server(self) -> RendezvousServer:
        """The rendezvous server at the KV endpoint (started on first use); pairs are accepted once
        ``start_receiving`` has given their payloads somewhere to go."""
        with self._rendezvous_lock:
            if self._closed.is_set():
                raise KVTransferError("The p2p connector is closed.")
            if self._rendezvous is None:
                try:
                    self._rendezvous = RendezvousServer(self.host, self._cluster_token, self._receive_pair,
                                                        self.connect_timeout, max_pairs=self.max_pairs)
                except OSError as error:
                    raise KVTransferError(f"Cannot listen for KV on {self.host}: {error}") from None
            return self._rendezvous

    def start_receiving(self, on_payload: OnPayload, on_error: OnError) -> None:
        self._on_payload, self._on_error = on_payload, on_error
        self._rendezvous_server().start()

    def cancel(self, transfer_id: str) -> None:
        self._dropped.add(transfer_id)

    def _receive_pair(self, index: int, peer: str, store: dist.Store, local_host: str) -> None:
        """One pair's receive thread (started by the rendezvous server): build this end, receive until it ends."""
        try:
            channels = accept_pair(store, index, local_host, self.connect_timeout, self.device,
                                   self.cpu_data_plane)
            self._receive_groups.append(channels)
        except Exception as error:
            logger.warning("KV pair %d could not be set up: %s", index, error)
            return
        logger.info("KV pair %d with %s ready (%s)", index, peer, channels.plane)
        try:
            PairReceiver(self, channels, f"{peer} (pair {index})").run()
        finally:
            channels.release()

    def _deliver(self, header: TransferHeader, data: torch.Tensor | BlockSource) -> None:
        """Verify one received payload (uint8 ``data`` on the cache's device, or the blocks in a mapped peer's
        memory) and hand it to the callback; refusals go to on_error, once per transfer."""
        if header.transfer_id in self._dropped or self._closed.is_set():
            return
        try:
            verify(header, data, self.model_fingerprint, self.layout, checksum_type=self.checksum_type)
            received = (ReceivedPayload(header, source=data) if isinstance(data, BlockSource)
                        else ReceivedPayload(header, payload_tensor(header, data)))
        except KVTransferError as error:
            self._dropped.add(header.transfer_id)
            self._on_error(header.transfer_id, error)
            return
        try:
            self._on_payload(received)
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
                    blocks_per_chunk = (min(max(1, source.num_blocks), self.max_mapped_blocks_per_chunk)
                                        if pair.channels.mapped else self.blocks_per_chunk)
                    send_on_pair(pair, header, source, blocks_per_chunk, self.send_timeout, self.checksum_type)
                    return
                except PairBroken as error:
                    self._drop_pair(pair)
                    if not reused or error.data_sent or self._closed.is_set():
                        raise KVTransferError(f"Sending KV to {destination.address} failed: {error}") from None
                    logger.info("KV pair to %s broke while idle (%s); building a new one", destination.address, error)

    def _pair_to(self, destination: KVEndpointInfo) -> tuple[SenderPair, bool]:
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
            pair = connect_pair(address, self.worker_id, self._cluster_token, self.connect_timeout,
                                self.send_timeout, self.device, self.cpu_data_plane)
            with self._pairs_lock:
                self._pairs[address] = pair
            return pair, False

    def _drop_pair(self, pair: SenderPair) -> None:
        with self._pairs_lock:
            if self._pairs.get(pair.address) is pair:
                del self._pairs[pair.address]

    def close(self) -> None:
        """Say goodbye on idle sender pairs (their receive threads end; on mapped memory each first drops this
        process's memory and says so), stop the watcher; returns within about a second a pair. Receive threads that
        wait on a live peer end when it sends or goes away."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._pairs_lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            if pair.lock.acquire(timeout=0.5):
                try:
                    goodbye = torch.tensor([0, 0, 0, 0, FLAG_GOODBYE], dtype=torch.int64)
                    pair.channels.control.send([goodbye], RECEIVER, TAG_META).wait(GOODBYE_WAIT)
                    if pair.channels.mapped:  # the receiver has let go of this process's memory
                        released = torch.empty(1, dtype=torch.int64)
                        pair.channels.control.recv([released], RECEIVER, TAG_ACK).wait(GOODBYE_WAIT)
                except Exception:
                    pass
                finally:
                    pair.lock.release()
        with self._rendezvous_lock:
            rendezvous, self._rendezvous = self._rendezvous, None
        if rendezvous is not None:
            rendezvous.close()
