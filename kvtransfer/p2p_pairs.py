"""How a prefill and a decode worker of the ``p2p`` connector meet and build their two-rank group.

No global process group and nothing external. The decode worker's KV endpoint
(``host:port``) is its rendezvous server (``rendezvous_server.py``), bound to
its host only. A prefill worker that first sends to it proves the cluster token
there (``rendezvous_client.py``), gets a pair number and a store of the pair's
own, and both build a two-rank ``ProcessGroupGloo`` over that store (prefill
rank 0, decode rank 1), Gloo's sockets bound to each end's address on the
rendezvous connection. The decode side builds its end on the thread the
rendezvous server starts for the pair (``accept_pair``), so it needs no hint
from the router. With CUDA caches the same shape works with
``ProcessGroupNCCL``; only Gloo is built here (see ``new_pair_group``).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.rendezvous_client import RendezvousClient, connect_rendezvous
from splitserve.kvtransfer.rendezvous_protocol import HandshakeRefused

logger = logging.getLogger(__name__)

SENDER, RECEIVER = 0, 1
IDLE_TIMEOUT = timedelta(days=7)  # a pair may stay idle as long as both workers live


def new_pair_group(store: dist.Store, index: int, rank: int, timeout: timedelta, device: torch.device,
                   host: str | None = None):
    """The two-rank group of pair ``index``, its Gloo sockets bound to ``host`` (None: Gloo's default, the
    machine's hostname). Gloo for CPU caches; for CUDA caches the same call shape is
    ``ProcessGroupNCCL(prefix_store, rank, 2, options)``, which this CPU build does not have."""
    if device.type != "cpu":
        raise KVTransferError(f"The p2p connector runs Gloo on CPU caches only in this build, not {device}.")
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"splitserve/kv/pair/{index}", store), rank, 2, options)


class SenderPair:
    """The prefill end of one pair; one send at a time (``lock``)."""

    def __init__(self, group, store: RendezvousClient, address: str) -> None:
        self.group = group
        self.store = store  # keeps the rendezvous connection alive with the group
        self.address = address
        self.lock = threading.Lock()


def connect_pair(address: str, worker_id: str, cluster_token: str | None, connect_timeout: timedelta,
                 send_timeout: timedelta) -> SenderPair:
    """Prefill side: prove the cluster token to the decode worker at ``address``, take a pair, build its group.

    Raises:
        KVTransferError: the decode worker refused this worker (a sentence saying why), or could not be
            reached, or the group not built, within ``connect_timeout``.
    """
    started = time.monotonic()
    timeout = connect_timeout.total_seconds()
    try:
        store = connect_rendezvous(address, worker_id, cluster_token, connect_timeout)
    except HandshakeRefused as error:
        raise KVTransferError(f"The KV endpoint {address} refused this worker: {error}") from None
    except (OSError, ValueError) as error:
        raise KVTransferError(f"Cannot reach the KV endpoint {address} within {timeout:g} s: {error}") from None
    try:
        group = new_pair_group(store, store.pair_index, SENDER, connect_timeout, torch.device("cpu"), store.local_host)
        group._set_default_timeout(send_timeout)
    except Exception as error:
        store.close()
        raise KVTransferError(f"Cannot build the KV pair with {address} within {timeout:g} s: {error}") from None
    logger.info("KV pair %d to %s ready in %.2f s", store.pair_index, address, time.monotonic() - started)
    return SenderPair(group, store, address)


def accept_pair(store: dist.Store, index: int, host: str, connect_timeout: timedelta) -> dist.ProcessGroupGloo:
    """Decode side: build this end of pair ``index`` over the pair's ``store``, Gloo bound to ``host``. Returns
    the group (which may stay idle as long as both workers live). Raises whatever Gloo raises when the sender
    does not build its end within ``connect_timeout``."""
    group = new_pair_group(store, index, RECEIVER, connect_timeout, torch.device("cpu"), host)
    group._set_default_timeout(IDLE_TIMEOUT)
    return group
