"""Paged attention in plain torch: the CPU backend, and the reference for the Triton kernels.

The KV cache of one layer is two tensors ``[num_kv_heads, num_blocks, block_size,
head_dim]``; token ``t`` of a request lives in slot ``block_table[t // B] * B + t % B``
of every head. They are strided views of the engine's block-major cache (see
``model_runner``): a block's rows of one head are contiguous, blocks and heads
are not, so nothing here flattens blocks and slots into one dimension.
Gathering a request's blocks gives each head's keys as one contiguous
``[tokens, head_dim]`` matrix, ready for attention without a transposing copy.

A step's batch is flattened: decode tokens first (one per request), then the
prefill chunks. :class:`AttentionMetadata` is built once per step by the model
runner and shared by every layer. It selects one of three implementations: this
module's torch code, the C++ CPU kernels (``splitserve/kernels/cpu_ops``: KV writes, decodes
and all prefill chunks in one call) or the Triton kernels (``splitserve/kernels/triton_attention``: KV writes, decodes
and all prefill chunks in one varlen launch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.kernels import cpu_ops, triton_attention


@dataclass
class PrefillSpan:
    """One request's prompt chunk in the flattened batch."""

    # Rows [query_start, query_end) of the flattened batch.
    query_start: int
    query_end: int
    # Tokens already in the cache before this chunk (0 for a fresh prompt).
    num_context_tokens: int
    # Block ids holding the context and the chunk: [num_blocks_of_request] int64.
    block_table: torch.Tensor


@dataclass
class DecodeGroup:
    """Decode requests of similar context length, attended together (padding stays small)."""

    # Rows [row_start, row_end) of the flattened batch, one token per request.
    row_start: int
    row_end: int
    # [requests, max_blocks] int64, padded with block 0 (masked).
    block_tables: torch.Tensor
    # [requests] int64: context length of each request, the new token included.
    seq_lens: torch.Tensor
    # [kv_heads * requests, 1, max_blocks * block_size] bool: True where a key position is PAST the
    # request's end (torch path only; None when the C++ kernels attend).
    mask: torch.Tensor | None


@dataclass
class PrefillBatch:
    """All prefill chunks of a step as one varlen batch (the Triton path's view of ``prefills``)."""

    # The chunks are rows [row_start, num_tokens) of the flattened batch (they follow the decodes).
    row_start: int
    # [chunks + 1] int32: chunk i is rows row_start + query_start_loc[i] ... row_start + query_start_loc[i + 1].
    query_start_loc: torch.Tensor
    # [chunks] int32: tokens of each request already in the cache before its chunk.
    context_lens: torch.Tensor
    # [chunks, max_blocks] int64: each request's blocks, padded with block 0 (never read).
    block_tables: torch.Tensor
    # The longest chunk, in tokens.
    max_query_len: int
    # The longest context before a chunk, in tokens (how far the kernel may split it).
    max_context_len: int

    @classmethod
    def from_spans(cls, spans: list[PrefillSpan]) -> PrefillBatch:
        """The step's prompt chunks (consecutive rows, after the decodes; at least one) as one batch."""
        row_start = spans[0].query_start
        starts = [span.query_start - row_start for span in spans] + [spans[-1].query_end - row_start]
        device = spans[0].block_table.device
        tables = torch.zeros(len(spans), max(len(span.block_table) for span in spans), dtype=torch.int64,
                             device=device)
        for row, span in enumerate(spans):
            tables[row, : len(span.block_table)] = span.block_table
        return cls(
            row_start=row_start,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor([span.num_context_tokens for span in spans], dtype=torch.int32, device=device),
            block_tables=tables,
            max_query_len=max(span.query_end - span.query_start for span in spans),
            max_context_len=max(span.num_context_tokens for span in spans),
        )


@dataclass
class AttentionMetadata:
    # Where each token's K/V is written: [num_tokens] int64 slot ids.
    slot_mapping: torch.Tensor
    # Decode tokens come first in the batch, grouped by context length.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Whether the C++ kernels store K/V and attend decodes (float32 or bfloat16), or plain torch.
    use_cpu_kernels: bool = False
    # Whether the Triton kernels store K/V and attend decodes and prefills, and the prefills as one
    # varlen batch for them or the C++ prefill kernel (built from ``prefills`` once per step by the model
    # runner; None: no prefills, or the C++ kernels do not take this head size and torch attends them).
    use_triton_kernels: bool = False
    prefill_batch: PrefillBatch | None = None
    # A piecewise CUDA graph's break (``engine/piecewise_graphs.py``): called instead of attending, with
    # (query, key, value, key_cache, value_cache, scale); returns the attention's output tensor.
    graph_break: Callable | None = None


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's keys and values into their slots.

    key_cache, value_cache: [kv_heads, num_blocks, block_size, head_dim] (any strides);
    key, value: [num_tokens, kv_heads, head_dim].
    """
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[:, blocks, offsets] = key.transpose(0, 1)
    value_cache[:, blocks, offsets] = value.transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention of the step's tokens over their requests' cached KV.

    Writes this step's key/value into the cache first, then attends.

    query: [num_tokens, q_heads, head_dim]; key, value: [num_tokens, kv_heads, head_dim].
    Returns: [num_tokens, q_heads, head_dim].
    """
    if metadata.graph_break is not None:
        return metadata.graph_break(query, key, value, key_cache, value_cache, scale)
    if metadata.use_triton_kernels:
        return paged_attention_triton(query, key, value, key_cache, value_cache, metadata, scale)
    if metadata.use_cpu_kernels:
        cpu_ops.write_kv_(key_cache, value_cache, key, value, metadata.slot_mapping)
    else:
        write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
    batch = metadata.prefill_batch
    if metadata.use_cpu_kernels and (batch is not None or not metadata.prefills):
        return _cpu_kernel_attention(query, key_cache, value_cache, metadata, scale)
    output = torch.empty_like(query)
    for group in metadata.decode_groups:
        rows = slice(group.row_start, group.row_end)
        if metadata.use_cpu_kernels:
            output[rows] = cpu_ops.paged_decode_attention(
                query[rows], key_cache, value_cache, group.block_tables, group.seq_lens, scale
            )
        else:
            output[rows] = decode_attention(query[rows], key_cache, value_cache, group, scale)
    for span in metadata.prefills:
        rows = slice(span.query_start, span.query_end)
        output[rows] = prefill_attention(query[rows], key[rows], value[rows], key_cache, value_cache, span, scale)
    return output


