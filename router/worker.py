"""Worker: one worker as the router sees it, and the errors its registration can meet.

The registry keeps one ``Worker`` per worker; the policies and the dispatcher
read copies (:func:`snapshot`, its ``WorkerLoad`` copied too), so they may read
while heartbeats write. The opaque ``kv_endpoint`` and ``capacity`` messages
are shared, never mutated. The errors are domain errors: each maps to the gRPC
status its docstring names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.errors import AlreadyExists, FailedPrecondition, InvalidRequest, NotFound
from splitserve.common.load import WorkerLoad
from splitserve.common.reasoning import REASONING_PARSER_NAMES
from splitserve.common.types import WorkerRole, WorkerState

# The proto's KVCacheDtype numbers -> dtype names.
KV_CACHE_DTYPES = {1: "float32", 2: "float16", 3: "bfloat16"}


@dataclass(frozen=True)
class KVCacheLayout:
    """A worker's KV cache layout as it registered it (the proto's KVCacheLayout, converted by the servicer).

    KV moves between a prefill and a decode worker only when their layouts are equal: the decode worker
    refuses every payload of another layout, and the prompt is computed twice.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str  # "float32", "float16", "bfloat16"
    block_size: int  # tokens per KV block

    @classmethod
    def from_pb(cls, message: Any) -> KVCacheLayout:
        """The layout of a KVCacheLayout message (read by field name: no proto import here)."""
        return cls(message.num_layers, message.num_kv_heads, message.head_size,
                   KV_CACHE_DTYPES.get(message.dtype, "unspecified"), message.block_size)

    def differences(self, other: KVCacheLayout) -> str:
        """Each field that differs, this layout's value first: "block size 32 vs 16"."""
        return ", ".join(
            f"{name.replace('_', ' ')} {getattr(self, name)} vs {getattr(other, name)}"
            for name in ("num_layers", "num_kv_heads", "head_size", "dtype", "block_size")
            if getattr(self, name) != getattr(other, name)
        )


@dataclass
class Worker:
    """One worker: what it told at registration (the proto's RegisterRequest), its state, load and lease."""

    worker_id: str
    role: WorkerRole
    address: str  # host:port of its gRPC server
    kv_endpoint: Any = None  # opaque (a KVEndpoint message); None for colocated workers
    capacity: Any = None  # opaque (a WorkerCapacity message)
    model_fingerprint: str = ""
    kv_layout: KVCacheLayout | None = None  # None for colocated workers, which exchange no KV
    state: WorkerState = WorkerState.SERVING
    load: WorkerLoad = field(default_factory=WorkerLoad)
    lease_id: str | None = None  # None for static workers
    registered_at: float = 0.0  # clock seconds
    last_heard: float = 0.0  # clock seconds of the last heartbeat or successful poll
    is_static: bool = False
    num_in_flight: int = 0  # requests the router has outstanding on it right now
    identity: str | None = None  # the client-certificate identity that registered it (mutual TLS), else None
    kv_connector: str | None = None  # how it moves KV ("p2p", "redis", "lmcache"); None: colocated or not given
    lora_names: frozenset[str] = frozenset()  # the LoRA adapters it serves (RegisterRequest.lora_names)
    reasoning_parser: str = ""  # its --reasoning-parser ("": none): whether its grammars wait out think blocks

    def serves(self, lora_name: str) -> bool:
        """Whether it can run a request for LoRA adapter ``lora_name`` ("": the base model, which every worker serves)."""
        return not lora_name or lora_name in self.lora_names

    @property
    def is_routable(self) -> bool:
        return self.state == WorkerState.SERVING


def snapshot(worker: Worker) -> Worker:
    """A copy of ``worker`` whose load is its own (the registry hands out nothing else)."""
    return dataclasses.replace(worker, load=dataclasses.replace(worker.load))


class InvalidRegistration(InvalidRequest):
    """A registration with a missing or bad field (INVALID_ARGUMENT)."""


class WorkerIdInUse(AlreadyExists):
    """The requested worker id belongs to a live worker at another address (ALREADY_EXISTS)."""


class RegistrationInUse(AlreadyExists):
    """The worker id or address of a live registration, from a caller that cannot prove it made it (ALREADY_EXISTS)."""


