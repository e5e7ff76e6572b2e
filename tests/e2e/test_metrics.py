"""Prometheus metrics of a running cluster, scraped over HTTP during and after real traffic.

One cluster (router, a prefill and a decode worker, KV over p2p), each process with ``--metrics-port 0``. The
prefill worker corrupts half of its KV payloads (the fault-injection hook), so some prompts arrive and some are
refused and recomputed; the router admits two requests at a time, so a burst is partly refused. Every metric the
issue names is checked to have moved as the traffic says it must.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.launcher import LocalCluster
from splitserve.prefill_service.faults import KV_FAULTS_ENV
from tests.cluster_helpers import ROUTER_ARGS, WORKER_ARGS, all_blocks_free, wait_until

pytestmark = pytest.mark.timeout(600)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 6


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample at ``url``: {(name, sorted label items): value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sample ``name`` with exactly ``labels`` (0 when absent, as a counter never incremented)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def metrics_url(process) -> str:
    """The metrics URL a process logged at start (it was given --metrics-port 0)."""
    found = wait_until(lambda: re.search(r"Prometheus metrics on (http://\S+/metrics)", process.log()), 30,
                       message=f"{process.name} logs its metrics URL")
    return found.group(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    cluster = LocalCluster(
        worker_args=[*WORKER_ARGS, "--metrics-port", "0", "--log-format", "json"],
        router_args=[*ROUTER_ARGS, "--metrics-port", "0", "--max-in-flight-requests", "2", "--log-format", "json"],
        log_dir=tmp_path_factory.mktemp("metrics-logs"), env={KV_FAULTS_ENV: "corrupt=0.5,seed=3"},
    )
    try:
        cluster.start_router()
        cluster.start_workers("prefill", 1)
        cluster.start_workers("decode", 1)
        yield cluster
    finally:
        cluster.stop()


def test_every_process_serves_metrics_on_its_host_only(cluster):
    for process in [cluster.router, *cluster.workers]:
        url = metrics_url(process)
        assert url.startswith("http://127.0.0.1:"), url
        assert scrape(url), f"{process.name} serves no samples"


def test_json_logs_carry_one_request_id_through_router_prefill_and_decode(cluster):
    # The workers see the router's id of each attempt: the client's, then '#' and a suffix of the attempt.
    with Client(cluster.router.address) as client:
        client.generate("Trace me. " + PROMPT, SamplingParams(temperature=0, max_tokens=4), request_id="trace-me-1")
    for process in [cluster.router, *cluster.workers]:
        entries = wait_until(lambda process=process: [entry for line in process.log().splitlines() if line.startswith("{")
                                      if (entry := json.loads(line))["request_id"].split("#")[0] == "trace-me-1"], 10,
                             message=f"{process.name} logs a JSON line about the request")
        assert {"time", "level", "logger", "process", "transfer_id", "message"} <= entries[0].keys(), entries[0]


def test_metrics_move_with_the_traffic(cluster):
    router_url = metrics_url(cluster.router)
    prefill, decode = (next(w for w in cluster.workers if w.name.startswith(role)) for role in ("prefill", "decode"))
    prefill_url, decode_url = metrics_url(prefill), metrics_url(decode)
    before = {url: scrape(url) for url in (router_url, prefill_url, decode_url)}
    assert value(before[router_url], "splitserve_router_workers", pool="prefill", state="serving") == 1
    assert value(before[router_url], "splitserve_router_workers", pool="decode", state="serving") == 1
    total_blocks = value(before[decode_url], "splitserve_worker_kv_blocks_total", role="decode")
    assert total_blocks > 0

    with Client(cluster.router.address) as client:
        num_prompt_tokens = len(client.tokenize(PROMPT))
        # Finished requests, one after another: the same prompt, so the prefill worker's prefix cache hits.
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(4):
            chunks = list(client.generate_stream(PROMPT, greedy))
            assert chunks[-1].finish_reason == 2  # length
        # A request refused before any token: INVALID_ARGUMENT.
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(PROMPT, greedy, request_id="not an id!")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A long generation seen running on the decode worker, then cancelled by its client.
        long_stream = client.generate_stream(PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        next(long_stream)
        during = wait_until(lambda: (s := scrape(decode_url)) and
                            value(s, "splitserve_worker_requests_running", role="decode") >= 1 and s, 30,
                            message="the decode worker reports the running request")
        assert value(during, "splitserve_worker_kv_blocks_free", role="decode") < total_blocks
        assert value(scrape(router_url), "splitserve_router_requests_in_flight") == 1
        long_stream.cancel()
        # A burst over the router's limit of two requests in flight: some are refused at admission.
        results: list[str] = []

        def one() -> None:
            try:
                list(client.generate_stream(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
                results.append("ok")
            except grpc.RpcError as error:
                results.append(error.code().name)

        threads = [threading.Thread(target=one) for _ in range(5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert "RESOURCE_EXHAUSTED" in results and "ok" in results, results
        wait_until(lambda: all_blocks_free(client), 30, message="every block freed")
    time.sleep(0.5)  # the last heartbeat-free counters are read at scrape time; the servicers update them at once
    after = {url: scrape(url) for url in (router_url, prefill_url, decode_url)}

    def moved(url: str, name: str, **labels) -> float:
        return value(after[url], name, **labels) - value(before[url], name, **labels)

    num_ok = 4 + results.count("ok")
    num_exhausted = results.count("RESOURCE_EXHAUSTED")
    # Router: outcomes and status codes, latencies, admission.
    assert moved(router_url, "splitserve_router_requests_total", outcome="length", code="OK") == num_ok
    assert moved(router_url, "splitserve_router_requests_total", outcome="refused", code="INVALID_ARGUMENT") == 1
    assert moved(router_url, "splitserve_router_requests_total", outcome="refused",
                 code="RESOURCE_EXHAUSTED") == num_exhausted
    assert sum(moved(router_url, "splitserve_router_requests_total", outcome="abort", code=code)
               for code in ("OK", "CANCELLED")) == 1
    assert moved(router_url, "splitserve_router_admission_refusals_total", reason="in_flight_limit") == num_exhausted
    assert moved(router_url, "splitserve_router_time_to_first_token_seconds_count") == num_ok + 1
    assert moved(router_url, "splitserve_router_inter_token_latency_seconds_count") >= num_ok * 4
    assert moved(router_url, "splitserve_router_e2e_request_latency_seconds_count") == num_ok + 1
    assert moved(router_url, "splitserve_router_request_queue_time_seconds_count") == num_ok
    assert moved(router_url, "splitserve_router_e2e_request_latency_seconds_sum") > 0
    assert value(after[router_url], "splitserve_router_requests_in_flight") == 0
    # Prefill worker: prompts computed, prefix-cache hits on the repeats, KV sent.
    num_prefills = num_ok + 1
    assert moved(prefill_url, "splitserve_worker_kv_transfers_sent_total", role="prefill") == num_prefills
    assert moved(prefill_url, "splitserve_worker_kv_transfer_bytes_total", role="prefill") > 0
    assert moved(prefill_url, "splitserve_worker_kv_transfer_seconds_count", connector="p2p",
                 direction="send") == num_prefills
    assert moved(prefill_url, "splitserve_worker_prefix_cache_queries_total", role="prefill") == \
        num_prefills * num_prompt_tokens
    hits = moved(prefill_url, "splitserve_worker_prefix_cache_hits_total", role="prefill")
    assert hits == (num_prefills - 1) * ((num_prompt_tokens - 1) // 16) * 16, hits
    assert value(after[prefill_url], "splitserve_worker_queued_prompt_tokens", role="prefill") == 0
    # Decode worker: KV received or refused and recomputed, no block left in use.
    received = moved(decode_url, "splitserve_worker_kv_transfers_received_total", role="decode")
    recomputed = moved(decode_url, "splitserve_worker_kv_recomputes_total", role="decode")
    assert received >= 1 and recomputed >= 1, (received, recomputed)
    assert moved(decode_url, "splitserve_worker_kv_payloads_refused_total", role="decode") >= recomputed
    assert moved(decode_url, "splitserve_worker_kv_transfer_failures_total", connector="p2p",
                 direction="receive") == recomputed
    assert moved(decode_url, "splitserve_worker_kv_transfer_seconds_count", connector="p2p",
                 direction="receive") >= 1
    assert value(after[decode_url], "splitserve_worker_kv_blocks_free", role="decode") == total_blocks
    assert value(after[decode_url], "splitserve_worker_requests_running", role="decode") == 0
    assert value(after[decode_url], "splitserve_worker_kv_block_usage_ratio", role="decode") == 0
