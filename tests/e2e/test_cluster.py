"""A real cluster: router, prefill and decode workers as separate processes, KV over p2p (Gloo).

Greedy outputs through the cluster are compared with transformers (float32)
and with the offline engine; the decode worker's counters and log show that
the KV came through the connector, not from a local recompute.
"""

from __future__ import annotations

import itertools
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from splitserve import LLM, SamplingParams
from splitserve.client import Client, generate_request, sampling_params_to_pb
from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.launcher import LocalCluster
from splitserve.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster_helpers import (
    ROUTER_ARGS,
    WORKER_ARGS,
    all_blocks_free,
    start_cluster,
    stream_completions,
    stream_tokens,
    wait_until,
    worker_status,
)
from tests.reference import MAX_TOKENS, hf_beams, hf_greedy_constrained, hf_prompt_logprobs

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("p2p-cluster"))
    yield cluster
    cluster.stop()


def decode_worker(cluster):
    return next(p for p in cluster.workers if p.name.startswith("decode"))


def prefill_worker(cluster):
    return next(p for p in cluster.workers if p.name.startswith("prefill"))


def test_disaggregated_greedy_is_token_identical_to_transformers(cluster, client, prompt_token_ids, hf_reference):
    before = worker_status(decode_worker(cluster).address, "decode").counters
    with ThreadPoolExecutor(len(prompt_token_ids)) as pool:
        results = list(pool.map(lambda ids: stream_tokens(client, ids, MAX_TOKENS), prompt_token_ids))
    for (token_ids, _text, last), expected in zip(results, hf_reference):
        assert token_ids == expected
        expected_reason = inference_pb2.FINISH_REASON_LENGTH if len(expected) == MAX_TOKENS else inference_pb2.FINISH_REASON_STOP
        assert last.finish_reason == expected_reason
        assert last.usage.completion_tokens == len(expected)
        assert last.timing.time_to_first_token_seconds > 0
    after = worker_status(decode_worker(cluster).address, "decode").counters
    # Every prompt's KV came through the connector; none was recomputed or prefilled locally.
    assert after.num_kv_transfers_received - before.num_kv_transfers_received == len(prompt_token_ids)
    assert after.num_kv_recomputes == before.num_kv_recomputes
    assert after.num_local_prefills == before.num_local_prefills
    assert after.num_kv_bytes > before.num_kv_bytes
    sent = worker_status(prefill_worker(cluster).address, "prefill").counters
    assert sent.num_kv_transfers_sent >= len(prompt_token_ids)
    log = decode_worker(cluster).log()
    assert log.count("tokens received (") >= len(prompt_token_ids)
    # The 1,111-token prompt was prefilled in 512-token chunks, each chunk's KV sent as it was computed
    # (the connector splits each send into wire payloads of a few MB); chunks that complete while the previous
    # send is still on the wire go out together, so a fast machine makes 2 sends of the 3 chunks.
    sent_line = re.search(r"request=(\S+) transfer=(\S+) KV of 1111 prompt tokens sent in [23] sends",
                          prefill_worker(cluster).log())
    assert sent_line is not None
    # Both workers' lines about the request carry its ids as fields.
    assert re.search(rf"request={sent_line[1]} transfer={sent_line[2]} KV of 1111 tokens received \(", log)
    wait_until(lambda: all_blocks_free(client), 15, message="all KV blocks free")


def test_prefix_cached_on_the_decode_worker_is_not_sent_again(cluster, client):
    """The same long prompt twice: the second time the decode worker holds its full blocks already, and only
    the rest of the KV travels; the tokens are the same."""
    decode = decode_worker(cluster)
    prompt = [1000 + (index * 7919) % 30000 for index in range(343)]  # 21 full blocks and 7 tokens, seen nowhere else
    sent, outputs = [], []
    for _ in range(2):
        before = worker_status(decode.address, "decode").counters.num_kv_bytes
        outputs.append(stream_tokens(client, prompt, MAX_TOKENS)[0])
        sent.append(worker_status(decode.address, "decode").counters.num_kv_bytes - before)
    per_block = 30 * 2 * 3 * 16 * 64 * 4
    assert sent == [22 * per_block, per_block]  # all of it, then only the last, partial block
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0
    assert "336 more from the prefix cache" in decode.log()


