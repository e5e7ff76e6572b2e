"""Every Triton kernel the engine launches, compiled here for an H100 (sm_90) and an A100 (sm_80), with
no GPU: ``python -m splitserve.kernels.triton_aot`` (Triton's compiler and NVIDIA's ptxas and cuobjdump
come with the triton wheel).

The interpreter tests (``test_triton_attention.py``, ``test_triton_ops.py``) check what the kernels
compute, but the interpreter runs programs a GPU compile rejects and says nothing of speed. These check
what a GPU would be given, at the shapes people serve (SmolLM2-135M, Llama-2-7B, Llama-3-8B and
Llama-3-70B: head sizes 64 and 128, grouped-query ratios 3, 1, 4 and 8; bfloat16 and float32): each
kernel compiles, fits an SM, spills no register to local memory, and the kernels bound by memory
bandwidth load most of their bytes 16 per thread at a time.

The compiler runs in a subprocess: this process imported Triton for its interpreter (``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` on a machine without a GPU), and a process has one or the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

pytest.importorskip("triton", reason="the Triton kernels are an optional extra: pip install 'splitserve[triton]'")
pytestmark = pytest.mark.timeout(600)

from splitserve.kernels.triton_aot import GPUS, MODELS, programs_per_sm  # noqa: E402

ENGINE_KERNELS = {
    "rms_norm_kernel", "silu_and_mul_kernel", "rotary_kernel", "copy_blocks_kernel", "store_kv_kernel",
    "decode_partial_kernel", "decode_reduce_kernel", "prefill_kernel",
}
# Kernels whose time is their bytes: the share of their global-load bytes in 16-byte loads must reach this.
BANDWIDTH_BOUND = {"decode_partial_kernel": 0.7, "copy_blocks_kernel": 0.9, "rms_norm_kernel": 0.9,
                   "silu_and_mul_kernel": 0.9}
# Every shape and dtype for the H100; the A100, the default model and one 8B shape.
MODELS_BY_GPU = {"h100": sorted(MODELS), "a100": ["llama-3-8b", "smollm2-135m"]}
# The compiler processes: the H100's shapes in two, a dtype each, so that the three share two cores evenly.
RUNS = [("h100", ["--dtype", "bfloat16"]), ("h100", ["--dtype", "float32"]),
        ("a100", ["--model", *MODELS_BY_GPU["a100"]])]
# One shape again with an empty cache folder: every cubin disassembled afresh (the runs above mostly read what
# an earlier run kept, see triton_aot._read_cubin), to compare.
UNCACHED = ("a100", ["--model", "smollm2-135m", "--dtype", "float32"])


def _compiler_env(cache: str | None = None) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9's default, stated to silence its warning
    if cache is not None:
        env["SPLITSERVE_CACHE"] = cache
    return env


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[dict]]:
    """Every run of RUNS and UNCACHED, compiled side by side (each compiler process is single-threaded): reports
    by GPU, and UNCACHED's under "uncached"."""
    folder = tmp_path_factory.mktemp("aot")
    # (key of the reports, GPU, flags, cache folder or None for the default one)
    jobs = [(gpu, gpu, flags, None) for gpu, flags in RUNS] + [("uncached", *UNCACHED, str(folder / "empty-cache"))]
    runs = [
        (key, gpu, folder / f"{index}.json", subprocess.Popen(
            [sys.executable, "-m", "splitserve.kernels.triton_aot", "--gpu", gpu, *flags,
             "--json", str(folder / f"{index}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_compiler_env(cache)))
        for index, (key, gpu, flags, cache) in enumerate(jobs)
    ]
    results = defaultdict(list)
    try:
        for key, gpu, report, process in runs:
            stdout, stderr = process.communicate(timeout=500)
            assert process.returncode == 0, stderr[-4000:]
            assert f"compiled for {GPUS[gpu].name}" in stdout
            results[key] += json.loads(report.read_text())
    finally:
        for *_, process in runs:
            if process.poll() is None:
                process.kill()
                process.wait()
    return dict(results)


@pytest.fixture(params=sorted(MODELS_BY_GPU))
def reports(request, compiled):
    return compiled[request.param]


def test_every_kernel_compiles_for_every_shape_and_dtype(reports):
    by_shape = defaultdict(set)
    for report in reports:
        by_shape[report["model"], report["dtype"]].add(report["kernel"])
    models = MODELS_BY_GPU[reports[0]["gpu"]]
    assert set(by_shape) == {(model, dtype) for model in models for dtype in ("bfloat16", "float32")}
    for shape, kernels in by_shape.items():
        assert kernels == ENGINE_KERNELS, f"{shape}: compiled {sorted(kernels)}"


def test_every_kernel_fits_an_sm_without_spilling(reports):
    spilled = [f"{r['model']} {r['dtype']} {r['kernel']} ({r['variant']}): {r['spill_stores']} spill stores, "
               f"{r['registers']} registers" for r in reports if r["spill_stores"]]
    assert not spilled, "\n".join(spilled)
    limit = GPUS[reports[0]["gpu"]].shared_per_program
    for r in reports:
        assert 0 < r["registers"] <= 255
        assert r["shared_bytes"] <= limit
        assert r["programs_per_sm"] >= 1, r


def test_bandwidth_bound_kernels_load_sixteen_bytes_at_a_time(reports):
    narrow = [f"{r['model']} {r['dtype']} {r['kernel']}: {r['wide_load_share']:.0%}" for r in reports
              if r["kernel"] in BANDWIDTH_BOUND and r["wide_load_share"] < BANDWIDTH_BOUND[r["kernel"]]]
    assert not narrow, "\n".join(narrow)


def test_decode_keeps_several_programs_per_sm(reports):
    # Loads of one program overlap another's arithmetic only if more than one is resident.
    for r in reports:
        if r["kernel"] == "decode_partial_kernel":
            assert r["programs_per_sm"] >= 2, r


def test_kept_cubin_readings_are_what_a_fresh_disassembly_reads(compiled):
    """The readings kept in the cache folder (under each cubin's SHA-256) give the reports a fresh cuobjdump gives."""
    def without_times(reports):
        return sorted(json.dumps({k: v for k, v in r.items() if k != "compile_seconds"}, sort_keys=True)
                      for r in reports)

    fresh = compiled["uncached"]
    assert {r["kernel"] for r in fresh} == ENGINE_KERNELS
    kept = [r for r in compiled["a100"] if (r["model"], r["dtype"]) == ("smollm2-135m", "float32")]
    assert without_times(fresh) == without_times(kept)


def test_refuses_under_the_interpreter():
    result = subprocess.run([sys.executable, "-m", "splitserve.kernels.triton_aot", "--model", "smollm2-135m"],
                            capture_output=True, text=True, env={**_compiler_env(), "TRITON_INTERPRET": "1"}, timeout=120)
    assert result.returncode == 2
    assert "TRITON_INTERPRET is set" in result.stderr
    assert result.stdout == ""


def test_programs_per_sm_takes_the_tightest_limit():
    h100 = GPUS["h100"]
    # 158 registers: 5120 per warp, 12 warps by registers: 3 programs of 4 warps (shared memory allows 5).
    assert programs_per_sm(h100, registers=158, shared=40 * 1024, num_warps=4) == 3
    # Few registers and no shared memory: the warp limit (64 per SM) gives 16 of 4 warps.
    assert programs_per_sm(h100, registers=24, shared=0, num_warps=4) == 16
    # 100 KiB each: 2 fit in 228 KiB with the 1 KiB reserved per program.
    assert programs_per_sm(h100, registers=64, shared=100 * 1024, num_warps=4) == 2
    # Over the per-program limit: none fits.
    assert programs_per_sm(h100, registers=64, shared=h100.shared_per_program + 1, num_warps=4) == 0