def _cpu_kernel_attention(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """The C++ kernels over a step of at most one decode group (rows first) and one prompt batch (the rest), each
    writing its rows of one output in place (a copy of a 4,096-token prompt step's took 1.4 ms a layer)."""
    output = query.new_empty(query.shape)
    for group in metadata.decode_groups:
        rows = slice(group.row_start, group.row_end)
        cpu_ops.paged_decode_attention(query[rows], key_cache, value_cache, group.block_tables, group.seq_lens, scale,
                                       out=output[rows])
    batch = metadata.prefill_batch
    if batch is not None:
        cpu_ops.paged_prefill_attention(query[batch.row_start:], key_cache, value_cache, batch.query_start_loc,
                                        batch.context_lens, batch.block_tables, scale, out=output[batch.row_start:])
    return output


def paged_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention through the Triton kernels: the KV write, one decode launch per group and one
    varlen launch for every prefill chunk (their context read from the cache in place), each writing its
    rows of the step's output (``out``, or a new tensor) in place (no copy: on a GPU an eager step pays for
    every launch)."""
    triton_attention.store_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
    output = torch.empty_like(query) if out is None else out
    for group in metadata.decode_groups:
        rows = slice(group.row_start, group.row_end)
        triton_attention.paged_decode_attention(
            query[rows], key_cache, value_cache, group.block_tables, group.seq_lens, scale, out=output[rows]
        )
    batch = metadata.prefill_batch  # built once per step by the model runner, shared by every layer
    if batch is not None:
        rows = slice(batch.row_start, None)
        triton_attention.paged_prefill_attention(
            query[rows], key[rows], value[rows], key_cache, value_cache, batch.query_start_loc, batch.context_lens,
            batch.block_tables, scale, max_query_len=batch.max_query_len, max_context_len=batch.max_context_len,
            out=output[rows],
        )
    return output


def decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    """One new token per request, each over its whole context.

    query: [num_decodes, q_heads, head_dim]. Returns the same shape.
    """
    num_decodes, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[0]
    group_size = num_q_heads // num_kv_heads
    # keys, values: [kv_heads * num_decodes, max_blocks * block_size, head_dim]
    keys = _gather_blocks(key_cache, group.block_tables).flatten(0, 1)
    values = _gather_blocks(value_cache, group.block_tables).flatten(0, 1)
    # The query heads sharing a KV head act as a short query sequence: [kv_heads * num_decodes, group, head_dim]
    q = query.view(num_decodes, num_kv_heads, group_size, head_dim).transpose(0, 1).reshape(-1, group_size, head_dim)
    # Plain matmuls: torch's fused CPU attention costs milliseconds per call at these small shapes.
    scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # [kv_heads * num_decodes, group, keys]
    scores.masked_fill_(group.mask, float("-inf"))
    out = torch.bmm(scores.softmax(dim=-1), values)  # [kv_heads * num_decodes, group, head_dim]
    return out.view(num_kv_heads, num_decodes, group_size, head_dim).transpose(0, 1).reshape(num_decodes, num_q_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    """One request's chunk of new tokens, causally over its context and itself.

    query: [chunk, q_heads, head_dim]; key, value: [chunk, kv_heads, head_dim] (this chunk's).
    Returns: [chunk, q_heads, head_dim].
    """
    num_new, num_q_heads, _ = query.shape
    num_kv_heads = key.shape[1]
    gqa = num_q_heads != num_kv_heads
    q = query.transpose(0, 1).unsqueeze(0)  # [1, q_heads, chunk, head_dim]
    if span.num_context_tokens == 0:
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        total = span.num_context_tokens + num_new
        # k, v: [1, kv_heads, total, head_dim] read back from the cache (context + this chunk).
        k = _gather_blocks(key_cache, span.block_table.unsqueeze(0))[:, :, :total]
        v = _gather_blocks(value_cache, span.block_table.unsqueeze(0))[:, :, :total]
        query_positions = torch.arange(span.num_context_tokens, total, device=query.device).unsqueeze(1)
        mask = torch.arange(total, device=query.device).unsqueeze(0) <= query_positions  # [chunk, total]
        out = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache: [kv_heads, num_blocks, block_size, head_dim]; block_tables: [batch, max_blocks].

    Returns: [kv_heads, batch, max_blocks * block_size, head_dim] (a contiguous copy).
    """
    batch, max_blocks = block_tables.shape
    num_kv_heads, _, block_size, head_dim = cache.shape
    # Advanced indexing, not index_select: on this strided view index_select falls back to an
    # element-wise loop about 100x slower.
    gathered = cache[:, block_tables.reshape(-1)]
    return gathered.view(num_kv_heads, batch, max_blocks * block_size, head_dim)
