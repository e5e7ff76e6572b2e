"""benchmarks/priority.py on a tiny workload: under the priority policy the urgent request's first token comes
before every background request's, under first come, first served after them; the table compares the two."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import priority

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_serves_the_urgent_request_first_only_under_priority(model_dir, tmp_path, capsys):
    out = tmp_path / "priority.json"
    assert priority.main(["--model", str(model_dir), "--num-background", "2", "--background-prompt", "16",
                          "--background-tokens", "4", "--num-urgent", "1", "--urgent-prompt", "8",
                          "--urgent-tokens", "2", "--max-num-seqs", "1", "--repeats", "1", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    [fcfs], [by_priority] = runs["fcfs"], runs["priority"]
    # One request at a time: the order of first tokens is the order requests started.
    assert max(fcfs["ttft"]["background"]) < min(fcfs["ttft"]["urgent"])
    assert max(by_priority["ttft"]["urgent"]) < min(by_priority["ttft"]["background"])
    printed = capsys.readouterr().out
    assert re.search(r"\| urgent ttft, median \(ms\) \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", printed), printed
    assert re.search(r"\| whole run \(s\) \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", printed), printed
