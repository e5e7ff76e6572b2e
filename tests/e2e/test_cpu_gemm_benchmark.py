"""benchmarks/cpu_gemm.py on small cases: it runs as a script, times both GEMMs and checks they agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.common.model_info import cache_dir
from splitserve.kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def _run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_gemm.py"), *arguments],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def _require_small_gemm() -> None:
    assert cpu_ops.available(str(cache_dir()))
    if not cpu_ops.small_gemm_supported():
        pytest.skip("small_gemm needs AVX-512, or AVX2 with FMA, which this build of the kernels lacks")


def test_cpu_gemm_benchmark_prints_each_shape_and_batch_with_its_ratio_and_agreement():
    _require_small_gemm()
    result = _run("--shapes", "64x96", "40x33", "--rows", "1", "9", "--layers", "2", "--repeats", "1",
                  "--evict-mb", "8")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith(("64x96", "40x33"))]
    assert [(row[0], row[1]) for row in rows] == [("64x96", "1"), ("64x96", "9"), ("40x33", "1"), ("40x33", "9")]
    for row in rows:
        small_ms, onednn_ms, ratio = float(row[2]), float(row[3]), float(row[4].rstrip("x"))
        # Milliseconds are printed rounded (a Zen 5 ran 64x96 at one row in under 5 microseconds: 0.000); the ratio
        # is computed from the unrounded times.
        assert small_ms >= 0 and onednn_ms >= 0 and ratio > 0
        assert float(row[-1]) < 1e-4  # the two GEMMs agree


def test_cpu_gemm_benchmark_in_bfloat16_times_the_bfloat16_small_gemm_or_says_why_not():
    assert cpu_ops.available(str(cache_dir()))
    result = _run("--dtype", "bfloat16", "--shapes", "64x96", "--rows", "1", "8", "--layers", "2", "--repeats", "1",
                  "--evict-mb", "8")
    if not cpu_ops.small_gemm_bfloat16_supported():
        assert result.returncode == 1 and "AVX512-BF16" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "bfloat16" in result.stdout.splitlines()[0]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("64x96")]
    assert [row[1] for row in rows] == ["1", "8"]
    for row in rows:
        assert float(row[4].rstrip("x")) > 0
        assert float(row[-1]) <= 0.25  # sums of 64 products of unit normals, each side rounded to bfloat16 once


def test_cpu_gemm_benchmark_refuses_a_batch_of_no_rows():
    result = _run("--rows", "0")
    assert result.returncode == 2 and "must be positive" in result.stderr


def test_cpu_gemm_benchmark_times_each_k_block_against_the_first():
    _require_small_gemm()
    result = _run("--shapes", "300x70", "--rows", "20", "--layers", "2", "--repeats", "1", "--evict-mb", "8",
                  "--block-steps", "128", "7", "0")
    assert result.returncode == 0, result.stderr
    assert f"k-block here: {cpu_ops.default_small_gemm_block_steps()} steps" in result.stdout.splitlines()[0]
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("300x70"))
    blocks = re.findall(r"block (\d+): (\d+) GFLOP/s \((\d+\.\d+)x\)", row)
    assert [steps for steps, _, _ in blocks] == ["128", "7", "0"]
    # The ratios are of times; the GFLOP/s of so small a shape print as whole numbers, 0 on a loaded host.
    assert float(blocks[0][2]) == 1.0 and all(float(ratio) > 0 for _, _, ratio in blocks), row
    refused = _run("--block-steps", "-3")
    assert refused.returncode == 2 and "--block-steps takes zero or positive" in refused.stderr


def test_cpu_gemm_benchmark_times_a_baseline_revisions_small_gemm_beside_this_trees(tmp_path):
    """--baseline with a copy of this tree's kernels (the same sources: the loaded build, no compile; building
    other sources is tested through cpu_attention.py, which shares kernel_baseline.py): each row adds the
    baseline's small GEMM, on panels it packed itself, and its outputs match this tree's bit for bit."""
    _require_small_gemm()
    for name, content in cpu_ops.source_files().items():
        (tmp_path / name).write_bytes(content)
    result = _run("--shapes", "64x96", "--rows", "1", "9", "--layers", "2", "--repeats", "1", "--evict-mb", "8",
                  "--baseline", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"baseline: the kernels of the sources in {tmp_path}: the same sources as this tree" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("64x96")]
    assert len(rows) == 2
    for row in rows:
        match = re.search(r"baseline: (\d+) GFLOP/s, baseline/this ([0-9.]+)x, identical bit for bit$", row)
        assert match and float(match.group(2)) > 0, row


def test_cpu_gemm_benchmark_refuses_a_baseline_that_is_neither_folder_nor_revision():
    result = _run("--baseline", "no-such-revision-or-folder")
    assert result.returncode == 2 and "neither a folder nor a git revision" in result.stderr


def test_cpu_gemm_benchmark_sweeps_the_caches_by_reading_unless_told_to_write(monkeypatch):
    """The caches are swept before each call by reading the buffer (the engine's caches hold clean lines: the KV
    cache decode attention read, the weights before), or by writing it with --evict-by write; the header says
    which, both ways time and agree, and another way is refused."""
    _require_small_gemm()
    for way, words in (([], "by reading 8 MB"), (["--evict-by", "write"], "by writing 8 MB")):
        result = _run("--shapes", "64x96", "--rows", "3", "--layers", "2", "--repeats", "1", "--evict-mb", "8", *way)
        assert result.returncode == 0, result.stderr
        assert words in result.stdout.splitlines()[0]
        row = next(line.split() for line in result.stdout.splitlines() if line.strip().startswith("64x96"))
        assert float(row[4].rstrip("x")) > 0 and float(row[-1]) < 1e-4
    refused = _run("--evict-by", "flush")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr

    # In the process: the read sweep leaves its buffer as it was, the write sweep adds one to every element.
    from benchmarks import cpu_gemm

    buffers = []
    real_zeros = torch.zeros

    def recorded_zeros(*size, **options):
        buffers.append(real_zeros(*size, **options))
        return buffers[-1]

    monkeypatch.setattr(cpu_gemm.torch, "zeros", recorded_zeros)
    for way, expected in (("read", 0.0), ("write", 4.0)):  # 4 timed passes of 1 layer: small, oneDNN, warm and timed
        buffers.clear()
        cpu_gemm.gemm_case(64, 96, 3, layers=1, repeats=1, evict_mb=1, evict_by=way)
        assert len(buffers) == 1 and torch.all(buffers[0] == expected), way
    with pytest.raises(ValueError, match="evict_by must be one of"):
        cpu_gemm.gemm_case(64, 96, 3, layers=1, repeats=1, evict_mb=1, evict_by="flush")
