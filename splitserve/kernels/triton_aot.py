"""Compile the Triton kernels for a GPU that is not here, and read what the compiler made of them.

CI and the development machines have no GPU, and Triton's interpreter (how the kernels are tested
against their references on a CPU) runs programs that a GPU compile may reject, and says nothing about
speed. Triton's compiler, though, runs anywhere: the triton wheel brings LLVM and NVIDIA's ``ptxas``,
so a kernel compiles here to the cubin an H100 (sm_90) or an A100 (sm_80) would load. This module
compiles every kernel the engine launches through the same wrappers and the same launch arguments as
the engine (CPU tensors stand in for the GPU's: only their dtypes, strides and alignment reach the
compiler, as Triton's own specialization of a launch), and reads each cubin with the ``cuobjdump``
that comes with ``ptxas``:

- registers per thread, and spills (``STL``, stores to local memory: a spilling kernel moves bytes it
  should not);
- shared memory per program, against the GPU's limit;
- programs resident per SM: the lowest of the register, shared-memory, warp and program limits;
- the share of its global-load instructions' bytes that a kernel loads 16 bytes per thread at a time
  (``LDG.E.128``, and ``LDGSTS...128``: the asynchronous copies of a software-pipelined loop), counted
  in the code, not weighted by how often each runs. A kernel bound by memory bandwidth wants it near 1.

:func:`compiling_for` needs Triton imported for the compiler, so a process without
``TRITON_INTERPRET=1`` (the test suite sets it: its test runs this module's command line in a
subprocess).

Usage::

    python -m splitserve.kernels.triton_aot                     # every model shape, both dtypes, H100
    python -m splitserve.kernels.triton_aot --gpu a100 --model llama-3-8b --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from splitserve.common.model_info import cache_dir, read_cached_json, write_cached_json
from splitserve.kernels import triton_attention, triton_ops

RESERVED_SHARED_PER_PROGRAM = 1024  # bytes the driver reserves in shared memory for each resident program
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of this many


@dataclass(frozen=True)
class GpuSpec:
    """What a program's resources are judged against (NVIDIA's tables for the architecture)."""

    name: str
    arch: int  # compute capability, major * 10 + minor
    sms: int
    shared_per_sm: int  # bytes
    shared_per_program: int  # the most one program may use, bytes
    peak_gbps: float
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_programs_per_sm: int = 32


GPUS = {
    "h100": GpuSpec("H100 SXM", 90, 132, 228 * 1024, 227 * 1024, 3350.0),
    "a100": GpuSpec("A100 SXM 80GB", 80, 108, 164 * 1024, 163 * 1024, 2039.0),
}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16


# The default model and the Llama shapes people serve on GPUs: grouped-query ratios 3, 1, 4 and 8.
MODELS = {
    "smollm2-135m": ModelShape(576, 1536, 9, 3, 64),
    "llama-2-7b": ModelShape(4096, 11008, 32, 32, 128),
    "llama-3-8b": ModelShape(4096, 14336, 32, 8, 128),
    "llama-3-70b": ModelShape(8192, 28672, 64, 8, 128),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class KernelReport:
    """One compiled launch: what it is, and what it costs an SM."""

    kernel: str
    variant: str  # its compile-time constants (a kernel is compiled once per set of them)
    grid: str  # the programs of the launch that was compiled (small stand-in shapes)
    model: str
    dtype: str
    gpu: str
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_stores: int  # STL instructions
    shared_bytes: int  # per program
    programs_per_sm: int
    wide_load_share: float  # of global-load instruction bytes, in 16-byte-per-thread loads
    compile_seconds: float

    @property
    def fits(self) -> bool:
        return self.programs_per_sm >= 1


@dataclass
class _Launch:
    kernel: str
    variant: str
    grid: tuple
    compiled: object  # triton.compiler.CompiledKernel
    seconds: float


@contextlib.contextmanager
def compiling_for(gpu: GpuSpec) -> Iterator[list[_Launch]]:
    """Within the block, every kernel launch of ``triton_ops`` and ``triton_attention`` is compiled for
    ``gpu`` instead of run (its outputs stay unwritten). Yields the list of compiled launches, filled as
    the block runs. Uses the binder and argument packing of triton 3.9's JITFunction.run (private)."""
    if triton_ops.interpreting() or triton_ops.language_interpreted():
        raise RuntimeError("compiling for a GPU needs Triton imported for its compiler: run this in a process "
                           "without TRITON_INTERPRET=1.")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", gpu.arch, 32)
    backend = make_backend(target)
    launches: list[_Launch] = []

    def compile_launch(jitted, grid, arguments, options) -> None:
        # What JITFunction.run does before it compiles, with the target given instead of the current device's.
        binder = create_function_from_signature(jitted.signature, jitted.params, backend)
        bound, specialization, parsed = binder(*arguments, **options)
        parsed, signature, constants, attributes = jitted._pack_args(backend, options, bound, specialization, parsed)
        started = time.perf_counter()
        compiled = triton_compile(ASTSource(jitted, signature, constants, attributes), target=target,
                                  options=parsed.__dict__)
        launches.append(_Launch(jitted.fn.__name__.strip("_"), _variant(options), tuple(grid), compiled,
                                time.perf_counter() - started))

    triton_ops._compile_instead = compile_launch
    try:
        yield launches
    finally:
        triton_ops._compile_instead = None


