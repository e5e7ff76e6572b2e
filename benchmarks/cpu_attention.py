"""The C++ CPU attention kernels against their torch references, timed in the same run.

Prefill: ``splitserve/kernels/cpu_prefill_attention.cpp`` (all of a step's prompt chunks in one call, keys and
values read from the paged cache in place) against the torch backend's ``prefill_attention`` (SDPA
per chunk; a chunk with cached context first gathers its blocks and builds a mask). Decode:
``splitserve/kernels/cpu_paged_attention.cpp`` against ``decode_attention`` (gathered blocks, two batched matmuls).
Each case runs all the model's layers, alternating kernel and reference, and prints medians, the
reference/kernel ratio (above 1: the kernel is faster), the kernel's rate (GFLOP/s for prefill, the
causal FLOPs only; GB/s of KV read for decode) and the largest difference between the two outputs. Where
a kernel runs in AMX tiles (a bfloat16 cache on an AMX CPU), its AVX-512 path is timed in the same runs too,
and the two are compared after the table. The decode kernel is also timed fetching ahead into the cache level
this CPU's default does not use (L2 where L1 holds 48 KB or more, else L1), and compared after the table.
With ``--baseline REVISION`` (or a folder of kernel sources), that revision's kernels are built beside this
tree's and every case times both in this process, alternating (kernel_baseline.py says why), and compares
their outputs bit for bit.

    python benchmarks/cpu_attention.py                      # SmolLM2-135M's shape, default cases
    python benchmarks/cpu_attention.py --prefill 0:2048 --prefill 1024:512 0:64 --decode 64x320 --repeats 9
    python benchmarks/cpu_attention.py --dtype bfloat16    # a bfloat16 cache (and torch in bfloat16)
    python benchmarks/cpu_attention.py --prefill 0:512 --decode 64x320 --baseline HEAD~3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as splitserve
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.kernel_baseline import baseline_of_arguments  # noqa: E402
from splitserve.common.model_info import cache_dir
from splitserve.engine.attention import (
    DecodeGroup,
    PrefillBatch,
    PrefillSpan,
    decode_attention,
    prefill_attention,
    write_kv,
)
from splitserve.engine.model_runner import allocate_kv_cache
from splitserve.kernels import cpu_ops


@dataclass
class Shape:
    layers: int = 30
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32


def _parse_chunks(text: str) -> tuple[int, int]:
    context, _, length = text.partition(":")
    return int(context), int(length)


def _parse_decode(text: str) -> tuple[int, int]:
    requests, _, context = text.partition("x")
    return int(requests), int(context)


def _layer_caches(shape: Shape, num_blocks: int, generator: torch.Generator):
    """Per layer, key and value views [kv_heads, blocks, block_size, head_dim] of one block-major cache,
    allocated as the engine allocates it (huge pages on Linux) and filled with normal noise."""
    cache = allocate_kv_cache((num_blocks, shape.layers, 2, shape.kv_heads, shape.block_size, shape.head_dim),
                              shape.dtype)
    cache.normal_(generator=generator)
    return [cache[:, layer].permute(1, 2, 0, 3, 4) for layer in range(shape.layers)]


def _median_times(functions: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions alternating within every repeat (after a warm-up run)."""
    for function in functions.values():  # warm-up (and first touches)
        function()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _against_baseline(kernel, baseline) -> dict:
    """How the kernel's outputs (one per layer) compare with the baseline build's on the same inputs: the largest
    difference, and whether they are identical bit for bit."""
    if baseline is None:
        return {}
    ours = kernel()
    with cpu_ops.kernels_from(baseline):
        theirs = kernel()
    return {"baseline_difference": max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs)),
            "baseline_identical": all(torch.equal(a, b) for a, b in zip(ours, theirs))}


