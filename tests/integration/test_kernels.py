"""The C++ CPU kernels (paged decode attention, fused layer operations) against their plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.common.model_info import cache_dir
from splitserve.engine.attention import DecodeGroup, decode_attention
from splitserve.kernels import cpu_ops


def block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, generator=None):
    """One layer's key and value caches [kv_heads, num_blocks, block_size, head_dim], strided views of a
    block-major cache [num_blocks, layers, 2, kv_heads, block_size, head_dim] (as the engine allocates it)."""
    cache = torch.randn(num_blocks, 3, 2, num_kv_heads, block_size, head_dim, generator=generator)
    layer = cache[:, 1].permute(1, 2, 0, 3, 4)  # [2, kv_heads, num_blocks, block_size, head_dim]
    return layer[0], layer[1]


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
    assert cpu_ops.available(str(cache_dir())), "the C++ kernel must build on this machine"
    generator = torch.Generator().manual_seed(0)
    num_blocks = 200
    key_cache, value_cache = block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, generator)
    assert not key_cache.is_contiguous()
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
    actual = cpu_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_bad_block_ids():
    assert cpu_ops.available(str(cache_dir()))
    key_cache = torch.zeros(1, 4, 4, 8)
    query = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode_attention(
            query, key_cache, key_cache, torch.tensor([[7]]), torch.tensor([3]), 1.0
        )


# ---- fused element-wise operations of the Llama layer --------------------------------------------


def _kernels():
    assert cpu_ops.available(str(cache_dir())), "the C++ kernels must build on this machine"
    return cpu_ops


def test_rms_norm_and_residual_add_match_the_torch_layer():
    from splitserve.engine.models.rms_norm import RMSNorm

    kernels = _kernels()
    generator = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    norm.weight.copy_(torch.randn(576, generator=generator))
    x = torch.randn(37, 576, generator=generator) * 3
    residual = torch.randn(37, 576, generator=generator)
    expected = norm(x)
    expected_with_residual, expected_residual = norm(x, residual.clone())
    torch.testing.assert_close(kernels.rms_norm(x, norm.weight, 1e-5), expected, rtol=2e-6, atol=2e-6)
    stream = residual.clone()
    out = kernels.add_rms_norm(x, stream, norm.weight, 1e-5)
    assert torch.equal(stream, expected_residual)  # the residual add is exact, in place
    torch.testing.assert_close(out, expected_with_residual, rtol=2e-6, atol=2e-6)
    # Rows taken out of a wider tensor (a strided view) read correctly.
    wide = torch.randn(5, 1000, generator=generator)
    torch.testing.assert_close(kernels.rms_norm(wide[:, :576], norm.weight, 1e-5), norm(wide[:, :576].contiguous()),
                               rtol=2e-6, atol=2e-6)


def test_silu_and_mul_matches_torch():
    kernels = _kernels()
    gate_up = torch.randn(9, 2 * 1539, generator=torch.Generator().manual_seed(2)) * 6  # odd width: scalar tail
    gate, up = gate_up.split(1539, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_rotary_matches_torch_bit_for_bit():
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.models.rotary_embedding import RotaryEmbedding, apply_rotary

    kernels = _kernels()
    config = ModelConfig("llama", "LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=100000.0)
    rotary = RotaryEmbedding(config, 512)
    positions = torch.tensor([0, 1, 7, 300, 511])
    cos, sin = rotary.tables(positions, torch.float32)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=torch.Generator().manual_seed(3))
    query_key = qkv[:, : 12 * 64].view(5, 12, 64)  # a strided view, rotated in place as the model does
    expected = apply_rotary(query_key.clone(), cos, sin)
    untouched = qkv[:, 12 * 64 :].clone()
    kernels.rotary_(query_key, cos.squeeze(1), sin.squeeze(1))
    assert torch.equal(query_key, expected)
    assert torch.equal(qkv[:, 12 * 64 :], untouched)


def test_write_kv_matches_index_copy():
    from splitserve.engine.attention import write_kv

    kernels = _kernels()
    generator = torch.Generator().manual_seed(4)
    qkv = torch.randn(40, (9 + 3 + 3) * 8, generator=generator)
    key = qkv[:, 9 * 8 : 12 * 8].view(40, 3, 8)  # strided views, as the model passes them
    value = qkv[:, 12 * 8 :].view(40, 3, 8)
    slots = torch.randperm(10 * 4, generator=generator)
    expected_keys, expected_values = block_major_caches(3, 10, 4, 8, generator)
    keys, values = block_major_caches(3, 10, 4, 8, generator)
    keys.copy_(expected_keys)
    values.copy_(expected_values)
    write_kv(expected_keys, expected_values, key, value, slots)
    kernels.write_kv_(keys, values, key, value, slots)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    # Every slot was written from its token's row (the reference itself is checked, not only the kernel).
    blocks, offsets = slots // 4, slots % 4
    assert torch.equal(expected_keys[:, blocks, offsets], key.transpose(0, 1))
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv_(keys, values, key[:1], value[:1], torch.tensor([40]))