def _variant(options: dict) -> str:
    """The launch's compile-time constants, as ``NAME=value`` (the kernel's own, then its options)."""
    return " ".join(f"{name}={value}" for name, value in options.items() if not isinstance(value, torch.Tensor))


def _qkv_views(m: ModelShape, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [tokens, q_heads, head_dim], key and value [tokens, kv_heads, head_dim]: strided views of one fused
    QKV projection's output, as the engine's attention gets them."""
    qkv = torch.zeros(tokens, (m.q_heads + 2 * m.kv_heads) * m.head_dim, dtype=dtype)
    query = qkv[:, : m.q_heads * m.head_dim].view(tokens, m.q_heads, m.head_dim)
    key_value = qkv[:, m.q_heads * m.head_dim :].view(tokens, 2 * m.kv_heads, m.head_dim)
    return query, key_value[:, : m.kv_heads], key_value[:, m.kv_heads :]


def launch_engine_kernels(model: ModelShape, dtype: torch.dtype, arch: int) -> None:
    """Call every kernel wrapper once the way the engine's CUDA path does, on small CPU tensors of the
    model's widths: a fused QKV output split into strided query/key/value views, one layer's strided view
    of the block-major cache [blocks, layers, 2, kv_heads, block_size, head_dim], int64 block tables; the
    prefill tiles a GPU of compute capability ``arch`` would get."""
    m, tokens, batch, blocks = model, 40, 3, 24
    zeros = lambda *size: torch.zeros(*size, dtype=dtype)  # noqa: E731

    hidden = zeros(tokens, m.hidden)
    triton_ops.rms_norm(hidden, zeros(m.hidden), 1e-5)
    triton_ops.add_rms_norm(hidden, zeros(tokens, m.hidden), zeros(m.hidden), 1e-5)
    triton_ops.silu_and_mul(zeros(tokens, 2 * m.intermediate))

    query, key, value = _qkv_views(m, tokens, dtype)
    table = zeros(tokens, m.head_dim)
    triton_ops.rotary_(query, table, table)
    triton_ops.rotary_(key, table, table)

    cache = zeros(blocks, 2, 2, m.kv_heads, m.block_size, m.head_dim)
    key_cache, value_cache = cache[:, 1].permute(1, 2, 0, 3, 4)
    triton_ops.scatter_blocks(cache, [3, 1, 2], triton_ops.gather_blocks(cache, [2, 1, 3]))
    # A p2p pair on one GPU: the peer's memory as rows of bytes into the cache's blocks.
    triton_ops.copy_blocks(cache.view(blocks, -1).view(torch.uint8), [0, 2], cache, [1, 3])
    triton_attention.store_kv(key_cache, value_cache, key, value, torch.arange(tokens, dtype=torch.int64))

    tables = torch.arange(batch * 8, dtype=torch.int64).reshape(batch, 8) % blocks
    seq_lens = torch.full((batch,), 8 * m.block_size, dtype=torch.int64)
    scale = m.head_dim**-0.5
    for splits in (1, 4):  # one split writes the output itself; more add the reduction kernel
        triton_attention.paged_decode_attention(query[:batch], key_cache, value_cache, tables, seq_lens, scale,
                                                num_splits=splits)
    launch_prefill(m, dtype, triton_attention.prefill_tiles(dtype, m.head_dim, arch))


def launch_prefill(model: ModelShape, dtype: torch.dtype, tiles: triton_attention.Tiles) -> None:
    """Call paged prefill attention as the engine does (two chunks, one after 32 cached tokens), on small CPU
    tensors of the model's heads, with ``tiles``: once whole, once with its context in 3 splits (the kernel's
    variant that writes partial outputs, and the reduction)."""
    m, tokens, blocks = model, 40, 24
    query, key, value = _qkv_views(m, tokens, dtype)
    key_cache, value_cache = torch.zeros(blocks, 2, 2, m.kv_heads, m.block_size, m.head_dim,
                                         dtype=dtype)[:, 1].permute(1, 2, 0, 3, 4)
    tables = torch.arange(16, dtype=torch.int64).reshape(2, 8) % blocks
    for splits in (1, 3):
        triton_attention.paged_prefill_attention(query, key, value, key_cache, value_cache,
                                                 torch.tensor([0, 16, tokens], dtype=torch.int32),
                                                 torch.tensor([0, 32], dtype=torch.int32), tables, m.head_dim**-0.5,
                                                 max_query_len=tokens - 16, num_splits=splits, tiles=tiles)


def compile_prefill_tiles(gpu_name: str, model_name: str, dtype_name: str,
                          tiles: list[triton_attention.Tiles]) -> list[KernelReport]:
    """Paged prefill attention compiled for ``gpu_name`` at each of ``tiles``: which of them spill, and how many
    programs an SM holds (the sweep's candidates, screened without a GPU)."""
    gpu = GPUS[gpu_name]
    with compiling_for(gpu) as launches:
        for each in tiles:
            launch_prefill(MODELS[model_name], DTYPES[dtype_name], each)
    return [_report(launch, gpu, gpu_name, model_name, dtype_name) for launch in launches]


def compile_engine_kernels(gpu_name: str, model_name: str, dtype_name: str) -> list[KernelReport]:
    gpu = GPUS[gpu_name]
    with compiling_for(gpu) as launches:
        launch_engine_kernels(MODELS[model_name], DTYPES[dtype_name], gpu.arch)
    return [_report(launch, gpu, gpu_name, model_name, dtype_name) for launch in launches]


def _report(launch: _Launch, gpu: GpuSpec, gpu_name: str, model: str, dtype: str) -> KernelReport:
    metadata = launch.compiled.metadata
    reading = _read_cubin(launch.compiled.asm["cubin"])
    registers = reading["registers"]
    shared = metadata.shared + reading["shared"]
    loads = reading["load_bytes"]
    return KernelReport(
        kernel=launch.kernel, variant=launch.variant, grid=str(launch.grid), model=model, dtype=dtype, gpu=gpu_name,
        num_warps=metadata.num_warps, num_stages=metadata.num_stages, registers=registers,
        spill_stores=reading["spill_stores"], shared_bytes=shared,
        programs_per_sm=programs_per_sm(gpu, registers, shared, metadata.num_warps),
        wide_load_share=round(loads["wide"] / loads["all"], 3) if loads["all"] else 1.0,
        compile_seconds=round(launch.seconds, 2),
    )


def programs_per_sm(gpu: GpuSpec, registers: int, shared: int, num_warps: int) -> int:
    """Programs of this size one SM holds at once (0: one does not fit)."""
    if shared > gpu.shared_per_program or registers > 255:
        return 0
    per_warp = math.ceil(registers * 32 / REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = (gpu.registers_per_sm // max(per_warp, 1)) // num_warps
    by_shared = gpu.shared_per_sm // (shared + RESERVED_SHARED_PER_PROGRAM)
    by_warps = gpu.max_warps_per_sm // num_warps
    return min(by_registers, by_shared, by_warps, gpu.max_programs_per_sm)


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _read_cubin(cubin: bytes) -> dict:
    """What a report needs of a cubin: registers and static shared memory per thread and program, spill stores,
    and the bytes of its global-load instructions (all of them; those 16 bytes wide).

    Disassembling a kernel takes ``cuobjdump`` about half a second, most of a warm run (Triton's compile cache
    answers the compile itself), so the reading is kept beside the kernels in the cache folder, under the
    cubin's SHA-256: the same bytes disassemble the same."""
    import triton

    path = cache_dir() / "triton-aot" / f"{hashlib.sha256(cubin).hexdigest()}-{triton.__version__}.json"
    kept = read_cached_json(path)
    if kept is not None:
        return kept
    usage, sass = _inspect_cubin(cubin)
    loads = collections.Counter(re.findall(r"\b(LDGSTS|LDG)\.[\w.]*?(\.(?:128|64|U8|S8|U16|S16))?\s", sass))
    load_bytes = {".128": 16, ".64": 8, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2, "": 4}
    reading = {
        "registers": int(usage["REG"]), "shared": int(usage.get("SHARED", 0)),
        "spill_stores": len(re.findall(r"\bSTL\b", sass)),
        "load_bytes": {"all": sum(count * load_bytes[width] for (_, width), count in loads.items()),
                       "wide": sum(count * 16 for (_, width), count in loads.items() if width == ".128")},
    }
    write_cached_json(path, reading)  # a read-only cache only costs the next run the disassembly
    return reading


def _inspect_cubin(cubin: bytes) -> tuple[dict[str, str], str]:
    """(resource usage, e.g. {"REG": "158", "SHARED": "0", ...}; the SASS) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", file.name], capture_output=True, text=True, check=True)
        sass = subprocess.run([_cuobjdump(), "-sass", file.name], capture_output=True, text=True, check=True)
    line = next(line for line in usage.stdout.splitlines() if "REG:" in line)
    return dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)), sass.stdout


# ---- command line ----------------------------------------------------------------------------------


def print_table(reports: list[KernelReport], gpu: GpuSpec) -> None:
    print(f"Triton kernels compiled for {gpu.name} (sm_{gpu.arch}, {gpu.sms} SMs, {gpu.shared_per_program // 1024} KiB "
          f"shared memory per program at most); no GPU was used.")
    header = (f"{'model':<13} {'dtype':<8} {'kernel':<38} {'warps':>5} {'stages':>6} {'regs':>4} {'spills':>6} "
              f"{'shared KiB':>10} {'per SM':>6} {'16B loads':>9}")
    print(header)
    print("-" * len(header))
    for r, label in zip(reports, _labels(reports)):
        print(f"{r.model:<13} {r.dtype:<8} {label:<38} {r.num_warps:>5} {r.num_stages:>6} {r.registers:>4} "
              f"{r.spill_stores:>6} {r.shared_bytes / 1024:>10.1f} {r.programs_per_sm:>6} {r.wide_load_share:>9.0%}")


def _labels(reports: list[KernelReport]) -> list[str]:
    """Each report's kernel name, with the constants that tell it from the kernel's other launches at the
    same model and dtype (``rms_norm_kernel HAS_RESIDUAL=True``)."""
    constants = [dict(item.split("=", 1) for item in r.variant.split()) for r in reports]
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for index, r in enumerate(reports):
        groups[r.model, r.dtype, r.kernel].append(index)
    labels = [r.kernel for r in reports]
    for members in groups.values():
        differing = sorted({key for i in members for key in constants[i]
                            if len({constants[j].get(key) for j in members}) > 1})
        for i in members:
            labels[i] += "".join(f" {key}={constants[i].get(key)}" for key in differing)
            if not differing and len(members) > 1:  # the same constants: told apart by their grids
                labels[i] += f" grid={reports[i].grid.replace(' ', '')}"
    return labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.kernels.triton_aot",
        description="Compile every Triton kernel the engine launches for a GPU (no GPU needed: Triton's compiler "
                    "and NVIDIA's ptxas come with the triton wheel) and print each kernel's registers, spills, "
                    "shared memory, programs resident per SM and share of 16-byte global loads.")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the GPU to compile for (default h100)")
    parser.add_argument("--model", choices=sorted(MODELS), nargs="+", default=list(MODELS),
                        help="model shapes (widths, heads, head size) to compile for (default: all)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["bfloat16", "float32"],
                        help="cache and activation dtypes (default: both)")
    parser.add_argument("--json", metavar="PATH", help="also write the reports as a JSON list to PATH")
    args = parser.parse_args(argv)
    if triton_ops.interpreting():
        parser.error("TRITON_INTERPRET is set: compiling for a GPU needs Triton's compiler; unset it.")
    try:
        import triton  # noqa: F401
    except ImportError:
        parser.error(triton_ops.INSTALL_HINT)
    from tqdm import tqdm

    reports: list[KernelReport] = []
    for model, dtype in tqdm([(m, d) for m in args.model for d in args.dtype], desc="compiling", file=sys.stderr):
        reports += compile_engine_kernels(args.gpu, model, dtype)
    print_table(reports, GPUS[args.gpu])
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(report) for report in reports], file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
