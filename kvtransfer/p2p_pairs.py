"""How a prefill and a decode worker of the ``p2p`` connector meet and build their pair.

No global process group and nothing external. The decode worker's KV endpoint
(``host:port``) is its rendezvous server (``rendezvous_server.py``), bound to
its host only. A prefill worker that first sends to it proves the cluster token
there (``rendezvous_client.py``), gets a pair number and a store of the pair's
own, and both build the pair's channels over that store (prefill rank 0,
decode rank 1): a two-rank Gloo group for control, and for the blocks the same
group (CPU caches) or an NCCL group (CUDA caches), see ``p2p_channels.py``.
Gloo's sockets are bound to each end's address on the rendezvous connection.
The decode side builds its end on the thread the rendezvous server starts for
the pair (``accept_pair``), so it needs no hint from the router.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.kvtransfer.errors import KVTransferError
from splitserve.kvtransfer.p2p_channels import PairChannels, build_channels
from splitserve.kvtransfer.rendezvous_client import RendezvousClient, connect_rendezvous
from splitserve.kvtransfer.rendezvous_protocol import HandshakeRefused

logger = logging.getLogger(__name__)

SENDER, RECEIVER = 0, 1


class SenderPair:
    """The prefill end of one pair; one send at a time (``lock``)."""

    def __init__(self, channels: PairChannels, store: RendezvousClient, address: str) -> None:
        self.channels = channels
        self.store = store  # keeps the rendezvous connection alive with the groups
        self.address = address
        self.lock = threading.Lock()


def connect_pair(address: str, worker_id: str, cluster_token: str | None, connect_timeout: timedelta,
                 send_timeout: timedelta, device: torch.device, cpu_data_plane: str = "control") -> SenderPair:
    """Prefill side: prove the cluster token to the decode worker at ``address``, take a pair, build its channels
    for a cache on ``device``.

    Raises:
        KVTransferError: the decode worker refused this worker (a sentence saying why), or could not be
            reached, or the channels not built, within ``connect_timeout``; the pair's ends differ in plane.
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
        channels = build_channels(store, store.pair_index, SENDER, connect_timeout, device, store.local_host,
                                  cpu_data_plane)
        channels.control._set_default_timeout(send_timeout)
        if channels.plane == "gloo+gloo":
            channels.data._set_default_timeout(send_timeout)
    except KVTransferError as error:
        store.close()
        raise KVTransferError(f"Cannot pair with the KV endpoint {address}: {error}") from None
    except Exception as error:
        store.close()
        raise KVTransferError(f"Cannot build the KV pair with {address} within {timeout:g} s: {error}") from None
    logger.info("KV pair %d to %s ready in %.2f s", store.pair_index, address, time.monotonic() - started)
    return SenderPair(channels, store, address)


def accept_pair(store: dist.Store, index: int, host: str, connect_timeout: timedelta, device: torch.device,
                cpu_data_plane: str = "control") -> PairChannels:
    """Decode side: build this end of pair ``index`` over the pair's ``store``, Gloo bound to ``host``, for a
    cache on ``device``. Returns the channels (the receive thread's waits name their own timeouts). Raises
    KVTransferError when the sender's plane differs, and whatever Gloo raises when the sender does not build
    its end within ``connect_timeout``."""
    return build_channels(store, index, RECEIVER, connect_timeout, device, host, cpu_data_plane)
