"""benchmarks/lora.py on a tiny workload (2 adapters, 4 prompts, 8 tokens, no vLLM): every request produces its
tokens, request i runs adapter i % 2 (its tokens are PEFT's with that adapter), and the table compares splitserve with
and without the adapters."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import lora
from tests.lora_helpers import peft_greedy

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_runs_request_i_on_adapter_i_mod_k(model_dir, tmp_path, capsys):
    out, adapter_dir = tmp_path / "lora.json", tmp_path / "adapters"
    assert lora.main(["--model", str(model_dir), "--num-adapters", "2", "--num-prompts", "4", "--max-tokens", "8",
                      "--repeats", "1", "--adapter-dir", str(adapter_dir), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == {"splitserve": 32, "splitserve lora": 32}  # 4 requests x 8 tokens, EOS ignored
    assert len(report["timings"]["splitserve lora"]) == 1 and report["max_loras"] == 2
    assert report["changed_by_adapters"] >= 1  # adapter-1 changes request 1's tokens: the adapters were applied
    prompts = lora.make_prompts(str(model_dir), 4)
    assert report["prompt_lens"] == [len(prompt) for prompt in prompts]
    for index, prompt in enumerate(prompts):
        expected = peft_greedy(str(model_dir), str(adapter_dir / f"adapter-{index % 2}"), prompt, 8)
        assert report["answers"]["splitserve lora"][index][: len(expected)] == expected, index  # PEFT stops at EOS
    printed = capsys.readouterr().out
    for name in ("splitserve", "splitserve lora"):
        assert re.search(rf"^\| {name} \| [\d.]+ \| [\d.]+ \| 32 \|$", printed, re.MULTILINE), printed
    assert re.search(r"splitserve lora / splitserve: [\d.]+x \(repeat by repeat [\d.]+\); the adapters changed the "
                     rf"greedy token ids of {report['changed_by_adapters']}/4 requests", printed), printed
    assert "vLLM" not in printed
