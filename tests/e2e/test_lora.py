"""LoRA adapters (``enable_lora``, ``LoRARequest``) end to end on the real model: greedy output with an adapter is
PEFT's (unmerged adapter on transformers, float32) token for token, for adapters of every projection and of attention
alone, in batches that mix two adapters and the base model; prefix caching keeps adapters' KV apart; with
``max_loras=1`` adapters take turns, still exact; speculative decoding holds with an adapter; beam search with an
adapter gives PEFT's beams; and refusals (an
engine without LoRA, a bad adapter) say why and leave nothing behind. On CUDA when a GPU is here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from splitserve import LLM, BeamSearchParams, SamplingParams
from splitserve.common.block_hash import request_root_hash
from splitserve.engine.lora import LoRARequest
from splitserve.router.policies import PrefixAware
from tests.lora_helpers import LORA_MAX_TOKENS as MAX_TOKENS
from tests.lora_helpers import peft_beams
from tests.reference import hf_greedy

pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False: a CPU build of torch, or no GPU)"


@pytest.fixture(scope="module")
def adapters(lora_adapters):
    return lora_adapters


@pytest.fixture(scope="module")
def references(lora_references):
    return lora_references


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), enable_lora=True, max_loras=2, num_kv_blocks=512, max_model_len=2048,
               max_num_batched_tokens=512)


def token_ids_of(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def assert_nothing_left(llm: LLM) -> None:
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.model_runner.lora.holders


def test_the_adapters_change_the_output(references):
    """Otherwise nothing below could fail for a LoRA delta left out."""
    for name in ("every", "attention"):
        assert sum(ours != base for ours, base in zip(references[name], references[None])) >= 3, name


def test_a_batch_of_two_adapters_and_the_base_model_is_peft_token_for_token(llm, prompt_token_ids, adapters,
                                                                          references):
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
    order = [(prompt, "every") for prompt in prompts] + [(prompt, "attention") for prompt in prompts[:6]] \
        + [(prompt, None) for prompt in prompts[:6]]
    outputs = llm.generate([prompt for prompt, _ in order], GREEDY, use_tqdm=False,
                           lora_request=[adapters[name] if name else None for _, name in order])
    got = token_ids_of(outputs)
    assert got[:8] == references["every"]
    assert got[8:14] == references["attention"]
    assert got[14:] == references[None]
    assert_nothing_left(llm)


def test_prefix_caching_keeps_each_adapters_kv_apart(llm, model_dir, prompt_token_ids, adapters, references):
    """The 40-day journal's blocks cached for one adapter are found again for it, never for the base model or
    another adapter: each reads KV its own weights computed."""
    prompt = [{"prompt_token_ids": prompt_token_ids[6]}]
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["every"])[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["every"])[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["attention"])[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == references["every"][6]
    block_size = llm.engine.config.block_size
    assert again.num_cached_tokens == (len(prompt_token_ids[6]) - 1) // block_size * block_size > 0
    assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert base.outputs[0].token_ids == hf_greedy(str(model_dir), prompt_token_ids[6], MAX_TOKENS)
    # The router's prefix-aware key for the adapter's prompt is a block hash of the adapter's cached blocks.
    policy = PrefixAware(block_size=block_size, prefix_blocks=4)
    key = policy.prefix_key(prompt_token_ids[6], request_root_hash(adapters["every"].lora_name, None, False))
    assert llm.engine.kv_cache.pool.lookup(key) is not None and key != policy.prefix_key(prompt_token_ids[6])
    assert_nothing_left(llm)


def test_with_one_adapter_a_step_adapters_take_turns_and_stay_exact(model_dir, prompt_token_ids, adapters,
                                                                    references):
    llm = LLM(str(model_dir), enable_lora=True, max_loras=1, num_kv_blocks=256, max_model_len=2048)
    manager = llm.engine.model_runner.lora
    steps: list[set[int]] = []
    prepare = manager.prepare
    manager.prepare = lambda row_ids, output_rows: steps.append(set(row_ids) - {0}) or prepare(row_ids, output_rows)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids[:6]]
    outputs = llm.generate(prompts * 3, GREEDY, use_tqdm=False,
                           lora_request=[adapters["every"], adapters["attention"], None] * 6)
    got = token_ids_of(outputs)
    for index, (tokens, name) in enumerate(zip(got, ["every", "attention", None] * 6)):
        assert tokens == references[name][index % 6], (index, name)
    assert max(len(adapters_of_step) for adapters_of_step in steps) == 1
    assert {1, 2} <= set().union(*steps)  # both ran, in turns
    assert_nothing_left(llm)


def test_speculative_decoding_with_an_adapter_is_peft(model_dir, prompt_token_ids, adapters, references):
    llm = LLM(str(model_dir), enable_lora=True, num_kv_blocks=256, max_model_len=2048,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids[:6]], GREEDY, use_tqdm=False,
                           lora_request=adapters["every"])
    assert token_ids_of(outputs) == references["every"][:6]
    assert llm.engine.stats.num_draft_tokens > 0
    assert_nothing_left(llm)


def test_an_engine_without_lora_refuses_an_adapter_with_a_sentence(model_dir, adapters):
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512)
    with pytest.raises(ValueError, match="serves no LoRA adapters.*--enable-lora"):
        llm.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, lora_request=[None, adapters["every"]])
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_adapter_is_refused_and_the_batch_left_nothing_behind(llm, tmp_path, adapters):
    missing = LoRARequest("missing", 7, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, lora_request=[adapters["every"], missing])
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'every'"):
        llm.generate(["Hi"], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("impostor", 1, adapters["attention"].lora_path))
    assert_nothing_left(llm)
    assert 7 not in llm.engine.model_runner.lora.adapters


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_adapters_on_cuda_are_peft(model_dir, prompt_token_ids, adapters, references):
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, num_kv_blocks=256, max_model_len=2048,
              device="cuda", dtype="float32")
    assert llm.engine.model_runner.decode_graphs is None  # LoRA steps run eagerly
    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids[:6]]
    outputs = llm.generate(prompts * 2, GREEDY, use_tqdm=False,
                           lora_request=[adapters["every"]] * 6 + [adapters["attention"]] * 6)
    assert token_ids_of(outputs) == references["every"][:6] + references["attention"]


def test_the_command_line_generates_with_an_adapter(model_dir, tmp_path, prompt_token_ids, adapters, references):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in prompt_token_ids[:3]))
    out = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--model", str(model_dir), "--file",
                    str(prompts), "--output", str(out), "--max-tokens", str(MAX_TOKENS),
                    "--lora", f"every={adapters['every'].lora_path}"], check=True, capture_output=True, timeout=300)
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == references["every"][:3]


def test_beam_search_with_an_adapter_gives_peft_s_beams(llm, model_dir, adapters, prompt_token_ids):
    # vLLM's LLM.beam_search(..., lora_request=...): every step's requests run the adapter, and forks stay within
    # its KV (its blocks chain from the adapter's root).
    prompts = prompt_token_ids[1:4]
    adapter = adapters["every"]
    outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], BeamSearchParams(3, 8),
                              lora_request=adapter)
    plain = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], BeamSearchParams(3, 8))
    for ids, output in zip(prompts, outputs):
        assert [beam.tokens[len(ids):] for beam in output.sequences] == peft_beams(
            str(model_dir), adapter.lora_path, ids, 3, 8)
    assert [[beam.tokens for beam in output.sequences] for output in outputs] != \
        [[beam.tokens for beam in output.sequences] for output in plain]
    assert_nothing_left(llm)
