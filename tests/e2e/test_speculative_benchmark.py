"""benchmarks/speculative.py on a tiny workload: splitserve with drafts gives the same greedy (and seeded sampled)
token ids as without, accepts some of them, and the table compares the two."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import speculative

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_speculates_with_the_plain_engines_tokens(model_dir, tmp_path, capsys):
    out = tmp_path / "speculative.json"
    assert speculative.main(["--model", str(model_dir), "--num-prompts", "2", "--max-tokens", "32", "--repeats", "1",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["answers"]["splitserve"] == report["answers"]["splitserve ngram"]
    assert 0 < report["accepted"] <= report["drafts"]
    printed = capsys.readouterr().out
    assert re.search(r"\| splitserve ngram \| [\d.]+ \| [\d.]+ \| \d+ \|", printed), printed
    assert re.search(r"splitserve ngram / splitserve: [\d.]+x .* greedy token ids identical for 2/2 requests",
                     printed), printed


def test_under_a_json_schema_the_benchmark_speculates_with_the_plain_engines_tokens(model_dir, tmp_path, capsys):
    out = tmp_path / "speculative.json"
    assert speculative.main(["--model", str(model_dir), "--num-prompts", "1", "--max-tokens", "40", "--repeats", "1",
                             "--json-schema", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["answers"]["splitserve"] == report["answers"]["splitserve ngram"]
    assert 0 < report["accepted"] <= report["drafts"]
    printed = capsys.readouterr().out
    assert "greedy, under a JSON schema" in printed and "identical for 1/1 requests" in printed, printed


def test_sampled_and_penalised_the_benchmark_speculates_with_the_plain_engines_tokens(model_dir, tmp_path, capsys):
    out = tmp_path / "speculative.json"
    assert speculative.main(["--model", str(model_dir), "--num-prompts", "2", "--max-tokens", "32", "--repeats", "1",
                             "--temperature", "0.7", "--top-k", "20", "--frequency-penalty", "0.3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["answers"]["splitserve"] == report["answers"]["splitserve ngram"]
    assert 0 < report["accepted"] <= report["drafts"]
    assert "seeded token ids identical for 2/2 requests" in capsys.readouterr().out
