"""benchmarks/offline_throughput.py on a small workload, against transformers in the same run: the table, the
greedy ids' agreement, the untimed warm-up run, the order of the systems in each repeat, the repeat-by-repeat
ratios and the JSON."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.offline_throughput import paired_ratios, parse_args, repeat_order

ROOT = Path(__file__).resolve().parents[2]


def _run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline_throughput.py"), *arguments],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_the_order_of_the_systems_is_reversed_every_repeat():
    assert repeat_order(["a", "b", "c"], 1) == ["a", "b", "c"]
    assert repeat_order(["a", "b", "c"], 2) == ["c", "b", "a"]
    assert repeat_order(["a", "b", "c"], 3) == ["a", "b", "c"]
    assert paired_ratios([2.0, 3.0, 4.0], [1.0, 2.0]) == [2.0, 1.5]  # repeats both measured
    assert paired_ratios([2.0], [0.0]) == []


def test_the_vllm_peer_is_pinned_to_as_many_cpus_as_splitserve_has_threads_unless_told_otherwise():
    allowed = sorted(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            cpus = [int(cpu) for cpu in parse_args([]).vllm_threads_bind.split(",")]
            assert cpus == allowed[:count]  # one CPU per splitserve thread, the lowest this process may use
    finally:
        torch.set_num_threads(threads)
    for value in ("nobind", "auto", "0-1", "0,2-3"):
        assert parse_args(["--vllm-threads-bind", value]).vllm_threads_bind == value
    for value in ("0;1", "all", "1,", ""):
        with pytest.raises(SystemExit):
            parse_args(["--vllm-threads-bind", value])


def test_offline_benchmark_against_transformers_reports_medians_paired_ratios_and_identical_ids(tmp_path):
    out = tmp_path / "report.json"
    result = _run("--num-requests", "3", "--min-prompt", "8", "--max-prompt", "24", "--output-len", "5",
                  "--hf-batch-size", "2", "--latency-prompt-len", "8", "--latency-output-len", "4",
                  "--repeats", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]

    # Each repeat runs the systems in turn, the order reversed every repeat, throughput and latency alike.
    order = re.findall(r"repeat (\d)/3: (splitserve|transformers) (throughput|batch-1 latency)", result.stderr)
    expected = []
    for repeat, systems in (("1", ["splitserve", "transformers"]), ("2", ["transformers", "splitserve"]),
                            ("3", ["splitserve", "transformers"])):
        expected += [(repeat, system, "throughput") for system in systems]
        expected += [(repeat, system, "batch-1 latency") for system in systems]
    assert order == expected
    # The default warm-up: each system runs the throughput workload once, untimed, before repeat 1.
    first_timed = result.stderr.index("repeat 1/3")
    for system in ("splitserve", "transformers"):
        line = f"warming up {system}: one untimed run of the throughput workload"
        assert line in result.stderr and result.stderr.index(line) < first_timed

    report = json.loads(out.read_text())
    systems = report["systems"]
    ours, theirs = systems["splitserve"], systems["transformers"]
    for system in (ours, theirs):
        assert len(system["throughput_runs"]) == 3 and len(system["latency_runs"]) == 3
        assert all(run["num_output_tokens"] == 3 * 5 for run in system["throughput_runs"])
    comparison = next(c for c in report["comparisons"] if (c["ours"], c["theirs"]) == ("splitserve", "transformers"))
    # float32 greedy: the same ids as transformers, request by request
    assert comparison["identical_requests"] == comparison["num_requests"] == 3
    # The paired ratios are each repeat's own, and their median is printed beside them.
    expected_throughput = [a["tokens_per_second"] / b["tokens_per_second"]
                           for a, b in zip(ours["throughput_runs"], theirs["throughput_runs"])]
    expected_latency = [a["ms_per_output_token"] / b["ms_per_output_token"]
                        for a, b in zip(ours["latency_runs"], theirs["latency_runs"])]
    assert comparison["throughput_ratios"] == pytest.approx(expected_throughput)
    assert comparison["latency_ratios"] == pytest.approx(expected_latency)
    assert comparison["throughput_paired_median"] == pytest.approx(statistics.median(expected_throughput))
    assert comparison["throughput_ratio"] == pytest.approx(ours["median_tokens_per_second"]
                                                           / theirs["median_tokens_per_second"])

    table = result.stdout
    assert "systems interleaved, their order reversed each repeat; warm-up: two short prompts, then the " \
        "throughput workload once, untimed" in table
    assert re.search(r"^splitserve\s+\d+\.\d \(\d+\.\d-\d+\.\d\)\s+\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)$", table, re.M)
    assert re.search(r"^splitserve/transformers\s+\d+\.\d\dx >=4x (PASS|MISS)\s+\d+\.\d\dx <=1.15x (PASS|MISS)\s+3/3$",
                     table, re.M)
    line = next(line for line in table.splitlines() if line.startswith("splitserve/transformers: "))
    printed = [float(ratio) for ratio in re.findall(r"(\d+\.\d\d)x", line.split(";")[0])]
    assert printed[:3] == pytest.approx([round(ratio, 2) for ratio in expected_throughput], abs=0.006)
    assert printed[3] == pytest.approx(statistics.median(expected_throughput), abs=0.006)
    assert "latency " in line.split(";")[1]


def test_offline_benchmark_refuses_no_repeats_and_unknown_warmups():
    result = _run("--repeats", "0")
    assert result.returncode == 2 and "--repeats must be >= 1" in result.stderr
    result = _run("--warmup", "none")
    assert result.returncode == 2 and "invalid choice: 'none'" in result.stderr
