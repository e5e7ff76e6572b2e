"""What prefill and decode workers share at run time: the engine and its loop, the KV transport and the engine's
KV connector over it, identity, admission, load reports and membership (config: ``worker_config``; counters:
``counters``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from splitserve import __version__
from splitserve.common.errors import Overloaded, Unavailable
from splitserve.common.types import KVConnectorKind
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.rpc.convert import worker_load_to_pb
from splitserve.rpc.counters import Counters
from splitserve.rpc.lora_catalog import LoRACatalog
from splitserve.rpc.worker_config import ROLES, WorkerConfig
from splitserve.v1 import inference_pb2, worker_pb2

logger = logging.getLogger(__name__)

# --role -> the proto's WorkerRole number ("prefill", "decode", "both").
class AdmissionLimit:
    """Counts a worker's requests in flight and refuses one beyond ``max_queued_requests``.

    The worker's gRPC server holds more concurrent calls than this limit
    (``splitserve.serve.worker_server_threads``), so a refusal is this one, RESOURCE_EXHAUSTED with a
    sentence, never a call left waiting for a server thread.
    """

    def __init__(self, max_queued_requests: int) -> None:
        self.max_queued_requests = max_queued_requests
        self._num_in_flight = 0
        self._lock = threading.Lock()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def enter(self, worker_id: str) -> None:
        """Count one more request in flight. Raises Overloaded (RESOURCE_EXHAUSTED) when the limit is reached."""
        with self._lock:
            if self._num_in_flight >= self.max_queued_requests:
                raise Overloaded(
                    f"Worker {worker_id} has {self._num_in_flight} requests in flight, its limit "
                    f"(--max-queued-requests {self.max_queued_requests}); retry later."
                )
            self._num_in_flight += 1

    def leave(self) -> None:
        """Count one request fewer in flight (once per ``enter`` that returned)."""
        with self._lock:
            self._num_in_flight -= 1


class WorkerRuntime:
    """The engine of one worker, the loop that drives it, its KV connector and its identity.

    Args:
        config: the worker's configuration.
        make_kv_connector: ``(transport, counters) -> KVConnectorBase``, the engine's KV connector over the
            worker's transport connector (the prefill service's sender, the decode service's receiver);
            built at start, when the worker knows its id. Unused for a colocated worker.
    """

    def __init__(self, config: WorkerConfig, make_kv_connector: Callable | None = None) -> None:
        import torch

        from splitserve.common.model_info import model_fingerprint

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.engine = LLMEngine(config.engine)
        cache = self.engine.kv_cache_tensor
        logger.info("KV cache: %d blocks of %d tokens, %.2f GiB on %s", self.engine.num_kv_blocks,
                    config.engine.block_size, cache.numel() * cache.element_size() / 1024**3, cache.device.type)
        self.lora = self._lora_catalog(config).start()
        self.loop = EngineLoop(self.engine)
        self.model_fingerprint = model_fingerprint(self.engine.model_dir, self.engine.model_runner.dtype_name)
        self.counters = Counters()
        self.state = inference_pb2.WORKER_STATE_STARTING
        self.address = ""
        self.worker_id = config.worker_id
        self.membership = None
        self._make_kv_connector = make_kv_connector
        # The transport (p2p, redis: splitserve.kvtransfer; lmcache: the LMCacheKVStore) and the engine's
        # connector over it; None colocated.
        self.kv_transport = None
        self.kv_connector = None
        self.admission = AdmissionLimit(config.max_queued_requests)
        from splitserve.rpc.metrics import WorkerMetrics

        colocated = config.role == "both"
        self.metrics = WorkerMetrics("colocated" if colocated else config.role,
                                     "none" if colocated else str(config.kv_transfer), self)
        self.tracer = None  # spans of its calls, with --otlp-traces-endpoint (splitserve.rpc.tracing)
        if config.otlp_traces_endpoint:
            from splitserve.rpc.tracing import RequestTracer

            self.tracer = RequestTracer(f"splitserve-{'colocated' if colocated else config.role}",
                                        config.otlp_traces_endpoint)

    def start_span(self, name: str, context):
        """A span of one call (``prefill``, ``decode``, ``embed``), the child of the router's span where the call's metadata
        carries its trace context; None without a tracer."""
        if self.tracer is None:
            return None
        return self.tracer.start_span(name, context.invocation_metadata() or ())

    def end_span(self, span, attributes: dict, error: BaseException | None) -> None:
        """End ``span`` (None: nothing) with ``attributes``; ``error``: what ended the call, as its status."""
        if span is None:
            return
        failure = None
        if error is not None:
            from splitserve.rpc.errors import status_of

            if isinstance(error, GeneratorExit):
                failure = "CANCELLED: the caller went away"
            else:
                code, message = status_of(error)
                failure = f"{code.name}: {message[:200]}"
        self.tracer.end(span, {"worker.id": self.worker_id, **attributes}, failure)

    def _lora_catalog(self, config: WorkerConfig) -> LoRACatalog:
        """The adapters this worker serves: its --lora-modules, each loaded once now (a bad one stops the worker at
        start, with the loader's sentence), and those its --lora-dir holds (each checked before it is served)."""
        catalog = LoRACatalog(config.lora_modules, config.lora_dir, check=self._check_adapter)
        manager = self.engine.model_runner.lora
        for request in catalog.fixed_requests:
            manager.acquire(request)
            manager.release(request)
        if config.lora_modules:
            logger.info("Serving %d LoRA adapters: %s", len(config.lora_modules), ", ".join(config.lora_modules))
        return catalog

    def _check_adapter(self, request) -> None:
        """Read ``request``'s adapter in full on the CPU, as the engine will load it (InvalidRequest: what is wrong)."""
        from splitserve.engine.lora import load_adapter, part_shapes

        manager = self.engine.model_runner.lora
        load_adapter(request, manager.config.num_hidden_layers, part_shapes(manager.config), manager.max_rank,
                     manager.dtype, "cpu")

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters this worker serves now, by name."""
        return self.lora.names()

    def lora_request(self, name: str):
        """The LoRARequest a request naming adapter ``name`` runs with; None for "" (the base model).

        Raises:
            InvalidRequest: not a valid adapter name.
            NotFound: this worker serves no adapter of that name.
        """
        return self.lora.request(name)

    # ---- life ------------------------------------------------------------------

    def start(self, address: str) -> None:
        """Start the engine loop and the connector; register with the router when configured."""
        self.address = address
        if not self.worker_id:
            self.worker_id = f"{self.config.role}-{address}"
        if self.config.role != "both":
            self.kv_transport = self._create_transport()
            self.kv_connector = self._make_kv_connector(self.kv_transport, self.counters)
            self.engine.attach_kv_connector(self.kv_connector)
        self._warm_up()
        self.loop.start()
        if hasattr(self.kv_connector, "start"):
            self.kv_connector.start()  # the decode side's receiving threads
        self.state = inference_pb2.WORKER_STATE_SERVING
        if self.config.router:
            from splitserve.rpc.membership import Membership

            self.membership = Membership(
                self.config.router, self.registration, self.load_pb, on_state=self._on_router_state,
                state=lambda: self.state, cluster_token=self.config.cluster_token, tls=self.config.tls,
                lora_names=(lambda: self.lora_names) if self.config.lora_dir else None,
            ).start(timeout=self.config.register_timeout_seconds)
            self.worker_id = self.membership.worker_id

    def stop(self) -> None:
        """Stop the loop (aborting what is in flight: no new step starts), leave the cluster, stop the connector."""
        self.state = inference_pb2.WORKER_STATE_DRAINING
        self.loop.stop()
        self.lora.stop()
        if self.membership is not None:
            self.membership.stop()
        if hasattr(self.kv_connector, "stop"):
            self.kv_connector.stop()
        if self.kv_transport is not None:
            self.kv_transport.close()
        if getattr(self, "metrics_server", None) is not None:
            self.metrics_server.shutdown()
        if self.tracer is not None:
            self.tracer.close()

    def _warm_up(self) -> None:
        """One short request through the engine before serving, so the first client does not pay for
        lazy initialisation (kernel loading, first allocations, structured outputs' tokenizer)."""
        from splitserve.common.sampling_params import SamplingParams

        started = time.monotonic()
        engine = self.engine
        engine.add_request("warm-up", None, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           prompt_token_ids=[1] * 2 * self.config.engine.block_size)
        while engine.has_unfinished_requests():
            engine.step()
        engine.structured_outputs.warm_up()  # llguidance's tokenizer, off the serving loop's path
        engine.stats = type(engine.stats)()
        self.loop.last_load = engine.load()
        logger.info("Engine warmed up in %.2f s", time.monotonic() - started)

    def _on_router_state(self, state: int) -> None:
        if state == inference_pb2.WORKER_STATE_DRAINING and self.state != state:
            logger.info("The router drains this worker: finishing in-flight requests, taking no new ones")
            self.state = state

    def _create_transport(self):
        """The worker's KV transport: a p2p or redis connector (``splitserve.kvtransfer``), or for lmcache the
        worker's ``LMCacheKVStore``, which the engine's connector uses directly (LMCache moves the bytes; there is
        no payload to route)."""
        from splitserve.kvtransfer import create_connector
        from splitserve.kvtransfer.layout import KVLayout

        layout = KVLayout.from_kv_cache(self.engine.kv_cache_tensor)
        self.kv_layout = layout
        if self.config.kv_transfer == KVConnectorKind.LMCACHE:
            return self._create_lmcache_store(layout)
        options = {"host": self.config.kv_address or self.config.host, "cluster_token": self.config.cluster_token,
                   "device": str(self.engine.kv_cache_tensor.device)}
        if self.config.kv_transfer == "redis":
            options = {"url": self.config.kv_address, **self.config.redis_access.connector_options(),
                       "device": options["device"]}
        options["checksum"] = self.config.kv_checksum
        return create_connector(self.config.kv_transfer, self.worker_id, self.model_fingerprint, layout, **options)

    def _create_lmcache_store(self, layout):
        from splitserve.kvtransfer.lmcache_connector import LMCacheKVStore

        config = self.config
        store = LMCacheKVStore(config.kv_address, self.model_fingerprint, layout, chunk_size=config.lmcache_chunk_size,
                               local_cpu_bytes=config.lmcache_local_cpu_mb << 20,
                               ttl_seconds=config.lmcache_ttl_seconds, redis_access=config.redis_access)
        logger.info("KV through LMCache at %s (chunks of %d tokens, %d MiB staging buffer, keys expire after %.0f s)",
                    store.url, config.lmcache_chunk_size, config.lmcache_local_cpu_mb, config.lmcache_ttl_seconds)
        return store

    # ---- admission ----------------------------------------------------------------

    def admit(self) -> None:
        """Count a new request in, or refuse it: UNAVAILABLE while draining, RESOURCE_EXHAUSTED when full."""
        if self.state != inference_pb2.WORKER_STATE_SERVING:
            raise Unavailable(f"Worker {self.worker_id} is draining and takes no new requests.")
        self.admission.enter(self.worker_id)
        self.counters.add(num_requests=1)

    @property
    def num_in_flight(self) -> int:
        return self.admission.num_in_flight

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.num_in_flight == 0

    @staticmethod
    def draining_state() -> int:
        return inference_pb2.WORKER_STATE_DRAINING

    def release(self) -> None:
        """Count a request admitted by ``admit`` out."""
        self.admission.leave()
        self.counters.add(num_finished_requests=1)

    # ---- identity and load --------------------------------------------------------

    def load_pb(self) -> inference_pb2.WorkerLoad:
        # The load after the engine's latest step: never waits for a long step to end.
        return worker_load_to_pb(self.loop.last_load)

    def capacity_pb(self) -> worker_pb2.WorkerCapacity:
        config = self.config.engine
        return worker_pb2.WorkerCapacity(
            num_total_kv_blocks=self.engine.num_kv_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.engine.max_model_len,
        )

    def layout_pb(self) -> worker_pb2.KVCacheLayout:
        from splitserve.kvtransfer.layout import KVLayout

        return KVLayout.from_kv_cache(self.engine.kv_cache_tensor).to_pb()

    def endpoint_pb(self) -> worker_pb2.KVEndpoint | None:
        if self.kv_transport is None:
            return None
        if self.config.kv_transfer == KVConnectorKind.LMCACHE:
            from splitserve.kvtransfer.connector import KVEndpointInfo

            # KV meets in LMCache's Redis: the endpoint names it by its public URL (no credentials).
            return KVEndpointInfo(KVConnectorKind.LMCACHE.value, self.kv_transport.url, self.worker_id).to_pb()
        return self.kv_transport.endpoint().to_pb()

    def registration(self) -> worker_pb2.RegisterRequest:
        return worker_pb2.RegisterRequest(
            worker_id=self.worker_id, role=ROLES[self.config.role], address=self.address,
            kv_endpoint=self.endpoint_pb(), capacity=self.capacity_pb(), model_fingerprint=self.model_fingerprint,
            kv_layout=self.layout_pb(), state=self.state, server_version=__version__,
            lora_names=self.lora_names, reasoning_parser=self.engine.config.reasoning_parser or "",
        )

    def status_pb(self) -> worker_pb2.GetWorkerStatusResponse:
        return worker_pb2.GetWorkerStatusResponse(
            status=inference_pb2.WorkerStatus(
                worker_id=self.worker_id, role=ROLES[self.config.role], address=self.address,
                state=self.state, load=self.load_pb(),
            ),
            capacity=self.capacity_pb(), model_fingerprint=self.model_fingerprint, kv_layout=self.layout_pb(),
            kv_endpoint=self.endpoint_pb(), server_version=__version__, counters=self.counters.to_pb(),
            reasoning_parser=self.engine.config.reasoning_parser or "", lora_names=self.lora_names,
        )


ACCEPT_TIMEOUT_SECONDS = 60.0


def wait_accepted(stream, timeout: float = ACCEPT_TIMEOUT_SECONDS):
    """The engine's acceptance of a submitted request (its reserved blocks); raises what refused it, or
    Unavailable when the engine loop did not take it in time."""
    from concurrent.futures import TimeoutError as FutureTimeout

    try:
        return stream.wait_accepted(timeout)
    except FutureTimeout:
        raise Unavailable(f"The engine did not take the request within {timeout:.0f} s; retry later.") from None
