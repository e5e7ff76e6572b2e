"""benchmarks/cluster_forks.py on a tiny workload: a cluster started and stopped by the benchmark; n completions in
one request against separate requests (one KV transfer a prompt against one a completion), and a beam search on
the decode worker against the same search stepped through the router (the same beams, one call against many)."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks import cluster_forks

pytestmark = pytest.mark.timeout(400)


def test_the_benchmark_times_each_forking_form_beside_what_it_replaces(model_dir, tmp_path, capsys):
    out = tmp_path / "forks.json"
    assert cluster_forks.main(["--model", str(model_dir), "--num-prompts", "2", "--prompt-len", "40", "--n", "3",
                               "--beam-width", "2", "--max-tokens", "4", "--repeats", "1", "--kv-cache-gb", "0.3",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    n, beams = report["n"], report["beams"]
    assert [len(n["seconds"][form]) for form in ("n", "separate")] == [1, 1]
    # One transfer a prompt for n, one a completion for separate requests: up to 3 times the KV (less when a
    # prompt's full blocks reached the decode worker's prefix cache before its other requests were acknowledged).
    assert n["received"]["n"][0][0] == 2 and n["received"]["separate"][0][0] == 6
    (_, n_bytes), (_, separate_bytes) = n["received"]["n"][0], n["received"]["separate"][0]
    assert 0 < n_bytes < separate_bytes <= 3 * n_bytes
    assert n["calls"] == {"n": 2, "separate": 6} and n["output_tokens"] == 2 * 3 * 4
    # The search: one call a prompt on the worker; stepped, a call a beam a step (1 at the first step, then 2).
    assert beams["calls"] == {"worker": 2, "stepped": 2 * (1 + 2 * 3)} and beams["output_tokens"] == 2 * 2 * 4
    assert beams["same_beams"] is True
    assert beams["received"]["worker"][0][0] == 2
    printed = capsys.readouterr().out
    assert re.search(r"^separate / n: [\d.]+x$", printed, re.MULTILINE), printed
    assert re.search(r"^stepped / worker: [\d.]+x$", printed, re.MULTILINE), printed
    with pytest.raises(SystemExit):
        cluster_forks.main(["--n", "1"])
