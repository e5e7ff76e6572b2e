"""OpenTelemetry traces: a p2p cluster whose router exports a span of every generation request, and whose workers
one of every prefill and decode call (``--otlp-traces-endpoint``), to a real OTLP/gRPC collector run here
(OpenTelemetry's own service definition, on a loopback port), reached directly and through the HTTP gateway.

The spans must carry the request's counts and times (equal to what the client was told), join the caller's trace
where the call carries a W3C ``traceparent`` (gRPC metadata, or the gateway's HTTP header), the workers' ones as
children of the router's, start a trace of their own where it does not, hold no prompt text, and a collector that
goes away must cost no request.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import httpx
import pytest

from splitserve.client import Client, embed_request, generate_request
from splitserve.common.sampling_params import SamplingParams
from tests.cluster_helpers import all_blocks_free, running_gateway, start_cluster, wait_until

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
                                    reason="the tracing extra is not installed (make install-test installs it)")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector(trace_service.TraceServiceServicer):
    """An OTLP/gRPC trace collector: it keeps every span it is sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def span_of(self, request_id: str):
        with self._lock:
            return next((span for _, span in self.spans if attributes(span).get("gen_ai.request.id") == request_id),
                        None)


def attributes(span) -> dict:
    values = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        values[kv.key] = ([item.string_value for item in value.array_value.values] if kind == "array_value"
                          else getattr(value, kind))
    return values


@pytest.fixture(scope="module")
def collector():
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, server, port
    server.stop(0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, collector):
    _, _, port = collector
    endpoint = ["--otlp-traces-endpoint", f"http://127.0.0.1:{port}"]
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("tracing-logs"), router_args=endpoint, worker_args=endpoint)
    yield cluster
    cluster.stop()


def test_a_request_with_trace_context_gets_spans_in_the_callers_trace(cluster, collector):
    servicer = collector[0]
    with Client(cluster.router.address) as client:
        request = generate_request(PROMPT, SamplingParams(temperature=0, max_tokens=6), request_id="traced-1")
        chunks = list(client.stub.GenerateStream(request, timeout=120,
                                                 metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")]))
        answer = client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), request_id="untraced-1")
    last = chunks[-1]
    span = wait_until(lambda: servicer.span_of("traced-1"), 30, message="the traced request's span")
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    values = attributes(span)
    assert values["gen_ai.usage.prompt_tokens"] == last.usage.prompt_tokens
    assert values["gen_ai.usage.completion_tokens"] == 6 == sum(len(chunk.token_ids) for chunk in chunks)
    assert values["gen_ai.request.max_tokens"] == 6 and values["gen_ai.request.temperature"] == 0
    assert values["gen_ai.response.finish_reasons"] == ["length"] and values["rpc.grpc.status_code"] == "OK"
    assert 0 < values["gen_ai.latency.time_to_first_token"] <= values["gen_ai.latency.e2e"]
    assert values["splitserve.prefilled_remotely"] is True and values["splitserve.kv_transfer_seconds"] > 0
    assert values["splitserve.migrations"] == 0
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(
        values["gen_ai.latency.e2e"], abs=0.05)
    assert not any(PROMPT in str(value) or "France" in str(value) for value in values.values())  # no prompt text
    resource = next(resource for resource, candidate in servicer.spans if candidate is span)
    assert resource["service.name"] == "splitserve-router"
    # The workers' spans of the same request: children of the router's, in its trace.
    def children():
        with servicer._lock:
            found = {resource["service.name"]: candidate for resource, candidate in servicer.spans
                     if candidate.parent_span_id == span.span_id}
        return found if len(found) == 2 else None

    workers = wait_until(children, 30, message="the prefill and decode spans")
    prefill, decode = workers["splitserve-prefill"], workers["splitserve-decode"]
    assert prefill.name == "prefill" and decode.name == "decode"
    assert prefill.trace_id == decode.trace_id == span.trace_id
    assert span.start_time_unix_nano <= prefill.start_time_unix_nano <= prefill.end_time_unix_nano
    assert decode.end_time_unix_nano <= span.end_time_unix_nano
    prefill_values, decode_values = attributes(prefill), attributes(decode)
    assert prefill_values["gen_ai.usage.prompt_tokens"] == last.usage.prompt_tokens
    assert prefill_values["splitserve.prefill_seconds"] > 0 and prefill_values["splitserve.sent_blocks"] > 0
    assert prefill_values["gen_ai.request.id"].startswith("traced-1#")  # the router's attempt id
    assert decode_values["gen_ai.usage.completion_tokens"] == 6
    assert decode_values["gen_ai.response.finish_reasons"] == ["length"]
    assert decode_values["splitserve.prefill_locally"] is False and decode_values["splitserve.kv_recomputed"] is False
    assert decode_values["worker.id"] and prefill_values["worker.id"] != decode_values["worker.id"]
    # Without trace context: a trace of its own, no parent.
    untraced = wait_until(lambda: servicer.span_of("untraced-1"), 30, message="the untraced request's span")
    assert untraced.trace_id.hex() != TRACE_ID and not untraced.parent_span_id
    assert attributes(untraced)["gen_ai.usage.completion_tokens"] == len(answer.token_ids) == 3


