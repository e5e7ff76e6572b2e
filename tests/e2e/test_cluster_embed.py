"""Embeddings through a p2p cluster (Inference.Embed -> DecodeWorker.Embed): transformers' last hidden state of the
prompt's last token, normalized, to 1e-4, for short and long prompts given as token ids or text; the raw vector and
the Matryoshka cut; refusals with their documented codes and a sentence; generation requests running beside
embeddings keep their greedy tokens; a deadline or a cancelled call aborts the request on its worker, and every KV
block ends free."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from splitserve.client import embed_request
from tests.cluster_helpers import all_blocks_free, stream_tokens, wait_until
from tests.e2e.test_embeddings import ATOL, _reference
from tests.reference import PROMPTS

pytestmark = pytest.mark.timeout(300)

HIDDEN_SIZE = 576  # SmolLM2-135M's


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """The e2e tier's shared cluster (tests/e2e/conftest.py); the ``client`` fixture carries its API key."""
    return shared_cluster


@functools.lru_cache(maxsize=4)
def _last_hidden_state(model_dir, token_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' last hidden state of the prompt's last token, on one thread: the cluster's workers hold the
    other cores, and OpenMP threads that outnumber them spin (a 6-token prompt took 2 s on two threads here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(model_dir, list(token_ids))
    finally:
        torch.set_num_threads(threads)


def _expected(model_dir, token_ids: list[int], dimensions: int | None = None, normalize: bool = True):
    """transformers' embedding of the prompt: its last hidden state, cut to ``dimensions`` and normalized as asked."""
    vector = _last_hidden_state(model_dir, tuple(token_ids))[:dimensions]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_embeddings_through_the_cluster_are_transformers_last_hidden_state(client, model_dir, prompt_token_ids):
    """A short and a long prompt (1,111 tokens: computed in chunks of the workers' 512-token budget), as token ids
    and as text, which the router tokenizes as Generate does."""
    for index in (1, 7):
        ids = prompt_token_ids[index]
        expected = _expected(model_dir, ids)
        for prompt in (ids, PROMPTS[index]):
            response = client.stub.Embed(embed_request(prompt), timeout=120)
            embedding = torch.tensor(response.embedding)
            assert response.prompt_tokens == len(ids) and embedding.shape == (HIDDEN_SIZE,)
            assert torch.linalg.vector_norm(embedding).item() == pytest.approx(1.0, abs=1e-5)
            assert torch.allclose(embedding, expected, atol=ATOL), (embedding - expected).abs().max()


def test_the_raw_vector_and_the_matryoshka_cut(client, model_dir, prompt_token_ids):
    ids = prompt_token_ids[2]
    raw = torch.tensor(client.embed(ids, normalize=False, timeout=120))
    expected = _expected(model_dir, ids, normalize=False)
    assert torch.allclose(raw, expected, atol=ATOL * expected.abs().max().item())
    cut = torch.tensor(client.embed(ids, dimensions=64, timeout=120))
    assert cut.shape == (64,) and torch.allclose(cut, _expected(model_dir, ids, dimensions=64), atol=ATOL)
    raw_cut = torch.tensor(client.embed(ids, normalize=False, dimensions=HIDDEN_SIZE, timeout=120))
    assert torch.allclose(raw_cut, raw, atol=1e-6)


@pytest.mark.parametrize("request_fields,code,sentence", [
    (dict(prompt=[504, 3575], dimensions=HIDDEN_SIZE + 1), grpc.StatusCode.INVALID_ARGUMENT,
     f"dimensions must be an integer from 1 to the model's hidden size {HIDDEN_SIZE}, got {HIDDEN_SIZE + 1}"),
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "The prompt is empty"),
    (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "The prompt is empty"),
    (dict(prompt=[504, 49152]), grpc.StatusCode.INVALID_ARGUMENT, "Prompt token id 49152 is outside the vocabulary"),
    (dict(prompt=[504] * 2048), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len is 2048"),
    (dict(prompt="Hi", request_id="no spaces"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (dict(prompt="Hi", lora_name="nowhere"), grpc.StatusCode.NOT_FOUND, "No worker serves LoRA adapter 'nowhere'"),
    (dict(prompt="Hi", lora_name="../etc"), grpc.StatusCode.INVALID_ARGUMENT, "[A-Za-z0-9._-]"),
    (dict(prompt="Hi", priority=1), grpc.StatusCode.INVALID_ARGUMENT,
     "priority 1 needs the priority scheduling policy (--scheduling-policy"),
])
def test_bad_input_is_refused_with_a_sentence_and_the_cluster_serves_on(client, request_fields, code, sentence):
    error = _refused(lambda: client.stub.Embed(embed_request(**request_fields), timeout=30))
    assert error.code() == code and sentence in error.details(), error.details()
    assert len(client.embed("Hi", timeout=30)) == HIDDEN_SIZE


def test_generation_beside_embeddings_keeps_its_greedy_tokens(client, prompt_token_ids):
    """Two generations alone, then again while embedding requests (short and long) run on the same workers."""
    prompts = [prompt_token_ids[3], prompt_token_ids[5]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        alone = [tokens for tokens, _, _ in pool.map(lambda ids: stream_tokens(client, ids, 16), prompts)]
        generations = [pool.submit(stream_tokens, client, ids, 16) for ids in prompts]
        embeddings = [client.embed(prompt_token_ids[index], timeout=120) for index in (6, 0, 4)]
        assert [generation.result(timeout=120)[0] for generation in generations] == alone
    assert all(len(embedding) == HIDDEN_SIZE for embedding in embeddings)


def test_a_deadline_an_abort_or_a_cancelled_call_frees_every_block(client, prompt_token_ids):
    """A 2,000-token prompt takes seconds on one thread: each way of ending it early aborts it on its worker."""
    long_prompt = (prompt_token_ids[7] * 2)[:2000]
    error = _refused(lambda: client.stub.Embed(embed_request(long_prompt), timeout=0.05))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = client.stub.Embed.future(embed_request(long_prompt, request_id="embed-to-abort"), timeout=60)
    wait_until(lambda: client.abort("embed-to-abort"), timeout=10, interval=0.01, message="Abort found the request")
    error = _refused(call.result)
    assert error.code() == grpc.StatusCode.CANCELLED
    call = client.stub.Embed.future(embed_request(long_prompt), timeout=60)
    wait_until(lambda: any(worker.num_router_in_flight_requests for pool in client.cluster_status().pools
                           for worker in pool.workers), timeout=10, interval=0.01, message="the router called a worker")
    call.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")
    assert len(client.embed("Hi", timeout=30)) == HIDDEN_SIZE  # the cluster serves on


def test_after_all_every_block_is_free_on_every_worker(client):
    wait_until(lambda: all_blocks_free(client), timeout=30, message="every block free")
