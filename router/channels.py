"""The router's gRPC channels to its workers: one per worker address, shared by all requests."""

from __future__ import annotations

import threading

import grpc

from splitserve.rpc.auth import with_cluster_token
from splitserve.rpc.tls import TLSConfig, open_channel
from splitserve.v1 import worker_pb2_grpc


class Channels:
    """One gRPC channel per worker address, shared by all requests; each call carries the cluster token if set.

    Args:
        cluster_token: sent with every call to a worker (None: none sent).
        tls: call workers over TLS, verifying their certificates and presenting the router's own (which
            workers under mutual TLS require); None: plaintext.
    """

    def __init__(self, cluster_token: str | None = None, tls: TLSConfig | None = None) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._cluster_token = cluster_token
        self._tls = tls

    def __repr__(self) -> str:
        return f"Channels({len(self._channels)} workers)"

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = with_cluster_token(open_channel(address, self._tls),
                                                                       self._cluster_token)
            return channel

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self.channel(address))

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self.channel(address))

    def forget(self, address: str) -> None:
        """Drop the channel of a removed worker; calls still on it finish or fail on their own."""
        with self._lock:
            self._channels.pop(address, None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