def test_the_gateway_passes_the_callers_trace_context_on(cluster, collector, tmp_path):
    servicer = collector[0]
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with running_gateway(cluster.router.address, tmp_path / "gateway.log") as url:
        headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01", "tracestate": "vendor=splitserve-test"}
        body = {"model": "any", "prompt": [PROMPT, PROMPT + " Again."], "max_tokens": 2, "temperature": 0, "n": 2}
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        response = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
    request_id = response.json()["id"]

    def spans():  # one a prompt (its n choices in one call), each under the caller's span
        with servicer._lock:
            found = [span for _, span in servicer.spans if span.trace_id.hex() == trace_id and span.name == "llm_request"]
        return found if len(found) == 2 else None

    found = wait_until(spans, 30, message="both prompts' spans")
    assert sorted(attributes(span)["gen_ai.request.id"] for span in found) == [f"{request_id}-0", f"{request_id}-1"]
    assert all(span.parent_span_id.hex() == "b7ad6b7169203331" for span in found)
    assert all(span.trace_state == "vendor=splitserve-test" for span in found)


def test_an_embedding_gets_the_routers_span_and_the_workers_as_its_child(cluster, collector):
    servicer = collector[0]
    with Client(cluster.router.address) as client:
        answer = client.stub.Embed(embed_request(PROMPT, request_id="embedded-1"), timeout=120,
                                   metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")])
    span = wait_until(lambda: servicer.span_of("embedded-1"), 30, message="the embedding's span")
    assert span.name == "embedding_request" and span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_ID
    values = attributes(span)
    assert values["gen_ai.operation.name"] == "embeddings" and values["rpc.grpc.status_code"] == "OK"
    assert values["gen_ai.usage.prompt_tokens"] == answer.prompt_tokens > 0
    assert values["splitserve.cached_tokens"] == answer.cached_tokens and values["gen_ai.latency.e2e"] > 0
    worker = wait_until(lambda: _children(servicer, span), 30, message="the worker's embed span")[0]
    resource = next(resource for resource, candidate in servicer.spans if candidate is worker)
    assert worker.name == "embed" and resource["service.name"] == "splitserve-decode"
    assert attributes(worker)["gen_ai.usage.prompt_tokens"] == answer.prompt_tokens
    assert attributes(worker)["gen_ai.request.id"].startswith("embedded-1#")


def test_a_tracing_gateway_makes_a_span_of_each_call_above_the_routers(cluster, collector, tmp_path):
    servicer = collector[0]
    endpoint = f"http://127.0.0.1:{collector[2]}"
    caller_span = "b7ad6b7169203331"
    traces = {name: f"{number:032x}" for number, name in enumerate(["completions", "embeddings", "refused"], 1)}
    with running_gateway(cluster.router.address, tmp_path / "gateway.log", "--otlp-traces-endpoint", endpoint) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

        def post(path: str, trace: str, body: dict) -> httpx.Response:
            return httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=120,
                              headers={"traceparent": f"00-{traces[trace]}-{caller_span}-01"})

        completions = post("/v1/completions", "completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2})
        embeddings = post("/v1/embeddings", "embeddings", {"input": PROMPT})
        refused = post("/v1/completions", "refused", {"prompt": PROMPT, "max_tokens": -1})
    assert (completions.status_code, embeddings.status_code, refused.status_code) == (200, 200, 400)

    def gateway_span(trace: str):
        with servicer._lock:
            return next((span for resource, span in servicer.spans if span.trace_id.hex() == traces[trace]
                         and resource["service.name"] == "splitserve-gateway"), None)

    # The completion's 2 choices come from one router call (n = 2).
    for trace, route, status, generations, calls, child in [
            ("completions", "/v1/completions", 200, 2, 1, "llm_request"),
            ("embeddings", "/v1/embeddings", 200, 1, 1, "embedding_request"),
            ("refused", "/v1/completions", 400, None, None, None)]:
        span = wait_until(lambda trace=trace: gateway_span(trace), 30, message=f"the gateway's span ({trace})")
        values = attributes(span)
        assert span.name == f"POST {route}" and span.kind == span.SPAN_KIND_SERVER
        assert span.parent_span_id.hex() == caller_span
        assert values["http.route"] == route and values["http.response.status_code"] == status
        assert values.get("splitserve.generations") == generations
        assert span.status.code == span.status.STATUS_CODE_UNSET  # a 4xx is the caller's error, not the server's
        if child is not None:  # the router's spans of its calls are its children
            children = wait_until(lambda span=span, calls=calls: _children(servicer, span, calls), 30,
                                  message=f"the router's spans under the gateway's ({trace})")
            assert {candidate.name for candidate in children} == {child}
            assert all(span.start_time_unix_nano <= candidate.start_time_unix_nano
                       and candidate.end_time_unix_nano <= span.end_time_unix_nano for candidate in children)


def _children(servicer, parent, count: int = 1) -> list | None:
    with servicer._lock:
        found = [span for _, span in servicer.spans if span.parent_span_id == parent.span_id]
    return found if len(found) == count else None


def test_a_collector_that_goes_away_costs_no_request(cluster, collector):
    _, server, _ = collector
    server.stop(0)  # spans now fail to leave, in the SDK's thread
    with Client(cluster.router.address) as client:
        for number in range(3):
            answer = client.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), request_id=f"lost-{number}")
            assert len(answer.token_ids) == 4
        wait_until(lambda: all_blocks_free(client), 20, message="every block free")
    assert cluster.router.alive()  # the router serves on
