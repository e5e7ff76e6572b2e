"""Where the offline workload's time goes, against the GEMM ceiling measured in the same run.

The workload is ``offline_throughput.py``'s (same flags, same seeded prompts, greedy, EOS ignored). The engine
runs it ``--repeats`` times with a clock around each part of a step (the projections, the logits, prompt
and decode attention, the KV write, the fused element-wise kernels, building the step's inputs, sampling);
what no clock covers is the scheduler, the detokenizer and the rest of the engine's Python. Medians are
reported. The clocks cost a few microseconds per call, so their run is a little slower than a plain one; the
plain run's wall time is printed beside it.

The ceiling: each projection shape of the model timed alone through the same oneDNN packed GEMM at
``--ceiling-rows`` rows (best of several), as GFLOP/s; the workload's GEMM work (every row every projection
and the logits saw, counted during the run) at that rate is the time no engine on this machine can beat
with these kernels. Its ratio to the measured GEMM time is how close the GEMMs run to it; output tokens
over it is the throughput bound if everything else cost nothing. The projections' time and FLOPs are also
split by the GEMM each call ran in (decode-sized batches in the C++ small GEMM, prompt steps in oneDNN), each
with its own GFLOP/s. With ``--vllm-tok-s`` (vLLM's figure from
``offline_throughput.py --vllm-python`` on the same workload) the report says what 1.2x vLLM needs.

Usage::

    python benchmarks/time_breakdown.py
    python benchmarks/time_breakdown.py --repeats 3 --vllm-tok-s 73.3 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.offline_throughput import engine_kwargs, make_workload, resolve_model  # noqa: E402

TARGET_OVER_VLLM = 1.2

# Category of each clocked function, in report order; "projections" and "logits" are the GEMMs.
CATEGORIES = ("projections (GEMM)", "logits (GEMM)", "prompt attention", "decode attention", "KV write",
              "norms, rotary, SiLU", "rest of the forward", "step inputs", "sampling",
              "scheduler, detokenizer, engine Python")
GEMM_CATEGORIES = ("projections (GEMM)", "logits (GEMM)")


class Clocks:
    """Seconds per category, and GEMM FLOPs, accumulated by wrapped functions; for the projections, seconds and
    FLOPs per path too (:func:`projection_path`)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.gemm_flops = 0
        self.path_seconds: collections.Counter = collections.Counter()
        self.path_flops: collections.Counter = collections.Counter()

    def wrap(self, function, category: str, flops=None, path=None):
        @functools.wraps(function)
        def clocked(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[category] += elapsed
                if flops is not None:
                    counted = flops(*args, **kwargs)
                    self.gemm_flops += counted
                    if path is not None:
                        name = path(*args, **kwargs)
                        self.path_seconds[name] += elapsed
                        self.path_flops[name] += counted
        return clocked


def projection_path(module, x) -> str:
    """Which GEMM a projection of ``x`` runs in: the C++ small GEMM (decode-sized batches) or oneDNN's packed one."""
    if module.small_gemm_kernels is not None and x.shape[0] <= module.small_rows:
        return "decode-sized (C++ small GEMM)"
    return "prompt-sized (oneDNN)"


@contextlib.contextmanager
def clocked_engine(clocks: Clocks):
    """Wrap the engine's parts in ``clocks`` (restored on exit)."""
    from splitserve.engine import attention, model_runner
    from splitserve.engine.models import llama
    from splitserve.engine.models.packed_linear import PackedLinear
    from splitserve.kernels import cpu_ops

    def linear_flops(module, x):
        return 2 * x.shape[0] * module.in_features * module.out_features

    def logits_flops(model, hidden):
        return 2 * hidden.shape[0] * hidden.shape[1] * model.config.vocab_size

    patches = [
        (PackedLinear, "forward", "projections (GEMM)", linear_flops, projection_path),
        (llama.LlamaForCausalLM, "compute_logits", "logits (GEMM)", logits_flops, None),
        (attention, "prefill_attention", "prompt attention", None, None),
        (cpu_ops, "paged_prefill_attention", "prompt attention", None, None),
        (cpu_ops, "paged_decode_attention", "decode attention", None, None),
        (cpu_ops, "write_kv_", "KV write", None, None),
        (cpu_ops, "rms_norm", "norms, rotary, SiLU", None, None),
        (cpu_ops, "add_rms_norm", "norms, rotary, SiLU", None, None),
        (cpu_ops, "rotary_", "norms, rotary, SiLU", None, None),
        (cpu_ops, "silu_and_mul", "norms, rotary, SiLU", None, None),
        (llama.LlamaForCausalLM, "forward", "forward", None, None),
        (model_runner.ModelRunner, "_prepare", "step inputs", None, None),
        (model_runner.Sampler, "__call__", "sampling", None, None),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, *_ in patches]
    for owner, name, category, flops, path in patches:
        setattr(owner, name, clocks.wrap(getattr(owner, name), category, flops, path))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def breakdown(clocks: Clocks, wall: float) -> dict[str, float]:
    """Seconds per reported category: the forward's own rest and the engine's rest are what no clock covered."""
    seconds = dict(clocks.seconds)
    inner = sum(seconds.get(c, 0.0) for c in CATEGORIES[:6] if c != "logits (GEMM)")  # compute_logits is outside
    result = {category: seconds.get(category, 0.0) for category in CATEGORIES[:6]}
    result["rest of the forward"] = max(0.0, seconds.get("forward", 0.0) - inner)
    result["step inputs"] = seconds.get("step inputs", 0.0)
    result["sampling"] = seconds.get("sampling", 0.0)
    covered = seconds.get("forward", 0.0) + sum(seconds.get(c, 0.0) for c in ("logits (GEMM)", "step inputs",
                                                                               "sampling"))
    result["scheduler, detokenizer, engine Python"] = max(0.0, wall - covered)
    return result


def median_paths(paths: list[dict[str, tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Per projection path, the median seconds and GFLOP over the clocked runs (a path a run never took counts 0)."""
    names = sorted({name for run in paths for name in run})
    return {name: {"seconds": statistics.median(run.get(name, (0.0, 0.0))[0] for run in paths),
                   "gflop": statistics.median(run.get(name, (0.0, 0.0))[1] for run in paths) / 1e9}
            for name in names}


def measure_gemm_ceiling(llm, rows: int, repeats: int = 7) -> dict[str, float]:
    """GFLOP/s of each distinct projection shape of the model through oneDNN's packed GEMM at ``rows`` rows
    (best of ``repeats``), and of the logits."""
    from splitserve.engine.models.packed_linear import PackedLinear

    model, dtype = llm.engine.model_runner.model, llm.engine.model_runner.dtype
    rates: dict[str, float] = {}
    shapes = {(m.in_features, m.out_features): m for m in model.modules() if isinstance(m, PackedLinear)}
    with torch.inference_mode():
        for (n_in, n_out), module in sorted(shapes.items()):
            x = torch.randn(rows, n_in, dtype=dtype)
            rates[f"{n_in}x{n_out}"] = _best_rate(functools.partial(module, x), 2 * rows * n_in * n_out, repeats)
        hidden = torch.randn(rows, model.config.hidden_size, dtype=dtype)
        rates["logits"] = _best_rate(functools.partial(model.compute_logits, hidden),
                                     2 * rows * model.config.hidden_size * model.config.vocab_size, repeats)
    return rates


def _best_rate(run, flops: int, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Where splitserve's offline workload (offline_throughput.py's) spends its time, part by part, "
        "against the GEMM ceiling measured in the same run, and what 1.2x vLLM's throughput would need.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: the converted "
                        "default model)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    parser.add_argument("--min-prompt", type=int, default=64, help="shortest prompt, in tokens")
    parser.add_argument("--max-prompt", type=int, default=512, help="longest prompt, in tokens")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt generator")
    parser.add_argument("--repeats", type=int, default=3, help="clocked runs (and plain runs); medians reported")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine limit (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine step budget (default: "
                        "the engine's)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="as offline_throughput.py (off)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's dtype (weights, activations, KV cache); the ceiling is timed in it too")
    parser.add_argument("--ceiling-rows", type=int, default=512, help="rows of the GEMMs timed for the ceiling")
    parser.add_argument("--vllm-tok-s", type=float, default=None,
                        help="vLLM-CPU's output tok/s on this workload (from offline_throughput.py --vllm-python)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the numbers to this JSON file")
    args = parser.parse_args(argv)
    # offline_throughput's workload fields this benchmark does not use
    args.latency_prompt_len, args.latency_output_len = 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from splitserve import LLM, SamplingParams

    model_path = resolve_model(args.model)
    llm = LLM(model=model_path, dtype=args.dtype, **engine_kwargs(args))
    if not llm.engine.model_runner.use_cpu_kernel:
        print("The C++ kernels are not in use here (they did not build): the breakdown would not be the engine's "
              "usual one.", file=sys.stderr)
        return 1
    workload = make_workload(args, llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)

    plain, clocked, parts, flops, paths = [], [], [], [], []
    for repeat in range(args.repeats):
        print(f"run {repeat + 1}/{args.repeats}: plain, then clocked", file=sys.stderr, flush=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=True)
        plain.append(time.perf_counter() - start)
        clocks = Clocks()
        with clocked_engine(clocks):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=True)
            wall = time.perf_counter() - start
        clocked.append(wall)
        parts.append(breakdown(clocks, wall))
        flops.append(clocks.gemm_flops)
        paths.append({name: (clocks.path_seconds[name], clocks.path_flops[name]) for name in clocks.path_seconds})
    print("measuring the GEMM ceiling", file=sys.stderr, flush=True)
    rates = measure_gemm_ceiling(llm, args.ceiling_rows)

    output_tokens = args.num_requests * args.output_len
    wall = statistics.median(clocked)
    median_parts = {c: statistics.median(p[c] for p in parts) for c in CATEGORIES}
    gemm_seconds = sum(median_parts[c] for c in GEMM_CATEGORIES)
    gemm_flops = statistics.median(flops)
    projection_rate = statistics.median(rate for name, rate in rates.items() if name != "logits")
    ceiling_seconds = gemm_flops / (max(rates.values()) * 1e9)
    report = {
        "workload": {"requests": args.num_requests, "prompt_tokens": sum(map(len, workload.prompts)),
                     "output_tokens": output_tokens},
        "plain_seconds": plain, "clocked_seconds": clocked, "parts_seconds": median_parts,
        "gemm_gflop": gemm_flops / 1e9, "gemm_ceiling_gflops": rates, "gemm_ceiling_seconds": ceiling_seconds,
        "projection_paths": median_paths(paths),
        "torch_threads": torch.get_num_threads(),
    }

    print(f"\nWorkload ({args.dtype}): {args.num_requests} requests, {report['workload']['prompt_tokens']:,} prompt tokens, "
          f"{output_tokens:,} output tokens; {torch.get_num_threads()} threads; medians of {args.repeats} runs.")
    print(f"Plain run: {statistics.median(plain):.2f} s ({output_tokens / statistics.median(plain):.1f} output "
          f"tok/s); clocked run: {wall:.2f} s.\n")
    print(f"{'part':<40}{'seconds':>9}{'share':>8}")
    for category in CATEGORIES:
        print(f"{category:<40}{median_parts[category]:>9.2f}{median_parts[category] / wall:>8.1%}")
    print(f"\nGEMM ceiling (oneDNN packed, {args.ceiling_rows} rows, best of 7): "
          + ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items()) + " GFLOP/s")
    print(f"The workload's GEMMs: {gemm_flops / 1e9:,.0f} GFLOP in {gemm_seconds:.2f} s "
          f"({gemm_flops / gemm_seconds / 1e9:.0f} GFLOP/s, {ceiling_seconds / gemm_seconds:.0%} of the ceiling; "
          f"projections alone peak at {projection_rate:.0f}). At the ceiling they take {ceiling_seconds:.2f} s: "
          f"with nothing else, {output_tokens / ceiling_seconds:.1f} output tok/s at most.")
    for name, path in report["projection_paths"].items():
        if path["seconds"] > 0:
            print(f"  projections, {name}: {path['gflop']:,.0f} GFLOP in {path['seconds']:.2f} s "
                  f"({path['gflop'] / path['seconds']:.0f} GFLOP/s)")
    non_gemm = wall - gemm_seconds
    print(f"Everything but the GEMMs: {non_gemm:.2f} s, {non_gemm / wall:.0%} of the run.")
    if args.vllm_tok_s:
        needed = output_tokens / (TARGET_OVER_VLLM * args.vllm_tok_s)
        report["needed_seconds_for_target"] = needed
        print(f"{TARGET_OVER_VLLM}x vLLM ({args.vllm_tok_s} tok/s) needs {needed:.2f} s for the workload: "
              f"{'below' if needed < ceiling_seconds else 'above'} the GEMM ceiling ({ceiling_seconds:.2f} s); the "
              f"non-GEMM parts would have to fit in {max(0.0, needed - gemm_seconds):.2f} s at today's GEMM speed "
              f"(they take {non_gemm:.2f}).")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
