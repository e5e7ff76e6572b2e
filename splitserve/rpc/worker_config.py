"""A worker process's configuration, from its flags: role, addresses, KV transfer, limits, the engine's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from splitserve.common.lora_names import MAX_LORA_MODULES, check_lora_name
from splitserve.common.types import KVConnectorKind, WorkerRole
from splitserve.engine.config import EngineConfig
from splitserve.kvtransfer.header import CHECKSUM_TYPES
from splitserve.kvtransfer.redis_access import RedisAccess, public_redis_url
from splitserve.prefill_service.faults import KVFaults
from splitserve.rpc.tls import TLSConfig

ROLES = {role.name.lower(): role.value for role in WorkerRole}
KV_CONNECTORS = (KVConnectorKind.P2P.value, KVConnectorKind.REDIS.value, KVConnectorKind.LMCACHE.value)
# The connectors whose kv_address is a Redis URL.
REDIS_CONNECTORS = (KVConnectorKind.REDIS.value, KVConnectorKind.LMCACHE.value)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class WorkerConfig:
    """One worker process, from its flags.

    Attributes:
        role: "prefill", "decode" or "both" (colocated: prefills its own requests, no KV transfer).
        host: interface to listen on.
        port: gRPC port (0: a free one, printed at start).
        worker_id: id to register under (empty: the router assigns one).
        router: router address to register with (None: static, named on the router's command line).
        kv_transfer: KV connector, "p2p", "redis" or "lmcache" (unused with role "both"); "lmcache" needs the
            optional extra (checked here: a ValueError saying how to install it).
        kv_address: p2p: host the rendezvous and Gloo bind (default: ``host``); redis and lmcache: a redis:// or
            rediss:// URL, without a password (it is advertised to the router and the prefill workers).
        redis_access: redis and lmcache: this worker's Redis user, password and TLS files
            (``kvtransfer.redis_access``); its password is never in ``repr``.
        lmcache_chunk_size: lmcache: tokens per LMCache chunk, a multiple of the block size; every worker sharing
            the Redis must use the same (it is part of every key).
        lmcache_local_cpu_mb: lmcache: LMCache's staging buffer in MiB, allocated in full at start; it must hold
            one chunk, and a store or retrieve moves at most this much at a time.
        lmcache_ttl_seconds: lmcache: every key LMCache writes expires this long after it is written.
        kv_checksum: "xxh3" (checksum every KV payload sent, require and verify one on every payload
            received) or "none" (neither); both pools must agree.
        kv_timeout_seconds: decode: longest wait for a prompt's KV before kv_load_failure applies.
        kv_load_failure: decode: "recompute" the prompt locally, or "fail" the request.
        max_queued_requests: requests in flight on this worker beyond which new ones get RESOURCE_EXHAUSTED
            (its gRPC server holds more calls than this: ``splitserve.serve.worker_server_threads``).
        num_threads: torch threads for this worker's compute (None: torch's default).
        drain_timeout_seconds: on SIGTERM, how long in-flight requests may run before they are aborted.
        register_timeout_seconds: with a router, how long the worker retries its first registration (the
            router not up yet, or refusing) before it exits saying why.
        cluster_token: the token the router's calls must carry and this worker's calls to the router
            send (``splitserve.rpc.auth``; None: open). Never in ``repr``.
        tls: the worker's certificate, key and CA (``splitserve.rpc.tls``), for its own port (with a CA: the
            router must present a certificate signed by it) and its calls to the router (None: plaintext).
        engine: the engine's configuration.
        kv_faults: prefill: faults injected into the KV payloads sent, for fault-injection tests only
            (``SPLITSERVE_INJECT_KV_FAULTS``, ``splitserve.prefill_service.faults``); None: none.
        metrics_port: serve Prometheus metrics over HTTP on ``host``:this port (0: a free one; None: not served).
        otlp_traces_endpoint: export a span of every prefill or decode call to this OTLP/gRPC collector
            (``splitserve.rpc.tracing``; None: no traces).
        lora_modules: the LoRA adapters this worker serves, {name: PEFT directory} (``--lora-modules``; needs
            ``engine.enable_lora``): loaded at start, requests name them (GenerateRequest.lora_name).
        lora_dir: a directory whose adapter subdirectories the worker serves by their names, found while it runs
            (``--lora-dir``; needs ``engine.enable_lora``; ``splitserve.rpc.lora_catalog``); None: none.
    """

    role: str = "decode"
    host: str = "127.0.0.1"
    port: int = 0
    worker_id: str = ""
    router: str | None = None
    kv_transfer: str = "p2p"
    kv_address: str = ""
    kv_checksum: str = "xxh3"
    kv_timeout_seconds: float = 30.0
    kv_load_failure: str = "recompute"
    max_queued_requests: int = 256
    num_threads: int | None = None
    drain_timeout_seconds: float = 30.0
    register_timeout_seconds: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster_token: str | None = field(default=None, repr=False)
    kv_faults: KVFaults | None = None
    tls: TLSConfig | None = None
    redis_access: RedisAccess = field(default_factory=RedisAccess)
    lmcache_chunk_size: int = 256
    lmcache_local_cpu_mb: int = 64
    lmcache_ttl_seconds: float = 600.0
    metrics_port: int | None = None
    otlp_traces_endpoint: str | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_dir: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}.")
        if self.kv_transfer not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_transfer!r}.")
        if self.kv_transfer in REDIS_CONNECTORS and self.role != "both":
            if not self.kv_address.startswith(("redis://", "rediss://")):
                raise ValueError(f"With kv_transfer {self.kv_transfer}, kv_address must be a redis:// URL (e.g. "
                                 "redis://127.0.0.1:6379/0) or a rediss:// one for TLS.")
            public_redis_url(self.kv_address)  # raises on a password in it
        if self.kv_transfer == KVConnectorKind.LMCACHE and self.role != "both":
            self._check_lmcache()
        if self.kv_checksum not in CHECKSUM_TYPES:
            raise ValueError(f"kv_checksum must be one of {', '.join(CHECKSUM_TYPES)}, got {self.kv_checksum!r}.")
        if self.kv_load_failure not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}.")
        if not self.kv_timeout_seconds > 0:
            raise ValueError(f"kv_timeout_seconds must be > 0, got {self.kv_timeout_seconds}.")
        if not self.register_timeout_seconds > 0:
            raise ValueError(f"register_timeout_seconds must be > 0, got {self.register_timeout_seconds}.")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}.")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}.")
        self._check_lora()

    def _check_lora(self) -> None:
        if len(self.lora_modules) > MAX_LORA_MODULES:
            raise ValueError(f"A worker serves at most {MAX_LORA_MODULES} LoRA adapters, not {len(self.lora_modules)}.")
        for name in self.lora_modules:
            check_lora_name(name)
        if self.lora_modules and not self.engine.enable_lora:
            raise ValueError("lora_modules needs an engine with enable_lora (--enable-lora).")
        if self.lora_dir is not None:
            if not self.engine.enable_lora:
                raise ValueError("lora_dir needs an engine with enable_lora (--enable-lora).")
            if not Path(self.lora_dir).is_dir():
                raise ValueError(f"--lora-dir {self.lora_dir}: no such directory (the adapters it serves are its "
                                 "subdirectories, one PEFT checkpoint each).")

    def _check_lmcache(self) -> None:
        """Raises ValueError on a bad LMCache setting, or when the extra is not installed (how to install it)."""
        block_size = self.engine.block_size
        if self.lmcache_chunk_size <= 0 or self.lmcache_chunk_size % block_size:
            raise ValueError(f"lmcache_chunk_size must be a positive multiple of the block size {block_size}, got "
                             f"{self.lmcache_chunk_size}.")
        if self.lmcache_local_cpu_mb < 1:
            raise ValueError(f"lmcache_local_cpu_mb must be >= 1, got {self.lmcache_local_cpu_mb}.")
        if not self.lmcache_ttl_seconds > 0:
            raise ValueError(f"lmcache_ttl_seconds must be > 0, got {self.lmcache_ttl_seconds}.")
        try:
            import splitserve.kvtransfer.lmcache_connector  # noqa: F401 (its ImportError says how to install it)
        except ImportError as error:
            raise ValueError(str(error)) from None
