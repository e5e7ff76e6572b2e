"""Loads splitserve's C++ CPU kernels: paged decode attention (``cpu_paged_attention.cpp``), paged
prefill attention (``cpu_prefill_attention.cpp``), the fused element-wise operations of the Llama layer
(``cpu_fused_ops.cpp``) and the linear layers of decode-sized batches (``cpu_small_gemm.cpp``), one extension.
Benchmarks can build other sources beside it (another revision's: :func:`load_other`) and time both in one
process (:func:`kernels_from`).

The sources are compiled on first use with the machine's C++ compiler into the
cache folder the caller names (the engine passes splitserve's cache folder), in a
folder named by the torch version, the target and a digest of the sources and flags;
later processes, from any checkout of the same sources, load the built library in
milliseconds. A compile takes about 40 s on a 2-core Zen 3, so a line on
the log says when one starts and how long it took. When no compiler is available the engine keeps the
plain-torch paths. Each kernel's plain-torch reference is named in its source
and compared with it in ``tests/integration/test_kernels.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import re
import time
from pathlib import Path

import torch

from splitserve.common.model_info import keep_newest

logger = logging.getLogger(__name__)
_FOLDER = Path(__file__).parent
_SOURCES = ("cpu_kernels.cpp", "cpu_paged_attention.cpp", "cpu_prefill_attention.cpp", "cpu_fused_ops.cpp",
            "cpu_small_gemm.cpp")
_NAME = "splitserve_cpu_kernels"
COMPILE_MESSAGE = "Compiling the C++ CPU kernels (first start only, under a minute)..."


MARCH_VARIABLE = "SPLITSERVE_CPU_MARCH"


def target_march() -> str:
    """The ``-march`` the kernels are compiled for: ``$SPLITSERVE_CPU_MARCH``, or ``native`` (this CPU).

    Another value builds for a family of CPUs instead, e.g. ``x86-64-v3`` (AVX2 and FMA, no AVX-512) for a
    fleet that mixes AVX2 and AVX-512 machines, or to run the AVX2 code on an AVX-512 machine as the tests
    and ``benchmarks/cpu_attention.py`` do. Raises ValueError for a value that is not a plain name.
    """
    march = os.environ.get(MARCH_VARIABLE, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", march):
        raise ValueError(f"{MARCH_VARIABLE} must be a compiler -march name such as x86-64-v3, got {march[:80]!r}.")
    return march


def _compile_flags() -> list[str]:
    # No contraction of a * b + c into one rounding: the fused operations round as torch does.
    return ["-O3", f"-march={target_march()}", "-fopenmp", "-ffp-contract=off"]


def source_files(folder: Path | None = None) -> dict[str, bytes]:
    """The kernels' sources and headers (``*.cpp``, ``*.h``) in ``folder`` (default: beside this module), by
    name."""
    folder = _FOLDER if folder is None else Path(folder)
    return {path.name: path.read_bytes() for pattern in ("*.cpp", "*.h") for path in folder.glob(pattern)}


def _source_digest(files: dict[str, bytes] | None = None) -> str:
    """A digest of ``files`` (default: every source and header beside this module), of the compile flags and, for
    a ``native`` build, of this CPU's feature flags: what the library is built from and for, whatever checkout it
    is in and whatever its files' times. (A cache folder shared by machines of different CPUs keeps a native
    build for each.)"""
    files = source_files() if files is None else files
    digest = hashlib.sha256(" ".join(_compile_flags()).encode())
    if target_march() == "native":
        digest.update(_cpu_flags().encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo (what ``-march=native`` reads), or "" where there is none."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    return ""


def build_folder(cache_folder: str) -> Path:
    """Where the kernels are built under ``cache_folder``: one folder per torch version, target (a
    ``-march-...`` suffix when it is not this CPU) and sources (their digest), so that checkouts of the same
    sources share one build, and a change of source, header or flags builds afresh beside it."""
    march = target_march()
    suffix = "" if march == "native" else f"-march-{march}"
    return Path(cache_folder) / "kernels" / f"torch-{torch.__version__}{suffix}-{_source_digest()}"


def _library(build_dir: Path, name: str = _NAME) -> Path:
    return build_dir / f"{name}.so"


def needs_compile(build_dir: Path) -> bool:
    """Whether loading from ``build_dir`` compiles: no built library there. The folder's name holds the
    sources' digest, so a library in it was built from these sources."""
    return not _library(build_dir).exists()


