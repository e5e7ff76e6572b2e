"""Other Llama-family architectures through --model: small random-weight checkpoints
written by transformers itself (Qwen2 with q/k/v biases, Mistral, Llama 3 rope
scaling with an untied head), compared token for token with transformers' generate."""

from __future__ import annotations

import shutil

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


FAMILIES = {"llama3": _llama3_config, "qwen2": _qwen2_config, "mistral": _mistral_config}


def write_tiny_model(config, directory, tokenizer_dir) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():  # larger weights: decisive (tie-free) greedy choices
            parameter.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_matches_transformers(family, tmp_path, model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    write_tiny_model(FAMILIES[family](), tmp_path, model_dir)
    prompts = ["The capital of France is", "A long time ago " * 20]
    prompt_ids = [tokenizer.encode(prompt) for prompt in prompts]

    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids])
            out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                                     do_sample=False, eos_token_id=None, min_new_tokens=12)
            expected.append(out[0, len(ids):].tolist())

    llm = LLM(str(tmp_path), num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks


def test_bfloat16_generates_the_same_answer(model_dir):
    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.model_runner.kv_cache.dtype == torch.bfloat16
    (output,) = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert output.outputs[0].text.startswith(" Paris")
