"""The enums both sides of the cluster speak: finish reasons, worker roles and states, KV connectors.

``WorkerRole`` and ``WorkerState`` carry the proto's numbers, so ``WorkerRole(message.role)``
converts a message's field and ``role.value`` fills one. ``FinishReason`` and
``KVConnectorKind`` are ``str`` enums: a member equals (and hashes, prints and
serializes as) its value, so code comparing with ``"stop"`` or ``"p2p"`` keeps working.
"""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    """A ``str`` enum whose members print as their value (``enum.StrEnum`` needs Python 3.11)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


class FinishReason(_StrEnum):
    """Why a request finished (the proto's FinishReason, by name)."""

    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's length limit
    ABORT = "abort"  # aborted by the client, a deadline, or a shutdown
    ERROR = "error"  # failed; the request's stop_reason says why


class WorkerRole(enum.Enum):
    """What a worker does; values equal the proto's WorkerRole numbers."""

    PREFILL = 1
    DECODE = 2
    BOTH = 3  # colocated: prefills and decodes its own requests


class WorkerState(enum.Enum):
    """Where a worker is in its life; values equal the proto's WorkerState numbers."""

    STARTING = 1
    SERVING = 2
    DRAINING = 3
    UNREACHABLE = 4


class KVConnectorKind(_StrEnum):
    """How KV blocks travel from prefill to decode workers (``--kv-transfer``)."""

    P2P = "p2p"  # torch.distributed point to point between the two workers
    REDIS = "redis"  # through a Redis server
    LMCACHE = "lmcache"  # through LMCache with a Redis backend
