"""What a client of the router sees when things stop mid-stream: a decode worker killed, the router SIGTERMed.

One small cluster (a router and one decode worker that prefills locally). A stream that already sent
tokens ends with a last message carrying FINISH_REASON_ERROR and a sentence, never a status code; a
SIGTERMed router refuses new requests but lets the streams in flight finish, then exits 0.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client
from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.v1 import inference_pb2
from tests.cluster_helpers import start_cluster, stream_completions, wait_until, worker_status

pytestmark = pytest.mark.timeout(600)

PROMPT = "Write a long story about a lighthouse keeper."
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
DRAIN_TIMEOUT = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("stream-failures"), prefill=0, decode=1,
                            router_args=["--drain-timeout", str(DRAIN_TIMEOUT)])
    yield cluster
    cluster.stop()


def live_decode_workers(cluster):
    return [p for p in cluster.workers if p.name.startswith("decode") and p.alive()]


def test_a_decode_worker_killed_mid_stream_ends_the_stream_with_an_error_message(cluster):
    [decode] = live_decode_workers(cluster)
    chunks = []
    with Client(cluster.router.address) as client:
        for chunk in client.generate_stream(PROMPT, LONG, timeout=120):
            chunks.append(chunk)
            if len(chunks) == 1:
                decode.kill()
        # Every message before the last one carries tokens; the last one says what failed, with the usage so far.
        *tokens, last = chunks
        token_ids = [t for chunk in tokens for t in chunk.token_ids]
        assert token_ids and all(chunk.finish_reason == inference_pb2.FINISH_REASON_UNSPECIFIED for chunk in tokens)
        assert last.finish_reason == inference_pb2.FINISH_REASON_ERROR
        assert last.error_message.startswith(f"The decode worker {decode.worker_id} failed mid-stream after "
                                             f"{len(token_ids)} tokens: ")
        assert last.error_message.endswith("the text so far is complete up to here.")
        assert last.usage.completion_tokens == len(token_ids) < LONG.max_tokens

        # The router goes on: no decode worker now, then one started afterwards serves.
        with pytest.raises(grpc.RpcError) as refused:
            client.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        cluster.start_workers("decode", 1)
        response = client.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), timeout=120)
        assert response.finish_reason == inference_pb2.FINISH_REASON_LENGTH and len(response.token_ids) == 4


def two_decode_workers_serving(cluster, client) -> None:
    while len(live_decode_workers(cluster)) < 2:
        cluster.start_workers("decode", 1)
    wait_until(lambda: len([w for pool in client.cluster_status().pools for w in pool.workers
                            if w.state == inference_pb2.WORKER_STATE_SERVING]) >= 2, 60,
               message="two decode workers serving")


def no_request_in_flight(client) -> None:
    """Waits for the router to count no request on any worker: it counts a stream off its worker just after the
    client has its last message, so a request started at once could otherwise see the one before as serving."""
    wait_until(lambda: all(w.num_router_in_flight_requests == 0 for pool in client.cluster_status().pools
                           for w in pool.workers), 30, interval=0.05, message="no request in flight")


def stream_killing_its_decode_worker(cluster, client, prompt: str, params: SamplingParams, after: int = 10):
    """Stream ``prompt``, SIGKILLing the decode worker serving it once ``after`` tokens came; returns the tokens,
    the text and the last message the client got, and the worker killed."""
    no_request_in_flight(client)
    token_ids, text, killed, last = [], "", None, None
    for chunk in client.generate_stream(prompt, params, timeout=300):
        token_ids.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
        if killed is None and len(token_ids) >= after:
            serving = [w.worker_id for pool in client.cluster_status().pools for w in pool.workers
                       if w.num_router_in_flight_requests]
            [killed] = [p for p in live_decode_workers(cluster) if p.worker_id in serving]
            killed.kill()
    assert killed is not None and not killed.alive()
    return token_ids, text, last, killed


def test_a_stream_whose_decode_worker_is_killed_migrates_to_another_and_stays_token_identical(cluster):
    """Two decode workers: killing the one serving a greedy stream mid-way moves the request (prompt plus the
    tokens streamed) to the other; the client sees one stream, token for token the undisturbed one. Its presence
    and frequency penalties count the tokens streamed before the move (num_resumed_tokens) as the undisturbed
    stream's do."""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, presence_penalty=0.3,
                            frequency_penalty=0.4)
    with Client(cluster.router.address) as client:
        two_decode_workers_serving(cluster, client)
        undisturbed = client.generate(PROMPT, params, timeout=300)
        token_ids, _, last, _ = stream_killing_its_decode_worker(cluster, client, PROMPT, params)
        assert (last.finish_reason, last.error_message) == (inference_pb2.FINISH_REASON_LENGTH, "")
        assert token_ids == list(undisturbed.token_ids)
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (undisturbed.usage.prompt_tokens, 120)
        no_request_in_flight(client)


