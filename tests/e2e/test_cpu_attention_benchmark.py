"""benchmarks/cpu_attention.py on small cases: it runs as a script, times both sides and checks they agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_attention_benchmark_prints_each_case_with_its_ratio_and_agreement():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"), "--layers", "2", "--repeats", "1",
         "--prefill", "0:40", "17:30", "--prefill", "100:1", "--decode", "4x33"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("prefill ", "decode "))]
    assert [row[0] for row in rows] == ["prefill", "prefill", "decode"]
    assert rows[0][1:3] == ["0:40", "17:30"] and rows[1][1] == "100:1" and rows[2][1] == "4x33"
    for row in rows:
        kernel_ms, torch_ms, ratio, rate = float(row[-6]), float(row[-5]), float(row[-4].rstrip("x")), float(row[-3])
        assert kernel_ms >= 0 and torch_ms > 0 and ratio > 0 and rate > 0
        assert row[-2] == ("GB/s" if row[0] == "decode" else "GFLOP/s")
        assert float(row[-1]) < 1e-4  # the kernel's output and the reference's agree


def test_cpu_attention_benchmark_refuses_a_head_size_the_prefill_kernel_does_not_take():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"), "--head-dim", "32"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "multiples of 64" in result.stderr
