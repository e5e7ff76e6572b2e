"""The C++ paged decode attention kernel against its plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.attention import DecodeGroup, decode_attention
from splitserve.engine.model_store import cache_dir
from splitserve.kernels import cpu_paged_attention


def reference(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_requests = query.shape[0]
    num_kv_heads, _, block_size, _ = key_cache.shape
    padding = torch.arange(block_tables.shape[1] * block_size).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = padding.unsqueeze(0).expand(num_kv_heads, -1, -1).reshape(num_kv_heads * num_requests, 1, -1)
    group = DecodeGroup(0, num_requests, block_tables, seq_lens, mask)
    return decode_attention(query, key_cache, value_cache, group, scale)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, lengths",
    [
        (9, 3, 64, 16, [1, 15, 16, 17, 300, 576]),  # SmolLM's shape; block-boundary lengths
        (4, 4, 32, 8, [5, 64, 9]),  # no grouping
        (8, 2, 16, 4, [1]),  # one token of context
    ],
)
def test_kernel_matches_torch_reference(num_q_heads, num_kv_heads, head_dim, block_size, lengths):
    assert cpu_paged_attention.available(str(cache_dir())), "the C++ kernel must build on this machine"
    generator = torch.Generator().manual_seed(0)
    num_blocks = 200
    key_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    value_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    max_blocks = -(-max(lengths) // block_size)
    # Every request gets distinct, shuffled blocks; unused table entries point at block 0.
    permutation = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int64)
    offset = 0
    for row, length in enumerate(lengths):
        count = -(-length // block_size)
        tables[row, :count] = permutation[offset : offset + count]
        offset += count
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    expected = reference(query, key_cache, value_cache, tables, seq_lens, scale)
    actual = cpu_paged_attention.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_bad_block_ids():
    assert cpu_paged_attention.available(str(cache_dir()))
    key_cache = torch.zeros(1, 4, 4, 8)
    query = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_paged_attention.paged_decode_attention(
            query, key_cache, key_cache, torch.tensor([[7]]), torch.tensor([3]), 1.0
        )
