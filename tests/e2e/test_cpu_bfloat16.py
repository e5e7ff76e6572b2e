"""bfloat16 on the CPU: the C++ kernels over a bfloat16 cache and oneDNN's bfloat16 GEMMs, against transformers
in bfloat16.

Two bfloat16 implementations round differently (the order of each sum, where a value is rounded), so greedy
outputs may part where two candidates are nearly tied. As vLLM's tests compare its bfloat16 runs with
transformers' (``check_logprobs_close``): token by token up to the first difference, where each side's token
must be among the other's 5 most likely; after it the two continue from different text and are not compared.
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.models.packed_linear import PackedLinear
from tests.reference import MAX_TOKENS

TOP = 5


@pytest.fixture(scope="module")
def hf_bfloat16(model_dir, prompt_token_ids):
    """transformers' greedy continuation of each reference prompt in bfloat16, with the top-5 log probabilities
    of every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    results = []
    with torch.inference_mode():
        for ids in prompt_token_ids:
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            top = [torch.log_softmax(scores[0].float(), -1).topk(TOP) for scores in out.scores]
            results.append((tokens, [dict(zip(t.indices.tolist(), t.values.tolist())) for t in top]))
    return results


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def test_bfloat16_engine_runs_the_kernels_and_agrees_with_transformers(model_dir, prompt_token_ids, hf_bfloat16):
    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=2048)
    runner = llm.engine.model_runner
    assert runner.use_cpu_kernel and runner.use_cpu_prefill_kernel
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.block_size == 128
    projections = [module for module in runner.model.modules() if isinstance(module, PackedLinear)]
    assert projections and all(module.dtype == torch.bfloat16 and module.panels is None for module in projections)

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False)
    identical = 0
    for index, (output, (tokens, top)) in enumerate(zip(outputs, hf_bfloat16)):
        ours = output.outputs[0]
        at = first_difference(ours.token_ids, tokens)
        if at is None:
            identical += 1
            continue
        assert ours.token_ids[at] in top[at], (
            f"prompt {index}, token {at}: ours {ours.token_ids[at]} is not among transformers' top {TOP} {top[at]}")
        assert tokens[at] in ours.logprobs[at], (
            f"prompt {index}, token {at}: transformers' {tokens[at]} is not among our top {TOP} {ours.logprobs[at]}")
    print(f"bfloat16: {identical} of {len(outputs)} outputs identical to transformers'")
    # Rounding parts a few near ties, not most outputs.
    assert identical >= len(outputs) // 2, f"only {identical} of {len(outputs)} outputs identical"
    assert llm.engine.free_block_count == llm.engine.num_kv_blocks