def test_a_migrated_stream_resumes_its_grammar_after_the_tokens_sent(cluster):
    """A JSON-schema stream whose decode worker is killed mid-way: the continuation's grammar takes the tokens
    already streamed first (num_resumed_tokens), so the client gets the undisturbed stream's tokens, one valid
    JSON array."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 40, "maxItems": 40}
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs={"json": schema})
    prompt = "Forty numbers as a JSON array:"
    with Client(cluster.router.address) as client:
        two_decode_workers_serving(cluster, client)
        undisturbed = client.generate(prompt, params, timeout=300)
        migrations = cluster.router.log().count("migrating it")
        token_ids, text, last, _ = stream_killing_its_decode_worker(cluster, client, prompt, params)
        assert cluster.router.log().count("migrating it") == migrations + 1
        assert (last.finish_reason, last.error_message) == (inference_pb2.FINISH_REASON_STOP, "")
        assert token_ids == list(undisturbed.token_ids) and len(token_ids) > 20
        assert text == undisturbed.text and len(json.loads(text)) == 40


def stream_n_killing_their_decode_worker(cluster, client, params: SamplingParams, after: int = 5):
    """Stream ``params.n`` completions of PROMPT, SIGKILLing their decode worker once each sent ``after`` tokens;
    returns each completion's tokens and last message by index, and the worker killed."""
    no_request_in_flight(client)
    token_ids: dict[int, list[int]] = {}
    last: dict[int, inference_pb2.GenerateStreamResponse] = {}
    killed = None
    for chunk in client.generate_stream(PROMPT, params, timeout=300):
        assert chunk.index not in last or not last[chunk.index].finish_reason, "a completion went on after its end"
        token_ids.setdefault(chunk.index, []).extend(chunk.token_ids)
        last[chunk.index] = chunk
        if killed is None and len(token_ids) == params.n and min(map(len, token_ids.values())) >= after:
            [killed] = [p for p in live_decode_workers(cluster) if p.worker_id in serving_decode_workers(client)]
            killed.kill()
    assert killed is not None and sorted(last) == list(range(params.n))
    return token_ids, last, killed


def holds_kv_blocks(worker) -> bool:
    """Whether a request holds KV blocks on ``worker`` (after its latest step): its search has started."""
    load = worker_status(worker.address, "decode").status.load
    return load.num_free_kv_blocks < load.num_total_kv_blocks


def serving_decode_workers(client) -> list[str]:
    return [w.worker_id for pool in client.cluster_status().pools for w in pool.workers
            if pool.role == inference_pb2.WORKER_ROLE_DECODE and w.num_router_in_flight_requests]


def test_n_completions_whose_decode_worker_is_killed_each_migrate_and_stay_token_identical(cluster):
    """A request for 3 seeded sampled completions whose decode worker is killed mid-stream: each unfinished
    completion moves on its own (the prompt plus its tokens streamed, seed + index) to the other decode worker, all
    at once; its random stream resumes past the draws of the tokens it had sent (num_resumed_tokens), so each ends
    token for token the undisturbed stream's completion, with its own usage. (top_k 20: over the whole vocabulary
    the continuation's recomputed prompt, rounded otherwise than the undisturbed decode steps, moves the cumulative
    sums that sampling inverts by enough that a token now and then becomes its neighbour in the vocabulary.)"""
    params = SamplingParams(n=3, temperature=1.0, top_k=20, seed=7, max_tokens=120, ignore_eos=True, presence_penalty=0.3,
                            frequency_penalty=0.4)
    with Client(cluster.router.address) as client:
        two_decode_workers_serving(cluster, client)
        runs = stream_completions(client, PROMPT, params)
        undisturbed, prompt_tokens = [token_ids for token_ids, _, _ in runs], runs[0][2][-1].usage.prompt_tokens
        assert len({tuple(token_ids) for token_ids in undisturbed}) == 3  # three different completions
        log_before = cluster.router.log()
        token_ids, last, killed = stream_n_killing_their_decode_worker(cluster, client, params)
        for index in range(3):
            assert (last[index].finish_reason, last[index].error_message) == (inference_pb2.FINISH_REASON_LENGTH, "")
            assert token_ids[index] == undisturbed[index], index
            assert (last[index].usage.prompt_tokens, last[index].usage.completion_tokens) == (prompt_tokens, 120)
        log = cluster.router.log()[len(log_before):]
        assert log.count("migrating it") == 3
        assert all(f"(completion {index}): decode worker {killed.worker_id} failed" in log for index in range(3))
        no_request_in_flight(client)


