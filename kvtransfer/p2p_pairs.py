"""How a prefill and a decode worker of the ``p2p`` connector meet and build their two-rank group.

No global process group and nothing external. The decode worker hosts a
``TCPStore`` (its KV endpoint address, ``host:port``). A prefill worker that
first sends to it connects to that store, takes a pair number (``add`` on a
counter), writes its worker id under that number, and builds a two-rank
``ProcessGroupGloo`` over the store under the pair's own prefix (prefill rank
0, decode rank 1). A watcher thread on the decode side sees the counter grow
and builds its end of the group (``accept_pair``), so it needs no hint from
the router. With CUDA caches the same shape works with ``ProcessGroupNCCL``;
only Gloo is built here (see ``new_pair_group``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import KVTransferError

logger = logging.getLogger(__name__)

PEERS_KEY = "splitserve/kv/peers"
SENDER, RECEIVER = 0, 1
IDLE_TIMEOUT = timedelta(days=7)  # a pair may stay idle as long as both workers live


def new_pair_group(store: dist.Store, index: int, rank: int, timeout: timedelta, device: torch.device):
    """The two-rank group of pair ``index``. Gloo for CPU caches; for CUDA caches the same call shape is
    ``ProcessGroupNCCL(prefix_store, rank, 2, options)``, which this CPU build does not have."""
    if device.type != "cpu":
        raise KVTransferError(f"The p2p connector runs Gloo on CPU caches only in this build, not {device}.")
    return dist.ProcessGroupGloo(dist.PrefixStore(f"splitserve/kv/pair/{index}", store), rank, 2, timeout)


class SenderPair:
    """The prefill end of one pair; one send at a time (``lock``)."""

    def __init__(self, group, store: dist.TCPStore, address: str) -> None:
        self.group = group
        self.store = store  # keeps the store connection alive with the group
        self.address = address
        self.lock = threading.Lock()


def connect_pair(address: str, worker_id: str, connect_timeout: timedelta, send_timeout: timedelta) -> SenderPair:
    """Prefill side: join the decode worker's store at ``address`` as a new pair and build its group.

    Raises:
        KVTransferError: the store cannot be reached or the group not built within ``connect_timeout``.
    """
    host, _, port = address.rpartition(":")
    started = time.monotonic()
    timeout = connect_timeout.total_seconds()
    try:
        # A plain probe first: TCPStore retries a refused connection for 2.5x its timeout, loudly.
        socket.create_connection((host, int(port)), timeout).close()
        store = dist.TCPStore(host, int(port), None, False, connect_timeout)
        index = store.add(PEERS_KEY, 1) - 1
        store.set(f"splitserve/kv/peer/{index}", worker_id)
        group = new_pair_group(store, index, SENDER, connect_timeout, torch.device("cpu"))
        group._set_default_timeout(send_timeout)
    except Exception as error:
        raise KVTransferError(f"Cannot reach the KV endpoint {address} within {timeout:g} s: {error}") from None
    logger.info("KV pair %d to %s ready in %.2f s", index, address, time.monotonic() - started)
    return SenderPair(group, store, address)


def accept_pair(store: dist.TCPStore, index: int, connect_timeout: timedelta) -> tuple[dist.ProcessGroupGloo, str]:
    """Decode side: build this end of pair ``index``, announced on ``store``. Returns the group (which may
    stay idle as long as both workers live) and the sender's worker id. Raises whatever the store or
    Gloo raise when the sender does not show up within ``connect_timeout``."""
    store.wait([f"splitserve/kv/peer/{index}"], connect_timeout)
    peer = store.get(f"splitserve/kv/peer/{index}").decode()
    group = new_pair_group(store, index, RECEIVER, connect_timeout, torch.device("cpu"))
    group._set_default_timeout(IDLE_TIMEOUT)
    return group, peer