@functools.cache
def load(cache_folder: str):
    """The compiled extension, built under ``cache_folder``/kernels, or None when it cannot be built here."""
    build_dir = build_folder(cache_folder)
    build_dir.mkdir(parents=True, exist_ok=True)
    return _locked_build(build_dir)


def _locked_build(build_dir: Path, name: str = _NAME, source_folder: Path | None = None):
    """_build under the folder's kernel lock."""
    # One builder at a time, under a kernel lock the OS releases when its holder dies. torch's own baton
    # (a ``lock`` file) is not: a process killed mid-compile leaves it, and every later start would wait
    # on it forever. Whoever holds the kernel lock holds the only live baton, so one found then is stale.
    with open(build_dir / "builder.flock", "w") as kernel_lock:
        fcntl.flock(kernel_lock, fcntl.LOCK_EX)
        for stale in ("lock", ".ninja_lock"):
            if (build_dir / stale).exists():
                logger.warning("Removing a stale build lock %s (a compile was killed).", build_dir / stale)
                (build_dir / stale).unlink(missing_ok=True)
        return _build(build_dir, name, source_folder)


OTHER_BUILDS_KEPT = 4  # builds of other sources (load_other) kept in the cache folder, the most recently used


def load_other(files: dict[str, bytes], cache_folder: str):
    """The kernels built from other sources than this module's (another revision's, an edited copy: ``files``
    by name, as :func:`source_files` gives them), with this tree's compiler flags, so that a benchmark can time
    two builds in one process (see :func:`kernels_from`). Where ``files`` are this tree's sources, the loaded
    build itself. Built under ``cache_folder``/kernels-other, which keeps the newest few builds.

    Raises ValueError when a source the extension is built from is missing, RuntimeError when they do not
    build.
    """
    digest = _source_digest(files)
    if digest == _source_digest():
        return load(cache_folder)
    missing = [name for name in _SOURCES if name not in files]
    if missing:
        raise ValueError(f"those kernel sources lack {', '.join(missing)}")
    if not all(re.fullmatch(r"[A-Za-z0-9_.-]+\.(cpp|h)", name) for name in files):
        raise ValueError("kernel sources are plain file names ending .cpp or .h")
    build_dir = Path(cache_folder) / "kernels-other" / f"torch-{torch.__version__}-{digest}"
    source_folder = build_dir / "src"
    source_folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():  # written once (a rewrite would make ninja compile again), whole or not
        if not (source_folder / name).exists():
            partial = source_folder / f".{name}.{os.getpid()}"
            partial.write_bytes(content)
            partial.replace(source_folder / name)
    module = _locked_build(build_dir, f"{_NAME}_{digest}", source_folder)
    if module is None:
        raise RuntimeError(f"the kernel sources did not build (see the log; build folder {build_dir})")
    build_dir.touch()  # the most recently used
    keep_newest(build_dir.parent, OTHER_BUILDS_KEPT, keep=build_dir)
    return module


@contextlib.contextmanager
def kernels_from(module):
    """Within the block, this module's functions call ``module`` (from :func:`load_other`) instead of the loaded
    kernels."""
    global _module
    previous, _module = _module, module
    try:
        yield
    finally:
        _module = previous


