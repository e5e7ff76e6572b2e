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


def test_cpu_attention_benchmark_in_bfloat16_compares_amx_with_avx512_where_the_cpu_has_amx():
    from splitserve.common.model_info import cache_dir
    from splitserve.kernels import cpu_ops

    assert cpu_ops.available(str(cache_dir()))
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"), "--layers", "2", "--repeats", "1",
         "--dtype", "bfloat16", "--prefill", "0:64", "--decode", "4x70", "1x16"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    decode_rows = [line.split() for line in lines if line.startswith("decode ")]
    assert [row[1] for row in decode_rows] == ["4x70", "1x16"]
    assert all(float(row[-1]) < 0.05 for row in decode_rows)  # bfloat16 torch against the kernel
    compared = [line for line in lines if "AVX-512/AMX" in line]
    if cpu_ops.decodes_in_amx(64, 16, 3):
        assert [line.split(": AVX-512")[0].strip() for line in compared] == ["prefill 0:64", "decode 4x70", "decode 1x16"]
        for line in compared:
            assert float(line.rsplit(" ", 1)[1].rstrip("x")) > 0
    else:
        assert compared == [] and "AMX" not in result.stdout
