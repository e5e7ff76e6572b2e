"""OpenTelemetry traces of requests (``--otlp-traces-endpoint``), as vLLM's and TGI's servers export them.

The router opens one span a generation request, ``llm_request`` (vLLM's name and its ``gen_ai.*`` attributes:
token counts, time in queue, to the first token, end to end, the finish reason; and ``splitserve.*`` ones: the
KV transfer's time, prefix tokens cached and loaded, migrations), from the moment it accepted the request to its
last message. Its parent is the caller's span where the call carries W3C trace context (``traceparent`` and
``tracestate`` gRPC metadata; the HTTP gateway passes its caller's headers on), so the request joins the
caller's trace; else it starts a trace of its own. The router sends its span's context with its calls to the
workers, whose ``prefill`` and ``decode`` spans (their own tracers) are its children.

Spans leave in batches, over OTLP/gRPC, from a thread of the SDK's: a collector that is slow or down loses spans
(the SDK logs it), never a request. Spans carry counts and times, never a prompt, a token or a key.

Needs the optional extra: ``pip install 'splitserve[tracing]'`` (OpenTelemetry's SDK and OTLP exporter).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

# How long spans wait to leave in a batch, and how long the last ones get at shutdown.
EXPORT_DELAY_MILLIS = 1000
SHUTDOWN_FLUSH_MILLIS = 2000
# The W3C trace context headers taken from a caller (metadata keys are lower-case in gRPC).
TRACE_HEADERS = ("traceparent", "tracestate")
# Longer values are not trace context (a traceparent is 55 characters; the W3C caps a tracestate at 512).
MAX_TRACE_HEADER_CHARS = 512


def check_endpoint(endpoint: str) -> str:
    """An OTLP/gRPC collector's address: ``http://HOST:PORT`` (plaintext) or ``https://HOST:PORT`` (TLS, the
    system's roots). Raises ValueError with the reason."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--otlp-traces-endpoint must be http://HOST:PORT or https://HOST:PORT (an OTLP/gRPC "
                         f"collector, such as http://127.0.0.1:4317), got {endpoint[:200]!r}.")
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number from 0 to 65535)
    except ValueError:
        raise ValueError(f"--otlp-traces-endpoint has a bad port: {endpoint[:200]!r}.") from None
    return endpoint


def trace_headers(pairs: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The W3C trace context among a call's metadata or a request's headers (names any case), bounded in
    length; what is not trace context is left out."""
    found = {}
    for name, value in pairs:
        name = name.lower()
        if name in TRACE_HEADERS and isinstance(value, str) and len(value) <= MAX_TRACE_HEADER_CHARS:
            found[name] = value
    return tuple(found.items())


class RequestTracer:
    """Spans of one service's requests, exported to an OTLP/gRPC collector.

    Args:
        service_name: the resource's ``service.name`` (``splitserve-router``, say).
        endpoint: the collector (:func:`check_endpoint`).

    Raises:
        ValueError: a bad endpoint, or the tracing extra is not installed.
    """

    def __init__(self, service_name: str, endpoint: str) -> None:
        check_endpoint(endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'splitserve[tracing]'.") from None
        self._exporter = OTLPSpanExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme == "http")
        # A provider of our own, not the process's global one: nothing else in the process (LMCache) exports ours.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter,
                                                             schedule_delay_millis=EXPORT_DELAY_MILLIS))
        self._tracer = self._provider.get_tracer("splitserve")
        self._propagator = TraceContextTextMapPropagator()

    def start_span(self, name: str, metadata: Iterable[tuple[str, str]], seconds_ago: float = 0.0):
        """A server span begun ``seconds_ago`` (when the request was accepted), the child of the caller's span
        where ``metadata`` carries trace context. The caller sets its attributes and ends it (:meth:`end`)."""
        from opentelemetry.trace import SpanKind

        context = self._propagator.extract(dict(trace_headers(metadata)))
        start_ns = time.time_ns() - int(max(seconds_ago, 0.0) * 1e9)
        return self._tracer.start_span(name, context=context, kind=SpanKind.SERVER, start_time=start_ns)

    def headers(self, span) -> tuple[tuple[str, str], ...]:
        """W3C trace context naming ``span`` as the parent: metadata for the calls made on its behalf."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return tuple(carrier.items())

    @staticmethod
    def end(span, attributes: dict, error: str | None = None) -> None:
        """Set ``span``'s attributes (None values left out) and end it; ``error``: the request failed, saying so."""
        from opentelemetry.trace import Status, StatusCode

        span.set_attributes({name: value for name, value in attributes.items() if value is not None})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def close(self) -> None:
        """Export the spans still waiting, for at most :data:`SHUTDOWN_FLUSH_MILLIS`, and stop the exporter.

        The SDK's flush takes no deadline of its own (it exports until done, retrying a collector that is down for
        up to ten seconds), so it runs in a thread of its own that is waited on that long; then the exporter is
        shut down, which ends a retry in progress, and spans not out by then are lost (a process stopping does not
        wait on a collector that is gone)."""
        flush = threading.Thread(target=self._provider.force_flush, name="otlp-last-flush", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_FLUSH_MILLIS / 1000)
        self._exporter.shutdown()
        self._provider.shutdown()