def test_n_completions_with_no_decode_worker_left_each_end_with_an_error_message(cluster):
    """The last decode worker killed under a request for 3 completions: none can move, so each ends with
    FINISH_REASON_ERROR, a sentence saying why and its own usage; the router goes on."""
    with Client(cluster.router.address) as client:
        while len(live_decode_workers(cluster)) > 1:
            live_decode_workers(cluster)[-1].kill()
        if not live_decode_workers(cluster):
            cluster.start_workers("decode", 1)
        params = SamplingParams(n=3, temperature=0.0, max_tokens=400, ignore_eos=True)
        token_ids, last, killed = stream_n_killing_their_decode_worker(cluster, client, params)
        for index, message in last.items():
            assert message.finish_reason == inference_pb2.FINISH_REASON_ERROR, index
            assert message.error_message.startswith(f"The decode worker {killed.worker_id} failed mid-stream after "
                                                    f"{len(token_ids[index])} tokens: ")
            assert "no other decode worker could continue the request" in message.error_message
            assert message.usage.completion_tokens == len(token_ids[index]) < 400
        cluster.start_workers("decode", 1)
        response = client.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), timeout=120)
        assert response.finish_reason == inference_pb2.FINISH_REASON_LENGTH  # the router goes on


def test_a_beam_search_whose_decode_worker_is_killed_starts_again_on_another(cluster):
    """A beam search sends its beams at its end: its decode worker killed during the search, the router runs
    the whole search again on the other decode worker, and the client gets the undisturbed search's beams."""
    beam = BeamSearchParams(beam_width=3, max_tokens=48, ignore_eos=True)
    with Client(cluster.router.address) as client:
        two_decode_workers_serving(cluster, client)
        undisturbed = stream_completions(client, PROMPT, beam, beam_search=beam)
        migrations = cluster.router.log().count("migrating it")
        no_request_in_flight(client)  # else the worker of the search before may still count as serving
        outcome: dict = {}

        def search() -> None:
            try:
                outcome["beams"] = stream_completions(client, PROMPT, beam, beam_search=beam)
            except Exception as error:  # noqa: BLE001 - reported below
                outcome["error"] = error

        searching = threading.Thread(target=search)
        searching.start()
        wait_until(lambda: serving_decode_workers(client), 60, interval=0.05, message="the search on a worker")
        [killed] = [p for p in live_decode_workers(cluster) if p.worker_id in serving_decode_workers(client)]
        # Killed once its beams run (after the worker took the request, which the router then counts as sent to
        # it: killed before, the router only tries the other worker, which is no migration).
        wait_until(lambda: holds_kv_blocks(killed), 60, interval=0.02, message="the search holding KV blocks")
        killed.kill()
        searching.join(300)
        assert "error" not in outcome, outcome.get("error")
        assert [ids for ids, _, _ in outcome["beams"]] == [ids for ids, _, _ in undisturbed]
        assert cluster.router.log().count("migrating it") == migrations + 1


def test_a_sigtermed_router_drains_its_streams_then_exits_0(cluster):
    if not live_decode_workers(cluster):
        cluster.start_workers("decode", 1)
    router = cluster.router
    with Client(router.address) as client, grpc.insecure_channel(router.address) as channel:
        stream = client.generate_stream(PROMPT, LONG, timeout=300)
        token_ids = list(next(stream).token_ids)
        router.terminate()
        sent = time.monotonic()
        refusals, alive = [], []

        def try_a_new_request() -> None:  # while the stream runs: refused, and not ready (alive until it exits)
            time.sleep(0.5)
            health = health_pb2_grpc.HealthStub(channel)
            refusals.append(health.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Inference"),
                                         timeout=10).status)
            alive.append(health.Check(health_pb2.HealthCheckRequest(), timeout=10).status)
            try:
                with Client(router.address) as other:
                    other.generate("Hello", SamplingParams(max_tokens=2), timeout=10)
            except grpc.RpcError as error:
                refusals.append((error.code(), error.details()))

        checker = threading.Thread(target=try_a_new_request)
        checker.start()
        last = None
        for chunk in stream:
            token_ids.extend(chunk.token_ids)
            last = chunk
        checker.join()
    assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH and len(token_ids) == LONG.max_tokens
    assert refusals[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert alive == [health_pb2.HealthCheckResponse.SERVING]
    assert refusals[1][0] == grpc.StatusCode.UNAVAILABLE and "draining" in refusals[1][1]
    assert router.popen.wait(DRAIN_TIMEOUT) == 0
    assert time.monotonic() - sent < DRAIN_TIMEOUT