def prefill_case(shape: Shape, chunks: list[tuple[int, int]], repeats: int, seed: int = 0, baseline=None) -> dict:
    """One step of prompt chunks ``(context, length)`` through every layer."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_chunk = [-(-(context + length) // shape.block_size) for context, length in chunks]
    layers = _layer_caches(shape, sum(blocks_per_chunk), generator)
    permutation = torch.randperm(sum(blocks_per_chunk), generator=generator)
    spans, row, used = [], 0, 0
    for (context, length), count in zip(chunks, blocks_per_chunk):
        spans.append(PrefillSpan(row, row + length, context, permutation[used:used + count].clone()))
        row, used = row + length, used + count
    query = torch.randn(row, shape.q_heads, shape.head_dim, generator=generator).to(shape.dtype)
    key = torch.randn(row, shape.kv_heads, shape.head_dim, generator=generator).to(shape.dtype)
    value = torch.randn(row, shape.kv_heads, shape.head_dim, generator=generator).to(shape.dtype)
    for span in spans:  # the chunks' own K/V are in the cache before attention, as the engine writes them
        positions = torch.arange(span.num_context_tokens, span.num_context_tokens + span.query_end - span.query_start)
        slots = span.block_table[positions // shape.block_size] * shape.block_size + positions % shape.block_size
        for key_cache, value_cache in layers:
            write_kv(key_cache, value_cache, key[span.query_start:span.query_end],
                     value[span.query_start:span.query_end], slots)
    batch = PrefillBatch.from_spans(spans)
    scale = shape.head_dim**-0.5

    def kernel():
        return [cpu_ops.paged_prefill_attention(query, k, v, batch.query_start_loc, batch.context_lens,
                                                batch.block_tables, scale) for k, v in layers]

    def reference():
        return [torch.cat([prefill_attention(query[s.query_start:s.query_end], key[s.query_start:s.query_end],
                                             value[s.query_start:s.query_end], k, v, s, scale) for s in spans])
                for k, v in layers]

    difference = (kernel()[0].float() - reference()[0].float()).abs().max().item()
    compared = _against_baseline(kernel, baseline)
    times = _times_with_avx512(kernel, reference, repeats, shape.dtype == torch.bfloat16
                               and cpu_ops.prefills_in_amx(shape.head_dim, shape.block_size), baseline=baseline)
    # Causal FLOPs: each query token against its visible keys, QK^T and PV, every query head and layer.
    visible = sum(length * context + length * (length + 1) / 2 for context, length in chunks)
    flops = 4 * visible * shape.head_dim * shape.q_heads * shape.layers
    label = " ".join(f"{context}:{length}" for context, length in chunks)
    return {"kind": "prefill", "case": label, **times, "rate": flops / times["kernel_s"] / 1e9, "unit": "GFLOP/s",
            "difference": difference, **compared}


def _times_with_avx512(kernel, reference, repeats: int, in_tiles: bool, other_prefetch: bool = False,
                       baseline=None) -> dict:
    """kernel_s and reference_s, medians of alternating runs; where the kernel runs in AMX tiles (a bfloat16 cache
    on an AMX CPU), avx512_s too: the same kernel with AMX turned off, as a second baseline in the same runs. With
    ``other_prefetch`` (decode cases), other_prefetch_s too: the kernel fetching ahead into the cache level this
    CPU's default does not use (L2 where it is L1, and the other way round)."""
    functions = {"kernel": kernel, "reference": reference}
    if in_tiles:
        def vectors():
            with cpu_ops.amx_disabled():
                return kernel()

        functions["avx512"] = vectors
    if other_prefetch:
        other_level = 3 - cpu_ops.decode_prefetch_level()

        def other():
            with cpu_ops.decode_prefetch_into(other_level):
                return kernel()

        functions["other_prefetch"] = other
    if baseline is not None:
        def of_baseline():
            with cpu_ops.kernels_from(baseline):
                return kernel()

        functions["baseline"] = of_baseline
    times = _median_times(functions, repeats)
    return {f"{name}_s": seconds for name, seconds in times.items()}


