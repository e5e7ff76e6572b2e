"""The data plane of a ``p2p`` pair whose two ends share one device's memory: the receiver copies each block
straight out of the sender's memory, mapped into its own process, into its own KV cache.

NCCL refuses two ranks on one GPU, but two processes on one GPU can map each other's allocations (CUDA IPC),
which is how a prefill and a decode worker that share a GPU pair. The sender exports the memory a block lives in
(the storage of its KV cache: once for as long as the pair lives) and sends, for each chunk, one descriptor
frame on the pair's control group where another plane would send the chunk's blocks: which exported memory, the
bytes of a block, and each block's offset in it. The receiver maps that memory the first time it is named and
checks the descriptor against it and against the chunk the META announced; what it delivers is then the
sender's blocks themselves (a ``BlockSource`` over the mapped memory, seen as rows of whole blocks where the
offsets fall on whole blocks, as a block-major cache's always do), which the decode worker copies into the
blocks it reserved in one pass (``ReceivedPayload.write_to``). No ring, no intermediate copy, nothing through
either host: a chunk is as large as a descriptor frame allows, so a prompt's KV is usually one chunk. The
blocks stay the sender's until the send's acknowledgement, which the receiver sends once every chunk is
delivered and its copies have finished.

CPU caches can share memory the same way (a shared-memory file, into which a sender moves what it sends, opened
by the receiver through ``/proc``): the ``shm`` plane, which is how the tests run this protocol on a machine
without a GPU. What differs between the two is two functions, how a storage is exported and how it is mapped
(``_EXPORTS``).

Both ends keep the same bounded list of exported memories, most recently named last, and drop the oldest past
``MAX_MAPPED`` in step (they see the same descriptors in the same order): a descriptor carries the export's
fields only when the sender names memory the list does not hold, and dropping a mapping lets its owner free it.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta

import torch

from splitserve.kvtransfer.blocks import BlockSource
from splitserve.kvtransfer.errors import KVTransferError

TAG_BLOCK = 4  # on the control group, beside p2p_wire's META, HEADER, PAYLOAD and ACK (0-3)
DESCRIPTOR_BASE_BYTES = 512  # a descriptor's head and export fields; each block's offset adds 8
MAX_DESCRIPTOR_BYTES = 1 << 20  # what a receiver will post for one (131,008 blocks a chunk)
MAX_MAPPED = 4  # exported memories each end keeps: a sender's KV cache, and a few gathered payloads
# The most blocks one chunk describes: its descriptor fits MAX_DESCRIPTOR_BYTES.
MAX_BLOCKS_PER_DESCRIPTOR = (MAX_DESCRIPTOR_BYTES - DESCRIPTOR_BASE_BYTES) // 8
_HEAD = struct.Struct("<qqqB")  # key, bytes of each block, number of blocks, number of export fields
_INT, _BYTES = 0, 1


def export_cuda(storage: torch.UntypedStorage) -> tuple:
    """A CUDA storage's IPC fields (torch's own: the allocation's handle, the storage's size and offset in it, a
    reference counter that keeps the allocation from being reused while mapped, and an event), less the device
    index, which the receiver takes from its own cache (the same GPU may have another index in its process)."""
    # (torch gives no event handle where none is needed: sent as empty bytes)
    return tuple(b"" if field is None else field for field in storage._share_cuda_()[1:])


def open_cuda(fields: tuple, device: torch.device) -> torch.UntypedStorage:
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle, size, offset, counter_handle, counter_offset, event_handle, event_sync = fields
    return torch.UntypedStorage._new_shared_cuda(index, handle, size, offset, counter_handle, counter_offset,
                                                 event_handle, bool(event_sync))


def _export_shm(storage: torch.UntypedStorage) -> tuple:
    """A CPU storage's shared-memory file, as this process's pid and descriptor (moved into shared memory in place
    first, where it is not yet there: its address changes, and what another thread writes into it during the move
    is lost, so a cache an engine writes goes into shared memory before its first step), and its size."""
    if not storage.is_shared():
        storage.share_memory_()
    descriptor, size = storage._share_fd_cpu_()
    return os.getpid(), descriptor, size


def _open_shm(fields: tuple, device: torch.device) -> torch.UntypedStorage:
    pid, descriptor, size = fields
    opened = os.open(f"/proc/{int(pid)}/fd/{int(descriptor)}", os.O_RDWR)
    try:
        return torch.UntypedStorage._new_shared_fd_cpu(opened, size)
    finally:
        os.close(opened)


_EXPORTS: dict[str, tuple[Callable, Callable]] = {"cuda": (export_cuda, open_cuda), "cpu": (_export_shm, _open_shm)}


def descriptor_bytes(blocks_per_chunk: int) -> int:
    """The frame of a chunk's descriptor, for chunks of at most ``blocks_per_chunk`` blocks."""
    return DESCRIPTOR_BASE_BYTES + 8 * blocks_per_chunk