def test_32_concurrent_streams_match_the_offline_engine(client, model_dir):
    prompts = [f"Question {index}: name a color that starts with the letter {chr(65 + index % 26)}." for index in range(32)]
    offline = LLM(str(model_dir), num_kv_blocks=256, max_model_len=2048)
    expected = offline.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    del offline
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda prompt: stream_tokens(client, prompt, 16), prompts))
    for (token_ids, text, last), output in zip(results, expected):
        assert token_ids == output.outputs[0].token_ids
        assert text == output.outputs[0].text
        assert last.finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)


def test_client_cancel_mid_stream_frees_blocks_on_both_workers(client, prompt_token_ids):
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    call = client.generate_stream(prompt_token_ids[6], params, timeout=300)
    received = 0
    for chunk in call:
        received += len(chunk.token_ids)
        if received >= 3:
            break
    call.cancel()
    assert received >= 3
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the cancel")
    status = client.cluster_status()
    assert {pool.role for pool in status.pools} >= {inference_pb2.WORKER_ROLE_PREFILL, inference_pb2.WORKER_ROLE_DECODE}


def test_abort_rpc_ends_the_stream_with_abort(client):
    request_id = f"abort-me-{uuid.uuid4().hex[:6]}"
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    chunks = []
    started = threading.Event()

    def consume():
        for chunk in client.generate_stream("Tell me a very long story.", params, request_id=request_id, timeout=300):
            chunks.append(chunk)
            started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(120)
    assert client.abort(request_id) is True
    thread.join(60)
    assert not thread.is_alive()
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_ABORT
    assert client.abort(request_id) is False
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the abort")


def test_n_completions_take_one_prefill_and_one_kv_transfer(cluster, client, prompt_token_ids, hf_reference):
    """n greedy completions of each prompt, through the prefill worker and the KV connector: every completion is
    transformers' continuation, and each request's prompt was computed and sent once (the decode worker forked
    its KV for completions 1 and 2)."""
    decode, prefill = decode_worker(cluster), prefill_worker(cluster)
    before = worker_status(decode.address, "decode").counters
    sent_before = worker_status(prefill.address, "prefill").counters.num_kv_transfers_sent
    chosen = (5, 6, 7)  # 51, 343 and 1,111 tokens: a partial last block each, the longest prefilled in chunks
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0.0)
    with ThreadPoolExecutor(len(chosen)) as pool:
        results = list(pool.map(lambda index: stream_completions(client, prompt_token_ids[index], params,
                                                                 return_prompt_token_ids=True), chosen))
    for completions, index in zip(results, chosen):
        for token_ids, _text, messages in completions:
            assert token_ids == hf_reference[index]
            assert messages[-1].usage.completion_tokens == len(token_ids)
            assert messages[-1].usage.prompt_tokens == len(prompt_token_ids[index])
            firsts = [message for message in messages if message.prompt_token_ids]
            assert len(firsts) == 1 and list(firsts[0].prompt_token_ids) == prompt_token_ids[index]
    after = worker_status(decode.address, "decode").counters
    assert after.num_kv_transfers_received - before.num_kv_transfers_received == len(chosen)
    assert after.num_local_prefills == before.num_local_prefills
    assert after.num_kv_recomputes == before.num_kv_recomputes
    assert worker_status(prefill.address, "prefill").counters.num_kv_transfers_sent - sent_before == len(chosen)
    wait_until(lambda: all_blocks_free(client), 15, message="all KV blocks free")


def test_seeded_n_completions_are_the_seeded_single_requests(client):
    """Completion i of a seeded request for n draws what a request seeded seed + i draws (vLLM's seeding): the
    first's first token sampled by the prefill worker, the others' by the decode worker from the forked KV."""
    prompt = "Write one sentence about the sea."
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=2**63 - 2)
    completions = [token_ids for token_ids, _, _ in stream_completions(client, prompt, params)]
    singles = []
    for index in range(3):
        single = SamplingParams(max_tokens=12, temperature=1.0, seed=(2**63 - 2 + index + 2**63) % 2**64 - 2**63)
        singles.append(list(client.generate(prompt, single).token_ids))
    assert completions == singles
    assert len({tuple(tokens) for tokens in completions}) > 1


def test_n_completions_refused_where_they_cannot_be_served(client):
    for n, method, message in ((2, client.stub.Generate, "Generate answers one completion"),
                               (65, client.stub.GenerateStream, "1 to 64"),
                               (0, client.stub.GenerateStream, "n must be an integer >= 1")):
        request = inference_pb2.GenerateRequest(text="hi", sampling_params=inference_pb2.SamplingParams(n=n))
        with pytest.raises(grpc.RpcError) as caught:
            answer = method(request, timeout=30)
            list(answer) if method is client.stub.GenerateStream else None
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()


