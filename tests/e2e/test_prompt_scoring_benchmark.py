"""benchmarks/prompt_scoring.py on a tiny workload: it times scoring and plain prefill and its scores are
transformers'."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import prompt_scoring

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_times_both_kinds_and_its_scores_are_transformers(model_dir, tmp_path, capsys):
    out = tmp_path / "scoring.json"
    assert prompt_scoring.main(["--model", str(model_dir), "--num-prompts", "3", "--min-prompt", "20",
                                "--max-prompt", "60", "--top", "2", "--repeats", "2", "--check-hf", "3",
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    timings = report["timings"]["splitserve"]
    assert len(timings["score"]) == len(timings["prefill"]) == 2 and min(timings["score"] + timings["prefill"]) > 0
    printed = capsys.readouterr().out
    assert re.search(r"\| splitserve \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", printed), printed
    difference = float(re.search(r"largest \|splitserve - transformers\| over the first 3 prompts: (\S+)",
                                 printed)[1])
    assert difference < 2e-4


def test_largest_difference_is_over_every_scored_token():
    assert prompt_scoring.largest_difference([[0.0, -1.0], [-2.0]], [[0.0, -1.5], [-1.75]]) == 0.5
