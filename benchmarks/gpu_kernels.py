"""Triton kernels against the GPU's peak memory bandwidth and their torch references, in the same run.

Kernels: the element-wise ones of ``splitserve/kernels/triton_ops.py`` (``rms_norm``, ``add_rms_norm``, ``rotary_``,
``silu_and_mul``), the KV block copies (``gather_blocks``, ``scatter_blocks``, ``copy_blocks``), and those of
``splitserve/kernels/triton_attention.py`` (``store_kv``, ``paged_decode_attention``, ``paged_prefill_attention``);
a kernel not there yet is skipped with a sentence.

Shapes are the default model's (SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 query heads, 3 KV
heads, head size 64, block 16) or, with ``--model llama-3-8b``, Llama-3-8B's, with the KV cache block-major
``[num_blocks, layers, 2, kv_heads, block_size, head_dim]`` as the engine allocates it (attention reads one
layer's strided view). Element-wise kernels run over ``--tokens`` rows; attention over ``--batch-sizes`` x
``--contexts`` (decode) and ``--prefill-batch-sizes`` x ``--contexts`` (chunks of ``--prefill-chunk`` new
tokens after the rest of the context, cached); block copies over one request's blocks of every layer for each
context.

Each kernel is judged by the bytes it must move (each input read once, each output written once) over its
time: on CUDA, the median of ``--repeats`` runs timed by CUDA events, the L2 cache flushed before each, its
kernels replayed from a CUDA graph (``--timing graph``, the default: the GPU's time without Python's launch
overhead; ``--timing eager`` includes it), against the GPU's peak (``--peak-gbps``, or a table by device name)
and against the torch reference (``engine/attention.py``, ``engine/models/``,
``index_select``/``index_copy_``) timed the same way; the largest difference from the reference (relative to
the reference's largest value) is printed beside. Target: paged decode attention at 70% of peak or more for
contexts of 4k tokens and more.

Without a CUDA GPU it says so and prints the bytes each kernel must move per shape, and the time they
take at the peak of ``--peak-gbps`` (default an H100 SXM's 3.35 TB/s): the model a GPU run is judged by.
Then it compiles every kernel for the GPU of ``--compile-for`` (default an H100; Triton's compiler and
NVIDIA's ptxas come with the triton wheel, see ``splitserve.kernels.triton_aot``) and prints what each
would cost an SM: registers, spills, shared memory, programs resident per SM, share of 16-byte loads.
``--interpret`` instead runs each kernel once on tiny shapes through Triton's CPU interpreter against its
reference (a check that it runs, not a timing).

Usage::

    python benchmarks/gpu_kernels.py                          # on a GPU: every kernel, every shape
    python benchmarks/gpu_kernels.py --kernels paged_decode_attention --contexts 4096 16384 --batch-sizes 16 64
    python benchmarks/gpu_kernels.py --dtype float32 --repeats 50 --json kernels.json
    python benchmarks/gpu_kernels.py --interpret              # on CPU: the bytes table, and a run on tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

# GPU peak memory bandwidth in GB/s by a piece of torch.cuda.get_device_name(), most specific first.
PEAK_BANDWIDTH_GBPS = (
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("GH200", 4000.0),
    ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("L4", 300.0), ("A10", 600.0), ("RTX 4090", 1008.0),
)
H100_SXM_GBPS = 3350.0
ELEMENTWISE = ("rms_norm", "add_rms_norm", "rotary_", "silu_and_mul", "store_kv")
BLOCK_COPIES = ("gather_blocks", "scatter_blocks", "copy_blocks")
ATTENTION = ("paged_decode_attention", "paged_prefill_attention")
ALL_KERNELS = ELEMENTWISE + BLOCK_COPIES + ATTENTION
ATTENTION_MODULE = "splitserve.kernels.triton_attention"
DECODE_TARGET = 0.70  # of peak bandwidth, contexts >= 4096


@dataclass(frozen=True)
class ModelShape:
    layers: int = 30
    hidden: int = 576
    intermediate: int = 1536
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


# --model: the default model's shape, and Llama-3-8B's (GQA 4, head size 128: 5.3 times the KV bytes per token).
MODEL_SHAPES = {
    "smollm2-135m": ModelShape(),
    "llama-3-8b": ModelShape(layers=32, hidden=4096, intermediate=14336, q_heads=32, kv_heads=8, head_dim=128),
}


@dataclass
class Case:
    """One kernel at one shape: what it must move, and (built on demand) how to run it and its reference."""

    kernel: str
    shape: str
    num_bytes: int
    flops: int
    # build(device, dtype) -> (run the kernel, run the reference, the largest difference of their outputs)
    build: Callable | None = None
    context: int = 0


# ---- shapes and the bytes each kernel must move ------------------------------------------------------


def cases(args, model: ModelShape, element_size: int) -> list[Case]:
    e, m = element_size, model
    qkv_width = (m.q_heads + 2 * m.kv_heads) * m.head_dim
    block_bytes = m.layers * 2 * m.kv_heads * m.block_size * m.head_dim * e
    rows: list[Case] = []
    for tokens in args.tokens:
        rows += [
            Case("rms_norm", f"tokens={tokens}", 2 * tokens * m.hidden * e + m.hidden * e, 0,
                 lambda d, t, n=tokens: _build_rms_norm(m, n, d, t, residual=False)),
            Case("add_rms_norm", f"tokens={tokens}", 4 * tokens * m.hidden * e + m.hidden * e, 0,
                 lambda d, t, n=tokens: _build_rms_norm(m, n, d, t, residual=True)),
            Case("rotary_", f"tokens={tokens}",
                 2 * tokens * (m.q_heads + m.kv_heads) * m.head_dim * e + 2 * tokens * m.head_dim * e, 0,
                 lambda d, t, n=tokens: _build_rotary(m, n, qkv_width, d, t)),
            Case("silu_and_mul", f"tokens={tokens}", 3 * tokens * m.intermediate * e, 0,
                 lambda d, t, n=tokens: _build_silu(m, n, d, t)),
            Case("store_kv", f"tokens={tokens}", 4 * tokens * m.kv_heads * m.head_dim * e + 8 * tokens, 0,
                 lambda d, t, n=tokens: _build_store_kv(m, n, d, t)),
        ]
    for context in args.contexts:
        num_blocks = -(-context // m.block_size)
        for name in BLOCK_COPIES:
            rows.append(Case(name, f"context={context} ({num_blocks} blocks, {m.layers} layers)",
                             2 * num_blocks * block_bytes, 0,
                             lambda d, t, c=context, k=name: _build_block_copy(m, c, k, d, t), context))
    for batch in args.batch_sizes:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * m.kv_heads * m.head_dim * e
            table_bytes = 8 * batch * (-(-context // m.block_size)) + 8 * batch
            rows.append(Case("paged_decode_attention", f"batch={batch} context={context}",
                             kv_bytes + 2 * batch * m.q_heads * m.head_dim * e + table_bytes,
                             4 * batch * m.q_heads * context * m.head_dim,
                             lambda d, t, b=batch, c=context: _build_decode(m, b, c, args, d, t), context))
    for batch in args.prefill_batch_sizes:
        for context in args.contexts:
            chunk = min(args.prefill_chunk, context)
            cached = context - chunk
            new_bytes = batch * chunk * (2 * m.q_heads + 2 * m.kv_heads) * m.head_dim * e
            pairs = chunk * cached + chunk * (chunk + 1) // 2  # (query, key) pairs attended, causal
            for tiles in args.prefill_tiles or [None]:
                for splits in args.prefill_splits or [None]:
                    label = (f" tiles {format_tiles(tiles)}" if tiles else "") + (f" splits {splits}" if splits else "")
                    rows.append(Case("paged_prefill_attention",
                                     f"batch={batch} context={context} (chunk {chunk}){label}",
                                     new_bytes + 2 * batch * cached * m.kv_heads * m.head_dim * e,
                                     4 * batch * m.q_heads * pairs * m.head_dim,
                                     lambda d, t, b=batch, c=context, n=chunk, x=tiles, k=splits: _build_prefill(
                                         m, b, c, n, d, t, tiles=x, num_splits=k),
                                     context))
    return [case for case in rows if case.kernel in args.kernels]


# ---- each kernel and its reference on real tensors ---------------------------------------------------


def _ops():
    from splitserve.kernels import triton_ops

    return triton_ops


def _attention_function(name: str):
    """The function ``name`` of splitserve/kernels/triton_attention.py, or a sentence saying why it cannot run."""
    try:
        module = importlib.import_module(ATTENTION_MODULE)
    except ImportError as error:
        return f"splitserve/kernels/triton_attention.py cannot be imported yet ({error})"
    function = getattr(module, name, None)
    return function if function is not None else f"splitserve/kernels/triton_attention.py has no {name} yet"


def _difference(actual, expected) -> float:
    """The largest difference, relative to the largest reference value (or absolute below 1)."""
    if not actual.numel():
        return 0.0
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1)).item()


def _build_rms_norm(m, tokens, device, dtype, residual: bool):
    import torch

    from splitserve.engine.models.rms_norm import RMSNorm

    ops = _ops()
    norm = RMSNorm(m.hidden, 1e-5).to(device=device, dtype=dtype)
    norm.weight.normal_()
    x = torch.randn(tokens, m.hidden, device=device, dtype=dtype)
    stream = torch.randn(tokens, m.hidden, device=device, dtype=dtype)
    if not residual:
        return (lambda: ops.rms_norm(x, norm.weight, 1e-5)), (lambda: norm(x)), \
            lambda: _difference(ops.rms_norm(x, norm.weight, 1e-5), norm(x))
    # The kernel adds into the stream on every run; the values stay finite (normal noise adds up slowly).
    check_stream = stream.clone()
    return (lambda: ops.add_rms_norm(x, stream, norm.weight, 1e-5)), (lambda: norm(x, stream)), \
        lambda: _difference(norm(x, check_stream)[0], ops.add_rms_norm(x, check_stream, norm.weight, 1e-5))


def _build_rotary(m, tokens, qkv_width, device, dtype):
    import torch

    from splitserve.engine.models.rotary_embedding import apply_rotary

    ops = _ops()
    qkv = torch.randn(tokens, qkv_width, device=device, dtype=dtype)
    query_key = qkv[:, : (m.q_heads + m.kv_heads) * m.head_dim].view(tokens, m.q_heads + m.kv_heads, m.head_dim)
    angles = torch.rand(tokens, m.head_dim // 2, device=device) * 6.28
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)

    def check():
        start = query_key.clone()
        expected = apply_rotary(start, cos.unsqueeze(1), sin.unsqueeze(1))
        ops.rotary_(start, cos, sin)
        return _difference(start, expected)

    return (lambda: ops.rotary_(query_key, cos, sin)), \
        (lambda: query_key.copy_(apply_rotary(query_key, cos.unsqueeze(1), sin.unsqueeze(1)))), check


def _build_silu(m, tokens, device, dtype):
    import torch
    import torch.nn.functional as F

    ops = _ops()
    gate_up = torch.randn(tokens, 2 * m.intermediate, device=device, dtype=dtype)

    def reference():
        gate, up = gate_up.split(m.intermediate, dim=-1)
        return F.silu(gate) * up

    return (lambda: ops.silu_and_mul(gate_up)), reference, lambda: _difference(ops.silu_and_mul(gate_up), reference())


def _layer_caches(m, num_blocks, device, dtype, layers=None):
    """A block-major cache and layer 0's key and value views [kv_heads, num_blocks, block_size, head_dim]."""
    import torch

    cache = torch.randn(num_blocks, layers or m.layers, 2, m.kv_heads, m.block_size, m.head_dim, device=device,
                        dtype=dtype)
    layer = cache[:, 0].permute(1, 2, 0, 3, 4)
    return cache, layer[0], layer[1]


