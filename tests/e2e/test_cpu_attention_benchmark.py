"""benchmarks/cpu_attention.py on small cases: it runs as a script, times both sides and checks they agree."""

from __future__ import annotations

import os
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


def _baseline_lines(result: subprocess.CompletedProcess) -> tuple[str, list[str]]:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Against the kernels of "))
    return lines[start], lines[start + 1:]


def _run_with_baseline(baseline: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"), "--layers", "2", "--repeats", "1",
         "--prefill", "0:40", "17:30", "--decode", "4x33", "--baseline", baseline],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )


def _assert_each_case_compared(cases: list[str]) -> None:
    assert [line.split(":")[0].strip() for line in cases] == ["prefill 0", "decode 4x33"]
    for line in cases:
        ratio = float(line.split("baseline/this ")[1].split("x,")[0])
        assert ratio > 0 and line.endswith("outputs identical bit for bit")


def test_cpu_attention_benchmark_against_a_copy_of_this_trees_kernels_times_the_one_build_twice(tmp_path):
    for pattern in ("*.cpp", "*.h"):
        for source in (ROOT / "splitserve" / "kernels").glob(pattern):
            (tmp_path / source.name).write_bytes(source.read_bytes())
    header, cases = _baseline_lines(_run_with_baseline(str(tmp_path)))
    assert header == f"Against the kernels of the sources in {tmp_path}: the same sources as this tree (one build, " \
                     "timed twice), in the same runs:"
    _assert_each_case_compared(cases)


def test_cpu_attention_benchmark_builds_other_kernel_sources_beside_this_trees_and_keeps_a_few_builds(tmp_path):
    """An edited copy (a comment more: other sources, the same arithmetic) is compiled into the cache folder's
    kernels-other, timed beside this tree's build in the same process, and gives the same bits; older builds there
    beyond the newest four are removed."""
    from splitserve.common.model_info import cache_dir
    from splitserve.kernels import cpu_ops

    assert cpu_ops.available(str(cache_dir()))
    edited = tmp_path / "edited"
    edited.mkdir()
    for name, content in cpu_ops.source_files().items():
        (edited / name).write_bytes(content)
    with open(edited / "cpu_paged_attention.cpp", "a") as source:
        source.write("\n// An edited copy for test_cpu_attention_benchmark.\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(cache_dir() / "kernels")  # this tree's build, already compiled
    others = cache / "kernels-other"
    others.mkdir()
    for i in range(5):
        old = others / f"torch-old-{i}"
        old.mkdir()
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    header, cases = _baseline_lines(_run_with_baseline(str(edited), env={**os.environ, "SPLITSERVE_CACHE": str(cache)}))
    assert header == f"Against the kernels of the sources in {edited}, in the same runs:"
    _assert_each_case_compared(cases)
    kept = sorted(path.name for path in others.iterdir())
    built = [name for name in kept if not name.startswith("torch-old-")]
    assert len(built) == 1 and kept == sorted(built + ["torch-old-2", "torch-old-3", "torch-old-4"])
    assert (others / built[0] / "src" / "cpu_paged_attention.cpp").read_bytes().endswith(b"test_cpu_attention_benchmark.\n")


def test_cpu_attention_benchmark_takes_a_git_revision_as_baseline():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    header, cases = _baseline_lines(_run_with_baseline("HEAD"))
    assert header.startswith(f"Against the kernels of HEAD ({head[:10]})")
    _assert_each_case_compared(cases)


def test_cpu_attention_benchmark_refuses_a_baseline_that_is_neither_folder_nor_revision():
    result = _run_with_baseline("no-such-revision-or-folder")
    assert result.returncode == 2
    assert "--baseline: 'no-such-revision-or-folder' is neither a folder nor a git revision" in result.stderr
