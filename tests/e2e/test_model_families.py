"""Other Llama-family architectures through --model: small random-weight checkpoints
written by transformers itself (Qwen2 with q/k/v biases, and with YaRN rope scaling, Qwen3 with its per-head query and key norms and
heads wider than hidden_size / heads, Mistral, Llama 3 rope scaling with an untied head, Granite with its four
scalars, Phi-3 with its projections fused in the checkpoint), compared token for
token with transformers' generate; Qwen3 through every attention backend (the C++ kernels, the torch references,
and the Triton kernels in Triton's interpreter), since its head norms run through each backend's RMSNorm."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from splitserve import LLM, SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


SMALL = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def _llama3_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        **SMALL,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(**SMALL, tie_word_embeddings=False)


def _mistral_config():
    from transformers import MistralConfig

    return MistralConfig(**SMALL, head_dim=16, sliding_window=None)


def _qwen2_yarn_config():
    from transformers import Qwen2Config

    # YaRN as Qwen2.5's long-context configs set it (factor 4 over the original context), on a small scale: the
    # second prompt runs past the original 128 positions.
    return Qwen2Config(**SMALL, tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})


def _qwen3_config():
    from transformers import Qwen3Config

    # head_dim 32 with 4 heads of a 64-wide model: queries 128 wide, as Qwen3's heads are wider than hidden / heads.
    return Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False)


def _granite_config():
    from transformers import GraniteConfig

    # Granite's four scalars, each away from 1 (Granite 3's are about 12, 1/128, 0.22 and 8-16), tied embeddings.
    return GraniteConfig(**SMALL, embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.5,
                         logits_scaling=4.0, tie_word_embeddings=True)


def _phi3_config():
    from transformers import Phi3Config

    # Phi-3 checkpoints hold q/k/v and gate/up fused already (qkv_proj, gate_up_proj).
    return Phi3Config(**SMALL, tie_word_embeddings=False)


FAMILIES = {"llama3": _llama3_config, "qwen2": _qwen2_config, "qwen2_yarn": _qwen2_yarn_config,
            "qwen3": _qwen3_config, "mistral": _mistral_config,
            "granite": _granite_config, "phi3": _phi3_config}


def write_tiny_model(config, directory, tokenizer_dir, auto_class=None) -> None:
    """A random-weight model of ``config`` saved by transformers (``auto_class``: AutoModelForCausalLM, or AutoModel
    for the base model alone), with the default model's tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = (auto_class or AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():  # larger weights: decisive (tie-free) greedy choices
            parameter.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)


PROMPTS = ["The capital of France is", "A long time ago " * 20]
MAX_TOKENS = 12
ENGINE_OPTIONS = {"num_kv_blocks": 64, "max_model_len": 512, "max_num_batched_tokens": 64}


def transformers_greedy(directory, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids])
            out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                                     do_sample=False, eos_token_id=None, min_new_tokens=max_tokens)
            expected.append(out[0, len(ids):].tolist())
    return expected


@pytest.mark.parametrize("family,backend", [(family, "auto") for family in sorted(FAMILIES)] + [("qwen3", "torch")])
def test_family_greedy_matches_transformers(family, backend, tmp_path, model_dir, tokenizer):
    write_tiny_model(FAMILIES[family](), tmp_path, model_dir)
    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    expected = transformers_greedy(tmp_path, prompt_ids)

    llm = LLM(str(tmp_path), attention_backend=backend, **ENGINE_OPTIONS)
    if family == "qwen3":  # the head norms run through the backend's RMSNorm: the C++ kernels, or the references
        norms = [layer.self_attn.q_norm for layer in llm.engine.model_runner.model.model.layers]
        assert all((norm.kernels is None) == (backend == "torch") for norm in norms)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    if family == "granite":  # logits_scaling leaves greedy choices as they are: the log probabilities show it
        _check_first_logprobs(llm, tmp_path, prompt_ids)


