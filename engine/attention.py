"""Paged attention in plain torch: the CPU backend, and the reference for the Triton kernels.

The KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``t`` of a request lives in slot ``block_table[t // B] * B + t % B``.

A step's batch is flattened: decode tokens first (one per request), then the
prefill chunks. :class:`AttentionMetadata` is built once per step by the model
runner and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
class AttentionMetadata:
    # Where each token's K/V is written: [num_tokens] int64 slot ids.
    slot_mapping: torch.Tensor
    # Decode tokens occupy rows [0, num_decode_tokens), one per request.
    num_decode_tokens: int = 0
    # [num_decodes, max_blocks] int64, padded with block 0 (masked).
    decode_block_tables: torch.Tensor | None = None
    # [num_decodes, 1, 1, max_blocks * block_size] bool: True where a key position is valid.
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's keys and values into their slots.

    key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim]; key, value: [num_tokens, kv_heads, head_dim].
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


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
    write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
    output = torch.empty_like(query)
    num_decode = metadata.num_decode_tokens
    if num_decode:
        output[:num_decode] = decode_attention(query[:num_decode], key_cache, value_cache, metadata, scale)
    for span in metadata.prefills:
        rows = slice(span.query_start, span.query_end)
        output[rows] = prefill_attention(query[rows], key[rows], value[rows], key_cache, value_cache, span, scale)
    return output


def decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One new token per request, each over its whole context.

    query: [num_decodes, q_heads, head_dim]. Returns the same shape.
    """
    num_decodes, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    block_tables = metadata.decode_block_tables
    # keys, values: [num_decodes, kv_heads, max_blocks * block_size, head_dim]
    keys = _gather_blocks(key_cache, block_tables).transpose(1, 2)
    values = _gather_blocks(value_cache, block_tables).transpose(1, 2)
    # q: [num_decodes, q_heads, 1, head_dim]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=metadata.decode_mask, scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    return out.view(num_decodes, num_q_heads, head_dim)


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
        k = _gather_blocks(key_cache, span.block_table.unsqueeze(0))[:, :total].transpose(1, 2)
        v = _gather_blocks(value_cache, span.block_table.unsqueeze(0))[:, :total].transpose(1, 2)
        query_positions = torch.arange(span.num_context_tokens, total).unsqueeze(1)
        mask = torch.arange(total).unsqueeze(0) <= query_positions  # [chunk, total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, head_dim]; block_tables: [batch, max_blocks].

    Returns: [batch, max_blocks * block_size, kv_heads, head_dim] (a copy).
    """
    batch, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, max_blocks * block_size, num_kv_heads, head_dim)
