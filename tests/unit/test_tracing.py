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
