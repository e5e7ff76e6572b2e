"""``LLM.embed``: each prompt's last token's final hidden state, normalized, as vLLM's pooling runner gives a
decoder-only model's embedding, compared with transformers' ``last_hidden_state`` on the same weights (float32):
prompts of a few tokens to over a thousand (chunked over several steps), embedding requests beside generation
requests in the same steps (whose tokens stay the plain run's), a prompt served from the prefix cache, the
Matryoshka cut and the raw vector, and the refusals. No token is generated and every block is freed."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve import LLM, PoolingParams, SamplingParams
from tests.reference import hf_model

# float32 through different kernels and chunkings: the vectors agree to about 1e-6 of their unit length.
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(model_dir):
    # A 64-token step budget: the longer prompts' embeddings come from their last chunk, steps after their first.
    return LLM(str(model_dir), num_kv_blocks=160, max_model_len=2048, max_num_batched_tokens=64)


def _reference(model_dir, token_ids: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the model's last norm) of the prompt's last token, float32."""
    with torch.inference_mode():
        return hf_model(str(model_dir)).model(torch.tensor([token_ids])).last_hidden_state[0, -1].float()


def _assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()


def test_embeddings_are_transformers_last_hidden_state_normalized(llm, model_dir, prompt_token_ids):
    prompts = prompt_token_ids[:6] + prompt_token_ids[7:]  # a few tokens to over a thousand
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    assert [output.prompt_token_ids for output in outputs] == prompts
    for ids, output in zip(prompts, outputs):
        embedding = torch.tensor(output.outputs.embedding)
        assert embedding.shape == (llm.engine.model_config.hidden_size,)
        assert torch.linalg.vector_norm(embedding).item() == pytest.approx(1.0, abs=1e-5)
        expected = torch.nn.functional.normalize(_reference(model_dir, ids), dim=-1)
        assert torch.allclose(embedding, expected, atol=ATOL), (embedding - expected).abs().max()
    _assert_all_blocks_free(llm)


def test_scores_are_the_cosine_similarities_of_transformers_states(llm, model_dir, prompt_token_ids):
    """``LLM.score`` as vLLM's with an embedding model: one prompt against several, and pairwise; each pair's score is
    the cosine of transformers' last hidden states of its two prompts."""
    first, others = prompt_token_ids[0], prompt_token_ids[1:4]
    states = {tuple(ids): _reference(model_dir, ids) for ids in [first, *others]}

    def expected(one, other):
        return torch.nn.functional.cosine_similarity(states[tuple(one)], states[tuple(other)], dim=0).item()

    outputs = llm.score({"prompt_token_ids": first}, [{"prompt_token_ids": ids} for ids in others], use_tqdm=False)
    assert [output.outputs.score for output in outputs] == pytest.approx([expected(first, ids) for ids in others],
                                                                          abs=ATOL)
    assert outputs[0].prompt_token_ids == first + others[0]
    pairwise = llm.score([{"prompt_token_ids": ids} for ids in others[:2]],
                         [{"prompt_token_ids": first}, {"prompt_token_ids": others[1]}], use_tqdm=False)
    assert [output.outputs.score for output in pairwise] == pytest.approx(
        [expected(others[0], first), 1.0], abs=ATOL)
    with pytest.raises(ValueError, match="give one first text"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="at least one text"):
        llm.score("a", [], use_tqdm=False)
    _assert_all_blocks_free(llm)