def test_cancelling_n_completions_mid_stream_frees_every_block(client, prompt_token_ids):
    params = SamplingParams(n=3, max_tokens=1000, temperature=0.0, ignore_eos=True)
    call = client.generate_stream(prompt_token_ids[6], params, timeout=300)
    seen: set[int] = set()
    for chunk in call:
        if chunk.token_ids:
            seen.add(chunk.index)
        if len(seen) == 3:
            break
    call.cancel()
    assert seen == {0, 1, 2}
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the cancel")


def test_beam_search_runs_on_the_decode_worker_after_one_kv_transfer(cluster, client, model_dir, tokenizer,
                                                                     prompt_token_ids):
    """The 343-token prompt's 3 beams: prefilled once and its KV sent once, the search stepped on the decode
    worker (each beam forking the KV of the one it grew from), the beams transformers', best first, each token with
    its log probability and the best 2 of the candidates its step scored (transformers' log-softmax)."""
    decode, ids = decode_worker(cluster), prompt_token_ids[6]
    before = worker_status(decode.address, "decode").counters
    beam = BeamSearchParams(beam_width=3, max_tokens=8)
    completions = stream_completions(client, ids, beam, beam_search=beam,
                                     logprobs_params=SamplingParams(logprobs=2))
    expected = hf_beams(str(model_dir), ids, 3, 8)
    eos = set(client.model_info().eos_token_ids)
    assert [token_ids for token_ids, _, _ in completions] == expected
    for (_, text, messages), beam_ids in zip(completions, expected):
        ended = beam_ids[-1] in eos
        assert text == tokenizer.decode(beam_ids[:-1] if ended else beam_ids, skip_special_tokens=True)
        reference = hf_prompt_logprobs(str(model_dir), tuple(ids + beam_ids))
        logprobs = [position for message in messages for position in message.logprobs]
        assert [position.sampled.token_id for position in logprobs] == beam_ids
        for offset, position in enumerate(logprobs):
            row = reference[len(ids) + offset - 1]
            assert position.sampled.logprob == pytest.approx(row[position.sampled.token_id].item(), abs=1e-3)
            assert [entry.token_id for entry in position.top] == row.topk(2).indices.tolist()
        last = messages[-1]
        assert last.finish_reason == (inference_pb2.FINISH_REASON_STOP if ended else inference_pb2.FINISH_REASON_LENGTH)
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), len(beam_ids))
    after = worker_status(decode.address, "decode").counters
    assert after.num_kv_transfers_received - before.num_kv_transfers_received == 1
    assert after.num_local_prefills == before.num_local_prefills and after.num_kv_recomputes == before.num_kv_recomputes
    wait_until(lambda: all_blocks_free(client), 15, message="all KV blocks free after the search")
    # Refused: the unary call, sampling fields a search cannot give, a width over 10; a search cut by its deadline
    # frees every block.
    for streamed, width, logprobs, message in ((False, 2, None, "ask GenerateStream"),
                                               (True, 2, 5, "logprobs is at most 2 x beam_width"),
                                               (True, 11, None, "beam_width must be")):
        request = generate_request(ids, beam_search=BeamSearchParams(beam_width=width, max_tokens=4))
        if logprobs is not None:
            request.sampling_params.logprobs = logprobs
        with pytest.raises(grpc.RpcError) as caught:
            if streamed:
                list(client.stub.GenerateStream(request, timeout=30))
            else:
                client.stub.Generate(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        list(client.generate_stream(ids, timeout=2, beam_search=BeamSearchParams(beam_width=4, max_tokens=1000,
                                                                                ignore_eos=True)))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the cut search")


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        (dict(text=""), "empty"),
        (dict(), "no prompt"),
        (dict(token_ids=inference_pb2.TokenIds(ids=[1, 2, 99999999])), "outside the vocabulary"),
        (dict(token_ids=inference_pb2.TokenIds(ids=[1] * 2048)), "max_model_len"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(temperature=-1)), "temperature"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(top_p=1.5)), "top_p"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(logprobs=50)), "logprobs"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(prompt_logprobs=21)), "prompt_logprobs"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(
            structured_outputs=inference_pb2.StructuredOutputs(regex="[a-"))), "the regex is not valid"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(
            structured_outputs=inference_pb2.StructuredOutputs(grammar="start: nowhere"))), "the grammar is not valid"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(
            structured_outputs=inference_pb2.StructuredOutputs())), "without a constraint"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(
            structured_outputs=inference_pb2.StructuredOutputs(json_object=False))), "must be true"),
        (dict(text="hi", sampling_params=inference_pb2.SamplingParams(
            structured_outputs=inference_pb2.StructuredOutputs(json="[1]"))), "an object or a boolean"),
    ],
)
def test_invalid_requests_get_invalid_argument_with_a_sentence(client, request_kwargs, message):
    for method in (client.stub.Generate, lambda request, timeout: list(client.stub.GenerateStream(request, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as caught:
            method(inference_pb2.GenerateRequest(**request_kwargs), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()


def test_deadline_propagates_and_frees_blocks(client):
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as caught:
        client.generate("Count from one to a thousand:", params, timeout=1.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the deadline")


def test_unary_generate_and_the_small_rpcs(client, tokenizer):
    response = client.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0, logprobs=2))
    assert response.text.startswith(" Paris")
    assert len(response.logprobs) == len(response.token_ids) == response.usage.completion_tokens
    assert all(len(position.top) == 2 for position in response.logprobs)
    assert response.logprobs[0].sampled.token_id == response.token_ids[0]
    assert client.tokenize("The capital of France is") == tokenizer.encode("The capital of France is")
    info = client.model_info()
    assert info.max_model_len == 2048 and info.vocab_size == tokenizer.vocab_size and info.has_chat_template
    chat = client.generate([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=4, temperature=0.0))
    assert chat.usage.prompt_tokens > 5


def test_prompt_logprobs_come_with_the_first_token_from_either_worker(cluster, client, model_dir, prompt_token_ids):
    """Through the router the prefill worker computes them (its KV still goes to the decode worker); a decode worker
    prefilling locally computes them itself. Both equal transformers', on the first token's message only."""
    prompt = prompt_token_ids[5]
    decode = decode_worker(cluster)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    before = worker_status(decode.address, "decode").counters
    chunks = list(client.generate_stream(prompt, params, timeout=300))
    after = worker_status(decode.address, "decode").counters
    assert after.num_kv_transfers_received == before.num_kv_transfers_received + 1
    assert after.num_local_prefills == before.num_local_prefills
    with grpc.insecure_channel(decode.address) as channel:
        request = worker_pb2.DecodeRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                           sampling_params=sampling_params_to_pb(params), prefill_locally=True)
        messages = list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=120))
    unary = client.generate(prompt, params, timeout=300)
    reference = hf_prompt_logprobs(str(model_dir), tuple(prompt))
    for stream in (chunks, messages):
        (first,) = [index for index, message in enumerate(stream) if message.token_ids][:1]
        assert not any(message.prompt_logprobs for index, message in enumerate(stream) if index != first)
        assert [token for message in stream for token in message.token_ids] == list(unary.token_ids)
        entries = stream[first].prompt_logprobs
        assert len(entries) == len(prompt) and not entries[0].top and entries[0].sampled.logprob == 0
        assert [entry.sampled.token_id for entry in entries] == prompt
        for position, entry in enumerate(entries[1:], start=1):
            row = reference[position - 1]
            assert entry.sampled.logprob == pytest.approx(row[prompt[position]].item(), abs=2e-4)
            assert [top.logprob for top in entry.top] == pytest.approx(row.topk(2).values.tolist(), abs=2e-4)
            assert [top.rank for top in entry.top] == [1, 2] and entry.sampled.rank >= 1
            assert (entry.sampled.rank == 1) == (entry.sampled.token_id == entry.top[0].token_id)
    assert not unary.prompt_text and not any(chunk.prompt_text for chunk in chunks)
    streamed = next(chunk for chunk in chunks if chunk.token_ids).prompt_logprobs
    assert [entry.sampled.logprob for entry in unary.prompt_logprobs] == pytest.approx(
        [entry.sampled.logprob for entry in streamed], abs=1e-6)
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")