class FingerprintMismatch(FailedPrecondition):
    """A worker serving other weights than the cluster (FAILED_PRECONDITION)."""


class KVLayoutMismatch(FailedPrecondition):
    """A prefill or decode worker whose KV layout differs from the cluster's (FAILED_PRECONDITION)."""


class KVConnectorMismatch(FailedPrecondition):
    """A prefill or decode worker moving KV another way than the cluster's (FAILED_PRECONDITION)."""


class ReasoningParserMismatch(FailedPrecondition):
    """A worker whose --reasoning-parser differs from the cluster's workers' (FAILED_PRECONDITION)."""


class UnknownLease(NotFound):
    """No live lease with this id: register again (NOT_FOUND)."""


class UnknownWorker(NotFound):
    """No worker with this id (NOT_FOUND)."""


def check_registration(role: Any, address: Any) -> None:
    """Raises InvalidRegistration unless ``role`` is a WorkerRole and ``address`` a non-empty string."""
    if not isinstance(role, WorkerRole):
        raise InvalidRegistration(f"role must be a WorkerRole (PREFILL, DECODE or BOTH), got {role!r}.")
    if not address or not isinstance(address, str):
        raise InvalidRegistration("address is required: the host:port the router can reach the worker at.")


def check_kv_identity(role: WorkerRole, model_fingerprint: str, kv_layout: KVCacheLayout | None) -> None:
    """Raises InvalidRegistration when a prefill or decode worker (one that exchanges KV) gives no fingerprint
    or no KV layout."""
    if role == WorkerRole.BOTH:
        return
    if not model_fingerprint:
        raise InvalidRegistration("model_fingerprint is required: a prefill or decode worker must say which "
                                  "weights it serves, so that only KV of the same model is exchanged.")
    if kv_layout is None:
        raise InvalidRegistration("kv_layout is required: a prefill or decode worker must give its KV cache "
                                  "layout, so that only workers whose KV fits each other's blocks are paired.")


def check_reasoning_parser_name(name: str) -> None:
    """Raises InvalidRegistration, quoting at most 64 characters of ``name``, unless it is "" (none) or one of
    REASONING_PARSER_NAMES."""
    if name and name not in REASONING_PARSER_NAMES:
        raise InvalidRegistration(f"reasoning_parser must be empty or one of {', '.join(REASONING_PARSER_NAMES)}, "
                                  f"got {name[:64]!r}.")


def check_reasoning_parser(address: str, parser: str, cluster: str | None) -> None:
    """Raises ReasoningParserMismatch when the cluster's workers have said theirs (``cluster``) and ``parser``
    differs: a prefill worker would sample a first token the decode worker's grammar does not expect, and the
    gateway could not tell whether answers start with a think block."""
    if cluster is not None and parser != cluster:
        def said(name: str) -> str:
            return f"--reasoning-parser {name}" if name else "no --reasoning-parser"

        raise ReasoningParserMismatch(
            f"The worker at {address} has {said(parser)}, but this cluster's workers have {said(cluster)}: their "
            "structured outputs would start at different tokens. Start it with the same flag as the rest."
        )


def check_kv_connector(address: str, connector: str | None, cluster: str | None) -> None:
    """Raises KVConnectorMismatch when ``connector`` and the cluster's are both known and differ."""
    if connector is not None and cluster is not None and connector != cluster:
        raise KVConnectorMismatch(
            f"The worker at {address} moves KV over {connector}, but this cluster's prefill and decode workers use "
            f"{cluster}: no KV could move between them. Start it with the same --kv-transfer as the rest."
        )


def check_kv_layout(address: str, layout: KVCacheLayout | None, cluster: KVCacheLayout | None) -> None:
    """Raises KVLayoutMismatch when ``layout`` and the cluster's are both known and differ."""
    if layout is not None and cluster is not None and layout != cluster:
        raise KVLayoutMismatch(
            f"The worker at {address} has another KV layout than this cluster's prefill and decode workers "
            f"({layout.differences(cluster)}): no KV could move between them. Start it with the same --model, "
            "--dtype and --block-size as the rest of the cluster."
        )
