"""Prometheus metrics of the router, the workers and the HTTP gateway, served over HTTP by each process
(``--metrics-port``).

Names follow Prometheus' conventions (``splitserve_`` prefix, base units, ``_total`` on counters, no colons:
those are for recording rules), and mirror vLLM's where the meaning is the same (time to first token,
inter-token latency, end-to-end and queue time, running/waiting requests, KV usage, prefix-cache queries and
hits in tokens), so dashboards carry over. Each process keeps its metrics in a registry of its own.

What a worker reports about its engine (load, KV blocks) is read when Prometheus scrapes, from the load the
engine loop publishes after each step and the worker's counters (``splitserve.rpc.counters``): nothing is
updated on the engine's thread. The autoscaling signals of ``deploy/`` are among them:
``splitserve_worker_queued_prompt_tokens`` for the prefill pool, ``splitserve_worker_kv_block_usage_ratio`` and
``splitserve_worker_requests_waiting`` for the decode pool.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Request latencies, seconds: from a few milliseconds (a cached short prompt) to minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Between two tokens of one stream, seconds.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# One KV hand-over, seconds.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """Serve ``registry`` at ``http://host:port/metrics`` (any path answers) on a daemon thread, bound to
    ``host`` only; returns the HTTP server (``server.server_port`` is the bound port; ``shutdown()`` stops it).

    Raises:
        CannotListen: the port is taken or the host is not local (a sentence).
    """
    from splitserve.rpc.server import CannotListen, bind_failure_reason

    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError:
        raise CannotListen(f"Cannot serve metrics on {host}:{port}: {bind_failure_reason(f'{host}:{port}')}.") from None
    logger.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_port)
    return server


class RouterMetrics:
    """What the router sees of every request, of the registry and of its own admission."""

    def __init__(self, pools: Callable[[], dict] | None = None, in_flight: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("splitserve_router_requests", "Generation requests ended, by outcome (stop, length, "
                                "abort, error: the finish reason; refused: a status code before any token) and gRPC "
                                "status code.", ["outcome", "code"], registry=registry)
        self.time_to_first_token = Histogram("splitserve_router_time_to_first_token_seconds", "From the router "
                                             "accepting a request to its first token.", buckets=LATENCY_BUCKETS,
                                             registry=registry)
        self.inter_token_latency = Histogram("splitserve_router_inter_token_latency_seconds", "Between consecutive "
                                             "tokens of one stream, as relayed (a message of n tokens counts n "
                                             "intervals of equal share).", buckets=INTER_TOKEN_BUCKETS, registry=registry)
        self.e2e_latency = Histogram("splitserve_router_e2e_request_latency_seconds", "From the router accepting a "
                                     "request to its last message.", buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("splitserve_router_request_queue_time_seconds", "Waiting in the prefill "
                                    "worker's queue before computation started (remote prefills).",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.admission_refusals = Counter("splitserve_router_admission_refusals", "Requests refused before "
                                          "dispatch: in_flight_limit (--max-in-flight-requests), draining.",
                                          ["reason"], registry=registry)
        self.migrations = Counter("splitserve_router_migrations", "Requests (each completion of a request for n on "
                                  "its own) moved to another decode worker after theirs failed mid-stream.", registry=registry)
        self.embeddings = Counter("splitserve_router_embedding_requests", "Embed requests ended, by gRPC status "
                                  "code (OK: the embedding returned).", ["code"], registry=registry)
        # Every series a dashboard or alert reads exists from the start, at 0, rather than after its first event.
        for outcome in ("stop", "length", "abort", "error"):
            self.requests.labels(outcome, "OK")
        for reason in ("in_flight_limit", "draining"):
            self.admission_refusals.labels(reason)
        self.embeddings.labels("OK")
        if pools is not None:
            registry.register(_RegistryCollector(pools, in_flight))


class GatewayMetrics:
    """What the HTTP gateway answers: requests by route and status, their durations (a stream's until its last
    event), the requests in flight and the generations they asked the router for (n for each prompt). Routes
    outside ``routes`` count as ``other``, so no client string becomes a label."""

    def __init__(self, routes: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        # Templated routes ("/v1/models/{model:path}") are labelled by their template, converters left out.
        routes = [re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route) for route in routes]
        self._templates = [(route[: route.index("{")], route) for route in routes if "{" in route]
        self.routes = frozenset(routes)
        registry = self.registry
        self.requests = Counter("splitserve_gateway_requests", "HTTP requests answered, by route and HTTP status "
                                "(a stream's is the status its headers carried).", ["route", "status"],
                                registry=registry)
        self.duration = Histogram("splitserve_gateway_request_duration_seconds", "From an HTTP request's arrival "
                                  "to its response's last byte (a stream's last event).", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=registry)
        self.in_flight = Gauge("splitserve_gateway_requests_in_flight", "HTTP requests being answered.",
                               registry=registry)
        self.generations = Counter("splitserve_gateway_generations", "Choices asked of the router for completions "
                                   "and chats: n for each prompt of a request (one router call a prompt).",
                                   registry=registry)
        for route in self.routes:
            self.requests.labels(route, "200")

    def route(self, path: str) -> str:
        """The label of a request's path: its route's (a templated route's, ``/v1/models/{model}``, for any path
        under it), or ``other``."""
        if path in self.routes:
            return path
        return next((label for prefix, label in self._templates if path.startswith(prefix)), "other")


class _RegistryCollector(Collector):
    """Workers by pool and state, and requests in flight on the router, read at scrape time."""

    def __init__(self, pools: Callable[[], dict], in_flight: Callable[[], int] | None) -> None:
        self._pools = pools
        self._in_flight = in_flight

    def collect(self) -> Iterable:
        from splitserve.v1 import inference_pb2

        workers = GaugeMetricFamily("splitserve_router_workers", "Workers in the router's registry, by pool and "
                                    "state.", labels=["pool", "state"])
        counts: dict[tuple[str, str], int] = {}
        for role, members in self._pools().items():
            pool = _label(inference_pb2.WorkerRole, role.value, "WORKER_ROLE_")
            for state in ("starting", "serving", "draining"):
                counts.setdefault((pool, state), 0)
            for worker in members:
                key = (pool, _label(inference_pb2.WorkerState, worker.state.value, "WORKER_STATE_"))
                counts[key] = counts.get(key, 0) + 1
        for (pool, state), count in sorted(counts.items()):
            workers.add_metric([pool, state], count)
        yield workers
        if self._in_flight is not None:
            yield GaugeMetricFamily("splitserve_router_requests_in_flight", "Generation and embedding calls open on "
                                    "the router.",
                                    value=self._in_flight())


class WorkerMetrics:
    """A worker's engine load and counters (read at scrape time) and its KV hand-overs.

    Args:
        role: the worker's role label ("prefill", "decode", "colocated").
        connector: its KV connector ("p2p", "redis", "lmcache"; "none" colocated).
        runtime: the ``WorkerRuntime`` whose load and counters are exported (None: only the histograms).
    """

    def __init__(self, role: str, connector: str, runtime=None) -> None:
        self.registry = CollectorRegistry()
        self.role = role
        self.connector = connector
        registry = self.registry
        self.kv_transfer_seconds = Histogram(
            "splitserve_worker_kv_transfer_seconds", "One prompt's KV hand-over: on a prefill worker from the "
            "sampled first token until the last block was handed over (direction send); on a decode worker its "
            "wait for the blocks (direction receive).", ["connector", "direction"], buckets=TRANSFER_BUCKETS,
            registry=registry)
        self.kv_transfer_failures = Counter(
            "splitserve_worker_kv_transfer_failures", "KV hand-overs that failed: a send not delivered (send), "
            "blocks that did not arrive in time or were refused (receive).", ["connector", "direction"],
            registry=registry)
        self.prefix_cache_queries = Counter(
            "splitserve_worker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["role"],
            registry=registry).labels(role)
        self.prefix_cache_hits = Counter(
            "splitserve_worker_prefix_cache_hits", "Prompt tokens found in the prefix cache, or loaded from the "
            "shared KV store, and not computed.", ["role"], registry=registry).labels(role)
        direction = {"prefill": "send", "decode": "receive"}.get(role)
        if direction is not None:  # present at 0 from the start (a colocated worker moves no KV)
            self.kv_transfer_seconds.labels(connector, direction)
            self.kv_transfer_failures.labels(connector, direction)
        if runtime is not None:
            registry.register(_WorkerCollector(runtime, role))

    def observe_transfer(self, direction: str, seconds: float | None) -> None:
        """One KV hand-over in ``direction`` ("send", "receive"): its seconds, or None when it failed."""
        if seconds is None:
            self.kv_transfer_failures.labels(self.connector, direction).inc()
        else:
            self.kv_transfer_seconds.labels(self.connector, direction).observe(seconds)

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prefix_cache_queries.inc(num_prompt_tokens)
        self.prefix_cache_hits.inc(num_cached_tokens)


class _WorkerCollector(Collector):
    """The engine's load after its latest step and the worker's counters, read at scrape time."""

    _GAUGES = (
        ("splitserve_worker_requests_running", "Requests in the engine's running batch.", "num_running_requests"),
        ("splitserve_worker_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_requests"),
        ("splitserve_worker_requests_waiting_for_remote_kvs", "Requests held until their prompt's KV arrives.",
         "num_waiting_for_remote_kvs_requests"),
        ("splitserve_worker_queued_prompt_tokens", "Prompt tokens admitted and not yet computed.",
         "num_queued_prefill_tokens"),
        ("splitserve_worker_kv_blocks_total", "KV cache blocks of the engine.", "num_total_kv_blocks"),
        ("splitserve_worker_kv_blocks_free", "KV cache blocks free (cached prefix blocks count as free).",
         "num_free_kv_blocks"),
        ("splitserve_worker_kv_block_usage_ratio", "Fraction of KV blocks in use, 0 to 1.", "kv_block_usage"),
    )
    _COUNTERS = (
        ("splitserve_worker_requests", "Requests admitted.", "num_requests"),
        ("splitserve_worker_finished_requests", "Requests that left the worker, whatever their outcome.",
         "num_finished_requests"),
        ("splitserve_worker_kv_transfers_sent", "Prompts whose KV this prefill worker delivered.",
         "num_kv_transfers_sent"),
        ("splitserve_worker_kv_transfers_received", "Prompts whose KV arrived on this decode worker.",
         "num_kv_transfers_received"),
        ("splitserve_worker_kv_transfer_bytes", "KV payload bytes sent (prefill) or received (decode).",
         "num_kv_bytes"),
        ("splitserve_worker_kv_recomputes", "Prompts recomputed here after their KV failed to arrive.",
         "num_kv_recomputes"),
        ("splitserve_worker_kv_payloads_refused", "KV payloads refused (checksum, size, layout).",
         "num_kv_payloads_refused"),
        ("splitserve_worker_local_prefills", "Prompts a decode worker prefilled itself.", "num_local_prefills"),
    )
    # Read from the engine's own counters (plain integers it alone writes, after each step).
    _ENGINE_COUNTERS = (
        ("splitserve_worker_spec_decode_draft_tokens", "Speculative decoding (--speculative-config): draft tokens "
         "verified, as vLLM's spec_decode_num_draft_tokens.", "num_draft_tokens"),
        ("splitserve_worker_spec_decode_accepted_tokens", "Speculative decoding: draft tokens accepted (each one a "
         "step saved), as vLLM's spec_decode_num_accepted_tokens.", "num_accepted_tokens"),
    )

    def __init__(self, runtime, role: str) -> None:
        self._runtime = runtime
        self._role = role

    def collect(self) -> Iterable:
        load = self._runtime.load_pb()
        counters = self._runtime.counters.to_pb()
        for name, documentation, field in self._GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=["role"])
            family.add_metric([self._role], getattr(load, field))
            yield family
        for name, documentation, field in self._COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["role"])
            family.add_metric([self._role], getattr(counters, field))
            yield family
        stats = self._runtime.engine.stats
        for name, documentation, field in self._ENGINE_COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["role"])
            family.add_metric([self._role], getattr(stats, field))
            yield family
        yield from self._lora_gauges(stats.lora_requests)

    def _lora_gauges(self, counts: dict[str, tuple[int, int]]) -> Iterable:
        """Per LoRA adapter the worker serves (--lora-modules and --lora-dir; at most 64), its requests running and
        waiting, as vLLM's lora_requests_info tells in labels."""
        names = self._runtime.lora_names
        if not names:
            return
        for index, (name, documentation) in enumerate((
                ("splitserve_worker_lora_requests_running", "Requests of each LoRA adapter in the running batch."),
                ("splitserve_worker_lora_requests_waiting", "Requests of each LoRA adapter waiting to start."))):
            family = GaugeMetricFamily(name, documentation, labels=["role", "lora_name"])
            for adapter in names:
                family.add_metric([self._role, adapter], counts.get(adapter, (0, 0))[index])
            yield family


def _label(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()