def test_structured_outputs_hold_across_the_prefill_and_decode_workers(cluster, client, model_dir):
    """The prefill worker samples the first token under the grammar and the decode worker continues it: greedy,
    each constraint's output is transformers' under the same grammar, and the KV still came through the
    connector (no local prefill)."""
    from tests.e2e.test_structured_outputs import CASES

    decode = decode_worker(cluster)
    before = worker_status(decode.address, "decode").counters
    eos = list(client.model_info().eos_token_ids)
    for prompt, constraint, max_tokens, check in CASES:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
        chunks = list(client.generate_stream(prompt, params, timeout=300))
        token_ids = [token for chunk in chunks for token in chunk.token_ids]
        text = "".join(chunk.text for chunk in chunks)
        expected = hf_greedy_constrained(str(model_dir), client.tokenize(prompt), max_tokens,
                                         constraint.to_grammar(), eos)
        assert token_ids == expected, (constraint.kind, text)
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_STOP and check(text), (constraint.kind, text)
    after = worker_status(decode.address, "decode").counters
    assert after.num_kv_transfers_received - before.num_kv_transfers_received == len(CASES)
    assert after.num_local_prefills == before.num_local_prefills
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")


def test_echo_returns_the_prompt_text_with_the_first_token(client, tokenizer):
    text = "Echo me, please: the capital of France is"
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    assert client.generate(text, params, echo=True).prompt_text == text
    chunks = list(client.generate_stream(ids, params, echo=True))
    assert [chunk.prompt_text for chunk in chunks if chunk.prompt_text] == [tokenizer.decode(ids)]
    assert chunks[0].token_ids  # on the message with the first token
    chat = client.generate([{"role": "user", "content": "Hi"}], params, echo=True).prompt_text
    assert chat.startswith("<|im_start|>") and chat.endswith("<|im_start|>assistant\n")


