"""The two channels of a ``p2p`` pair: control on the host, block data where the caches are.

Control (META, header frames, acknowledgements: small host tensors, matched by
tag) always runs on a Gloo group. The blocks run on the data plane:

- CPU caches: the control group itself (one Gloo group, nothing extra); for
  the tests, a second Gloo group (``cpu_data_plane="gloo"``: the NCCL path's
  two-group protocol on CPU) or shared memory (``"shm"``: the one-GPU path's
  protocol on CPU, ``p2p_mapped.py``);
- CUDA caches on two GPUs: a ``ProcessGroupNCCL`` over the same pair store, so
  the blocks go from one GPU's cache to the other's without touching either host;
- CUDA caches on one GPU (NCCL refuses two ranks on one device): CUDA IPC, the
  receiver copying each block out of the sender's cache, mapped into its own
  process (``p2p_mapped.py``).

Everything else (rendezvous, META, headers, chunking, the receive ring, failure
handling) is the same code for all; what differs is here: how a group is
built, where buffers live, and how a data operation is waited for. NCCL matches
sends to receives by order, not by tag, so only blocks ever travel on the data
group (in order on both ends). Both ends of a CUDA pair publish their GPU's
UUID: the same GPU on both sides takes CUDA IPC, two take NCCL.

Both ends publish their plane's name in the pair store before building groups;
a pair whose ends differ (a CPU cache on one side, a CUDA cache on the other) is
refused with a sentence instead of hanging in a group that can never form.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.p2p_mapped import MappedData, descriptor_bytes

_POLL_SECONDS = 0.0002  # between completion checks of a data operation on a CUDA cache


CPU_DATA_PLANES = {"control": "gloo", "gloo": "gloo+gloo", "shm": "gloo+shm"}
SAME_GPU_PLANE = "gloo+cuda-ipc"  # what "gloo+nccl" becomes where both ends hold their caches on one GPU


def plane_name(device: torch.device, cpu_data_plane: str = "control") -> str:
    """The name a pair's end announces: "gloo" (one group), "gloo+gloo", "gloo+shm" (CPU caches; see
    ``CPU_DATA_PLANES``) or "gloo+nccl" (CUDA caches: NCCL, or CUDA IPC once both ends find one GPU)."""
    if device.type not in ("cpu", "cuda"):
        raise KVTransferError(f"The p2p connector moves KV between CPU or CUDA caches, not {device} ones.")
    if cpu_data_plane not in CPU_DATA_PLANES:
        raise KVTransferError(f"cpu_data_plane must be one of {', '.join(CPU_DATA_PLANES)}, not {cpu_data_plane!r}.")
    if device.type == "cuda":
        if cpu_data_plane != "control":
            raise KVTransferError("cpu_data_plane applies to CPU caches; a CUDA cache's plane follows its GPU.")
        return "gloo+nccl"
    return CPU_DATA_PLANES[cpu_data_plane]


class PairChannels:
    """One end of a pair: ``control`` (Gloo) and ``data`` (Gloo, NCCL or mapped memory; maybe ``control``
    itself), over ``plane``."""

    def __init__(self, control, data, device: torch.device, plane: str) -> None:
        self.control = control
        self.data = data
        self.device = device
        self.plane = plane
        self.on_cuda = device.type == "cuda"
        self.over_nccl = plane == "gloo+nccl"
        self.mapped = isinstance(data, MappedData)

    def buffer(self, num_bytes: int) -> torch.Tensor:
        """A uint8 buffer for received blocks, where the data group writes them."""
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def wait_data(self, work, timeout: timedelta) -> None:
        """Wait for a data-group operation. A Gloo work waits itself (a mapped block's lands as it does); an NCCL
        work is polled (its own wait only orders the CUDA streams) until its kernel has finished, so that the
        bytes are in place when this returns and a peer that stalls is seen within ``timeout``.

        Raises:
            TimeoutError: the NCCL operation did not finish in time (its communicator is aborted).
        """
        if not self.over_nccl:
            work.wait(timeout)
            return
        deadline = time.monotonic() + timeout.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"an NCCL block transfer did not finish within {timeout.total_seconds():g} s")
            time.sleep(_POLL_SECONDS)
        work.wait()  # raises the communicator's error, if it failed

    def send_blocks(self, blocks: list[torch.Tensor], peer: int, tag: int) -> list:
        """Send one chunk's blocks (contiguous uint8 tensors) on a group's data plane, a message each. Returns the
        works to wait for (``wait_data``)."""
        return [self.data.send([block], peer, tag) for block in blocks]

    def send_described(self, cache: torch.Tensor, block_ids: list[int], peer: int, blocks_per_chunk: int) -> list:
        """On a mapped plane, send one chunk's descriptor: blocks ``block_ids`` of ``cache``. Returns the works to
        wait for (``wait_data``)."""
        return [self.data.send(cache, block_ids, peer, descriptor_bytes(blocks_per_chunk))]

    def recv_blocks(self, data: torch.Tensor, num_blocks: int, peer: int, tag: int) -> list:
        """Post the receives of one chunk of ``num_blocks`` blocks into ``data`` (uint8, where the blocks land in
        order), as ``send_blocks`` sends them on a group. Returns the works to wait for (``wait_data``)."""
        block_bytes = data.numel() // max(1, num_blocks)
        return [self.data.recv([data[block * block_bytes : (block + 1) * block_bytes]], peer, tag)
                for block in range(num_blocks)]

    def recv_described(self, num_blocks: int, peer: int, blocks_per_chunk: int):
        """On a mapped plane, post the receive of one chunk's descriptor; its ``wait(timeout, block_bytes)`` returns
        the chunk's blocks where they lie in the peer's memory (``MappedData.land``)."""
        return self.data.recv(num_blocks, peer, descriptor_bytes(blocks_per_chunk))

    def begin_data(self) -> None:
        """Before a send's blocks go: on a mapped plane, wait for their writes (a group orders its own)."""
        if self.mapped:
            self.data.begin()

    def finish_data(self) -> None:
        """Before acknowledging a send: wait for what the data plane queued without waiting (the copies out of a
        mapped peer's memory; nothing on a group, whose waits are complete)."""
        if self.mapped:
            self.data.finish()

    def abort(self) -> None:
        """Abort an NCCL data group (its pending operations end; the process goes on)."""
        abort = getattr(self.data, "abort", None)
        if self.over_nccl and abort is not None:
            try:
                abort()
            except Exception:  # already aborted or torn down
                pass

    def release(self) -> None:
        """Drop what the data plane holds of the peer (mapped memory; nothing on a group): the pair is over."""
        if self.mapped:
            self.data.release()

    def device_scope(self):
        """A context in which this thread's CUDA operations run on the cache's device (nothing on CPU)."""
        return torch.cuda.device(self.device) if self.on_cuda else _NoScope()


class _NoScope:
    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        return None


def build_channels(store: dist.Store, index: int, rank: int, timeout: timedelta, device: torch.device,
                   host: str | None, cpu_data_plane: str = "control") -> PairChannels:
    """This end's channels of pair ``index`` over the pair's ``store``: publish this end's plane, check the
    peer's (and for CUDA caches whether both are on one GPU), then build the groups (Gloo sockets bound to
    ``host``; None: Gloo's default, the hostname).

    Raises:
        KVTransferError: the peer's plane differs from this end's (a sentence naming both), or this build of
            torch has no NCCL for CUDA caches on two GPUs.
        Whatever Gloo or the store raise when the peer does not come within ``timeout``.
    """
    plane = plane_name(device, cpu_data_plane)
    prefix = f"splitserve/kv/pair/{index}"
    peer_plane = _exchange(store, f"{prefix}/plane", rank, plane, timeout)
    if peer_plane != plane:
        _refuse(store, f"{prefix}/plane", rank, timeout, KVTransferError(
            f"The KV peer moves blocks over {peer_plane}, this worker over {plane}: both ends of a p2p pair need "
            "their KV caches on the same kind of device (CPU: Gloo; CUDA: NCCL) and the same options."
        ))
    if plane == "gloo+nccl":
        identity = gpu_identity(device)
        if same_gpu(identity, _exchange(store, f"{prefix}/gpu", rank, identity, timeout)):
            plane = SAME_GPU_PLANE
    control = _gloo_group(dist.PrefixStore(prefix, store), rank, timeout, host)
    if plane == "gloo":
        return PairChannels(control, control, device, plane)
    if plane == "gloo+gloo":
        return PairChannels(control, _gloo_group(dist.PrefixStore(f"{prefix}/data", store), rank, timeout, host),
                            device, plane)
    if plane in ("gloo+shm", SAME_GPU_PLANE):
        return PairChannels(control, MappedData(control, device), device, plane)
    return PairChannels(control, _nccl_group(dist.PrefixStore(f"{prefix}/data", store), rank, timeout, device),
                        device, plane)


def gpu_identity(device: torch.device) -> str:
    """A CUDA device's UUID as its driver reports it: the same GPU gives the same string in every process, whatever
    index CUDA_VISIBLE_DEVICES gives it there ("" where this torch reports none: the pair is then not checked)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return "" if uuid is None else str(uuid)


def same_gpu(identity: str, peer_identity: str) -> bool:
    """Whether a pair's two ends hold their caches on one GPU (False where a torch reports no UUID: NCCL then
    decides, and refuses two ranks on one device)."""
    return bool(identity) and identity == peer_identity


def _exchange(store: dist.Store, key: str, rank: int, value: str, timeout: timedelta) -> str:
    """Publish this end's ``value`` under ``key`` and return the peer's (at most 64 characters of it)."""
    store.set(f"{key}/{rank}", value)
    peer_key = f"{key}/{1 - rank}"
    store.wait([peer_key], timeout)
    return store.get(peer_key).decode(errors="replace")[:64]


def _refuse(store: dist.Store, key: str, rank: int, timeout: timedelta, error: KVTransferError) -> None:
    """Raise ``error`` after an exchange under ``key`` that refuses the pair. First each end says it has read the
    other's value and waits (briefly) to hear the same, so that the decode end, which serves the store and drops
    it as it gives up, does not take it away before the peer read."""
    try:
        store.set(f"{key}-read/{rank}", "1")
        store.wait([f"{key}-read/{1 - rank}"], timeout)
    except Exception:  # the peer gave up (and the store went) first: this end's value was read all the same
        pass
    raise error


def _gloo_group(store: dist.Store, rank: int, timeout: timedelta, host: str | None):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _nccl_group(store: dist.Store, rank: int, timeout: timedelta, device: torch.device):
    """A two-rank NCCL group for the blocks. A failed or timed-out operation aborts the communicator and
    raises; it must not take the worker down with it (TORCH_NCCL_ASYNC_ERROR_HANDLING=2: clean up only,
    unless the operator set it otherwise)."""
    if not (dist.is_nccl_available() and hasattr(dist, "ProcessGroupNCCL")):
        raise KVTransferError("This build of torch has no NCCL: p2p between CUDA caches needs a CUDA build of torch.")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with torch.cuda.device(device):
        return dist.ProcessGroupNCCL(store, rank, 2, options)
