"""Triton kernels for the Llama layer's element-wise operations and for KV block copies.

Each computes what its plain-torch reference computes, with the same in-place contract as the C++
CPU kernels of ``cpu_ops``:

- :func:`rms_norm`, :func:`add_rms_norm` (reference: ``engine.models.rms_norm.RMSNorm``);
- :func:`rotary_` (``engine.models.rotary_embedding.apply_rotary``: half-split layout);
- :func:`silu_and_mul` (``F.silu(gate) * up``, as ``engine.models.llama.LlamaMLP``);
- :func:`gather_blocks`, :func:`scatter_blocks` (``kvtransfer.blocks``: ``index_select`` / ``index_copy_``
  of whole blocks of the block-major cache), for KV connectors whose transport needs one buffer.

Arithmetic is float32 whatever the tensors' dtype, rounded to that dtype wherever torch rounds, so
results differ from torch's only by a sum's order or the last bits of an exp or a square root, before
that rounding; the residual add and rotary (launched without multiply-add contraction) are
bit-identical to torch on a GPU, and in float32 in the interpreter too.

Triton is an optional extra (``pip install 'splitserve[triton]'``); this module imports without it and
each op raises then. The kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``
(the tests). Triton reads that variable twice: when ``triton`` is first imported (its own library
functions, ``tl.sum`` and the like, are wrapped then) and when a kernel is wrapped. This module imports
Triton and wraps its kernels on the first call of an op, so setting the variable before that is enough,
unless something else imported Triton earlier in the process (an op then says so).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

# Imported on the first call of an op (_import_triton), not with this module: TRITON_INTERPRET is read then.
triton = tl = None

INSTALL_HINT = "Triton is not installed: pip install 'splitserve[triton]' (a CUDA build of torch brings its own)."
_MAX_ROW_BLOCK = 65536  # the widest row one program normalizes (hidden sizes of Llama models are <= 16384)
_COPY_CHUNK = 4096  # words a program copies in gather/scatter_blocks
_SILU_CHUNK = 1024  # outputs a program computes in silu_and_mul


def available() -> bool:
    """Whether the ops can run here: Triton is installed, and a CUDA GPU is present or the interpreter is on
    (and was on when Triton was imported). Imports Triton."""
    try:
        _import_triton()
    except RuntimeError:
        return False
    return torch.cuda.is_available() or (interpreting() and language_interpreted())


def interpreting() -> bool:
    """Whether kernels wrapped now run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _import_triton() -> None:
    global triton, tl
    if triton is not None:
        return
    try:
        import triton as triton_module
        import triton.language as language
    except ImportError as error:
        raise RuntimeError(INSTALL_HINT) from error
    triton, tl = triton_module, language


def language_interpreted() -> bool:
    """Whether Triton's own library functions (``tl.sum``...) were wrapped for the interpreter at its import
    (interpreted kernels that call them need it). Imports Triton."""
    _import_triton()
    return type(sys.modules["triton.language"].sum).__name__ == "InterpretedFunction"


@functools.cache
def _jit(kernel, interpret: bool):
    # Wrapped here, not with a decorator at import: the interpreter switch is read at wrapping time.
    del interpret  # part of the cache key only
    return triton.jit(kernel)


# Set by ``triton_aot.compiling_for`` while it compiles the kernels for a GPU that is not here: a callable
# (jitted kernel, grid, arguments, options) that compiles each launch instead of running it.
_compile_instead = None


def launch(jitted, grid, *arguments, **options) -> None:
    """Run a jitted kernel over ``grid`` (or, inside ``triton_aot.compiling_for``, compile it for that GPU)."""
    if _compile_instead is not None:
        _compile_instead(jitted, grid, arguments, options)
    else:
        jitted[grid](*arguments, **options)


def _launch(kernel, grid, *arguments, **options):
    """Run ``kernel`` over ``grid``, after checking that its tensors can be reached from where it runs."""
    interpret = interpreting()
    if _compile_instead is not None:
        launch(_jit(kernel, interpret), grid, *arguments, **options)
        return
    for argument in arguments:
        if isinstance(argument, torch.Tensor) and argument.device.type != "cuda" and not interpret:
            raise RuntimeError(
                f"{kernel.__name__}: Triton kernels run on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 "
                f"set before the first call; got a tensor on {argument.device}."
            )
    if interpret and not language_interpreted():
        raise RuntimeError(
            f"{kernel.__name__}: TRITON_INTERPRET=1 was set after Triton was imported in this process; set it "
            "before anything imports triton."
        )
    launch(_jit(kernel, interpret), grid, *arguments, **options)


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() != 2 or (tensor.shape[1] > 1 and tensor.stride(1) != 1):
        raise ValueError(f"{name}: expected [rows, features] with unit stride along features, got "
                         f"shape {tuple(tensor.shape)} strides {tensor.stride()}")