def _build_store_kv(m, tokens, device, dtype):
    import torch

    from splitserve.engine.attention import write_kv

    store_kv = _attention_function("store_kv")
    if isinstance(store_kv, str):
        return store_kv
    num_blocks = -(-tokens // m.block_size) * 2
    _, key_cache, value_cache = _layer_caches(m, num_blocks, device, dtype)
    _, ref_keys, ref_values = _layer_caches(m, num_blocks, device, dtype)
    key = torch.randn(tokens, m.kv_heads, m.head_dim, device=device, dtype=dtype)
    value = torch.randn(tokens, m.kv_heads, m.head_dim, device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * m.block_size, device=device)[:tokens]

    def check():
        store_kv(key_cache, value_cache, key, value, slots)
        write_kv(ref_keys, ref_values, key, value, slots)
        blocks, offsets = slots // m.block_size, slots % m.block_size
        return max(_difference(key_cache[:, blocks, offsets], ref_keys[:, blocks, offsets]),
                   _difference(value_cache[:, blocks, offsets], ref_values[:, blocks, offsets]))

    return (lambda: store_kv(key_cache, value_cache, key, value, slots)), \
        (lambda: write_kv(ref_keys, ref_values, key, value, slots)), check


def _build_block_copy(m, context, kind: str, device, dtype):
    """gather_blocks (cache -> buffer), scatter_blocks (buffer -> cache) or copy_blocks (one cache's blocks into
    another's: a p2p pair on one GPU), each against its torch reference."""
    import torch

    ops = _ops()
    num_blocks = -(-context // m.block_size)
    cache, _, _ = _layer_caches(m, 2 * num_blocks, device, dtype)
    block_ids = torch.randperm(2 * num_blocks)[:num_blocks].tolist()  # shuffled, as a transfer's are
    ids_on_device = torch.tensor(block_ids, device=device)
    buffer = torch.randn((num_blocks, *cache.shape[1:]), device=device).to(dtype)
    if kind == "gather_blocks":
        return (lambda: ops.gather_blocks(cache, block_ids)), \
            (lambda: cache.index_select(0, torch.tensor(block_ids).to(device))), \
            lambda: float(not torch.equal(ops.gather_blocks(cache, block_ids).view(torch.uint8),
                                          cache[block_ids].view(torch.uint8)))
    if kind == "copy_blocks":
        source, _, _ = _layer_caches(m, 2 * num_blocks, device, dtype)
        source_ids = torch.randperm(2 * num_blocks)[:num_blocks].tolist()
        source_on_device = torch.tensor(source_ids, device=device)

        def check_copy():
            cache[ids_on_device] = 0
            ops.copy_blocks(source, source_ids, cache, block_ids)
            return float(not torch.equal(cache[ids_on_device].view(torch.uint8),
                                         source[source_on_device].view(torch.uint8)))

        return (lambda: ops.copy_blocks(source, source_ids, cache, block_ids)), \
            (lambda: cache.index_copy_(0, ids_on_device, source.index_select(0, source_on_device))), check_copy

    def check_scatter():
        cache[ids_on_device] = 0
        ops.scatter_blocks(cache, block_ids, buffer)
        return float(not torch.equal(cache[ids_on_device].view(torch.uint8), buffer.view(torch.uint8)))

    return (lambda: ops.scatter_blocks(cache, block_ids, buffer)), \
        (lambda: cache.index_copy_(0, torch.tensor(block_ids).to(device), buffer)), check_scatter


def _decode_inputs(m, batch, context, device, dtype, layers=None):
    import torch

    blocks_per_sequence = -(-context // m.block_size)
    num_blocks = batch * blocks_per_sequence
    cache, key_cache, value_cache = _layer_caches(m, num_blocks, device, dtype, layers)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_sequence)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    return cache, key_cache, value_cache, tables, seq_lens


def _build_decode(m, batch, context, args, device, dtype, layers=None):
    import torch

    from splitserve.engine.attention import DecodeGroup, decode_attention

    paged_decode_attention = _attention_function("paged_decode_attention")
    if isinstance(paged_decode_attention, str):
        return paged_decode_attention
    _, key_cache, value_cache, tables, seq_lens = _decode_inputs(m, batch, context, device, dtype, layers)
    query = torch.randn(batch, m.q_heads, m.head_dim, device=device, dtype=dtype)
    scale = m.head_dim**-0.5
    padding = torch.arange(tables.shape[1] * m.block_size, device=device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = padding.unsqueeze(0).expand(m.kv_heads, -1, -1).reshape(m.kv_heads * batch, 1, -1)
    group = DecodeGroup(0, batch, tables, seq_lens, mask)

    def kernel():
        return paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale,
                                      num_splits=args.num_splits)

    def reference():
        return decode_attention(query, key_cache, value_cache, group, scale)

    return kernel, reference, lambda: _difference(kernel(), reference())


def parse_tiles(text: str):
    """ROWSxKEYSxWARPSxSTAGES (e.g. 64x64x4x3) as a tuple in the order of the attention kernels' Tiles (made
    into one only when a kernel runs: importing the kernels here would import triton before --interpret)."""
    try:
        rows, key_tile, num_warps, num_stages = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxKEYSxWARPSxSTAGES, e.g. 64x64x4x3") from None
    powers = all(value > 0 and value & (value - 1) == 0 for value in (rows, key_tile, num_warps))
    if not powers or rows < 16 or key_tile < 16 or num_stages < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rows and keys powers of two from 16, warps a power of two, "
                                         "stages >= 1")
    return rows, key_tile, num_warps, num_stages


def format_tiles(tiles: tuple[int, int, int, int]) -> str:
    return "x".join(str(value) for value in tiles)


def _build_prefill(m, batch, context, chunk, device, dtype, layers=None, tiles=None, num_splits=None):
    import torch
    import torch.nn.functional as F

    from splitserve.engine.attention import write_kv

    paged_prefill_attention = _attention_function("paged_prefill_attention")
    if isinstance(paged_prefill_attention, str):
        return paged_prefill_attention
    _, key_cache, value_cache, tables, _ = _decode_inputs(m, batch, context, device, dtype, layers)
    cached = context - chunk
    query = torch.randn(batch * chunk, m.q_heads, m.head_dim, device=device, dtype=dtype)
    key = torch.randn(batch * chunk, m.kv_heads, m.head_dim, device=device, dtype=dtype)
    value = torch.randn(batch * chunk, m.kv_heads, m.head_dim, device=device, dtype=dtype)
    query_start_loc = torch.arange(0, (batch + 1) * chunk, chunk, device=device, dtype=torch.int64)
    context_lens = torch.full((batch,), cached, device=device, dtype=torch.int64)
    # The chunk's own K/V are in the cache too (the engine stores them before attending).
    positions = torch.arange(cached, context, device=device)
    slots = (tables[:, positions // m.block_size] * m.block_size + positions % m.block_size).reshape(-1)
    write_kv(key_cache, value_cache, key, value, slots)
    scale = m.head_dim**-0.5
    causal = torch.arange(context, device=device).unsqueeze(0) <= (positions.unsqueeze(1))  # [chunk, context]

    # The longest chunk, when the kernel takes it (else it reads query_start_loc: a sync inside the timing).
    known = {"max_query_len": chunk} if "max_query_len" in inspect.signature(paged_prefill_attention).parameters else {}
    if tiles is not None:
        known["tiles"] = importlib.import_module(ATTENTION_MODULE).Tiles(*tiles)
    if num_splits is not None:
        known["num_splits"] = num_splits

    def kernel():
        return paged_prefill_attention(query, key, value, key_cache, value_cache, query_start_loc, context_lens,
                                       tables, scale, **known)

    def reference():
        outputs = []
        for sequence in range(batch):
            k = key_cache[:, tables[sequence]].flatten(1, 2)[:, :context].unsqueeze(0)  # [1, kv_heads, ctx, D]
            v = value_cache[:, tables[sequence]].flatten(1, 2)[:, :context].unsqueeze(0)
            q = query[sequence * chunk : (sequence + 1) * chunk].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale,
                                                 enable_gqa=m.q_heads != m.kv_heads)
            outputs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outputs)

    return kernel, reference, lambda: _difference(kernel(), reference())


# ---- timing on CUDA ------------------------------------------------------------------------------------


def time_on_cuda(function, repeats: int, warmup: int, flush, graph: bool = True) -> tuple[float, str]:
    """Median seconds of ``function`` over ``repeats`` runs, timed by CUDA events, the L2 flushed before each,
    and how it ran: "graph" (its kernels captured once in a CUDA graph and replayed, so that the time is the
    GPU's alone, not Python's and the launcher's) or "eager" (called each time: what a caller without graphs
    waits, or a function that cannot be captured because it waits on the GPU)."""
    import torch

    for _ in range(warmup):
        function()
    torch.cuda.synchronize()
    run, mode = function, "eager"
    if graph:
        replay = _captured(function)
        if replay is not None:
            run, mode = replay, "graph"
    pairs = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs) / 1e3, mode


