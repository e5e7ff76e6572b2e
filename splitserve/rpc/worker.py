"""What prefill and decode workers share: config, engine + loop, KV connector, identity, load, membership."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve import __version__
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kvtransfer.base import CHECKSUM_TYPES
from splitserve.rpc.errors import ResourceExhausted, Unavailable
from splitserve.v1 import inference_pb2, worker_pb2

logger = logging.getLogger(__name__)

ROLES = {
    "prefill": inference_pb2.WORKER_ROLE_PREFILL,
    "decode": inference_pb2.WORKER_ROLE_DECODE,
    "both": inference_pb2.WORKER_ROLE_BOTH,
}
KV_CONNECTORS = ("p2p", "redis")
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
        kv_transfer: KV connector, "p2p" or "redis" (unused with role "both").
        kv_address: p2p: host the rendezvous store binds (default: ``host``); redis: a redis:// URL.
        kv_checksum: "xxh3" (checksum every KV payload sent, require and verify one on every payload
            received) or "none" (neither); both pools must agree.
        kv_timeout_seconds: decode: longest wait for a prompt's KV before kv_load_failure applies.
        kv_load_failure: decode: "recompute" the prompt locally, or "fail" the request.
        max_queued_requests: requests in flight on this worker beyond which new ones get RESOURCE_EXHAUSTED.
        num_threads: torch threads for this worker's compute (None: torch's default).
        drain_timeout_seconds: on SIGTERM, how long in-flight requests may run before they are aborted.
        engine: the engine's configuration.
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
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}.")
        if self.kv_transfer not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_transfer!r}.")
        if self.kv_transfer == "redis" and self.role != "both" and not self.kv_address.startswith("redis://"):
            raise ValueError("With kv_transfer redis, kv_address must be a redis:// URL (e.g. redis://127.0.0.1:6379/0).")
        if self.kv_checksum not in CHECKSUM_TYPES:
            raise ValueError(f"kv_checksum must be one of {', '.join(CHECKSUM_TYPES)}, got {self.kv_checksum!r}.")
        if self.kv_load_failure not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}.")
        if not self.kv_timeout_seconds > 0:
            raise ValueError(f"kv_timeout_seconds must be > 0, got {self.kv_timeout_seconds}.")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}.")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}.")


@dataclass
class Counters:
    """Mirror of worker_pb2.WorkerCounters; updated under ``lock`` by any thread."""

    num_requests: int = 0
    num_finished_requests: int = 0
    num_kv_transfers_received: int = 0
    num_local_prefills: int = 0
    num_kv_recomputes: int = 0
    num_kv_payloads_refused: int = 0
    num_kv_transfers_sent: int = 0
    num_kv_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def to_pb(self) -> worker_pb2.WorkerCounters:
        with self.lock:
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lock"}
        return worker_pb2.WorkerCounters(**values)


class WorkerRuntime:
    """The engine of one worker, the loop that drives it, its KV connector and its identity.

    Args:
        config: the worker's configuration.
        after_step: passed to the EngineLoop (runs on the engine thread after each step).
    """

    def __init__(self, config: WorkerConfig, after_step: Callable | None = None) -> None:
        import torch

        from splitserve.engine.model_store import model_fingerprint

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.engine = LLMEngine(config.engine)
        self.loop = EngineLoop(self.engine, after_step=after_step)
        self.model_fingerprint = model_fingerprint(self.engine.model_dir, config.engine.dtype)
        self.counters = Counters()
        self.state = inference_pb2.WORKER_STATE_STARTING
        self.address = ""
        self.worker_id = config.worker_id
        self.membership = None
        self.connector = None
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()

    # ---- life ------------------------------------------------------------------

    def start(self, address: str) -> None:
        """Start the engine loop and the connector; register with the router when configured."""
        self.address = address
        if not self.worker_id:
            self.worker_id = f"{self.config.role}-{address}"
        if self.config.role != "both":
            self.connector = self._create_connector()
        self._warm_up()
        self.loop.start()
        self.state = inference_pb2.WORKER_STATE_SERVING
        if self.config.router:
            from splitserve.rpc.membership import Membership

            self.membership = Membership(
                self.config.router, self.registration, self.load_pb, on_state=self._on_router_state,
                state=lambda: self.state,
            ).start()
            self.worker_id = self.membership.worker_id

    def stop(self) -> None:
        """Leave the cluster, abort what is in flight, stop the loop and the connector."""
        self.state = inference_pb2.WORKER_STATE_DRAINING
        if self.membership is not None:
            self.membership.stop()
        self.loop.stop()
        if self.connector is not None:
            self.connector.close()

    def _warm_up(self) -> None:
        """One short request through the engine before serving, so the first client does not pay for
        lazy initialisation (kernel loading, first allocations)."""
        from splitserve.engine.sampling_params import SamplingParams

        started = time.monotonic()
        engine = self.engine
        engine.add_request("warm-up", None, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           prompt_token_ids=[1] * 2 * self.config.engine.block_size)
        while engine.has_unfinished_requests():
            engine.step()
        engine.stats = type(engine.stats)()
        self.loop.last_load = engine.load()
        logger.info("Engine warmed up in %.2f s", time.monotonic() - started)

    def _on_router_state(self, state: int) -> None:
        if state == inference_pb2.WORKER_STATE_DRAINING and self.state != state:
            logger.info("The router drains this worker: finishing in-flight requests, taking no new ones")
            self.state = state

    def _create_connector(self):
        from splitserve.kvtransfer import create_connector
        from splitserve.kvtransfer.base import KVLayout

        options = {"host": self.config.kv_address or self.config.host}
        if self.config.kv_transfer == "redis":
            options = {"url": self.config.kv_address}
        options["checksum"] = self.config.kv_checksum
        layout = KVLayout.from_kv_cache(self.engine.model_runner.kv_cache)
        self.kv_layout = layout
        return create_connector(self.config.kv_transfer, self.worker_id, self.model_fingerprint, layout, **options)

    # ---- admission ----------------------------------------------------------------

    def admit(self) -> None:
        """Count a new request in, or refuse it: UNAVAILABLE while draining, RESOURCE_EXHAUSTED when full."""
        if self.state != inference_pb2.WORKER_STATE_SERVING:
            raise Unavailable(f"Worker {self.worker_id} is draining and takes no new requests.")
        with self._in_flight_lock:
            if self._in_flight >= self.config.max_queued_requests:
                raise ResourceExhausted(
                    f"Worker {self.worker_id} has {self._in_flight} requests in flight, its limit "
                    f"(--max-queued-requests {self.config.max_queued_requests}); retry later."
                )
            self._in_flight += 1
        self.counters.add(num_requests=1)

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._in_flight == 0

    @staticmethod
    def draining_state() -> int:
        return inference_pb2.WORKER_STATE_DRAINING

    def release(self) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
        self.counters.add(num_finished_requests=1)

    # ---- identity and load --------------------------------------------------------

    def load_pb(self) -> inference_pb2.WorkerLoad:
        # The load after the engine's latest step: never waits for a long step to end.
        load = self.loop.last_load
        total = max(load.num_total_kv_blocks, 1)
        return inference_pb2.WorkerLoad(
            **dataclasses.asdict(load), kv_block_usage=1.0 - load.num_free_kv_blocks / total
        )

    def capacity_pb(self) -> worker_pb2.WorkerCapacity:
        config = self.config.engine
        return worker_pb2.WorkerCapacity(
            num_total_kv_blocks=self.engine.num_kv_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.engine.max_model_len,
        )

    def layout_pb(self) -> worker_pb2.KVCacheLayout:
        from splitserve.kvtransfer.base import KVLayout

        return KVLayout.from_kv_cache(self.engine.model_runner.kv_cache).to_pb()

    def endpoint_pb(self) -> worker_pb2.KVEndpoint | None:
        if self.connector is None:
            return None
        return self.connector.endpoint().to_pb()

    def registration(self) -> worker_pb2.RegisterRequest:
        return worker_pb2.RegisterRequest(
            worker_id=self.worker_id, role=ROLES[self.config.role], address=self.address,
            kv_endpoint=self.endpoint_pb(), capacity=self.capacity_pb(), model_fingerprint=self.model_fingerprint,
            kv_layout=self.layout_pb(), state=self.state, server_version=__version__,
        )

    def status_pb(self) -> worker_pb2.GetWorkerStatusResponse:
        return worker_pb2.GetWorkerStatusResponse(
            status=inference_pb2.WorkerStatus(
                worker_id=self.worker_id, role=ROLES[self.config.role], address=self.address,
                state=self.state, load=self.load_pb(),
            ),
            capacity=self.capacity_pb(), model_fingerprint=self.model_fingerprint, kv_layout=self.layout_pb(),
            kv_endpoint=self.endpoint_pb(), server_version=__version__, counters=self.counters.to_pb(),
        )
