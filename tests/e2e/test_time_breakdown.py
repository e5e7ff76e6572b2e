"""benchmarks/time_breakdown.py on a tiny workload: its clocks cover the engine's parts without changing its
tokens, and the GEMM work it counts is exactly what the workload's shape implies."""

from __future__ import annotations

import json

import pytest

from benchmarks import time_breakdown
from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_the_clocked_engine_gives_the_same_tokens_and_counts_every_gemm_flop(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100, 100 + length))} for length in (7, 23, 40)]
    plain = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    clocks = time_breakdown.Clocks()
    with time_breakdown.clocked_engine(clocks):
        clocked = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    assert clocked == plain
    # Every prompt token and every output token but the last goes through each projection once, except that
    # the last layer's output projection and MLP see only the rows sampled (one per output token: each prompt's
    # last, then every decode row); each output token is sampled from one row of logits.
    config = llm.engine.model_config
    hidden, inter, heads, kv_heads, head_dim = (config.hidden_size, config.intermediate_size,
                                                config.num_attention_heads, config.num_key_value_heads,
                                                config.head_dim)
    qkv = hidden * (heads + 2 * kv_heads) * head_dim
    after_attention = heads * head_dim * hidden + 3 * hidden * inter
    tokens, sampled = (7 + 23 + 40) + 3 * (5 - 1), 3 * 5
    expected = (2 * tokens * (qkv + after_attention) * (config.num_hidden_layers - 1)
                + 2 * (tokens * qkv + sampled * after_attention) + 2 * sampled * hidden * config.vocab_size)
    assert clocks.gemm_flops == expected
    # The projections' seconds and FLOPs, split by the GEMM each call ran in, add up to theirs.
    assert set(clocks.path_flops) <= {"decode-sized (C++ small GEMM)", "prompt-sized (oneDNN)"}
    assert sum(clocks.path_flops.values()) == expected - 2 * sampled * hidden * config.vocab_size
    assert sum(clocks.path_seconds.values()) == pytest.approx(clocks.seconds["projections (GEMM)"])
    for part in ("projections (GEMM)", "logits (GEMM)", "prompt attention", "decode attention", "KV write",
                 "norms, rotary, SiLU", "forward", "step inputs", "sampling"):
        assert clocks.seconds[part] > 0, part
    parts = time_breakdown.breakdown(clocks, wall=sum(clocks.seconds.values()))
    assert set(parts) == set(time_breakdown.CATEGORIES)


def test_the_benchmark_runs_and_writes_its_report(model_dir, tmp_path, capsys):
    out = tmp_path / "breakdown.json"
    assert time_breakdown.main(["--model", str(model_dir), "--num-requests", "3", "--min-prompt", "20",
                                "--max-prompt", "40", "--output-len", "4", "--repeats", "1", "--ceiling-rows", "64",
                                "--vllm-tok-s", "50", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"]["output_tokens"] == 12 and report["gemm_ceiling_seconds"] > 0
    assert sum(report["parts_seconds"].values()) == pytest.approx(report["clocked_seconds"][0], rel=0.02)
    printed = capsys.readouterr().out
    assert "GEMM ceiling" in printed and "1.2x vLLM (50.0 tok/s) needs" in printed
    paths = report["projection_paths"]
    assert paths and all(path["seconds"] > 0 and path["gflop"] > 0 for path in paths.values())
    assert all(f"projections, {name}:" in printed for name in paths)