def decode_case(shape: Shape, requests: int, context: int, repeats: int, seed: int = 0, baseline=None) -> dict:
    """One decode step of ``requests`` requests of ``context`` tokens through every layer."""
    generator = torch.Generator().manual_seed(seed)
    per_request = -(-context // shape.block_size)
    layers = _layer_caches(shape, requests * per_request, generator)
    tables = torch.randperm(requests * per_request, generator=generator).view(requests, per_request).contiguous()
    seq_lens = torch.full((requests,), context, dtype=torch.int64)
    query = torch.randn(requests, shape.q_heads, shape.head_dim, generator=generator).to(shape.dtype)
    padding = torch.arange(per_request * shape.block_size).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = padding.unsqueeze(0).expand(shape.kv_heads, -1, -1).reshape(shape.kv_heads * requests, 1, -1)
    group = DecodeGroup(0, requests, tables, seq_lens, mask)
    scale = shape.head_dim**-0.5

    def kernel():
        return [cpu_ops.paged_decode_attention(query, k, v, tables, seq_lens, scale) for k, v in layers]

    def reference():
        return [decode_attention(query, k, v, group, scale) for k, v in layers]

    difference = (kernel()[0].float() - reference()[0].float()).abs().max().item()
    element_size = torch.empty((), dtype=shape.dtype).element_size()
    kv_bytes = 2 * requests * context * shape.kv_heads * shape.head_dim * element_size * shape.layers
    compared = _against_baseline(kernel, baseline)
    times = _times_with_avx512(kernel, reference, repeats, shape.dtype == torch.bfloat16 and cpu_ops.decodes_in_amx(
        shape.head_dim, shape.block_size, shape.q_heads // shape.kv_heads), other_prefetch=True, baseline=baseline)
    return {"kind": "decode", "case": f"{requests}x{context}", **times, "rate": kv_bytes / times["kernel_s"] / 1e9,
            "unit": "GB/s", "difference": difference, **compared}


def run(args, baseline=None) -> list[dict]:
    """Every case of ``args``, in order: the prefill cases, then the decode cases; each timed against ``baseline``
    (a module from kernel_baseline.load_baseline) too where one is given."""
    shape = Shape(args.layers, args.q_heads, args.kv_heads, args.head_dim, args.block_size, getattr(torch, args.dtype))
    prefill_cases = args.prefill or [[(0, 512), (0, 300), (200, 100)], [(0, 2048)], [(1536, 512)]]
    results = [prefill_case(shape, chunks, args.repeats, baseline=baseline) for chunks in prefill_cases]
    return results + [decode_case(shape, requests, context, args.repeats, baseline=baseline)
                      for requests, context in args.decode or []]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", nargs="+", type=_parse_chunks, action="append", metavar="CONTEXT:LENGTH",
                        help="one prefill case: its step's prompt chunks, each as tokens already cached:new tokens; "
                             "repeat the flag for more cases (default: 0:512 0:300 200:100, then 0:2048, "
                             "then 1536:512)")
    parser.add_argument("--decode", nargs="*", type=_parse_decode, metavar="REQUESTSxCONTEXT",
                        default=[(64, 320), (8, 2048)], help="decode cases, each requests x context tokens; "
                                                             "the flag alone: none (default: 64x320 8x2048)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each side, alternating; medians (default: 5)")
    parser.add_argument("--layers", type=int, default=30, help="layers per run (default: 30, as SmolLM2-135M)")
    parser.add_argument("--q-heads", type=int, default=9, help="query heads (default: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default: 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head size; the prefill kernel takes multiples of 64 (default: 64)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the cache, queries and the torch reference's arithmetic (default: %(default)s); the "
                             "kernels accumulate in float32 either way (in bfloat16 on an AMX CPU, both kernels run in "
                             "AMX tiles and their AVX-512 paths are timed beside them)")
    parser.add_argument("--baseline", metavar="REVISION|FOLDER", default=None,
                        help="also time the kernels of this git revision (or of a folder of *.cpp and *.h files), "
                             "built beside this tree's with the same flags and alternated with them in this process; "
                             "after the table, each case's baseline/this-tree ratio and whether the outputs are "
                             "identical bit for bit (default: none)")
    args = parser.parse_args(argv)
    if not cpu_ops.prefill_supports(args.head_dim):
        parser.error(f"--head-dim {args.head_dim}: the C++ prefill kernel takes multiples of 64")
    if not cpu_ops.available(str(cache_dir())):
        print("The C++ CPU kernels could not be built here: nothing to time.", file=sys.stderr)
        return 1
    label, baseline = baseline_of_arguments(parser, args.baseline)
    results = run(args, baseline)
    print(f"{torch.get_num_threads()} threads, {args.layers} layers, {args.q_heads}/{args.kv_heads} heads, "
          f"head_dim {args.head_dim}, blocks of {args.block_size}, {args.dtype}; medians of {args.repeats}")
    print(f"{'kind':8} {'case':28} {'kernel ms':>10} {'torch ms':>10} {'torch/kernel':>13} {'kernel rate':>16} "
          f"{'max diff':>9}")
    for r in results:
        print(f"{r['kind']:8} {r['case']:28} {r['kernel_s'] * 1e3:10.2f} {r['reference_s'] * 1e3:10.2f} "
              f"{r['reference_s'] / r['kernel_s']:12.2f}x {r['rate']:10.1f} {r['unit']:>5} {r['difference']:9.1e}")
    in_tiles = [r for r in results if "avx512_s" in r]
    if in_tiles:
        print("The kernels ran in AMX tiles (a bfloat16 cache on an AMX CPU); their AVX-512 paths in the same runs:")
        for r in in_tiles:
            print(f"  {r['kind']} {r['case']}: AVX-512 {r['avx512_s'] * 1e3:.2f} ms, AMX {r['kernel_s'] * 1e3:.2f} ms, "
                  f"AVX-512/AMX {r['avx512_s'] / r['kernel_s']:.2f}x")
    fetched = [r for r in results if "other_prefetch_s" in r]
    if fetched:
        level = cpu_ops.decode_prefetch_level()
        print(f"Decode attention fetched each chunk's successor into L{level} (this CPU's default); into "
              f"L{3 - level} in the same runs:")
        for r in fetched:
            print(f"  decode {r['case']}: L{3 - level} {r['other_prefetch_s'] * 1e3:.2f} ms, L{level} "
                  f"{r['kernel_s'] * 1e3:.2f} ms, L{3 - level}/L{level} {r['other_prefetch_s'] / r['kernel_s']:.2f}x")
    if baseline is not None:
        print(f"Against the kernels of {label}, in the same runs:")
        for r in results:
            agreement = ("outputs identical bit for bit" if r["baseline_identical"]
                         else f"outputs differ by at most {r['baseline_difference']:.1e}")
            print(f"  {r['kind']} {r['case']}: baseline {r['baseline_s'] * 1e3:.2f} ms, this tree "
                  f"{r['kernel_s'] * 1e3:.2f} ms, baseline/this {r['baseline_s'] / r['kernel_s']:.3f}x, {agreement}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