def _build(build_dir: Path, name: str = _NAME, source_folder: Path | None = None):
    """Load the extension ``name`` in ``build_dir``, compiling it from ``source_folder`` (default: beside this
    module) first when it is not there (or does not load); None when it cannot be built here."""
    source_folder = _FOLDER if source_folder is None else source_folder
    if _library(build_dir, name).exists():
        try:
            return _import_library(build_dir, name)
        except ImportError as error:  # e.g. a link killed mid-way; ninja's log has no record of it: it rebuilds
            logger.warning("The built C++ CPU kernels in %s do not load (%s); compiling them again.", build_dir,
                           str(error)[:200])
    from torch.utils.cpp_extension import load as load_extension

    logger.warning(COMPILE_MESSAGE)  # a WARNING, so it shows where no logging is configured (the offline API) too
    started = time.monotonic()
    try:
        module = load_extension(
            name=name,
            sources=[str(source_folder / source) for source in _SOURCES],
            extra_include_paths=[str(source_folder)],
            extra_cflags=_compile_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as error:  # no compiler, no headers: the torch paths still work
        logger.warning("C++ CPU kernels unavailable (%s); using the torch implementations.", error)
        return None
    logger.warning("C++ CPU kernels compiled in %.0f s (in %s; later starts load them at once).",
                   time.monotonic() - started, build_dir)
    return module


def _import_library(build_dir: Path, name: str = _NAME):
    """The built extension module, imported from its file (what torch's loader does after its build)."""
    spec = importlib.util.spec_from_file_location(name, _library(build_dir, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def available(cache_folder: str) -> bool:
    """Whether the kernels are built (building them now if needed) under ``cache_folder``."""
    global _module
    _module = load(str(cache_folder))
    return _module is not None


_module = None


def _query_rows(query: torch.Tensor) -> torch.Tensor:
    """The query [rows, heads, head_dim] as the attention kernels take it: float32, each row's heads contiguous.
    The model's queries are a view of the fused QKV output (rows 960 floats apart for SmolLM's 576), which the
    kernels read in place: no copy of a prompt step's queries (4.7 MB per layer for 2,048 tokens)."""
    query = query.float()
    if query.stride(2) != 1 or query.stride(1) != query.shape[2] or query.stride(0) < query.shape[1] * query.shape[2]:
        query = query.contiguous()
    return query


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [requests, q_heads, head_dim]; caches: [kv_heads, num_blocks, block_size, head_dim];
    block_tables: [requests, max_blocks] int64; seq_lens: [requests] int64.

    Returns: [requests, q_heads, head_dim] in the query's dtype: ``out`` where given (contiguous, the query's shape
    and dtype; a float32 one is written in place). The caches float32 or bfloat16 (the kernel computes in float32
    either way, but see :func:`rounds_bfloat16_queries`; a bfloat16 query is widened first). Call
    :func:`available` first.
    """
    output = _module.paged_decode_attention(_query_rows(query), key_cache, value_cache, block_tables, seq_lens, scale,
                                            _in_place(out))
    return _attention_result(output, query.dtype, out)


def rounds_bfloat16_queries(head_dim: int) -> bool:
    """Whether the attention kernels over a bfloat16 cache round the queries (times the scale) to bfloat16:
    they multiply them with the keys in AVX512-BF16's pair dot products where this build has them, for head
    sizes that are multiples of 32 (all the prefill kernel takes). Call :func:`available` first."""
    return _module.bfloat16_dot_supported() and head_dim % 32 == 0


def decodes_in_amx(head_dim: int, block_size: int, group: int) -> bool:
    """Whether :func:`paged_decode_attention` over a bfloat16 cache of this shape runs in AMX tiles
    (``splitserve/kernels/cpu_amx_attention.h``): on CPUs with AMX-BF16 that Linux lets this process use, head sizes 64
    and 128, blocks of a multiple of 16 tokens. There the softmax weights are rounded to bfloat16 before they
    multiply the values, as well as the queries (see :func:`rounds_bfloat16_queries`). Call :func:`available`
    first."""
    return _module.amx_decode_supported(head_dim, block_size, group)


def prefills_in_amx(head_dim: int, block_size: int) -> bool:
    """Whether :func:`paged_prefill_attention` over a bfloat16 cache of this shape runs in AMX tiles
    (``splitserve/kernels/cpu_amx_attention.h``; the conditions of :func:`decodes_in_amx`, any number of query heads per KV
    head), rounding the softmax weights to bfloat16 too. Call :func:`available` first."""
    return _module.amx_prefill_supported(head_dim, block_size)


@contextlib.contextmanager
def amx_disabled():
    """Within the block the kernels leave AMX alone and run their AVX-512 paths (process-wide), so that
    tests and ``benchmarks/cpu_attention.py`` reach both on an AMX machine. Call :func:`available` first."""
    previous = _module.set_amx_enabled(False)
    try:
        yield
    finally:
        _module.set_amx_enabled(previous)


def decode_prefetch_level() -> int:
    """The cache level (1 or 2) :func:`paged_decode_attention` fetches each chunk's successor into: by default L1
    on AMD CPUs whose L1 data cache holds 48 KB or more (Zen 5), else L2 (Zen 3 and 4; Intel with 48 KB, measured
    in ``splitserve/kernels/cpu_paged_attention.cpp``).
    Call :func:`available` first."""
    return _module.decode_prefetch_level()


@contextlib.contextmanager
def decode_prefetch_into(level: int):
    """Within the block decode attention fetches ahead into cache level ``level`` (1 or 2; process-wide), so that
    ``benchmarks/cpu_attention.py`` can time both on any CPU. Call :func:`available` first."""
    previous = _module.set_decode_prefetch_level(level)
    try:
        yield
    finally:
        _module.set_decode_prefetch_level(previous)


def prefill_supports(head_dim: int) -> bool:
    """Whether :func:`paged_prefill_attention` takes this head size (its micro-kernels work on 64 lanes)."""
    return head_dim % 64 == 0


@functools.cache
def has_amx_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in AMX tiles (Sapphire Rapids and later Xeons), as Linux reports it.

    There oneDNN, and torch's scaled_dot_product_attention through it, multiplies bfloat16 matrices several
    times faster than AVX-512 pair dot products can, so the engine leaves bfloat16 prompt attention to torch.
    """
    try:
        with open("/proc/cpuinfo") as file:
            return any(line.startswith("flags") and " amx_bf16" in line for line in file)
    except OSError:
        return False


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a batch of prompt chunks over their requests' cached KV (the chunks' own K/V
    already written), read from the cache in place.

    query: [rows, q_heads, head_dim], the chunks back to back; caches: [kv_heads, num_blocks, block_size,
    head_dim]; query_start_loc: [chunks + 1] int32 row offsets; context_lens: [chunks] int32 tokens cached
    before each chunk; block_tables: [chunks, max_blocks] int64. Returns: [rows, q_heads, head_dim] in the
    query's dtype: ``out`` where given, as :func:`paged_decode_attention`. Caches float32 or bfloat16 (computed
    in float32; see :func:`rounds_bfloat16_queries`), head_dim a multiple of 64 (:func:`prefill_supports`).
    Call :func:`available` first.
    """
    output = _module.paged_prefill_attention(_query_rows(query), key_cache, value_cache, query_start_loc,
                                             context_lens, block_tables, scale, _in_place(out))
    return _attention_result(output, query.dtype, out)


def _in_place(out: torch.Tensor | None) -> torch.Tensor:
    """What the attention kernels take for ``out``: a float32 tensor they write into, else an empty one (they then
    return a new float32 tensor, converted by :func:`_attention_result`)."""
    return out if out is not None and out.dtype == torch.float32 else _EMPTY


def _attention_result(output: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return output.to(dtype)
    if output.data_ptr() != out.data_ptr():
        out.copy_(output)
    return out


def write_kv_(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Store key, value: [tokens, kv_heads, head_dim] into slots ``slot_mapping`` ([tokens] int64) of the
    caches [kv_heads, num_blocks, block_size, head_dim], in place; float32 or bfloat16, one dtype for all."""
    _module.write_kv_(key_cache, value_cache, key, value, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, hidden] -> ``weight * (x * rsqrt(mean(x^2) + eps))``, a new [rows, hidden]."""
    return _module.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place (both [rows, hidden], residual contiguous), then returns
    ``rms_norm(residual, weight, eps)``."""
    return _module.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [rows, 2 * intermediate] -> ``silu(gate) * up``: [rows, intermediate], written into ``out`` where
    given (contiguous, gate_up's dtype; e.g. a block of rows of a larger tensor), else a new tensor."""
    return _module.silu_and_mul(gate_up, _EMPTY if out is None else out)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: float32 [rows, vocab] (rows contiguous) -> int64 [rows], the first of tied maxima, a NaN
    counting as the largest: ``torch.argmax(logits, dim=-1)``'s indices, read at the cache's speed."""
    return _module.argmax_rows(logits)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on float32 ``logits`` [num_rows, vocab] (rows contiguous): -inf on each of ``rows`` (int64 [n])
    where its ``bitmask`` row (int32 [n, words], bit j of word w allows token 32 w + j) does not allow the token;
    tokens past 32 words are not allowed. The torch reference: ``engine.structured_output.apply_token_bitmask``."""
    _module.apply_token_bitmask_(logits, rows, bitmask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x: [tokens, heads, head_dim] in place; cos, sin: [tokens, head_dim]."""
    _module.rotary_(x, cos, sin)


def small_gemm_supported() -> bool:
    """Whether :func:`small_gemm` was built here (it needs AVX-512, or AVX2 with FMA). Call :func:`available` first."""
    return _module is not None and _module.small_gemm_supported()


def small_gemm_max_rows() -> int:
    """Up to this many rows a float32 projection runs in :func:`small_gemm`, above it in oneDNN's packed GEMM, which
    wins the prompt chunks: 192 where the kernels run AVX-512, 96 where they run AVX2 (oneDNN's AVX2 GEMM is ahead
    from about 100 rows); 0 where :func:`small_gemm` was not built. Measured in ``splitserve/kernels/cpu_small_gemm.cpp``.
    Call :func:`available` first."""
    return _module.small_gemm_max_rows()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """An nn.Linear weight [out_features, in_features] as :func:`small_gemm`'s panels [ceil(out / 32),
    in_features, 32] (a new tensor; columns past out_features are zero)."""
    return _module.pack_panels(weight.float().contiguous())


def small_gemm(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x: [rows, in_features] (rows of a few to a few hundred) and the
    weight's :func:`pack_panels`. Returns a new [rows, out_features]. float32; needs
    :func:`small_gemm_supported`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _module.small_gemm(x, panels, bias if bias is not None else _EMPTY, out_features)


def default_small_gemm_block_steps() -> int:
    """The k-block :func:`small_gemm` walks its panels in on this CPU, in 128-byte steps: 128 (16 KB); 192 on
    AMD CPUs whose L1 data cache holds 48 KB or more (Zen 5); 0, each panel whole, on other AMD CPUs where the
    kernels run AVX-512 (Zen 4); 256 on other CPUs with a 48 KB L1 where the kernels run AVX-512 (Intel since Ice
    Lake). Measured in ``splitserve/kernels/cpu_small_gemm.cpp``. Call :func:`available` first."""
    return _module.default_small_gemm_block_steps()


@contextlib.contextmanager
def small_gemm_block_steps(steps: int):
    """Within the block :func:`small_gemm` walks its panels in k-blocks of ``steps`` 128-byte steps (0: each
    panel whole; -1: this CPU's default, :func:`default_small_gemm_block_steps`; process-wide), so that
    ``benchmarks/cpu_gemm.py --block-steps`` can time them in one run on any CPU. Call :func:`available` first."""
    previous = _module.set_small_gemm_block_steps(steps)
    try:
        yield
    finally:
        _module.set_small_gemm_block_steps(previous)


_EMPTY = torch.empty(0)


# Up to this many rows a bfloat16 projection runs in small_gemm_bfloat16, above it in oneDNN's packed bfloat16
# GEMM (AMX or AVX512-BF16). `benchmarks/cpu_gemm.py --dtype bfloat16` (2-core Emerald Rapids with AMX, cold
# weights, medians of 5): 1.9-2.8x oneDNN from 1 to 8 rows on SmolLM2's four projections, 0.96-1.9x at 16, and
# 0.4-1.0x at 64, where oneDNN's AMX tiles are far ahead. The 120 projections of a step in turn, weights not
# evicted (medians of 9): 1.99x at 1 row (the weights streamed at 21.6 GB/s against 10.9), 1.21x at 8, 0.73x at 16.
SMALL_GEMM_BFLOAT16_MAX_ROWS = 8


def small_gemm_bfloat16_supported() -> bool:
    """Whether :func:`small_gemm_bfloat16` was built here (it needs AVX512-BF16: Intel from Cooper Lake, AMD
    from Zen 4). Call :func:`available` first."""
    return _module is not None and _module.small_gemm_bfloat16_supported()


def pack_panels_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 nn.Linear weight [out_features, in_features] (in_features even) as
    :func:`small_gemm_bfloat16`'s panels [ceil(out / 32), in_features / 2, 64] (a new tensor)."""
    return _module.pack_panels_bfloat16(weight.to(torch.bfloat16).contiguous())


def small_gemm_bfloat16(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in bfloat16 for a few rows of x: [rows, in_features] and the weight's
    :func:`pack_panels_bfloat16`: products summed in float32 in VDPBF16PS pairs, each output rounded to bfloat16
    once (as oneDNN does, in another order). Returns a new bfloat16 [rows, out_features]; needs
    :func:`small_gemm_bfloat16_supported`."""
    if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    bias = _EMPTY if bias is None else bias.float()
    return _module.small_gemm_bfloat16(x, panels, bias, out_features)