def test_embedding_requests_share_steps_with_generation_requests(llm, prompt_token_ids):
    """Embedding and generation requests added together run in the same steps: the generations are the plain
    run's tokens, the embeddings the embed call's vectors, and the embedding requests finish with no token."""
    params = SamplingParams(temperature=0, max_tokens=8)
    generating = [prompt_token_ids[0], prompt_token_ids[4]]
    embedding = [prompt_token_ids[1], prompt_token_ids[3]]
    plain = [output.outputs[0].token_ids
             for output in llm.generate([{"prompt_token_ids": ids} for ids in generating], params, use_tqdm=False)]
    alone = [output.outputs.embedding
             for output in llm.embed([{"prompt_token_ids": ids} for ids in embedding], use_tqdm=False)]
    engine = llm.engine
    for index, ids in enumerate(generating):
        engine.add_request(f"gen-{index}", prompt_token_ids=ids, sampling_params=params)
    for index, ids in enumerate(embedding):
        engine.add_request(f"emb-{index}", prompt_token_ids=ids, pooling_params=PoolingParams())
    final, shared_steps = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        kinds = {output.request_id[:3] for output in outputs if output.request_id not in final}
        shared_steps += kinds == {"gen", "emb"}
        final.update((output.request_id, output) for output in outputs if output.finished)
    assert shared_steps >= 1
    assert [final[f"gen-{index}"].outputs[0].token_ids for index in range(2)] == plain
    for index in range(2):
        output = final[f"emb-{index}"]
        assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "stop"
        assert torch.allclose(torch.tensor(output.embedding), torch.tensor(alone[index]), atol=1e-6)
        assert final[f"gen-{index}"].embedding is None
    _assert_all_blocks_free(llm)


def test_a_cached_prefix_gives_the_same_embedding(llm, prompt_token_ids):
    ids = prompt_token_ids[6]  # 12 blocks and more: all but the last token's block come from the cache
    first, again = (llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0] for _ in range(2))
    assert torch.allclose(torch.tensor(first.outputs.embedding), torch.tensor(again.outputs.embedding), atol=1e-6)
    engine = llm.engine
    engine.add_request("cached", prompt_token_ids=ids, pooling_params=PoolingParams())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = [output for output in outputs if output.finished]
    assert output.num_cached_tokens >= 16 and output.num_cached_tokens % 16 == 0
    _assert_all_blocks_free(llm)


def test_the_raw_vector_and_the_matryoshka_cut(llm, model_dir, prompt_token_ids):
    ids = prompt_token_ids[2]
    expected = _reference(model_dir, ids)
    (raw,) = llm.embed({"prompt_token_ids": ids}, PoolingParams(normalize=False), use_tqdm=False)
    assert torch.allclose(torch.tensor(raw.outputs.embedding), expected, atol=ATOL * expected.abs().max().item())
    (cut,) = llm.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=64), use_tqdm=False)
    assert torch.allclose(torch.tensor(cut.outputs.embedding), torch.nn.functional.normalize(expected[:64], dim=-1),
                          atol=ATOL)


@pytest.mark.parametrize("params,words", [
    (PoolingParams(dimensions=0), "dimensions must be an integer from 1 to the model's hidden size 576, got 0"),
    (PoolingParams(dimensions=577), "hidden size 576, got 577"),
    (PoolingParams(normalize="yes"), "normalize must be a boolean"),
    ({"normalize": True}, "pooling_params must be a PoolingParams, got dict"),
])
def test_bad_pooling_params_are_refused_with_nothing_queued(llm, params, words):
    with pytest.raises(ValueError, match=words):
        llm.embed(["Hello", "World"], params, use_tqdm=False)
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request("refused", "Hello", pooling_params=params)
    _assert_all_blocks_free(llm)


def test_an_embedding_model_saved_as_its_base_model_loads_and_embeds(tmp_path, model_dir, tokenizer):
    """Embedding models on these architectures are saved as their base model (Qwen3-Embedding: a Qwen3Model's
    tensors without the "model." prefix, tied embeddings): such a checkpoint loads, and its embeddings are
    transformers' last_hidden_state, normalized."""
    from transformers import AutoModel

    from tests.e2e.test_model_families import _qwen3_config, write_tiny_model

    config = _qwen3_config()
    config.tie_word_embeddings = True
    write_tiny_model(config, tmp_path, model_dir, auto_class=AutoModel)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(tmp_path), num_kv_blocks=32, max_model_len=256, max_num_batched_tokens=64)
    reference = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "A long time ago " * 20)]
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = reference(torch.tensor([ids])).last_hidden_state[0, -1].float()
        assert torch.allclose(torch.tensor(output.outputs.embedding), torch.nn.functional.normalize(expected, dim=-1),
                              atol=ATOL)