def _check_first_logprobs(llm, directory, prompt_ids: list[list[int]]) -> None:
    """Each prompt's first sampled token's top-3 log probabilities are transformers' (log-softmax of its logits)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for ids, output in zip(prompt_ids, outputs):
        with torch.inference_mode():
            expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        top = torch.topk(expected, 3)
        (step,) = output.outputs[0].logprobs
        assert set(step) == set(top.indices.tolist())
        for token_id, logprob in zip(top.indices.tolist(), top.values.tolist()):
            assert step[token_id] == pytest.approx(logprob, abs=1e-4)


def test_qwen3_through_a_disaggregated_cluster_matches_transformers(tmp_path, model_dir, tokenizer):
    """A tiny Qwen3 served by a prefill and a decode worker with KV over p2p: its heads are wider than
    hidden_size / heads (32 against 16), so every size the KV path computes must come from head_dim. Each prompt's
    KV travels (whole blocks of 2 layers x K and V x 2 heads x 32 values, float32), and the streams are
    transformers' greedy tokens."""
    model = tmp_path / "qwen3"
    model.mkdir()
    write_tiny_model(_qwen3_config(), model, model_dir)
    counters = _stream_through_a_cluster(model, tmp_path, tokenizer)
    per_block = 2 * 2 * 2 * 16 * 32 * 4
    blocks, rest = divmod(counters.num_kv_bytes, per_block)
    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    assert rest == 0 and blocks == sum(-(-len(ids) // 16) for ids in prompt_ids)


def _stream_through_a_cluster(model, tmp_path, tokenizer):
    """Stream PROMPTS' greedy tokens from ``model`` through a p2p cluster of a prefill and a decode worker: each
    transformers' generate's, each prompt's KV sent once and none recomputed, every block free after; returns the
    decode worker's counters."""
    from splitserve.client import Client
    from tests.cluster_helpers import all_blocks_free, start_cluster, stream_tokens, wait_until, worker_status

    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    expected = transformers_greedy(model, prompt_ids)
    model_args = ["--model", str(model), "--max-model-len", "512"]
    cluster = start_cluster("p2p", tmp_path / "logs", worker_args=model_args, router_args=model_args)
    try:
        decode = next(process for process in cluster.workers if process.name.startswith("decode"))
        with Client(cluster.router.address) as client:
            assert [stream_tokens(client, ids, MAX_TOKENS, ignore_eos=True)[0] for ids in prompt_ids] == expected
            counters = worker_status(decode.address, "decode").counters
            assert counters.num_kv_transfers_received == len(prompt_ids) and counters.num_kv_recomputes == 0
            wait_until(lambda: all_blocks_free(client), 15, message="all KV blocks free")
            return counters
    finally:
        cluster.stop()


_TRITON_GENERATE = """
import json, sys
from splitserve import LLM, SamplingParams
from splitserve.kernels import triton_ops
model, options, prompt_ids, max_tokens = json.loads(sys.argv[1])
llm = LLM(model, attention_backend="triton", **options)
layers = llm.engine.model_runner.model.model.layers
assert all(layer.self_attn.q_norm.kernels is triton_ops and layer.self_attn.k_norm.kernels is triton_ops
           for layer in layers)
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
assert llm.engine.free_block_count == llm.engine.num_kv_blocks
print(json.dumps([output.outputs[0].token_ids for output in outputs]))
"""


@pytest.mark.timeout(300)
def test_qwen3_through_the_triton_kernels_matches_transformers(tmp_path, model_dir, tokenizer):
    """The Triton backend in Triton's interpreter (a process of its own: TRITON_INTERPRET=1 must be set before
    triton is imported), on a short prompt and a chunked one: the head norms through the Triton RMSNorm."""
    write_tiny_model(_qwen3_config(), tmp_path, model_dir)
    prompt_ids = [tokenizer.encode(prompt) for prompt in ("The capital of France is", "A long time ago " * 6)]
    max_tokens = 6
    expected = transformers_greedy(tmp_path, prompt_ids, max_tokens)
    options = {"num_kv_blocks": 16, "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 16,
               "enable_prefix_caching": False}
    argument = json.dumps([str(tmp_path), options, prompt_ids, max_tokens])
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _TRITON_GENERATE, argument], env=environment, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_bfloat16_generates_the_same_answer(model_dir):
    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.model_runner.kv_cache.dtype == torch.bfloat16
    (output,) = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert output.outputs[0].text.startswith(" Paris")


def _longrope_config(original: int):
    """Phi-4-mini's rotary on a small scale: half of each head rotates (head_dim 16: 4 frequencies) and LongRoPE
    has distinct short and long factors, ``original`` its original context."""
    from transformers import Phi3Config

    half = 16 // 2 // 2
    return Phi3Config(**SMALL, partial_rotary_factor=0.5, tie_word_embeddings=False,
                      original_max_position_embeddings=original,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                       "long_factor": [2.0 + 3.0 * i for i in range(half)]})


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_phi4_mini_partial_rotary_and_longrope_match_transformers(backend, tmp_path, model_dir, tokenizer):
    """Phi-4-mini's rotary on a small scale: half of each head rotates (its factor is 0.75 of 128) and LongRoPE has
    distinct short and long factors, through the C++ kernels (which rotate the heads' leading dimensions in place)
    and the torch references. Within the original context the tokens are transformers' generate's; with an
    original context the second prompt's decoding passes after 4 tokens, where the request is computed again with
    the long factors throughout (preempted once), as transformers' generate runs the whole sequence again there:
    its tokens are generate's too."""
    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    for original in (len(prompt_ids[1]) + MAX_TOKENS, len(prompt_ids[1]) + 4):
        directory = tmp_path / str(original)
        write_tiny_model(_longrope_config(original), directory, model_dir)
        expected = transformers_greedy(directory, prompt_ids)
        llm = LLM(str(directory), attention_backend=backend, **ENGINE_OPTIONS)
        assert llm.engine.model_runner.model.model.layers[0].self_attn.rotary_dim == 8
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected, original
        passes = original < len(prompt_ids[1]) + MAX_TOKENS
        assert [output.metrics.num_preemptions for output in outputs] == [0, int(passes)]
        assert llm.engine.free_block_count == llm.engine.num_kv_blocks


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_prompt_past_longropes_original_context_takes_the_long_factors_throughout(backend, tmp_path, model_dir,
                                                                                   tokenizer):
    """A LongRoPE model whose original context (40) the 81-token prompt passes: every position of that request
    rotates with the long factors, as transformers (and vLLM) rotate such a prompt, chunked prefill included, while
    the short prompt beside it keeps the short ones. Its blocks chain from a root of their own: the KV of a shorter
    request's same first tokens (rotated with the short factors) is not taken from the prefix cache, its own is."""
    prompt_ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    original = 40
    assert len(prompt_ids[0]) + MAX_TOKENS <= original < len(prompt_ids[1])
    write_tiny_model(_longrope_config(original), tmp_path, model_dir)
    expected = transformers_greedy(tmp_path, prompt_ids)
    llm = LLM(str(tmp_path), attention_backend=backend, block_size=16, **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    shorter = {"prompt_token_ids": prompt_ids[1][:original - 4]}  # its first two blocks are the long prompt's tokens
    llm.generate([shorter], dataclasses.replace(params, max_tokens=4), use_tqdm=False)  # within the original context
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert outputs[1].num_cached_tokens == 0  # not the shorter request's blocks
    [again] = llm.generate([{"prompt_token_ids": prompt_ids[1]}], params, use_tqdm=False)
    assert again.outputs[0].token_ids == expected[1] and again.num_cached_tokens == 80  # its own five blocks
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    # The router's prefix-aware key for the long prompt (its model config saying the original context) is its
    # fifth block's hash in this engine's prefix cache; keyed from the base root, it would be the shorter one's.
    from splitserve.common.block_hash import request_root_hash
    from splitserve.common.model_info import ModelConfig
    from splitserve.router.policies import PrefixAware

    assert ModelConfig.from_model_dir(tmp_path).long_rope_context == original
    policy = PrefixAware(block_size=16, prefix_blocks=5)
    assert llm.engine.kv_cache.pool.lookup(policy.prefix_key(prompt_ids[1], request_root_hash(None, None, True))) is not None
    assert policy.prefix_key(prompt_ids[1]) != policy.prefix_key(prompt_ids[1], request_root_hash(None, None, True))


def test_a_longrope_prompt_past_its_original_context_through_a_disaggregated_cluster(tmp_path, model_dir,
                                                                                     tokenizer):
    """The same model (original context 10) through a prefill and a decode worker (KV over p2p): the prefill worker
    rotates the 81-token prompt with the long factors throughout, and so does the decode worker for the tokens after
    it (each decides from the sequence's length); the 5-token prompt passes the original context while the decode
    worker decodes it, which computes it again with the long factors. Both streams are transformers' generate's."""
    model = tmp_path / "phi3"
    model.mkdir()
    write_tiny_model(_longrope_config(10), model, model_dir)
    _stream_through_a_cluster(model, tmp_path, tokenizer)


def test_a_longrope_beam_search_past_the_original_context_gets_transformers_beams(tmp_path, model_dir, tokenizer):
    """Beams that pass the original context (10) during the search: the step past it asks for sequences longer
    than the original context, which rotate with the long factors throughout (their blocks under their own root,
    so none forks its parent's short-rotated KV: each computes its beam again), as transformers' generate runs the
    whole sequence again there; the beams are transformers'."""
    from transformers import AutoModelForCausalLM

    from splitserve.engine.beam_search import BeamSearchParams
    from tests.reference import generate_beams

    write_tiny_model(_longrope_config(10), tmp_path, model_dir)
    ids = tokenizer.encode(PROMPTS[0])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = generate_beams(reference, ids, 3, MAX_TOKENS)
    llm = LLM(str(tmp_path), block_size=16, **ENGINE_OPTIONS)
    [found] = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))
    assert len(ids) < 10 < len(ids) + MAX_TOKENS
    assert [sequence.tokens[found.prompt_len:] for sequence in found.sequences] == expected
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