def test_generate_cli_streams_from_the_cluster(cluster, tmp_path):
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address,
         "The capital of France is", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris.")
    assert "[length; first token after" in result.stderr
    scored = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address,
         "The capital of France is", "--max-tokens", "1", "--prompt-logprobs", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert scored.returncode == 0 and "[prompt: 4 tokens scored, log-likelihood -" in scored.stderr, scored.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address, "Hi",
         "--temperature", "-1"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "temperature" in bad.stderr
    # A JSONL line with an n: a record for each completion (its index), printed each at its end without --output.
    lines = tmp_path / "n.jsonl"
    lines.write_text(json.dumps({"prompt": "The capital of France is", "n": 2, "temperature": 0, "logprobs": 1}) + "\n")
    for output in (tmp_path / "n.out.jsonl", None):
        written = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address, "--file",
             str(lines), "--max-tokens", "3", *(["--output", str(output)] if output else [])],
            capture_output=True, text=True, timeout=120,
        )
        assert written.returncode == 0, written.stderr
        if output is None:
            assert written.stdout.count(" Paris") == 2 and "[completion 1]" in written.stdout
            assert written.stderr.count("[length; first token after") == 2
        else:
            records = [json.loads(line) for line in output.read_text().splitlines()]
            assert [record["index"] for record in records] == [0, 1]
            assert records[0]["text"] == records[1]["text"] and records[0]["text"].startswith(" Paris")
            for record in records:  # greedy: each token's entry has it, the best, alone
                assert [list(map(int, step)) for step in record["logprobs"]] == [[t] for t in record["token_ids"]]


def test_generate_cli_beam_search_through_the_cluster(cluster, tmp_path, model_dir, tokenizer):
    """`splitserve generate --server ... --beam-width 3`: a record a beam, best first, transformers' beams."""
    import json
    import subprocess
    import sys

    output = tmp_path / "beams.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address,
         "The capital of France is", "--max-tokens", "6", "--beam-width", "3", "--logprobs", "1", "--output",
         str(output)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    expected = hf_beams(str(model_dir), tokenizer.encode("The capital of France is"), 3, 6)
    assert [record["token_ids"] for record in records] == expected
    assert [record["index"] for record in records] == [0, 1, 2]
    assert all(len(record["logprobs"]) == len(record["token_ids"]) and str(record["token_ids"][0]) in
               record["logprobs"][0] for record in records)  # each token's, with the best of its step's candidates


