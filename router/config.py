"""RouterConfig: one validated configuration for the router process."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.rpc.auth import Credentials
from splitserve.rpc.tls import TLSConfig

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


@dataclass
class RouterConfig:
    """The router, from its flags.

    Attributes:
        host, port: where the router listens (port 0: a free one).
        model: model directory the router reads tokenizer files and config.json from, never weights
            (None: the default model's converted directory, which ``splitserve prepare-model`` writes).
        dtype: the workers' dtype (part of the model fingerprint they must share); "auto": float32 or
            bfloat16, whichever the first worker to register serves.
        max_model_len: context limit enforced at the door (None: the model's).
        chat_template: a Jinja chat template's text that replaces the model's (None: the model's own).
        prefill_workers, decode_workers, colocated_workers: static worker addresses
            (workers may also register themselves with ``--router``).
        prefill_policy, decode_policy: routing policy per pool.
        local_prefill_threshold: prompts shorter than this many tokens are prefilled
            by the decode worker itself (0: always disaggregate when a prefill worker is up).
        max_in_flight_requests: requests in flight on the router, over all workers, beyond which new ones get
            RESOURCE_EXHAUSTED (its gRPC server holds 16 calls more); each worker refuses beyond its own
            ``max_queued_requests`` too, and the router then tries another.
        lease_seconds: a registered worker silent this long is removed.
        heartbeat_seconds: how often workers heartbeat (and static workers are polled).
        prefill_attempts: prefill workers tried per request before the decode worker prefills itself.
        kv_timeout_seconds: how long a decode worker waits for KV before recomputing (None: its own setting).
        drain_timeout_seconds: on SIGTERM or SIGINT, how long requests in flight may finish (new ones are
            refused with UNAVAILABLE) before the rest are aborted and the router stops.
        block_size: KV block size of the workers (prefix-aware routing hashes whole blocks).
        migration_limit: times one request may move to another decode worker when its decode worker fails
            mid-stream (0: never; the stream then ends with FINISH_REASON_ERROR).
        credentials: API keys required on the Inference service and the cluster token required on
            WorkerRegistry and sent to workers (``splitserve.rpc.auth``; empty: open). Never in ``repr``.
        tls: the router's certificate, key and CA (``splitserve.rpc.tls``), used both for its own port (with a
            CA: workers and clients must present certificates signed by it) and for its calls to workers
            (None: plaintext).
        metrics_port: serve Prometheus metrics over HTTP on ``host``:this port (0: a free one; None: not served).
        otlp_traces_endpoint: export a span of every generation request to this OTLP/gRPC collector
            (``splitserve.rpc.tracing``; None: no traces).
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    chat_template: str | None = None
    prefill_workers: list[str] = field(default_factory=list)
    decode_workers: list[str] = field(default_factory=list)
    colocated_workers: list[str] = field(default_factory=list)
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_loaded"
    local_prefill_threshold: int = 0
    max_in_flight_requests: int = 512
    lease_seconds: float = 10.0
    heartbeat_seconds: float = 1.0
    prefill_attempts: int = 2
    kv_timeout_seconds: float | None = None
    drain_timeout_seconds: float = 30.0
    block_size: int = 16
    migration_limit: int = 3
    metrics_port: int | None = None
    otlp_traces_endpoint: str | None = None
    credentials: Credentials = field(default_factory=Credentials)
    tls: TLSConfig | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}, got {getattr(self, name)!r}.")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}.")
        if self.max_in_flight_requests < 1:
            raise ValueError(f"max_in_flight_requests must be >= 1, got {self.max_in_flight_requests}.")
        if not 0 < self.heartbeat_seconds < self.lease_seconds:
            raise ValueError("heartbeat_seconds must be > 0 and shorter than lease_seconds.")
        if self.prefill_attempts < 1:
            raise ValueError(f"prefill_attempts must be >= 1, got {self.prefill_attempts}.")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}.")
        if not self.drain_timeout_seconds >= 0:
            raise ValueError(f"drain_timeout_seconds must be >= 0, got {self.drain_timeout_seconds}.")
        if self.kv_timeout_seconds is not None and not self.kv_timeout_seconds > 0:
            raise ValueError(f"kv_timeout_seconds must be > 0, got {self.kv_timeout_seconds}.")
