"""The C++ small-batch GEMM against oneDNN's packed GEMM, timed in the same run, with the weights cold.

``splitserve/kernels/cpu_small_gemm.cpp`` runs the engine's projections for batches of up to
``small_gemm_max_rows()`` rows (192 with AVX-512, 96 with AVX2); above that oneDNN's packed GEMM
(``PackedLinear``) does. In the
engine a layer's weights are cold when its GEMM runs (attention and the other layers have swept the
caches), so each case holds one weight per layer (30 for SmolLM2-135M), runs them in turn as a step
does, and sweeps the caches before every call by reading a buffer of 32 MB, as decode attention reads
one layer's KV cache before the output projection (``--evict-by write`` writes it instead, as this
benchmark did before 2026-11-29: the weights' reads then also wait on the buffer's dirty lines going
back to memory, which the engine's caches do not hold). Between two calls on the same weight the other
29 weights and 30 sweeps pass (about 1 GB), so each call finds its weight in memory. The sweep is no
longer than a layer's attention on purpose: the longer the gap before a call, the slower the call,
even with no memory traffic in the gap (2-core Zen 4 VM, SmolLM2's 576x576 at 16 rows: 100 us after a
32 MB sweep, 257 after the same sweep and 8 ms of Python spinning, 170 after a 256 MB sweep of 10 ms,
this benchmark's default before 2026-12-02), a cost the engine's back-to-back calls do not pay. Both sides
alternate; the medians, oneDNN/small ratio (above 1: small_gemm is faster), GFLOP/s and the largest
difference between the two outputs are printed.

    python benchmarks/cpu_gemm.py                                  # SmolLM2-135M's four projections
    python benchmarks/cpu_gemm.py --rows 1 64 256 --shapes 4096x4096 --layers 4 --repeats 9
    python benchmarks/cpu_gemm.py --dtype bfloat16 --rows 1 4 8 16         # small_gemm_bfloat16 (AVX512-BF16)
    python benchmarks/cpu_gemm.py --block-steps 128 0 --rows 16 64 192     # small_gemm's k-blocks against whole panels
    python benchmarks/cpu_gemm.py --baseline HEAD~2 --rows 16 64 192      # that revision's small_gemm beside this tree's

With ``--baseline``, a revision's kernels (or a folder of kernel sources) are built beside this tree's and their
small GEMM, on panels its own pack_panels made, alternates with this tree's and oneDNN in the same process
(``kernel_baseline.py`` says why); each row then adds the baseline's GFLOP/s, baseline/this-tree time and whether
the two outputs are identical bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as splitserve
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.kernel_baseline import baseline_of_arguments  # noqa: E402
from splitserve.common.model_info import cache_dir
from splitserve.kernels import cpu_ops

# How the caches are swept before each call: by reading a buffer (the default), or by writing it.
EVICT_BY = ("read", "write")

# SmolLM2-135M's projections, in_features x out_features: q/k/v fused, o, gate/up fused, down.
DEFAULT_SHAPES = ["576x960", "576x576", "576x3072", "1536x576"]


def _parse_shape(text: str) -> tuple[int, int]:
    in_features, _, out_features = text.partition("x")
    return int(in_features), int(out_features)


def gemm_case(in_features: int, out_features: int, rows: int, layers: int, repeats: int, evict_mb: int,
              seed: int = 0, dtype: torch.dtype = torch.float32, block_steps: list[int] | None = None,
              baseline=None, evict_by: str = "read") -> dict:
    """One step's worth of one projection (``layers`` distinct weights) at ``rows`` rows, both ways: in float32
    small_gemm, in bfloat16 small_gemm_bfloat16, against oneDNN's packed GEMM in the same dtype. With
    ``block_steps`` (float32), small_gemm runs once at each of those k-blocks (0: whole panels) per repeat, all
    alternating with oneDNN; ``small_s`` is then the first one's time and ``block_s`` has each. With ``baseline``
    (a module from kernel_baseline.load_baseline), its small GEMM too, on panels it packed: ``baseline_s``.
    ``evict_by``: "read" or "write", how the ``evict_mb`` buffer sweeps the caches before each call."""
    if evict_by not in EVICT_BY:
        raise ValueError(f"evict_by must be one of {EVICT_BY}, not {evict_by!r}")
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(out_features, in_features, generator=generator).to(dtype) for _ in range(layers)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, None) for weight in weights]
    bfloat16 = dtype == torch.bfloat16
    pack, multiply = ((cpu_ops.pack_panels_bfloat16, cpu_ops.small_gemm_bfloat16) if bfloat16
                      else (cpu_ops.pack_panels, cpu_ops.small_gemm))
    panels = [pack(weight) for weight in weights]
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    evict = torch.zeros(evict_mb * 1024 * 1024 // 4)
    sweep = evict.sum if evict_by == "read" else functools.partial(evict.add_, 1.0)

    def onednn(layer):
        return torch.ops.mkldnn._linear_pointwise(x, packed[layer], None, "none", [], "")

    def small(layer):
        return multiply(x, panels[layer], None, out_features)

    if baseline is not None:
        with cpu_ops.kernels_from(baseline):
            baseline_panels = [pack(weight) for weight in weights]

        def of_baseline(layer):  # called inside cpu_ops.kernels_from(baseline): see timed
            return multiply(x, baseline_panels[layer], None, out_features)

    def timed(function, steps: int | None = None, kernels=None) -> float:
        """Seconds of ``function`` over every layer, at k-block ``steps`` or with the ``kernels`` module (the
        baseline's) put in for the whole loop. Entering cpu_ops.kernels_from around each call instead made the
        baseline's calls 40-60 us longer than this tree's (2-core Zen 4), a third of an 8-row call: a copy of this
        tree's kernels then read 1.05-1.35x its time at 8 to 64 rows."""
        seconds = 0.0
        with (cpu_ops.kernels_from(kernels) if kernels is not None else contextlib.nullcontext() if steps is None
              else cpu_ops.small_gemm_block_steps(steps)):
            for layer in range(layers):
                sweep()  # the weights and x leave the caches
                start = time.perf_counter()
                function(layer)
                seconds += time.perf_counter() - start
        return seconds

    difference = (small(0).float() - onednn(0).float()).abs().max().item()
    blocks = list(block_steps) if block_steps else [None]
    for steps in blocks:
        timed(small, steps)
    timed(onednn)  # warm-up
    small_times: dict = {steps: [] for steps in blocks}
    onednn_times, baseline_times = [], []
    if baseline is not None:
        timed(of_baseline, kernels=baseline)
    # Every side once a repeat, in an order reversed every other repeat, so that neither place in the sequence
    # favours one side.
    sides = [(small_times[steps], small, steps, None) for steps in blocks] + [(onednn_times, onednn, None, None)]
    if baseline is not None:
        sides.append((baseline_times, of_baseline, None, baseline))
    for repeat in range(repeats):
        for times, function, steps, kernels in sides if repeat % 2 == 0 else reversed(sides):
            times.append(timed(function, steps, kernels))
    block_s = {steps: statistics.median(times) for steps, times in small_times.items()}
    small_s, onednn_s = block_s[blocks[0]], statistics.median(onednn_times)
    flops = 2 * rows * in_features * out_features * layers
    compared = {}
    if baseline is not None:
        with cpu_ops.kernels_from(baseline):
            theirs = of_baseline(0)
        ours = small(0)
        baseline_s = statistics.median(baseline_times)
        compared = {"baseline_s": baseline_s, "baseline_gflops": flops / baseline_s / 1e9,
                    "baseline_identical": torch.equal(ours, theirs),
                    "baseline_difference": (ours.float() - theirs.float()).abs().max().item()}
    return {**compared, "shape": f"{in_features}x{out_features}", "rows": rows, "small_s": small_s, "onednn_s": onednn_s,
            "small_gflops": flops / small_s / 1e9, "onednn_gflops": flops / onednn_s / 1e9,
            "difference": difference, "block_s": block_s if block_steps else {},
            "block_gflops": {steps: flops / seconds / 1e9 for steps, seconds in block_s.items()} if block_steps else {}}


def _against_baseline(r: dict) -> str:
    """The end of a row with a baseline: its GFLOP/s, baseline/this-tree time and the outputs' agreement."""
    if "baseline_s" not in r:
        return ""
    agreement = ("identical bit for bit" if r["baseline_identical"]
                 else f"differs by at most {r['baseline_difference']:.1e}")
    return (f"  baseline: {r['baseline_gflops']:.0f} GFLOP/s, baseline/this {r['baseline_s'] / r['small_s']:.3f}x, "
            f"{agreement}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=_parse_shape, metavar="INxOUT",
                        default=[_parse_shape(shape) for shape in DEFAULT_SHAPES],
                        help="projections as in_features x out_features (default: SmolLM2-135M's: "
                             + " ".join(DEFAULT_SHAPES) + ")")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 192, 512],
                        help="batch sizes in rows (default: 1 16 64 192 512; the engine sends up to 192 to "
                             "small_gemm where the kernels run AVX-512, up to 96 where they run AVX2)")
    parser.add_argument("--layers", type=int, default=30, help="distinct weights per shape, run in turn (default: 30)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each side, alternating; medians (default: 5)")
    parser.add_argument("--evict-mb", type=int, default=32,
                        help="MB read (or written, --evict-by write) before each call, as decode attention reads one "
                             "layer's KV cache (about 30 MB at 64 requests of 310 tokens) before a projection "
                             "(default: %(default)s; 256 before 2026-12-02, a 10 ms sweep after which each call of "
                             "SmolLM2's projections at 16 and 64 rows took 50-190 us longer on a 2-core Zen 4 VM; 0: no "
                             "sweep, weights warm where they fit)")
    parser.add_argument("--evict-by", choices=EVICT_BY, default="read",
                        help="sweep the caches before each call by reading the buffer, as decode attention reads the KV "
                             "cache before a projection (default), or by writing it, which leaves dirty lines that the "
                             "weights' reads must first send back to memory (this benchmark's way before 2026-11-29)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and activations (default: %(default)s); bfloat16 times small_gemm_bfloat16 "
                             f"(AVX512-BF16; the engine sends it up to {cpu_ops.SMALL_GEMM_BFLOAT16_MAX_ROWS} rows) "
                             "against oneDNN's packed bfloat16 GEMM (AMX where the CPU has it)")
    parser.add_argument("--block-steps", nargs="+", type=int, metavar="STEPS",
                        help="float32 only: time small_gemm at each of these k-blocks, in 128-byte steps of a panel "
                             "(0: each panel whole, fetched 32 KB ahead; the default is 128, 192 on AMD CPUs with a 48 KB "
                             "L1, 0 on other AMD CPUs with AVX-512, 256 on other CPUs with AVX-512 and a 48 KB L1), "
                             "alternating, and print each one's GFLOP/s and its ratio to the first")
    parser.add_argument("--baseline", metavar="REVISION|FOLDER", default=None,
                        help="also time the small GEMM of this git revision's kernels (or of a folder of *.cpp and *.h "
                             "files), built beside this tree's with the same flags and alternated with it in this "
                             "process; each row adds its GFLOP/s, baseline/this-tree time and whether the outputs are "
                             "identical bit for bit (default: none)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if any(rows < 1 for rows in args.rows) or args.layers < 1 or args.repeats < 1:
        parser.error("--rows, --layers and --repeats must be positive")
    if args.block_steps and (dtype != torch.float32 or any(steps < 0 for steps in args.block_steps)):
        parser.error("--block-steps takes zero or positive step counts, and float32 only")
    if not cpu_ops.available(str(cache_dir())):
        print("The C++ CPU kernels could not be built here: nothing to time.", file=sys.stderr)
        return 1
    if dtype == torch.float32 and not cpu_ops.small_gemm_supported():
        print("small_gemm needs AVX-512, or AVX2 with FMA, which this build of the kernels lacks: the engine uses oneDNN for every batch here.",
              file=sys.stderr)
        return 1
    if dtype == torch.bfloat16 and not cpu_ops.small_gemm_bfloat16_supported():
        print("small_gemm_bfloat16 needs AVX512-BF16, which this CPU lacks: the engine uses oneDNN for every bfloat16 "
              "batch here.", file=sys.stderr)
        return 1
    label, baseline = baseline_of_arguments(parser, args.baseline)
    if baseline is not None:
        print(f"baseline: the kernels of {label}")
    print(f"{torch.get_num_threads()} threads, {args.dtype}, {args.layers} weights per shape, caches evicted before "
          f"each call by {'reading' if args.evict_by == 'read' else 'writing'} {args.evict_mb} MB; medians of {args.repeats}; small_gemm's k-block here: "
          f"{cpu_ops.default_small_gemm_block_steps()} steps")
    print(f"{'shape':>10} {'rows':>5} {'small ms':>9} {'oneDNN ms':>10} {'oneDNN/small':>13} {'small GFLOP/s':>14} "
          f"{'oneDNN GFLOP/s':>15} {'max diff':>9}")
    for in_features, out_features in args.shapes:
        for rows in args.rows:
            r = gemm_case(in_features, out_features, rows, args.layers, args.repeats, args.evict_mb, dtype=dtype,
                          block_steps=args.block_steps, baseline=baseline, evict_by=args.evict_by)
            blocks = "".join(f"  block {steps}: {gflops:.0f} GFLOP/s ({r['block_s'][args.block_steps[0]] / r['block_s'][steps]:.3f}x)"
                             for steps, gflops in r["block_gflops"].items())
            print(f"{r['shape']:>10} {r['rows']:5d} {r['small_s'] * 1e3:9.3f} {r['onednn_s'] * 1e3:10.3f} "
                  f"{r['onednn_s'] / r['small_s']:12.2f}x {r['small_gflops']:14.0f} {r['onednn_gflops']:15.0f} "
                  f"{r['difference']:9.1e}{blocks}{_against_baseline(r)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