def _captured(function):
    """``function``'s kernels as a replayable CUDA graph, or None when they cannot be captured."""
    import torch

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            function()
    except RuntimeError:  # a host sync or a non-capturable call inside
        torch.cuda.synchronize()
        return None
    return graph.replay


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy for ``seconds`` so that its clocks leave their idle state before the first timing."""
    import time

    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def peak_bandwidth(args) -> tuple[float | None, str]:
    if args.peak_gbps:
        return args.peak_gbps, "--peak-gbps"
    import torch

    name = torch.cuda.get_device_name()
    for piece, gbps in PEAK_BANDWIDTH_GBPS:
        if piece in name:
            return gbps, f"table entry {piece!r}"
    return None, f"{name!r} is not in the table: pass --peak-gbps"


def run_on_cuda(args, model: ModelShape, dtype) -> list[dict]:
    import torch

    peak, peak_source = peak_bandwidth(args)
    print(f"GPU: {torch.cuda.get_device_name()}; peak {peak or '?'} GB/s ({peak_source}); dtype {args.dtype}; "
          f"median of {args.repeats} runs, L2 flushed before each, {args.timing} timing")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    warm_up_gpu()
    header = (f"{'kernel':<24} {'shape':<42} {'MB':>9} {'us':>9} {'GB/s':>7} {'%peak':>6} "
              f"{'torch us':>9} {'torch GB/s':>10} {'speedup':>7} {'rel diff':>9} timed")
    print(header)
    results = []
    for case in cases(args, model, torch.empty((), dtype=dtype).element_size()):
        measured = _measure(case, args, dtype, flush)
        if isinstance(measured, str):
            print(f"{case.kernel:<24} {case.shape:<42} skipped: {measured}")
            results.append({**_row(case), "skipped": measured})
            continue
        (seconds, mode), (reference_seconds, reference_mode), difference = measured
        gbps = case.num_bytes / seconds / 1e9
        reference_gbps = case.num_bytes / reference_seconds / 1e9
        fraction = gbps / peak if peak else None
        print(f"{case.kernel:<24} {case.shape:<42} {case.num_bytes / 1e6:>9.2f} {seconds * 1e6:>9.1f} {gbps:>7.0f} "
              f"{(f'{fraction:.0%}' if fraction is not None else '?'):>6} {reference_seconds * 1e6:>9.1f} {reference_gbps:>10.0f} "
              f"{reference_seconds / seconds:>6.2f}x {difference:>9.2g} {mode}/{reference_mode}")
        results.append({**_row(case), "seconds": seconds, "gbps": gbps, "fraction_of_peak": fraction,
                        "reference_seconds": reference_seconds, "reference_gbps": reference_gbps,
                        "max_relative_difference": difference, "timing": mode, "reference_timing": reference_mode})
    _print_target(results, peak)
    return results


def _measure(case: Case, args, dtype, flush):
    """(kernel seconds, reference seconds, largest relative difference), or why the case was skipped."""
    import torch

    try:
        built = case.build("cuda", dtype)
        if isinstance(built, str):
            return built
        kernel, reference, check = built
        difference = check()
        graph = args.timing == "graph"
        return (time_on_cuda(kernel, args.repeats, args.warmup, flush, graph),
                time_on_cuda(reference, args.repeats, args.warmup, flush, graph), difference)
    except torch.cuda.OutOfMemoryError:
        return "out of GPU memory (fewer --layers, or smaller --batch-sizes / --contexts)"
    finally:
        built = kernel = reference = check = None  # drop the case's tensors so that empty_cache frees them
        torch.cuda.empty_cache()


def _print_target(results: list[dict], peak: float | None) -> None:
    judged = [r for r in results if r["kernel"] == "paged_decode_attention" and r["context"] >= 4096 and "gbps" in r]
    if not judged or not peak:
        print("Target (paged decode attention >= 70% of peak at contexts >= 4k): not measured"
              + ("" if peak else " (peak bandwidth unknown)"))
        return
    misses = [f"{r['shape']} {r['fraction_of_peak']:.0%}" for r in judged if r["fraction_of_peak"] < DECODE_TARGET]
    worst = min(r["fraction_of_peak"] for r in judged)
    print(f"Target (paged decode attention >= 70% of peak at contexts >= 4k): "
          f"{len(judged) - len(misses)}/{len(judged)} shapes meet it (lowest {worst:.0%})"
          + (f"; below: {', '.join(misses)}" if misses else ""))


def _row(case: Case) -> dict:
    return {"kernel": case.kernel, "shape": case.shape, "context": case.context, "bytes": case.num_bytes,
            "flops": case.flops}


# ---- without a GPU -------------------------------------------------------------------------------------


def print_bytes_model(args, model: ModelShape, element_size: int) -> list[dict]:
    peak = args.peak_gbps or H100_SXM_GBPS
    print(f"No CUDA GPU found (torch.cuda.is_available() is False): no kernel is timed. The bytes each kernel must "
          f"move per shape ({args.dtype}), the model a GPU run is judged by, and the time that takes at "
          f"{peak:.0f} GB/s{'' if args.peak_gbps else ' (an H100 SXM)'}, and at 70% of it:")
    print(f"{'kernel':<24} {'shape':<42} {'MB':>10} {'GFLOP':>8} {'us @peak':>9} {'us @70%':>9}")
    rows = []
    for case in cases(args, model, element_size):
        seconds = case.num_bytes / (peak * 1e9)
        print(f"{case.kernel:<24} {case.shape:<42} {case.num_bytes / 1e6:>10.3f} {case.flops / 1e9:>8.2f} "
              f"{seconds * 1e6:>9.2f} {seconds / DECODE_TARGET * 1e6:>9.2f}")
        rows.append({**_row(case), "seconds_at_peak": seconds})
    print("A kernel launch takes a few microseconds: shapes under about 10 MB measure that latency more than "
          "bandwidth.\nPrefill attention is compute-bound (the GFLOP column): its bytes are a floor, not its measure.")
    return rows


def print_compiled(args) -> None:
    """Every kernel compiled for ``--compile-for`` at the default model's shape, and what each costs an SM."""
    try:
        triton_aot = importlib.import_module("splitserve.kernels.triton_aot")
        importlib.import_module("triton")
    except ImportError:
        print("\nTriton is not installed (pip install 'splitserve[triton]'): nothing is compiled.")
        return
    print()
    triton_aot.print_table(triton_aot.compile_engine_kernels(args.compile_for, "smollm2-135m", args.dtype),
                           triton_aot.GPUS[args.compile_for])
    if args.prefill_tiles:
        attention = importlib.import_module(ATTENTION_MODULE)
        print(f"\nPaged prefill attention at each of --prefill-tiles, {args.model}'s heads:")
        triton_aot.print_table(
            triton_aot.compile_prefill_tiles(args.compile_for, args.model, args.dtype,
                                             [attention.Tiles(*tiles) for tiles in args.prefill_tiles]),
            triton_aot.GPUS[args.compile_for])