def test_decode_worker_kv_failure_policies(cluster, client, tokenizer):
    """A transfer that never arrives: recompute locally (same tokens) or fail with a clear message; with n
    completions the others fork the recomputed prompt, or fail with the first."""
    address = decode_worker(cluster).address
    prompt = tokenizer.encode("The capital of France is")
    expected, _, _ = stream_tokens(client, prompt, 8)
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        for policy, n in itertools.product((worker_pb2.KV_FAILURE_POLICY_RECOMPUTE, worker_pb2.KV_FAILURE_POLICY_FAIL),
                                           (1, 2)):
            request = worker_pb2.DecodeRequest(
                request_id=uuid.uuid4().hex, transfer_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                sampling_params=sampling_params_to_pb(SamplingParams(max_tokens=8, temperature=0.0, n=n)),
                kv_timeout_seconds=0.5, on_kv_failure=policy,
            )
            messages = list(stub.Decode(request, timeout=120))
            assert messages[0].state == worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS
            for index in range(n):
                mine = [message for message in messages if message.index == index]
                last = mine[-1]
                if policy == worker_pb2.KV_FAILURE_POLICY_RECOMPUTE:
                    assert [t for m in mine for t in m.token_ids] == expected
                    assert last.kv_recomputed == (index == 0)  # the others forked what the first recomputed
                else:
                    assert last.finish_reason == inference_pb2.FINISH_REASON_ERROR
                    assert "did not arrive" in last.error_message
        # Bad input straight to the worker: the right codes, and the worker goes on.
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Decode(worker_pb2.DecodeRequest(request_id="x", prompt_token_ids=prompt), timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free after the KV failures")


def test_decode_worker_out_of_kv_blocks_is_resource_exhausted(cluster, client):
    """Remote-KV requests reserve their prompt's blocks up front; one that does not fit is refused, not queued."""
    address = decode_worker(cluster).address
    total = worker_status(address, "decode").capacity.num_total_kv_blocks
    prompt = [1000 + i % 500 for i in range(2000)]  # 125 blocks each
    params = sampling_params_to_pb(SamplingParams(max_tokens=4, temperature=0.0))
    calls = []
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        try:
            for _ in range(total // 125):
                call = stub.Decode(worker_pb2.DecodeRequest(
                    request_id=uuid.uuid4().hex, transfer_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                    sampling_params=params, kv_timeout_seconds=120), timeout=120)
                assert next(call).state == worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS
                calls.append(call)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Decode(worker_pb2.DecodeRequest(
                    request_id=uuid.uuid4().hex, transfer_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                    sampling_params=params), timeout=60))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Cannot reserve 125 KV blocks" in caught.value.details()
        finally:
            for call in calls:
                call.cancel()
    wait_until(lambda: all_blocks_free(client), 20, message="the reserved blocks freed after the cancels")


def test_conditional_disaggregation_and_colocated_give_the_same_tokens(cluster, client, prompt_token_ids, hf_reference):
    decode, prefill = decode_worker(cluster), prefill_worker(cluster)
    # A second router over the same workers, prefilling prompts under 200 tokens on the decode worker.
    threshold = LocalCluster(router_args=[*ROUTER_ARGS, "--local-prefill-threshold", "200",
                                          "--prefill-worker", prefill.address, "--decode-worker", decode.address],
                             log_dir=cluster.log_dir / "threshold")
    colocated = LocalCluster(worker_args=WORKER_ARGS, router_args=[*ROUTER_ARGS, "--max-in-flight-requests", "1"],
                             log_dir=cluster.log_dir / "colocated")
    try:
        threshold.start_router()
        colocated.start_router()
        colocated.start_workers("both", 1)
        before = worker_status(decode.address, "decode").counters
        indexes = range(len(prompt_token_ids))
        with Client(threshold.router.address) as via_threshold, Client(colocated.router.address) as via_colocated:
            wait_until(lambda: len(via_threshold.cluster_status().pools) == 2, 20, message="static workers polled")
            # Each router's prompts one after the other (the colocated router takes one at a time), the two routers
            # side by side: their workers are apart.
            def greedy_in_turn(via: Client) -> list[list[int]]:
                return [stream_tokens(via, prompt_token_ids[index], MAX_TOKENS)[0] for index in indexes]

            with ThreadPoolExecutor(2) as pool:
                outputs = list(pool.map(greedy_in_turn, [via_threshold, via_colocated]))
            assert outputs == [hf_reference, hf_reference]
            # Embeddings on a colocated worker: the decode worker's vector (each computes the prompt itself).
            text = "The capital of France is Paris."
            on_colocated, on_decode = via_colocated.embed(text), client.embed(text)
            assert len(on_colocated) == 576 and max(abs(a - b) for a, b in zip(on_colocated, on_decode)) < 1e-5
            # Back-pressure: the colocated router takes one request at a time.
            call = via_colocated.generate_stream("Tell me a long story.", SamplingParams(max_tokens=500, ignore_eos=True))
            next(iter(call))
            with pytest.raises(grpc.RpcError) as caught:
                via_colocated.generate("Hello", SamplingParams(max_tokens=2))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit" in caught.value.details()
            call.cancel()
        after = worker_status(decode.address, "decode").counters
        num_short = sum(1 for ids in prompt_token_ids if len(ids) < 200)
        assert 0 < num_short < len(prompt_token_ids)
        assert after.num_local_prefills - before.num_local_prefills == num_short
        assert after.num_kv_transfers_received - before.num_kv_transfers_received == len(prompt_token_ids) - num_short
    finally:
        threshold.stop()
        colocated.stop()


def test_decode_pool_scales_at_run_time(cluster, client, prompt_token_ids, hf_reference):
    # Each worker gets its own CUDA_VISIBLE_DEVICES, as `up` places workers on GPUs (none used on a CPU build).
    drained, crashed = cluster.start_workers("decode", 2, gpus=["GPU-test-0", "GPU-test-1"])
    for process, gpu in ((drained, "GPU-test-0"), (crashed, "GPU-test-1")):
        environ = open(f"/proc/{process.pid}/environ", "rb").read().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={gpu}".encode() in environ

    def listed(process) -> bool:
        return any(w.worker_id == process.worker_id for p in client.cluster_status().pools for w in p.workers)

    wait_until(lambda: listed(drained) and listed(crashed), 20, message="the new decode workers in the cluster status")
    indexes = [0, 1, 2, 3, 4, 5, 0, 1, 2]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda index: stream_tokens(client, prompt_token_ids[index], MAX_TOKENS)[0], indexes))
    assert results == [hf_reference[i] for i in indexes]
    assert worker_status(drained.address, "decode").counters.num_requests > 0
    assert worker_status(crashed.address, "decode").counters.num_requests > 0

    # Nobody but the worker itself can drain it: its public id is not enough (Drain needs its lease).
    with grpc.insecure_channel(cluster.router.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerRegistryStub(channel).Drain(worker_pb2.DrainRequest(worker_id=drained.worker_id),
                                                              timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(w.state == inference_pb2.WORKER_STATE_SERVING for p in client.cluster_status().pools
               for w in p.workers if w.worker_id == drained.worker_id)
    # SIGTERM drains it (the worker's own Drain), ends it cleanly, and it leaves the pool.
    drained.stop()
    assert drained.popen.returncode == 0
    wait_until(lambda: not listed(drained), 10, message="the drained worker deregistered")

    crashed.kill()  # a crash: no deregistration, no drain
    for index in (4, 5, 0, 1):
        assert stream_tokens(client, prompt_token_ids[index], MAX_TOKENS)[0] == hf_reference[index]
    wait_until(lambda: not listed(crashed), 20, message="the killed worker removed after its lease")
    assert stream_tokens(client, prompt_token_ids[2], MAX_TOKENS)[0] == hf_reference[2]


def test_prefill_worker_failure_falls_back_to_local_prefill(cluster, client, prompt_token_ids, hf_reference):
    prefill_worker(cluster).kill()
    for index in (1, 6):
        assert stream_tokens(client, prompt_token_ids[index], MAX_TOKENS)[0] == hf_reference[index]
    wait_until(lambda: all(p.role != inference_pb2.WORKER_ROLE_PREFILL for p in client.cluster_status().pools),
               20, message="the killed prefill worker removed")
    assert stream_tokens(client, prompt_token_ids[3], MAX_TOKENS)[0] == hf_reference[3]
    wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")


def test_no_decode_worker_is_unavailable(tmp_path):
    with LocalCluster(router_args=ROUTER_ARGS, log_dir=tmp_path) as empty:
        empty.start_router()
        with Client(empty.router.address) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate("Hello", SamplingParams(max_tokens=2), timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "No decode worker" in caught.value.details()


def test_every_server_offers_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {cluster.router.address: "splitserve.v1.Inference"}
    expected.update({p.address: "splitserve.v1.DecodeWorker" for p in cluster.workers
                     if p.name.startswith("decode") and p.alive()})
    for address, service in expected.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10)
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names
