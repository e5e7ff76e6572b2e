"""The tracing helpers: the collector's address and the W3C trace context taken from a caller."""

from __future__ import annotations

import pytest

from splitserve.rpc.tracing import MAX_TRACE_HEADER_CHARS, check_endpoint, trace_headers


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:4317", "https://otel.example:4317", "http://collector"])
def test_collector_addresses_are_taken(endpoint):
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4317", "grpc://x:4317", "http://:4317", "http://x:4317/v1/traces",
                                      "http://x:port", "http://x:70000", "ftp://x"])
def test_other_addresses_are_refused_with_the_flag_named(endpoint):
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        check_endpoint(endpoint)


def test_only_bounded_trace_context_is_taken_from_a_call():
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    pairs = [("authorization", "Bearer secret"), ("Traceparent", parent), ("tracestate", "a=1"),
             ("x-other", "1")]
    assert trace_headers(pairs) == (("traceparent", parent), ("tracestate", "a=1"))
    assert trace_headers([("tracestate", "a" * (MAX_TRACE_HEADER_CHARS + 1))]) == ()
    assert trace_headers([]) == ()


def test_closing_with_the_collector_gone_waits_only_the_flush_deadline(monkeypatch):
    """A process stopping does not wait on a collector that is down: the SDK's flush retries one for up to ten
    seconds, and the last spans get only SHUTDOWN_FLUSH_MILLIS (cut here to 300 ms) before the exporter stops."""
    import socket
    import time

    from splitserve.rpc import tracing

    with socket.socket() as closed:  # a loopback port with no listener: every export is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(tracing, "SHUTDOWN_FLUSH_MILLIS", 300)
    tracer = tracing.RequestTracer("splitserve-test", f"http://127.0.0.1:{port}")
    tracer.end(tracer.start_span("llm_request", []), {"gen_ai.request.max_tokens": 4})
    started = time.monotonic()
    tracer.close()
    assert time.monotonic() - started < 3  # the SDK's own flush retries for up to 10 s