def encode_descriptor(key: int, block_bytes: int, offsets: list[int], fields: tuple, frame_bytes: int) -> torch.Tensor:
    """A chunk's descriptor frame (uint8[frame_bytes], zero padded): the head, each export field as an int64 or as
    length-prefixed bytes, then each block's byte offset in the exported memory (int64)."""
    parts = [_HEAD.pack(key, block_bytes, len(offsets), len(fields))]
    for field in fields:
        if isinstance(field, (bytes, bytearray)):
            parts.append(struct.pack("<BH", _BYTES, len(field)) + bytes(field))
        else:
            parts.append(struct.pack("<Bq", _INT, int(field)))
    head = b"".join(parts)
    if len(head) > DESCRIPTOR_BASE_BYTES:
        raise KVTransferError(f"A KV descriptor's export fields take {len(head)} bytes, over {DESCRIPTOR_BASE_BYTES}.")
    encoded = head + struct.pack(f"<{len(offsets)}q", *offsets)
    if len(encoded) > frame_bytes:
        raise KVTransferError(f"A KV descriptor of {len(offsets)} blocks does not fit a frame of {frame_bytes} bytes.")
    frame = torch.zeros(frame_bytes, dtype=torch.uint8)
    frame[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return frame


def decode_descriptor(frame: bytes) -> tuple[int, int, list[int], tuple]:
    """(key, bytes of each block, each block's offset, export fields) of a descriptor frame.

    Raises:
        KVTransferError: the frame is not a descriptor (cut short, or a field of an unknown kind).
    """
    try:
        key, block_bytes, num_blocks, num_fields = _HEAD.unpack_from(frame)
        position, fields = _HEAD.size, []
        for _ in range(num_fields):
            (kind,) = struct.unpack_from("<B", frame, position)
            if kind == _INT:
                fields.append(struct.unpack_from("<q", frame, position + 1)[0])
                position += 9
            elif kind == _BYTES:
                (length,) = struct.unpack_from("<H", frame, position + 1)
                if position + 3 + length > len(frame):
                    raise struct.error("a field runs past the frame")
                fields.append(bytes(frame[position + 3 : position + 3 + length]))
                position += 3 + length
            else:
                raise struct.error(f"a field of kind {kind}")
        if not 0 <= num_blocks <= (len(frame) - position) // 8:
            raise struct.error(f"{num_blocks} block offsets in a frame of {len(frame)} bytes")
        offsets = list(struct.unpack_from(f"<{num_blocks}q", frame, position))
    except struct.error as error:
        raise KVTransferError(f"The KV peer sent an unreadable block descriptor ({error}).") from None
    return key, block_bytes, offsets, tuple(fields)


class MappedData:
    """The data plane of a pair on shared memory: ``send`` and ``recv`` of one chunk's blocks each, carried as a
    descriptor frame on ``control``; a receive's ``wait`` returns the blocks it names. One sender and one receiver
    per pair, each on one thread."""

    def __init__(self, control, device: torch.device) -> None:
        self.control = control
        self.device = device
        self._export, self._open = _EXPORTS[device.type]
        # (address, bytes) -> (key, the storage: held, so that its address names nothing else while listed)
        self._sent: OrderedDict[tuple[int, int], tuple[int, torch.UntypedStorage]] = OrderedDict()
        self._mapped: OrderedDict[int, torch.Tensor] = OrderedDict()  # key -> uint8 view of the peer's memory
        self._next_key = 0

    def begin(self) -> None:
        """Before describing a send's blocks: wait for the writes queued on this thread's stream, as an NCCL send
        waits for them (the receiver reads the blocks from its own stream, which knows nothing of this one's)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def send(self, cache: torch.Tensor, block_ids: list[int], dst: int, frame_bytes: int) -> _Sent:
        """Describe blocks ``block_ids`` of ``cache`` (``[num_blocks, ...]``, each block contiguous, written before
        ``begin``) to the receiver in a frame of ``frame_bytes``: export the cache's memory if the receiver has not
        mapped it, send the descriptor. Each block's offset is computed from the cache's strides: no tensor is made
        per block."""
        if cache.dim() < 1 or not cache[:1].is_contiguous():
            raise KVTransferError("The mapped plane sends whole blocks of a cache whose blocks are contiguous.")
        storage = cache.untyped_storage()
        listed, fields = self._sent.get((storage.data_ptr(), storage.nbytes())), ()
        if listed is None:
            key, self._next_key = self._next_key, self._next_key + 1
            fields = self._export(storage)  # may move a CPU storage into shared memory: addresses read after
            self._sent[(storage.data_ptr(), storage.nbytes())] = (key, storage)
            if len(self._sent) > MAX_MAPPED:
                self._sent.popitem(last=False)
        else:
            key = listed[0]
            self._sent.move_to_end((storage.data_ptr(), storage.nbytes()))
        element = cache.element_size()
        start, stride = cache.storage_offset() * element, cache.stride(0) * element
        offsets = [start + stride * block_id for block_id in block_ids]
        frame = encode_descriptor(key, cache[:1].numel() * element, offsets, fields, frame_bytes)
        return _Sent(self.control.send([frame], dst, TAG_BLOCK), frame)

    def recv(self, num_blocks: int, src: int, frame_bytes: int) -> _Receive:
        """Post the receive of one chunk of ``num_blocks`` blocks: its descriptor, in a frame of ``frame_bytes``.
        Its ``wait`` returns the blocks (``land``)."""
        if frame_bytes > MAX_DESCRIPTOR_BYTES:
            raise KVTransferError(f"The peer's chunks of this many blocks need descriptors of {frame_bytes} bytes, "
                                  f"over {MAX_DESCRIPTOR_BYTES}.")
        frame = torch.empty(frame_bytes, dtype=torch.uint8)
        return _Receive(self, self.control.recv([frame], src, TAG_BLOCK), frame, num_blocks)

    def land(self, frame: torch.Tensor, num_blocks: int, block_bytes: int) -> BlockSource:
        """The blocks a received descriptor names, where they lie in the peer's memory: rows of that memory (no
        copy; valid until this send is acknowledged), or, where they are not whole rows of it, a copy.

        Raises:
            KVTransferError: the descriptor is unreadable, names memory this end has not mapped, or blocks that
                are not inside it or not the chunk the META announced (the pair breaks: the peer does not speak
                this protocol).
        """
        key, described_bytes, offsets, fields = decode_descriptor(frame.numpy().tobytes())
        if fields:
            try:
                storage = self._open(fields, self.device)
            except (OSError, RuntimeError, TypeError, ValueError) as error:
                raise KVTransferError(f"Cannot map the KV peer's memory: {error}") from None
            self._mapped[key] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                storage, 0, (storage.nbytes(),), (1,))
            if len(self._mapped) > MAX_MAPPED:
                self._mapped.popitem(last=False)  # as the sender drops it: its owner may free it
        elif key in self._mapped:
            self._mapped.move_to_end(key)
        else:
            raise KVTransferError(f"The KV peer names memory {key}, which it never shared with this worker.")
        memory = self._mapped[key]
        if len(offsets) != num_blocks or described_bytes != block_bytes:
            raise KVTransferError(f"The KV peer describes {len(offsets)} blocks of {described_bytes} bytes; it "
                                  f"announced {num_blocks} of {block_bytes}.")
        if any(not 0 <= offset <= memory.numel() - block_bytes for offset in offsets):
            raise KVTransferError(f"The KV peer describes a block outside the {memory.numel()} bytes it shared.")
        if memory.numel() % block_bytes == 0 and all(offset % block_bytes == 0 for offset in offsets):
            return BlockSource(memory.view(-1, block_bytes), [offset // block_bytes for offset in offsets])
        rows = torch.empty(num_blocks, block_bytes, dtype=torch.uint8, device=self.device)
        for row, offset in zip(rows, offsets):
            row.copy_(memory[offset : offset + block_bytes])
        return BlockSource(rows, range(num_blocks))

    def finish(self) -> None:
        """Wait for the copies this end has queued (before the send's acknowledgement frees the sender's blocks)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def release(self) -> None:
        """Drop every mapping (the pair is over)."""
        self._mapped.clear()
        self._sent.clear()


class _Sent:
    def __init__(self, work, frame: torch.Tensor) -> None:
        self.work, self.frame = work, frame  # the frame stays referenced until it is sent

    def wait(self, timeout: timedelta) -> None:
        self.work.wait(timeout)


class _Receive:
    def __init__(self, plane: MappedData, work, frame: torch.Tensor, num_blocks: int) -> None:
        self.plane, self.work, self.frame, self.num_blocks = plane, work, frame, num_blocks

    def wait(self, timeout: timedelta, block_bytes: int) -> BlockSource:
        self.work.wait(timeout)
        return self.plane.land(self.frame, self.num_blocks, block_bytes)
