"""Paged attention in Triton: the KV write, decode with split-K (flash-decoding), and varlen prefill.

Each kernel's plain-torch reference is in ``splitserve.engine.attention``: :func:`store_kv` against
``write_kv``, :func:`paged_decode_attention` against ``decode_attention`` and
:func:`paged_prefill_attention` against ``prefill_attention`` (one request at a time there); they are
compared in ``tests/integration/test_triton_attention.py``.

The caches are one layer's ``[kv_heads, num_blocks, block_size, head_dim]`` views of the engine's
block-major cache: every kernel takes their strides and never assumes contiguity. Token ``t`` of a
request lives in block ``block_table[t // block_size]`` at row ``t % block_size``; the kernels look
blocks up per token, so a tile of keys may span several blocks and any block size works.

Triton is an optional extra (``pip install 'splitserve[triton]'``; a CUDA build of torch brings its
own). It is imported on first use, never when this module is imported, and each kernel is compiled
for the mode in force at that moment: on a CPU the kernels run only through Triton's interpreter,
``TRITON_INTERPRET=1``, which must be set before ``triton`` is first imported in the process (the
interpreter replaces ``triton.language``'s own functions as they are defined). That is for tests:
it runs every program instance in Python, one after another.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from splitserve.kernels.triton_ops import interpreting, language_interpreted, launch

triton = None  # the triton module and triton.language, imported by _triton() on first use
tl = None

# Split-K for decode: each split covers at least this many tokens of context (one key tile)...
MIN_TOKENS_PER_SPLIT = 64
# ...and a decode launch has at most this many splits per (request, KV head). On an H100 a split is bound by
# latency, not bytes (a program's first tile waits on its block table, then on its keys): one request over
# 4,096 tokens took 17 us in 16 splits and 13 in 64, over 16,384 tokens 20 us in 64 and 18 in 128.
MAX_NUM_SPLITS = 128
# Split-K for prefill: a split covers at least this many tokens of cached context, and a prefill launch has at most
# MAX_PREFILL_SPLITS splits per (query tile, chunk, KV head). One chunk of a long prompt over a few KV heads is
# otherwise a few dozen programs on a GPU of 132 SMs, each walking the whole context alone.
MIN_CONTEXT_PER_SPLIT = 256
MAX_PREFILL_SPLITS = 16
# Rows (token x KV head) per store_kv program.
STORE_ROWS = 64
# tl.dot needs every dimension of at least 16 on GPUs: smaller GQA groups are padded to this.
MIN_DOT_ROWS = 16

_INSTALL_HINT = "pip install 'splitserve[triton]' (a CUDA build of torch brings its own triton)"


@dataclass(frozen=True)
class Tiles:
    """How an attention launch cuts its work, and the GPU resources of each program. A key tile may span
    several cache blocks."""

    rows: int  # query rows (token x query head of one KV head) per prefill program, a power of 2 >= 16
    key_tile: int  # keys (and values) attended per loop iteration, a power of 2 >= 16
    num_warps: int
    num_stages: int  # depth of the software pipeline of the key/value loads


def decode_tiles(dtype: torch.dtype, head_dim: int) -> Tiles:
    """The decode tiles that compile without register spills for sm_80 and sm_90 with Triton 3.6 and 3.9, as
    :func:`prefill_tiles`.

    A decode program's rows are the query heads of one KV head (``rows`` is unused). Half precision:
    64 keys, 4 warps; a three-stage load pipeline at head size 64, two from 128 (three spill there with
    Triton 3.6, and two spill at 64). Measured on an H100 at head size 64 (``benchmarks/gpu_kernels.py``
    and its notes in the README): 16 to 128 keys, 1 to 8 warps and 2 to 4 stages are within a few percent
    of one another once the split count fills the GPU. Float32 at head size 128 spills with 64 keys on 4
    warps (and with 32 keys on 4 warps): 32 keys on 8 warps do not.
    """
    if dtype == torch.float32:
        return Tiles(rows=0, key_tile=32, num_warps=8, num_stages=3)
    return Tiles(rows=0, key_tile=64, num_warps=4, num_stages=2 if head_dim >= 128 else 3)


def prefill_tiles(dtype: torch.dtype, head_dim: int, arch: int | None = None) -> Tiles:
    """The tiles that compile without register spills for the GPU of compute capability ``arch`` (major * 10 +
    minor; None: not a GPU, the interpreter), checked for sm_80 and sm_90 by ``python -m
    splitserve.kernels.triton_aot`` and ``tests/integration/test_triton_compile.py``.

    Half-precision products run on tensor cores: 64 query rows x 64 keys in 4 warps and two pipeline
    stages up to head size 64. From head size 128, on Hopper (sm_90, warp-group products) 128 rows x 64
    keys in 8 warps and two stages, elsewhere 64 x 64 in 8 warps and three (on sm_80, 128 rows spill at
    head size 128, and so do 4 warps). The Hopper and head-64 tiles were the fastest of nine non-spilling
    ones timed on an H100 (``benchmarks/gpu_kernels.py --prefill-tiles``; README "On an H100"): at head size
    128, 1.8-2.0x the 64 x 64 x 8-warp tiles; at 64, 0-9% ahead of three stages. Float32 products run in
    full precision on the CUDA cores, each thread holding a share of both operands: tiles of 16 rows by 16
    keys keep them in registers with the loads pipelined (64 x 64 spills hundreds of registers at head size
    64, thousands at 128; 32 x 16 still spills at 128 unless unpipelined).
    """
    if dtype == torch.float32:
        hopper_head_128 = head_dim >= 128 and arch is not None and arch >= 90  # Triton 3.8 spills it pipelined
        return Tiles(rows=16, key_tile=16, num_warps=4, num_stages=1 if hopper_head_128 else 2)
    if head_dim < 128:
        return Tiles(rows=64, key_tile=64, num_warps=4, num_stages=2)
    if arch is not None and arch >= 90:
        return Tiles(rows=128, key_tile=64, num_warps=8, num_stages=2)
    return Tiles(rows=64, key_tile=64, num_warps=8, num_stages=3)


def check_usable(device: torch.device) -> None:
    """Raise ValueError with a sentence when the Triton kernels cannot run on ``device`` in this process.

    Imports triton only once the checks that need no import pass (an import without TRITON_INTERPRET
    would fix triton.language for the compiler in this process).
    """
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"attention_backend='triton' needs triton: {_INSTALL_HINT}.")
    if device.type == "cuda":
        return
    if not interpreting():
        raise ValueError(
            f"attention_backend='triton' on a {device.type} device runs only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting (slow, for tests), or use the 'cpu' or 'torch' backend here."
        )
    if not language_interpreted():
        raise ValueError(
            "TRITON_INTERPRET=1 was set after triton was imported in this process, so triton.language "
            "was built for the compiler; set it before anything imports triton."
        )


def store_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's keys and values into their slots of the caches, in place.

    key_cache, value_cache: [kv_heads, num_blocks, block_size, head_dim] (any strides);
    key, value: [tokens, kv_heads, head_dim] (any strides); slot_mapping: [tokens] int64,
    slot = block * block_size + row; a negative slot skips its token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_padded = _next_power_of_2(num_kv_heads)
    tokens_per_program = max(1, STORE_ROWS // heads_padded)
    kernels = _kernels(interpreting())
    launch(
        kernels.store_kv, (-(-num_tokens // tokens_per_program),),
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        num_tokens, num_kv_heads, head_dim, key_cache.shape[2],
        TOKENS=tokens_per_program, HEADS=heads_padded, HEAD_DIM=_next_power_of_2(head_dim),
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per request attending to its whole paged context, split-K over the context.

    A first kernel attends each (request, KV head, split) program's share of the context for the
    query heads of that KV head (grouped-query attention at any ratio) and writes a partial output
    with its log-sum-exp; a second combines the splits. Splits past a request's end are empty.

    query: [requests, q_heads, head_dim] (any strides); caches: [kv_heads, num_blocks, block_size,
    head_dim] (any strides); block_tables: [requests, max_blocks] int (entries past a request's
    blocks are never read); seq_lens: [requests] int, context lengths with the new token, each at
    least 1 and at most max_blocks * block_size. num_splits: None chooses from the context length
    (:func:`choose_num_splits`); tests set it. tiles: None chooses by dtype and head size
    (:func:`decode_tiles`); tests set it. out: where to write the result (any strides, query's shape and
    dtype: the engine's step output, rows of these requests), saving a copy; None: a new tensor.

    Returns: ``out``, or a new [requests, q_heads, head_dim] tensor in query's dtype.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    _check_grouping(num_q_heads, num_kv_heads)
    output = _output_for(query, out)
    if num_seqs == 0:
        return output
    max_context = block_tables.shape[1] * block_size  # an upper bound known without reading seq_lens
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    tiles = tiles or decode_tiles(query.dtype, head_dim)
    group_size = num_q_heads // num_kv_heads
    partial_out, partial_lse = _partials(output, num_splits)
    head_dim_padded = _next_power_of_2(head_dim)
    kernels = _kernels(interpreting())
    launch(
        kernels.decode_partial, (num_seqs, num_kv_heads, num_splits),
        query, key_cache, value_cache, block_tables, seq_lens, partial_out, partial_lse,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0), *partial_out.stride(),
        scale * _LOG2_E, head_dim, block_size, group_size, num_q_heads, num_splits,
        GROUP=max(MIN_DOT_ROWS, _next_power_of_2(group_size)), HEAD_DIM=head_dim_padded, KEY_TILE=tiles.key_tile,
        FP32_DOT=_fp32_dot(query.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _combine_splits(kernels, partial_out, partial_lse, output)
    return output


def paged_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch of prompt chunks over their cached context and themselves.

    Chunk ``i`` is rows ``query_start_loc[i]:query_start_loc[i + 1]``; its first token sits at
    position ``context_lens[i]`` of its request, whose earlier tokens are in the paged cache
    (``block_tables[i]``). Context keys and values are read from the cache in place (no gather copy);
    the chunk's own come from ``key``/``value``, so this does not depend on :func:`store_kv` having
    run first.

    query: [tokens, q_heads, head_dim]; key, value: [tokens, kv_heads, head_dim] (any strides);
    caches: [kv_heads, num_blocks, block_size, head_dim] (any strides); query_start_loc:
    [chunks + 1] int, ascending from 0; context_lens: [chunks] int; block_tables: [chunks,
    max_blocks] int, covering each chunk's context. max_query_len: the longest chunk, when the
    caller knows it (else read from query_start_loc, a device sync on GPUs). max_context_len: the
    longest context, when the caller knows it (else bounded by the block tables' width). num_splits:
    parts of each chunk's context attended by programs of their own and combined by a second kernel, as
    decode's splits; None chooses from the launch's programs and the context (:func:`choose_prefill_splits`);
    tests set it. tiles: None chooses by dtype, head size and query's GPU (:func:`prefill_tiles`); tests and
    ahead-of-time compiles set it. out: where to write the result (as :func:`paged_decode_attention`'s);
    None: a new tensor.

    Returns: ``out``, or a new [tokens, q_heads, head_dim] tensor in query's dtype.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    _check_grouping(num_q_heads, num_kv_heads)
    output = _output_for(query, out)
    num_chunks = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_chunks == 0:
        return output
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group_size = num_q_heads // num_kv_heads
    group_padded = _next_power_of_2(group_size)
    tiles = tiles or prefill_tiles(query.dtype, head_dim, _arch(query.device))
    rows = max(tiles.rows, group_padded)
    tokens_per_tile = rows // group_padded
    num_tiles = -(-max_query_len // tokens_per_tile)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = block_tables.shape[1] * key_cache.shape[2]  # a bound known without a sync
        num_splits = choose_prefill_splits(num_tiles * num_chunks * num_kv_heads, max_context_len, query.device,
                                           prefill_programs_per_sm(tiles))
    partial_out, partial_lse = _partials(output, num_splits)
    kernels = _kernels(interpreting())
    launch(
        kernels.prefill, (num_tiles, num_chunks, num_kv_heads * num_splits),
        query, key, value, key_cache, value_cache, partial_out, partial_lse, query_start_loc, context_lens,
        block_tables,
        *query.stride(), *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        *partial_out.stride(), block_tables.stride(0),
        scale * _LOG2_E, head_dim, key_cache.shape[2], group_size, num_q_heads, num_splits,
        ROWS=rows, GROUP=group_padded, KEY_TILE=tiles.key_tile, HEAD_DIM=_next_power_of_2(head_dim),
        SPLIT=num_splits > 1, FP32_DOT=_fp32_dot(query.dtype), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _combine_splits(kernels, partial_out, partial_lse, output)
    return output


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (request, KV head): enough programs to fill the device, each split at least
    MIN_TOKENS_PER_SPLIT tokens, at most MAX_NUM_SPLITS. A batch of a few long requests splits
    its context; a large batch or short contexts do not split."""
    by_length = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    by_occupancy = -(-_wanted_programs(device, 4) // (num_seqs * num_kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_NUM_SPLITS))


def choose_prefill_splits(num_programs: int, max_context: int, device: torch.device, programs_per_sm: int) -> int:
    """Splits of the cached context per prefill program (query tile, chunk, KV head): as many times as the
    launch's programs fit in one wave of ``programs_per_sm`` on every SM (where the GPU is not known, in
    128 programs), each split at least MIN_CONTEXT_PER_SPLIT tokens of context, at most MAX_PREFILL_SPLITS.

    A launch of a wave or more (a large chunk, several chunks, many KV heads), or a short context, does not
    split: a split then adds waves, not SMs, and costs a second kernel. Measured on an H200 (README "Prefill
    attention split across programs"): SmolLM2's one chunk of 512 tokens is 96 programs of 3 per SM, and 4
    splits took it from 505 to 158 us after 16k tokens; Llama-3-8B's is 128 programs of one per SM, and any
    split was slower or within 5%; four chunks of either were fastest unsplit.
    """
    by_length = max(1, max_context // MIN_CONTEXT_PER_SPLIT)
    by_occupancy = _wanted_programs(device, programs_per_sm) // max(1, num_programs)
    return max(1, min(by_length, by_occupancy, MAX_PREFILL_SPLITS))


def prefill_programs_per_sm(tiles: Tiles) -> int:
    """Prefill programs an SM holds at once with ``tiles``, as the compile check reads them for sm_80 and sm_90
    (``python -m splitserve.kernels.triton_aot``): 8-warp tiles one (their registers and shared memory), 4-warp
    tiles 3 in bfloat16 at head size 64 (5-6 in float32: 3 is the floor)."""
    return 1 if tiles.num_warps >= 8 else 3


def _wanted_programs(device: torch.device, per_sm: int) -> int:
    """Programs that fill ``device`` at ``per_sm`` programs per SM; 128 where it is not a GPU (the interpreter)."""
    if device.type != "cuda":
        return 128
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def _partials(output: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a split-K launch writes: normalized partial outputs [rows, q_heads, splits, head_dim] (float32; with
    one split, the output itself as a view of one split: no second kernel) and their log2-sum-exp2 [rows, q_heads,
    splits] (float32), for ``output`` [rows, q_heads, head_dim]."""
    rows, num_q_heads, head_dim = output.shape
    if num_splits == 1:
        partial_out = output.unsqueeze(2)
    else:
        partial_out = torch.empty((rows, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=output.device)
    return partial_out, torch.empty((rows, num_q_heads, num_splits), dtype=torch.float32, device=output.device)


def _combine_splits(kernels: SimpleNamespace, partial_out: torch.Tensor, partial_lse: torch.Tensor,
                    output: torch.Tensor) -> None:
    """The reduction launch: each (row, query head) of ``output`` from its splits in ``_partials``' tensors."""
    rows, num_q_heads, num_splits, head_dim = partial_out.shape
    launch(
        kernels.decode_reduce, (rows, num_q_heads),
        partial_out, partial_lse, output, *output.stride(), num_q_heads, num_splits, head_dim,
        SPLITS=_next_power_of_2(num_splits), HEAD_DIM=_next_power_of_2(head_dim),
    )


_LOG2_E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))


def _fp32_dot(dtype: torch.dtype) -> bool:
    """Whether attention products run in float32 (see _attend_tile_step): for float32 inputs, and
    always in the interpreter."""
    return dtype == torch.float32 or interpreting()


def _output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against ``query`` (the kernels write it through its strides), or a new tensor like it."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match the query: {tuple(query.shape)} {query.dtype} on {query.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}.")
    return out