def _row_block(size: int) -> int:
    block = triton.next_power_of_2(max(size, 1))
    if block > _MAX_ROW_BLOCK:
        raise ValueError(f"rows of {size} features are wider than one program normalizes ({_MAX_ROW_BLOCK})")
    return block


# ---- RMSNorm, with and without the residual add -------------------------------------------------------


def _rms_norm_kernel(x_ptr, x_row_stride, residual_ptr, residual_row_stride, weight_ptr, out_ptr, size, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row. With HAS_RESIDUAL: residual += x (rounded to its dtype, stored), then the row
    # normalized is the new residual.
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < size
    x = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * residual_row_stride + columns
        summed = (tl.load(residual_row, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(residual_row, summed, mask=mask)
        x = summed
    values = x.to(tl.float32)
    mean_square = tl.sum(values * values, axis=0) / size
    normalized = (values * tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))).to(x.dtype)  # rounded as torch's .to(dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * size + columns, (weight * normalized.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, hidden] (unit stride along hidden); weight: [hidden].

    Returns ``weight * (x * rsqrt(mean(x^2) + eps))``, a new contiguous [rows, hidden] of x's dtype (the
    normalization in float32, rounded to x's dtype before the weight, as ``RMSNorm``). Changes nothing.
    """
    _import_triton()
    _check_rows(x, "rms_norm")
    _check_weight(weight, x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _launch(_rms_norm_kernel, (x.shape[0],), x, x.stride(0), x, 0, weight, out, x.shape[1], float(eps),
                HAS_RESIDUAL=False, BLOCK=_row_block(x.shape[1]))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then returns ``rms_norm(residual, weight, eps)`` (a new tensor).

    x, residual: [rows, hidden] of one dtype, unit stride along hidden (residual is modified; x is not);
    weight: [hidden]. The same contract as ``cpu_ops.add_rms_norm``.
    """
    _import_triton()
    _check_rows(x, "add_rms_norm")
    _check_rows(residual, "add_rms_norm")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    _check_weight(weight, x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _launch(_rms_norm_kernel, (x.shape[0],), x, x.stride(0), residual, residual.stride(0), weight, out,
                x.shape[1], float(eps), HAS_RESIDUAL=True, BLOCK=_row_block(x.shape[1]))
    return out


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.numel() != x.shape[1] or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"the weight must be a contiguous [{x.shape[1]}] of {x.dtype}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")


# ---- SiLU-and-multiply ------------------------------------------------------------------------------------


def _silu_and_mul_kernel(gate_up_ptr, row_stride, out_ptr, size, BLOCK: tl.constexpr):
    # Program (row, chunk): out[row, chunk] = silu(gate) * up, silu rounded to the dtype first (as F.silu).
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < size
    gate_row = gate_up_ptr + row * row_stride
    gate = tl.load(gate_row + columns, mask=mask, other=0.0)
    up = tl.load(gate_row + size + columns, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * size + columns, (silu.to(tl.float32) * up).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [rows, 2 * intermediate] (gate, then up; unit stride along features).

    Returns ``silu(gate) * up``, [rows, intermediate] of gate_up's dtype: ``out`` where given (contiguous, on
    gate_up's device; e.g. a block of rows of a larger tensor), else a new contiguous tensor.
    """
    _import_triton()
    _check_rows(gate_up, "silu_and_mul")
    if gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension must be even, got {gate_up.shape[1]}")
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(rows, size, dtype=gate_up.dtype, device=gate_up.device)
    elif (out.shape != (rows, size) or out.dtype != gate_up.dtype or out.device != gate_up.device
          or not out.is_contiguous()):
        raise ValueError("silu_and_mul: out must be a contiguous [rows, features / 2] tensor of gate_up's dtype "
                         "and device")
    if rows and size:
        block = min(_SILU_CHUNK, triton.next_power_of_2(size))
        _launch(_silu_and_mul_kernel, (rows, triton.cdiv(size, block)), gate_up, gate_up.stride(0), out, size,
                BLOCK=block)
    return out


# ---- Rotary embedding ---------------------------------------------------------------------------------


def _rotary_kernel(x_ptr, token_stride, head_stride, cos_ptr, sin_ptr, table_stride, num_heads, half,
                   HEADS: tl.constexpr, HALF: tl.constexpr):
    # One program per token, all its heads: row = row * cos + rotate_half(row) * sin, where
    # rotate_half(row) = [-row[half:], row[:half]]. Each product and the sum rounded to the dtype.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first_ptr = x_ptr + token * token_stride + heads * head_stride + dims
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(first_ptr + half, mask=mask, other=0.0)
    dtype = first.dtype
    table = token * table_stride + dims
    cos_first = tl.load(cos_ptr + table, mask=dims < half, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + table + half, mask=dims < half, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + table, mask=dims < half, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + table + half, mask=dims < half, other=0.0).to(tl.float32)
    a = first.to(tl.float32)
    b = second.to(tl.float32)
    new_first = (a * cos_first).to(dtype).to(tl.float32) + (-b * sin_first).to(dtype).to(tl.float32)
    new_second = (b * cos_second).to(dtype).to(tl.float32) + (a * sin_second).to(dtype).to(tl.float32)
    tl.store(first_ptr, new_first.to(dtype), mask=mask)
    tl.store(first_ptr + half, new_second.to(dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x: [tokens, heads, head_dim] in place (unit stride along head_dim; tokens and heads may be
    strided, e.g. the query and key heads of a fused QKV output). cos, sin: [tokens, head_dim], one stride.

    Half-split layout, as ``apply_rotary``: ``x * cos + rotate_half(x) * sin``. Nothing else changes.
    """
    _import_triton()
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise ValueError(f"rotary_: x must be [tokens, heads, even head_dim] with unit stride along head_dim, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    tokens, num_heads, head_dim = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (tokens, head_dim) or table.stride(1) != 1 or table.stride(0) != cos.stride(0):
            raise ValueError(f"rotary_: {name} must be [{tokens}, {head_dim}] with unit stride along head_dim "
                             f"(cos and sin alike), got {tuple(table.shape)} strides {table.stride()}")
    if tokens == 0 or num_heads == 0:
        return
    half = head_dim // 2
    # No multiply-add contraction: each product is rounded on its own, as torch rounds it.
    _launch(_rotary_kernel, (tokens,), x, x.stride(0), x.stride(1), cos, sin, cos.stride(0), num_heads, half,
            HEADS=triton.next_power_of_2(num_heads), HALF=triton.next_power_of_2(half), enable_fp_fusion=False)


# ---- Whole KV blocks into one buffer and back ---------------------------------------------------------


def _copy_blocks_kernel(source_ptr, source_block_stride, destination_ptr, destination_block_stride, source_ids_ptr,
                        destination_ids_ptr, words_per_block, SOURCE_IDS: tl.constexpr, DESTINATION_IDS: tl.constexpr,
                        CHUNK: tl.constexpr):
    # Program (i, chunk) copies one chunk of words of the i-th block: source[source_ids[i]] ->
    # destination[destination_ids[i]], either side's ids the identity where it has none (gather: the source's
    # only; scatter: the destination's only). Words are integers: the copy is bit-exact for any dtype.
    index = tl.program_id(0).to(tl.int64)
    source_block = index
    destination_block = index
    if SOURCE_IDS:
        source_block = tl.load(source_ids_ptr + index).to(tl.int64)
    if DESTINATION_IDS:
        destination_block = tl.load(destination_ids_ptr + index).to(tl.int64)
    words = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = words < words_per_block
    data = tl.load(source_ptr + source_block * source_block_stride + words, mask=mask)
    tl.store(destination_ptr + destination_block * destination_block_stride + words, data, mask=mask)


def gather_blocks(kv_cache: torch.Tensor, block_ids) -> torch.Tensor:
    """The blocks ``block_ids`` (a list or a 1-D integer tensor; any order, repeats allowed) of the cache,
    copied into a new contiguous buffer. Changes nothing.

    kv_cache: [num_blocks, *block_shape], each block contiguous (the block-major cache
              [num_blocks, layers, 2, kv_heads, block_size, head_dim]).
    returns:  [len(block_ids), *block_shape], bit-identical to ``kv_cache[block_ids]``.
    """
    _import_triton()
    ids = _block_ids(kv_cache, block_ids, "gather_blocks")
    buffer = torch.empty((ids.numel(), *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    _copy_blocks(kv_cache, ids, buffer, None)
    return buffer


def scatter_blocks(kv_cache: torch.Tensor, block_ids, buffer: torch.Tensor) -> None:
    """Write ``buffer[i]`` into block ``block_ids[i]`` of the cache, in place; no other block changes.

    kv_cache: [num_blocks, *block_shape], each block contiguous   (modified)
    block_ids: a list or a 1-D integer tensor, any order, no repeats
    buffer:   [len(block_ids), *block_shape] of the cache's dtype, each block contiguous
    """
    _import_triton()
    ids = _block_ids(kv_cache, block_ids, "scatter_blocks", unique=True)
    if buffer.shape != (ids.numel(), *kv_cache.shape[1:]) or buffer.dtype != kv_cache.dtype:
        raise ValueError(f"scatter_blocks: the buffer is {tuple(buffer.shape)} {buffer.dtype}; expected "
                         f"{(ids.numel(), *kv_cache.shape[1:])} {kv_cache.dtype}")
    _copy_blocks(buffer, None, kv_cache, ids)


def copy_blocks(source: torch.Tensor, source_ids, destination: torch.Tensor, destination_ids) -> None:
    """Write block ``source_ids[i]`` of ``source`` into block ``destination_ids[i]`` of ``destination``, in place,
    in one pass (no intermediate buffer); no other block changes. Both are ``[num_blocks, *block_shape]`` with each
    block contiguous and of the same bytes (their dtypes may differ: blocks are copied as bytes).

    source_ids: a list or a 1-D integer tensor, any order, repeats allowed
    destination_ids: as many, no repeats (each block is written once)
    """
    _import_triton()
    if source[:1].numel() * source.element_size() != destination[:1].numel() * destination.element_size():
        raise ValueError(f"copy_blocks: blocks of {source[:1].numel() * source.element_size()} and "
                         f"{destination[:1].numel() * destination.element_size()} bytes")
    from_ids = _block_ids(source, source_ids, "copy_blocks")
    to_ids = _block_ids(destination, destination_ids, "copy_blocks", unique=True)
    if from_ids.numel() != to_ids.numel():
        raise ValueError(f"copy_blocks: {from_ids.numel()} source blocks for {to_ids.numel()} destination blocks")
    _copy_blocks(source, from_ids, destination, to_ids)


def _block_ids(kv_cache: torch.Tensor, block_ids, name: str, unique: bool = False) -> torch.Tensor:
    """block_ids as an int64 tensor on the cache's device, checked against the cache (on the host for a list
    or a CPU tensor; a CUDA tensor is checked where it is, one device sync); ``unique``: each id once."""
    if kv_cache.dim() < 2 or not kv_cache[:1].is_contiguous():
        raise ValueError(f"{name}: the cache must be [num_blocks, ...] with each block contiguous, got shape "
                         f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
    if ids.numel():
        low, high = ids.min().item(), ids.max().item()
        if low < 0 or high >= kv_cache.shape[0]:
            raise IndexError(f"{name}: block ids must be in [0, {kv_cache.shape[0]}), got {low}..{high}")
    if unique and ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{name}: a block id appears twice; each block is written once")
    return ids.to(kv_cache.device, non_blocking=True).contiguous()


def _copy_blocks(source: torch.Tensor, source_ids: torch.Tensor | None, destination: torch.Tensor,
                 destination_ids: torch.Tensor | None) -> None:
    """One launch: block ``source_ids[i]`` (or i) of source into block ``destination_ids[i]`` (or i)."""
    ids = source_ids if source_ids is not None else destination_ids
    if ids.numel() == 0 or source[:1].numel() == 0:
        return
    if not source[:1].is_contiguous() or not destination[:1].is_contiguous():
        raise ValueError("gather/scatter/copy_blocks: each block of the cache and of the buffer must be contiguous")
    word = _word_type(source, destination)
    source_words, destination_words = _as_words(source, word), _as_words(destination, word)
    words_per_block = source_words.shape[1]
    chunk = min(_COPY_CHUNK, triton.next_power_of_2(words_per_block))
    _launch(_copy_blocks_kernel, (ids.numel(), triton.cdiv(words_per_block, chunk)),
            source_words, source_words.stride(0), destination_words, destination_words.stride(0),
            source_ids if source_ids is not None else ids, destination_ids if destination_ids is not None else ids,
            words_per_block, SOURCE_IDS=source_ids is not None, DESTINATION_IDS=destination_ids is not None,
            CHUNK=chunk)


def _word_type(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type (8, 4, 2 or 1 bytes) dividing the block's bytes, and each tensor's block
    stride and start address: blocks are copied in words of it."""
    block_bytes = tensors[0][:1].numel() * tensors[0].element_size()
    for word, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if block_bytes % size == 0 and all(
            tensor.stride(0) * tensor.element_size() % size == 0 and tensor.data_ptr() % size == 0
            for tensor in tensors
        ):
            return word
    return torch.uint8


def _as_words(blocks: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """[num_blocks, ...] with contiguous blocks seen as [num_blocks, words] of ``word``."""
    flat = blocks.as_strided((blocks.shape[0], blocks[:1].numel()), (blocks.stride(0), 1))
    return flat.view(torch.uint8).view(word)
