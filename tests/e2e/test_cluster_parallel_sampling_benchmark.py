"""benchmarks/cluster_parallel_sampling.py on a tiny workload: a cluster started and stopped by the benchmark, n
completions in one request against separate requests, one KV transfer a prompt against one a completion."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import cluster_parallel_sampling

pytestmark = pytest.mark.timeout(300)


def test_the_benchmark_times_n_beside_separate_requests_and_counts_their_transfers(model_dir, tmp_path, capsys):
    out = tmp_path / "cluster-n.json"
    assert cluster_parallel_sampling.main(["--model", str(model_dir), "--num-prompts", "2", "--prompt-len", "40",
                                           "--n", "3", "--max-tokens", "4", "--repeats", "2", "--kv-cache-gb", "0.3",
                                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [len(report["seconds"][form]) for form in ("n", "separate")] == [2, 2]
    # One transfer a prompt for n, one a completion for separate requests: up to 3 times the KV (less when a
    # prompt's full blocks reached the decode worker's prefix cache before its other requests were acknowledged).
    assert [transfers for transfers, _ in report["received"]["n"]] == [2, 2]
    assert [transfers for transfers, _ in report["received"]["separate"]] == [6, 6]
    (_, n_bytes), (_, separate_bytes) = report["received"]["n"][0], report["received"]["separate"][0]
    assert 0 < n_bytes < separate_bytes <= 3 * n_bytes
    printed = capsys.readouterr().out
    assert re.search(r"^separate / n: [\d.]+x$", printed, re.MULTILINE), printed
    with pytest.raises(SystemExit):
        cluster_parallel_sampling.main(["--n", "1"])