def _check_grouping(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads}).")


def _arch(device: torch.device) -> int | None:
    """The compute capability of a CUDA device as major * 10 + minor (None elsewhere)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _triton():
    """Import triton (and triton.language as this module's ``tl``, which the kernels use)."""
    global triton, tl
    if tl is None:
        try:
            import triton as triton_module
            import triton.language as language
        except ImportError as error:
            raise ImportError(f"the Triton kernels need triton: {_INSTALL_HINT}") from error
        triton, tl = triton_module, language
    return triton


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The kernels jitted for one mode: the interpreter or the compiler (triton decides when jitting).

    The kernels call their shared step by its global name ``_attend_tile``, bound here: jitted for
    the compiler, the plain function for the interpreter (which runs kernels as Python, and patches
    ``triton.language`` again on every call of a jitted helper: milliseconds). A process uses one
    mode, since ``triton.language`` itself is built for one.
    """
    global _attend_tile
    jit = _triton().jit
    _attend_tile = _attend_tile_step if interpret else jit(_attend_tile_step)
    return SimpleNamespace(
        store_kv=jit(_store_kv_kernel),
        decode_partial=jit(_decode_partial_kernel),
        decode_reduce=jit(_decode_reduce_kernel),
        prefill=jit(_prefill_kernel),
    )


# ---- kernels (plain functions, jitted by _kernels; ``tl`` is bound by then) ----------------------


_attend_tile = None  # _attend_tile_step as _kernels binds it


def _attend_tile_step(q, k_t, v, visible, scale_log2, row_max, row_sum, acc, FP32_DOT: tl.constexpr):
    """One step of the online softmax: queries q [M, D] against a tile of keys k_t [D, N] and values
    v [N, D], where ``visible`` [M, N] (or [1, N]) says which keys each query sees. Scores are in base
    2 (scale_log2 = scale * log2(e)); row_max, row_sum [M] and acc [M, D] (float32) are carried.
    FP32_DOT: both products in float32 at full precision (not TF32) from the operands' values, which
    for bfloat16 operands gives what a bfloat16 dot accumulating in float32 gives (their products are
    exact in float32); the interpreter needs it, since its tl.dot misreads bfloat16.

    Returns the updated (row_max, row_sum, acc).
    """
    if FP32_DOT:
        scores = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    else:
        scores = tl.dot(q, k_t)
    scores = tl.where(visible, scores * scale_log2, float("-inf"))  # [M, N]
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    correction = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(probs, 1)
    # The weights are rounded to the values' dtype, as a low-precision dot would take them.
    if FP32_DOT:
        weighted = tl.dot(probs.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        weighted = tl.dot(probs.to(v.dtype), v)
    return new_max, row_sum, acc * correction[:, None] + weighted


def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    key_stride_token, key_stride_head, key_stride_dim,
    value_stride_token, value_stride_head, value_stride_dim,
    key_cache_stride_head, key_cache_stride_block, key_cache_stride_row, key_cache_stride_dim,
    value_cache_stride_head, value_cache_stride_block, value_cache_stride_row, value_cache_stride_dim,
    num_tokens, num_kv_heads, head_dim, block_size,
    TOKENS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Program i: tokens [i * TOKENS, (i + 1) * TOKENS), each its [kv_heads, head_dim] key and value
    into its slot; rows of the tile are (token, KV head) pairs."""
    # Offsets are int64 (caches can pass 2**31 elements; the interpreter also skips its overflow checks).
    rows = tl.arange(0, TOKENS * HEADS).to(tl.int64)
    tokens = tl.program_id(0) * TOKENS + rows // HEADS  # [TOKENS * HEADS]
    heads = rows % HEADS
    dims = tl.arange(0, HEAD_DIM).to(tl.int64)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    blocks = slots // block_size
    block_rows = slots % block_size
    row_mask = (tokens < num_tokens) & (heads < num_kv_heads) & (slots >= 0)
    mask = row_mask[:, None] & (dims < head_dim)[None, :]
    key = tl.load(
        key_ptr + tokens[:, None] * key_stride_token + heads[:, None] * key_stride_head + dims[None, :] * key_stride_dim,
        mask=mask,
    )
    value = tl.load(
        value_ptr + tokens[:, None] * value_stride_token + heads[:, None] * value_stride_head
        + dims[None, :] * value_stride_dim,
        mask=mask,
    )
    tl.store(
        key_cache_ptr + heads[:, None] * key_cache_stride_head + blocks[:, None] * key_cache_stride_block
        + block_rows[:, None] * key_cache_stride_row + dims[None, :] * key_cache_stride_dim,
        key.to(key_cache_ptr.dtype.element_ty), mask=mask,
    )
    tl.store(
        value_cache_ptr + heads[:, None] * value_cache_stride_head + blocks[:, None] * value_cache_stride_block
        + block_rows[:, None] * value_cache_stride_row + dims[None, :] * value_cache_stride_dim,
        value.to(value_cache_ptr.dtype.element_ty), mask=mask,
    )


def _decode_partial_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr,
    query_stride_seq, query_stride_head, query_stride_dim,
    key_cache_stride_head, key_cache_stride_block, key_cache_stride_row, key_cache_stride_dim,
    value_cache_stride_head, value_cache_stride_block, value_cache_stride_row, value_cache_stride_dim,
    block_tables_stride,
    partial_out_stride_seq, partial_out_stride_head, partial_out_stride_split, partial_out_stride_dim,
    scale_log2, head_dim, block_size, group_size, num_q_heads, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, KEY_TILE: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Program (request, KV head, split): the query heads of that KV head over the split's tokens,
    online softmax in base 2; writes the normalized partial output and its log2-sum-exp2. Each request's
    context is cut into num_splits parts of whole key tiles by its own length (not the batch's longest), so
    short requests in a long batch, or in a CUDA graph sized for the longest request, still split."""
    # Offsets are int64 (caches can pass 2**31 elements; the interpreter also skips its overflow checks).
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    tokens_per_split = (seq_len + num_splits * KEY_TILE - 1) // (num_splits * KEY_TILE) * KEY_TILE
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    members = tl.arange(0, GROUP).to(tl.int64)  # [GROUP] query heads of this KV head (padded)
    dims = tl.arange(0, HEAD_DIM).to(tl.int64)
    q_heads = kv_head * group_size + members
    member_mask = members < group_size
    dim_mask = dims < head_dim
    # q: [GROUP, HEAD_DIM]
    q = tl.load(
        query_ptr + seq * query_stride_seq + q_heads[:, None] * query_stride_head + dims[None, :] * query_stride_dim,
        mask=member_mask[:, None] & dim_mask[None, :], other=0.0,
    )
    # tl.full, not tl.zeros: the interpreter re-patches triton.language on every call of one of its
    # jitted library functions (tl.zeros is one), which costs milliseconds.
    row_max = tl.full([GROUP], float("-inf"), dtype=tl.float32)
    row_sum = tl.full([GROUP], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP, HEAD_DIM], 0.0, dtype=tl.float32)
    key_base = key_cache_ptr + kv_head * key_cache_stride_head
    value_base = value_cache_ptr + kv_head * value_cache_stride_head
    table = block_tables_ptr + seq * block_tables_stride
    for tile_start in range(start, end, KEY_TILE):
        tokens = tile_start + tl.arange(0, KEY_TILE).to(tl.int64)  # [KEY_TILE]
        valid = tokens < end
        blocks = tl.load(table + tokens // block_size, mask=valid, other=0).to(tl.int64)
        rows = tokens % block_size
        kv_mask = valid[:, None] & dim_mask[None, :]
        # k, v: [KEY_TILE, HEAD_DIM], both loaded along the cache's rows (16 bytes per thread where it can).
        k = tl.load(
            key_base + blocks[:, None] * key_cache_stride_block + rows[:, None] * key_cache_stride_row
            + dims[None, :] * key_cache_stride_dim,
            mask=kv_mask, other=0.0,
        )
        v = tl.load(
            value_base + blocks[:, None] * value_cache_stride_block + rows[:, None] * value_cache_stride_row
            + dims[None, :] * value_cache_stride_dim,
            mask=kv_mask, other=0.0,
        )
        row_max, row_sum, acc = _attend_tile(q, tl.trans(k), v, valid[None, :], scale_log2, row_max, row_sum, acc,
                                             FP32_DOT)

    # An empty split (past the request's end) writes zeros with a log-sum-exp of -inf: weight 0.
    has_keys = row_sum > 0
    out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
    lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
    tl.store(partial_lse_ptr + (seq * num_q_heads + q_heads) * num_splits + split, lse, mask=member_mask)
    tl.store(
        partial_out_ptr + seq * partial_out_stride_seq + q_heads[:, None] * partial_out_stride_head
        + split * partial_out_stride_split + dims[None, :] * partial_out_stride_dim,
        out.to(partial_out_ptr.dtype.element_ty), mask=member_mask[:, None] & dim_mask[None, :],
    )


def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, output_ptr,
    output_stride_seq, output_stride_head, output_stride_dim,
    num_q_heads, num_splits, head_dim,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Program (request, query head): combine the splits' partial outputs, weighted by exp2 of their
    log-sum-exp relative to the largest."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM).to(tl.int64)
    split_mask = splits < num_splits
    dim_mask = dims < head_dim
    rows = (seq * num_q_heads + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + rows, mask=split_mask, other=float("-inf"))  # [SPLITS]
    weights = tl.exp2(lse - tl.max(lse, 0))  # the first split always holds a key: the max is finite
    partial = tl.load(partial_out_ptr + rows[:, None] * head_dim + dims[None, :],
                      mask=split_mask[:, None] & dim_mask[None, :], other=0.0)  # [SPLITS, HEAD_DIM]
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(output_ptr + seq * output_stride_seq + head * output_stride_head + dims * output_stride_dim,
             out.to(output_ptr.dtype.element_ty), mask=dim_mask)


def _prefill_kernel(
    query_ptr, key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, output_ptr, lse_ptr,
    query_start_loc_ptr, context_lens_ptr, block_tables_ptr,
    query_stride_token, query_stride_head, query_stride_dim,
    key_stride_token, key_stride_head, key_stride_dim,
    value_stride_token, value_stride_head, value_stride_dim,
    key_cache_stride_head, key_cache_stride_block, key_cache_stride_row, key_cache_stride_dim,
    value_cache_stride_head, value_cache_stride_block, value_cache_stride_row, value_cache_stride_dim,
    output_stride_token, output_stride_head, output_stride_split, output_stride_dim,
    block_tables_stride,
    scale_log2, head_dim, block_size, group_size, num_q_heads, num_splits,
    ROWS: tl.constexpr, GROUP: tl.constexpr, KEY_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Program (query tile, chunk, KV head x split): ROWS // GROUP tokens of one chunk times the GROUP
    query heads sharing the KV head (rows are (token, query head) pairs, so each key tile is loaded once
    for the group), first over its split's share of the request's cached context (every key visible),
    then, in the last split, causally over the chunk's own keys.

    The keys this tile attends (the context and its own, up to its last token) are cut into num_splits
    parts of whole key tiles; split s takes the context's keys in part s, and the last split all of the
    chunk's own (key 0 is visible to every row, so every row of the last split has a finite maximum;
    other splits see every key of their tiles or none). output_ptr: [tokens, q_heads, splits, head_dim] (the
    output as one split when unsplit); SPLIT: it is float32 for the normalized partial outputs, and lse_ptr a
    [tokens, q_heads, splits] for their log2-sum-exp2 (unused when unsplit)."""
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    kv_head = (tl.program_id(2) // num_splits).to(tl.int64)
    split = (tl.program_id(2) % num_splits).to(tl.int64)
    chunk_start = tl.load(query_start_loc_ptr + chunk).to(tl.int64)
    chunk_len = tl.load(query_start_loc_ptr + chunk + 1).to(tl.int64) - chunk_start
    tile_start = tile * (ROWS // GROUP)
    if tile_start >= chunk_len:
        return
    num_context = tl.load(context_lens_ptr + chunk).to(tl.int64)
    key_end = tl.minimum(chunk_len, tile_start + ROWS // GROUP)  # the chunk's own keys this tile's rows see
    if SPLIT:
        per_split = (num_context + key_end + num_splits * KEY_TILE - 1) // (num_splits * KEY_TILE) * KEY_TILE
        context_start = tl.minimum(split * per_split, num_context)
        context_end = tl.minimum(context_start + per_split, num_context)
        own_end = tl.where(split == num_splits - 1, key_end, 0)
    else:  # the bounds as plain as they can be: the unsplit kernel keeps its registers for the tiles
        context_start = 0
        context_end = num_context
        own_end = key_end

    rows = tl.arange(0, ROWS).to(tl.int64)
    positions = tile_start + rows // GROUP  # [ROWS] each row's token, as a position within the chunk
    members = rows % GROUP
    q_heads = kv_head * group_size + members
    row_mask = (positions < chunk_len) & (members < group_size)
    dims = tl.arange(0, HEAD_DIM).to(tl.int64)
    dim_mask = dims < head_dim
    token_rows = chunk_start + positions
    q = tl.load(
        query_ptr + token_rows[:, None] * query_stride_token + q_heads[:, None] * query_stride_head
        + dims[None, :] * query_stride_dim,
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    )
    row_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    row_sum = tl.full([ROWS], 0.0, dtype=tl.float32)
    acc = tl.full([ROWS, HEAD_DIM], 0.0, dtype=tl.float32)

    # The context, read from the paged cache: every query sees all of it.
    key_base = key_cache_ptr + kv_head * key_cache_stride_head
    value_base = value_cache_ptr + kv_head * value_cache_stride_head
    table = block_tables_ptr + chunk * block_tables_stride
    for key_start in range(context_start, context_end, KEY_TILE):
        tokens = key_start + tl.arange(0, KEY_TILE).to(tl.int64)
        valid = tokens < context_end
        blocks = tl.load(table + tokens // block_size, mask=valid, other=0).to(tl.int64)
        block_rows = tokens % block_size
        k_t = tl.load(
            key_base + blocks[None, :] * key_cache_stride_block + block_rows[None, :] * key_cache_stride_row
            + dims[:, None] * key_cache_stride_dim,
            mask=valid[None, :] & dim_mask[:, None], other=0.0,
        )
        v = tl.load(
            value_base + blocks[:, None] * value_cache_stride_block + block_rows[:, None] * value_cache_stride_row
            + dims[None, :] * value_cache_stride_dim,
            mask=valid[:, None] & dim_mask[None, :], other=0.0,
        )
        row_max, row_sum, acc = _attend_tile(q, k_t, v, valid[None, :], scale_log2, row_max, row_sum, acc, FP32_DOT)

    # The chunk itself from key/value (the last split only), causal: key j is visible to query i when j <= i.
    for key_start in range(0, own_end, KEY_TILE):
        key_positions = key_start + tl.arange(0, KEY_TILE).to(tl.int64)
        valid = key_positions < own_end
        key_rows = chunk_start + key_positions
        k_t = tl.load(
            key_ptr + key_rows[None, :] * key_stride_token + kv_head * key_stride_head + dims[:, None] * key_stride_dim,
            mask=valid[None, :] & dim_mask[:, None], other=0.0,
        )
        v = tl.load(
            value_ptr + key_rows[:, None] * value_stride_token + kv_head * value_stride_head
            + dims[None, :] * value_stride_dim,
            mask=valid[:, None] & dim_mask[None, :], other=0.0,
        )
        visible = valid[None, :] & (key_positions[None, :] <= positions[:, None])
        row_max, row_sum, acc = _attend_tile(q, k_t, v, visible, scale_log2, row_max, row_sum, acc, FP32_DOT)

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # A split with no keys (its part past the context) writes zeros with a log-sum-exp of -inf: weight 0.
        has_keys = row_sum > 0
        out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
        lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + (token_rows * num_q_heads + q_heads) * num_splits + split, lse, mask=row_mask)
        tl.store(
            output_ptr + token_rows[:, None] * output_stride_token + q_heads[:, None] * output_stride_head
            + split * output_stride_split + dims[None, :] * output_stride_dim,
            out, mask=out_mask,
        )
    else:
        out = acc / row_sum[:, None]
        tl.store(
            output_ptr + token_rows[:, None] * output_stride_token + q_heads[:, None] * output_stride_head
            + dims[None, :] * output_stride_dim,
            out.to(output_ptr.dtype.element_ty), mask=out_mask,
        )
