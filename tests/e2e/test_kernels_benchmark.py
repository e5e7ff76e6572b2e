"""benchmarks/gpu_kernels.py without a GPU: the bytes each kernel must move, the kernels compiled for an H100,
and the interpreter check, each as a user runs the script (a subprocess; Triton's compiler and its
interpreter cannot share a process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels are an optional extra: pip install 'splitserve[triton]'")
pytestmark = pytest.mark.timeout(600)
without_a_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark times the kernels instead")
with_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here (torch.cuda.is_available() is False): nothing to time")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_kernels.py"
KERNELS = ["rms_norm", "add_rms_norm", "rotary_", "silu_and_mul", "store_kv", "gather_blocks", "scatter_blocks",
           "copy_blocks", "paged_decode_attention", "paged_prefill_attention"]


def _run(*arguments: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, env=env,
                          timeout=500, cwd=ROOT)


@without_a_gpu
def test_without_a_gpu_it_prints_the_bytes_model_and_the_kernels_compiled_for_an_h100(tmp_path):
    out = tmp_path / "kernels.json"
    result = _run("--tokens", "16", "--contexts", "4096", "--batch-sizes", "16", "--prefill-batch-sizes", "1",
                  "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "No CUDA GPU found" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert sorted({row["kernel"] for row in rows}) == sorted(KERNELS)
    # SmolLM2's decode at batch 16 over 4,096 tokens in bfloat16: keys and values of 3 heads x 64 dims,
    # 2 bytes each, read once (the query, output and block tables add under 0.2%).
    (decode,) = [row for row in rows if row["kernel"] == "paged_decode_attention"]
    kv_bytes = 2 * 16 * 4096 * 3 * 64 * 2
    assert kv_bytes <= decode["bytes"] <= kv_bytes * 1.002
    assert decode["seconds_at_peak"] == pytest.approx(decode["bytes"] / 3350e9)
    # Then the compile table: every kernel the engine launches, none spilling.
    assert "Triton kernels compiled for H100 SXM (sm_90" in result.stdout
    table = [line.split() for line in result.stdout.splitlines() if line.startswith("smollm2-135m")]
    compiled = {row[2] for row in table}
    assert {"prefill_kernel", "decode_partial_kernel", "decode_reduce_kernel", "store_kv_kernel",
            "rms_norm_kernel", "rotary_kernel", "silu_and_mul_kernel", "copy_blocks_kernel"} == compiled
    spills = [int(row[-4]) for row in table]  # columns from the right: 16B loads, per SM, shared, spills
    assert spills and not any(spills)


@without_a_gpu
def test_interpret_runs_each_kernel_on_tiny_shapes_against_its_reference():
    result = _run("--interpret", "--dtype", "float32", "--tokens", "4", "--contexts", "64", "--batch-sizes", "2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    checked = [line.split() for line in result.stdout.splitlines() if line.endswith((" ok", " WRONG"))]
    assert sorted({row[0] for row in checked}) == sorted(KERNELS)
    assert all(row[-1] == "ok" for row in checked)
    assert "compiled for" not in result.stdout  # the interpreter and the compiler do not share a process


@without_a_gpu
def test_the_llama_3_8b_shape_moves_its_own_bytes(tmp_path):
    out = tmp_path / "kernels.json"
    result = _run("--model", "llama-3-8b", "--kernels", "paged_decode_attention", "--contexts", "4096",
                  "--batch-sizes", "16", "--compile-for", "none", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    (decode,) = json.loads(out.read_text())["rows"]
    kv_bytes = 2 * 16 * 4096 * 8 * 128 * 2  # keys and values of 8 heads x 128 dims, bfloat16
    assert kv_bytes <= decode["bytes"] <= kv_bytes * 1.002


@without_a_gpu
def test_prefill_tiles_are_each_a_row_and_screened_for_spills_on_the_compiler(tmp_path):
    out = tmp_path / "kernels.json"
    result = _run("--model", "llama-3-8b", "--kernels", "paged_prefill_attention", "--contexts", "4096",
                  "--prefill-batch-sizes", "1", "--prefill-tiles", "64x64x8x3", "128x128x4x2", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["shape"].split("tiles ")[1] for row in rows] == ["64x64x8x3", "128x128x4x2"]
    assert rows[0]["bytes"] == rows[1]["bytes"]  # the same work, cut two ways
    screened = result.stdout.split("at each of --prefill-tiles")[1]
    # Each tile compiled whole and split (the variant writing partial outputs), and the reduction beside.
    table = {(row[3], row[4], row[5], row[7]): int(row[-4]) for row in
             (line.split() for line in screened.splitlines() if line.startswith("llama-3-8b") and "prefill_kernel" in line)}
    assert len(table) == 4
    # The engine's tile at head size 128 fits in registers; 128 rows x 128 keys on 4 warps cannot.
    for split in ("SPLIT=False", "SPLIT=True"):
        assert table[("KEY_TILE=64", "ROWS=64", split, "num_warps=8")] == 0
        assert table[("KEY_TILE=128", "ROWS=128", split, "num_warps=4")] > 0

    refused = _run("--prefill-tiles", "64x48x4x3")
    assert refused.returncode == 2 and "powers of two" in refused.stderr


def test_prefill_split_counts_are_each_a_row(tmp_path):
    """--prefill-splits: one row per split count of each shape, the same work (with a GPU each is timed; here the
    rows of the bytes table)."""
    out = tmp_path / "kernels.json"
    result = _run("--kernels", "paged_prefill_attention", "--contexts", "4096", "--prefill-batch-sizes", "1",
                  "--prefill-splits", "1", "4", "--compile-for", "none", "--repeats", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["shape"].rsplit(" ", 2)[1:] for row in rows] == [["splits", "1"], ["splits", "4"]]
    assert rows[0]["bytes"] == rows[1]["bytes"]


@with_a_gpu
def test_on_a_gpu_each_kernel_is_timed_from_a_cuda_graph_against_its_reference(tmp_path):
    out = tmp_path / "kernels.json"
    result = _run("--tokens", "64", "--contexts", "1024", "--batch-sizes", "4", "--prefill-batch-sizes", "1",
                  "--prefill-chunk", "256", "--repeats", "5", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted({row["kernel"] for row in rows}) == sorted(KERNELS)
    for row in rows:
        assert row["seconds"] > 0 and row["reference_seconds"] > 0, row
        assert row["max_relative_difference"] < 0.02, row  # bfloat16 against the torch reference
    # Attention and the element-wise kernels never wait on the host: captured. (Block copies take a Python
    # list of block ids and may fall back to eager.)
    assert all(row["timing"] == "graph" for row in rows
               if row["kernel"] not in ("gather_blocks", "scatter_blocks", "copy_blocks"))
    assert "Target (paged decode attention" in result.stdout


GRAPHS_SCRIPT = ROOT / "benchmarks" / "decode_graphs.py"


@without_a_gpu
def test_the_decode_graphs_benchmark_says_it_finds_no_gpu():
    result = subprocess.run([sys.executable, str(GRAPHS_SCRIPT), "--batch-sizes", "1"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "no CUDA device here" in result.stdout and "Traceback" not in result.stderr


@with_a_gpu
def test_on_a_gpu_the_decode_graphs_benchmark_times_both_engines_on_the_same_ids(tmp_path):
    out = tmp_path / "graphs.json"
    result = subprocess.run([sys.executable, str(GRAPHS_SCRIPT), "--batch-sizes", "1", "5", "--prompt-len", "64",
                             "--steps", "8", "--repeats", "1", "--dtype", "float32", "--json", str(out)],
                            capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 5]
    assert all(row["identical_ids"] and row["eager_ms"] > 0 and row["graphs_ms"] > 0 for row in rows)


PREFILL_GRAPHS_SCRIPT = ROOT / "benchmarks" / "prefill_graphs.py"


@without_a_gpu
def test_the_prefill_graphs_benchmark_says_it_finds_no_gpu():
    result = subprocess.run([sys.executable, str(PREFILL_GRAPHS_SCRIPT), "--tokens", "64"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "no CUDA device here" in result.stdout and "Traceback" not in result.stderr


def test_the_prefill_graphs_benchmark_refuses_steps_it_cannot_capture():
    result = subprocess.run([sys.executable, str(PREFILL_GRAPHS_SCRIPT), "--tokens", "4096"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "every --tokens between --requests and 2048" in result.stderr


@with_a_gpu
def test_on_a_gpu_the_prefill_graphs_benchmark_times_both_engines_on_the_same_tokens(tmp_path):
    out = tmp_path / "pieces.json"
    result = subprocess.run([sys.executable, str(PREFILL_GRAPHS_SCRIPT), "--tokens", "40", "300", "--requests", "2",
                             "--repeats", "2", "--dtype", "float32", "--json", str(out)],
                            capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [40, 300]
    assert all(row["same_first_tokens"] and row["replayed_steps"] == 2 and row["eager_ms"] > 0 for row in rows)