def check_interpreted(args, dtype) -> bool:
    """Each kernel once on tiny shapes, in Triton's CPU interpreter, against its reference."""
    tiny = ModelShape(layers=2, hidden=40, intermediate=24, q_heads=6, kv_heads=2, head_dim=8, block_size=4)
    tolerance = 1e-5 if args.dtype == "float32" else 2 * 2**-7  # two bfloat16 units (the interpreter truncates)
    tiny_args = argparse.Namespace(**{**vars(args), "tokens": [3], "contexts": [13], "batch_sizes": [2],
                                      "prefill_batch_sizes": [2], "prefill_chunk": 5})
    print(f"\nInterpreter check (TRITON_INTERPRET=1, CPU, {args.dtype}, tiny shapes; largest difference from the "
          f"reference relative to its largest value, allowed {tolerance:g}):")
    all_right = True
    for case in cases(tiny_args, tiny, 4):
        built = case.build("cpu", dtype)
        if isinstance(built, str):
            print(f"  {case.kernel:<24} skipped: {built}")
            continue
        difference = built[2]()
        right = difference <= tolerance
        all_right &= right
        print(f"  {case.kernel:<24} {case.shape:<42} {difference:.2g} {'ok' if right else 'WRONG'}")
    return all_right


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--kernels", nargs="+", default=list(ALL_KERNELS), choices=ALL_KERNELS, metavar="KERNEL",
                        help=f"which kernels (default all: {', '.join(ALL_KERNELS)})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="element type of activations and the KV cache (default bfloat16, the CUDA default)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 4096, 16384],
                        help="rows of the element-wise kernels and store_kv: decode batches and prefill chunks "
                             "(default 1 16 64 512 4096 16384)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384],
                        help="context lengths in tokens for attention and block copies (default 512 to 16384)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="sequences in a decode batch (default 1 4 16 64)")
    parser.add_argument("--prefill-batch-sizes", type=int, nargs="+", default=[1, 4],
                        help="sequences in a prefill batch (default 1 4)")
    parser.add_argument("--prefill-chunk", type=int, default=512,
                        help="new tokens per sequence in a prefill step; the rest of the context is cached (512)")
    parser.add_argument("--prefill-tiles", type=parse_tiles, nargs="+", default=None, metavar="RxKxWxS",
                        help="time paged prefill attention with each of these tiles (query rows x keys x warps x "
                             "pipeline stages, e.g. 64x64x4x3 128x64x8x2), one row per tile, instead of the "
                             "kernel's own choice (splitserve/kernels/triton_attention.prefill_tiles): the GPU sweep of tiles")
    parser.add_argument("--prefill-splits", type=int, nargs="+", default=None, metavar="N",
                        help="time paged prefill attention with its cached context in each of these numbers of "
                             "split-K parts, one row per count (1: unsplit), instead of the kernel's own choice "
                             "(splitserve/kernels/triton_attention.choose_prefill_splits)")
    parser.add_argument("--num-splits", type=int, default=None,
                        help="split-K parts of paged decode attention (default: the kernel chooses)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per kernel and shape; the median counts (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first: compilation, autotuning (default 3)")
    parser.add_argument("--timing", default="graph", choices=["graph", "eager"],
                        help="graph (default): each function's kernels captured once in a CUDA graph and replayed, "
                             "so that a time is the GPU's alone (functions that wait on the GPU fall back to eager; "
                             "the last column says which); eager: each function called from Python every time, "
                             "launch overhead included, as an engine without CUDA graphs runs it")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the GPU's peak memory bandwidth in GB/s (default: a table by device name, H100 SXM "
                             "3350, H200 4800...; without a GPU, 3350 for the bytes table)")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_SHAPES),
                        help="the model whose widths, heads and head size the kernels run at (default smollm2-135m, "
                             "the default model; llama-3-8b: 8 KV heads of 128)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers in the block-major KV cache (default the model's: 30, 32): sets the "
                             "distance between blocks of one layer and the bytes of a block copy")
    parser.add_argument("--interpret", action="store_true",
                        help="print the bytes table and run each kernel once on tiny shapes in Triton's CPU "
                             "interpreter against its reference, even on a GPU machine (nothing is timed then; "
                             "needs triton and numpy: pip install 'splitserve[triton]')")
    parser.add_argument("--compile-for", default="h100", choices=["h100", "a100", "none"],
                        help="without a GPU (and without --interpret): compile every kernel for this GPU, the "
                             "default model's shape, and print each one's registers, spills, shared memory and "
                             "programs per SM (default h100; none skips it)")
    parser.add_argument("--json", metavar="FILE", help="also write the arguments and the rows to FILE as JSON")
    args = parser.parse_args(argv)

    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    dtype = getattr(torch, args.dtype)
    model = MODEL_SHAPES[args.model]
    if args.layers is not None:
        model = dataclasses.replace(model, layers=args.layers)
    all_right = True
    if torch.cuda.is_available() and not args.interpret:
        rows = run_on_cuda(args, model, dtype)
    else:
        rows = print_bytes_model(args, model, torch.empty((), dtype=dtype).element_size())
        if args.interpret:
            all_right = check_interpreted(args, dtype)
        elif args.compile_for != "none":
            print_compiled(args)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"arguments": vars(args), "rows": rows}, file, indent=1)
    return 0 if all_right else 1


if __name__ == "__main__":
    sys.exit(main())
