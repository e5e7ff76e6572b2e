"""The C++ CPU kernels (paged decode and prefill attention, fused layer operations) against their plain-torch
references."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from splitserve.common.model_info import cache_dir
from splitserve.engine.attention import (
    DecodeGroup,
    PrefillBatch,
    PrefillSpan,
    decode_attention,
    prefill_attention,
    write_kv,
)
from splitserve.kernels import cpu_ops


def block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, generator=None):
    """One layer's key and value caches [kv_heads, num_blocks, block_size, head_dim], strided views of a
    block-major cache [num_blocks, layers, 2, kv_heads, block_size, head_dim] (as the engine allocates it)."""
    cache = torch.randn(num_blocks, 3, 2, num_kv_heads, block_size, head_dim, generator=generator)
    layer = cache[:, 1].permute(1, 2, 0, 3, 4)  # [2, kv_heads, num_blocks, block_size, head_dim]
    return layer[0], layer[1]


def shuffled_block_tables(lengths, block_size, num_blocks, generator):
    """[requests, max_blocks] tables giving every request distinct, shuffled blocks; unused entries point at
    block 0."""
    permutation = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), -(-max(lengths) // block_size), dtype=torch.int64)
    offset = 0
    for row, length in enumerate(lengths):
        count = -(-length // block_size)
        tables[row, :count] = permutation[offset : offset + count]
        offset += count
    return tables


def decode_case(num_q_heads, num_kv_heads, head_dim, block_size, lengths, num_blocks, generator):
    """A decode step's inputs: one query row per request over shuffled blocks of a block-major cache of
    ``num_blocks`` blocks. Returns the query, both caches, the block tables and the sequence lengths."""
    key_cache, value_cache = block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, generator)
    tables = shuffled_block_tables(lengths, block_size, num_blocks, generator)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=generator)
    return query, key_cache, value_cache, tables, torch.tensor(lengths, dtype=torch.int64)


def reference(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_requests = query.shape[0]
    num_kv_heads, _, block_size, _ = key_cache.shape
    padding = torch.arange(block_tables.shape[1] * block_size).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = padding.unsqueeze(0).expand(num_kv_heads, -1, -1).reshape(num_kv_heads * num_requests, 1, -1)
    group = DecodeGroup(0, num_requests, block_tables, seq_lens, mask)
    return decode_attention(query, key_cache, value_cache, group, scale)


# From 4 requests per thread on, the kernel gives each thread whole requests (all their KV heads, block by
# block) instead of (request, KV head) pairs; 64 requests take that path on machines of up to 16 threads.
MANY_LENGTHS = [1, 15, 16, 17, 33, 100, 2, 31] * 8


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, lengths",
    [
        (9, 3, 64, 16, [1, 15, 16, 17, 300, 576]),  # SmolLM's shape; block-boundary lengths
        (4, 4, 32, 8, [5, 64, 9]),  # no grouping
        (8, 2, 16, 4, [1]),  # one token of context
        (9, 3, 64, 16, MANY_LENGTHS),  # whole requests per thread
        (16, 8, 64, 16, MANY_LENGTHS),  # whole requests, heads in two passes (7 fit the kernel's state)
        (8, 4, 256, 16, MANY_LENGTHS),  # whole requests, one head per pass
        (4, 4, 32, 8, MANY_LENGTHS),  # whole requests, no grouping
        (6, 2, 48, 16, MANY_LENGTHS),  # a head size the 16-float path does not take: the per-key loop
        (9, 3, 64, 128, [1, 127, 128, 129, 300, 576]),  # the offline LLM's CPU blocks, per (request, head)
        (9, 3, 64, 128, [1, 127, 128, 129, 300, 576] * 11),  # and whole requests
        # Blocks of more than one 16-row chunk run in two passes (scores, then values): every head size
        (8, 2, 16, 32, [1, 31, 32, 33, 70, 96]),  # head size 16, per (request, head)
        (4, 4, 32, 64, [1, 63, 64, 65, 200] * 10),  # head size 32, whole requests
        (8, 4, 128, 32, MANY_LENGTHS),  # head size 128, whole requests
        (4, 1, 256, 32, [1, 31, 32, 33, 100]),  # head size 256
        (8, 2, 64, 256, [1, 255, 256, 257, 600] * 10),  # the largest block the kernel takes
        # Spans of several blocks (up to 128 rows in one softmax update), lengths on and one past span ends
        (9, 3, 64, 16, [127, 128, 129, 256, 257, 1000]),  # 8 blocks of 16 a span, per (request, head)
        (9, 3, 64, 16, [127, 128, 129, 256, 257, 1000] * 11),  # and whole requests
        (6, 2, 32, 24, [23, 24, 25, 120, 121, 500] * 11),  # 24-token blocks: pieces of 16 and 8 rows, 5 a span
        (4, 4, 64, 8, [7, 8, 9, 128, 129, 700]),  # 8-token blocks: 16 pieces a span
        (8, 1, 128, 48, [47, 48, 49, 96, 97, 300]),  # 48-token blocks: 2 a span (96 rows)
        (96, 6, 32, 16, [1, 128, 129, 300] * 16),  # groups of 16: the weights fit 4 heads a pass, so 2 passes
    ],
)
def test_kernel_matches_torch_reference(num_q_heads, num_kv_heads, head_dim, block_size, lengths):
    assert cpu_ops.available(str(cache_dir())), "the C++ kernel must build on this machine"
    generator = torch.Generator().manual_seed(0)
    num_blocks = max(200, sum(-(-length // block_size) for length in lengths))
    query, key_cache, value_cache, tables, seq_lens = decode_case(num_q_heads, num_kv_heads, head_dim, block_size,
                                                                  lengths, num_blocks, generator)
    assert not key_cache.is_contiguous()
    scale = head_dim**-0.5

    expected = reference(query, key_cache, value_cache, tables, seq_lens, scale)
    actual = cpu_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size",
    [
        (9, 3, 64, 128),  # one block a span: each head's pieces in turn
        (9, 3, 64, 16),  # 8 blocks of one piece a span: block by block, the heads of a block in turn
        (6, 2, 32, 64),  # 2 blocks of 4 pieces a span
        (6, 2, 32, 24),  # pieces of 16 and 8 rows
        (16, 8, 64, 32),  # heads in two passes (7, then 1), 4 blocks of 2 pieces a span
    ],
)
def test_whole_requests_read_in_memory_order_give_the_bits_of_one_head_at_a_time(num_q_heads, num_kv_heads,
                                                                                 head_dim, block_size):
    """With enough requests a thread takes whole requests and reads each span's pieces of every head in the order
    they lie in memory; alone, a request's heads are tasks of their own, each reading its pieces in turn. The
    order of the reads changes no arithmetic: every row is the same bits either way."""
    assert cpu_ops.available(str(cache_dir()))
    generator = torch.Generator().manual_seed(11)
    lengths = [1, block_size - 1, block_size, block_size + 1, 129, 300, 577] * 10
    num_blocks = sum(-(-length // block_size) for length in lengths) + 8
    query, key_cache, value_cache, tables, seq_lens = decode_case(num_q_heads, num_kv_heads, head_dim, block_size,
                                                                  lengths, num_blocks, generator)
    scale = head_dim**-0.5
    together = cpu_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    for row in range(len(lengths)):
        alone = cpu_ops.paged_decode_attention(query[row : row + 1], key_cache, value_cache, tables[row : row + 1],
                                               seq_lens[row : row + 1], scale)
        assert torch.equal(alone[0], together[row]), f"request {row} ({lengths[row]} tokens)"
    expected = reference(query, key_cache, value_cache, tables, seq_lens, scale)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)


def test_decode_kernel_fetches_ahead_into_either_cache_level_with_the_same_result():
    """Where the kernel fetches each chunk's successor (L1 on AMD CPUs whose L1 holds 48 KB, else L2) changes its
    speed only: both give the same bits. 128-token blocks, so that blocks have several chunks to fetch ahead."""
    assert cpu_ops.available(str(cache_dir()))
    assert cpu_ops.decode_prefetch_level() == (1 if _amd_cpu() and _l1_data_cache_bytes() >= 48 * 1024 else 2)
    default = cpu_ops.decode_prefetch_level()
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 127, 128, 129, 300, 576] * 11  # whole requests per thread, then per (request, head)
    query, key_cache, value_cache, tables, seq_lens = decode_case(9, 3, 64, 128, lengths, 400, generator)
    expected = reference(query, key_cache, value_cache, tables, seq_lens, 0.125)
    for count in (len(lengths), 2):
        outputs = []
        for level in (1, 2):
            with cpu_ops.decode_prefetch_into(level):
                assert cpu_ops.decode_prefetch_level() == level
                outputs.append(cpu_ops.paged_decode_attention(query[:count], key_cache, value_cache, tables[:count],
                                                              seq_lens[:count], 0.125))
            assert cpu_ops.decode_prefetch_level() == default
        assert torch.equal(outputs[0], outputs[1])
        torch.testing.assert_close(outputs[0], expected[:count], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="the level must be 1 \\(L1\\), 2 \\(L2\\)"):
        cpu_ops.decode_prefetch_into(3).__enter__()
    assert cpu_ops.decode_prefetch_level() == default


def test_kernel_refuses_bad_block_ids():
    assert cpu_ops.available(str(cache_dir()))
    key_cache = torch.zeros(1, 4, 4, 8)
    query = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode_attention(
            query, key_cache, key_cache, torch.tensor([[7]]), torch.tensor([3]), 1.0
        )


# ---- paged prefill attention ----------------------------------------------------------------------


def prefill_case(num_q_heads, num_kv_heads, head_dim, block_size, chunks, seed=0):
    """A step's prompt chunks, each ``(context, length)``, over shuffled blocks of a block-major cache whose
    slots already hold every chunk's keys and values (as the engine writes them before it attends).

    Returns the query, the chunks' own keys and values, both caches, the spans and the scale."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(context + length) // block_size) for context, length in chunks) + 3
    key_cache, value_cache = block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, generator)
    permutation = torch.randperm(num_blocks, generator=generator)
    spans, row, used = [], 0, 0
    for context, length in chunks:
        count = -(-(context + length) // block_size)
        spans.append(PrefillSpan(row, row + length, context, permutation[used : used + count].clone()))
        row, used = row + length, used + count
    query = torch.randn(row, num_q_heads, head_dim, generator=generator)
    key = torch.randn(row, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(row, num_kv_heads, head_dim, generator=generator)
    for span in spans:
        positions = torch.arange(span.num_context_tokens, span.num_context_tokens + span.query_end - span.query_start)
        slots = span.block_table[positions // block_size] * block_size + positions % block_size
        rows = slice(span.query_start, span.query_end)
        write_kv(key_cache, value_cache, key[rows], value[rows], slots)
    return query, key, value, key_cache, value_cache, spans, head_dim**-0.5


def prefill_reference(query, key, value, key_cache, value_cache, spans, scale):
    """The torch backend's prefill attention, chunk by chunk."""
    return torch.cat([
        prefill_attention(query[rows], key[rows], value[rows], key_cache, value_cache, span, scale)
        for span in spans
        for rows in [slice(span.query_start, span.query_end)]
    ])


def run_prefill_kernel(query, key_cache, value_cache, spans, scale):
    batch = PrefillBatch.from_spans(spans)
    return _kernels().paged_prefill_attention(query, key_cache, value_cache, batch.query_start_loc,
                                              batch.context_lens, batch.block_tables, scale)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, chunks",
    [
        # SmolLM's shape: whole prompts of 1 token, one short of, exactly on and one past a block boundary.
        (9, 3, 64, 16, [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33)]),
        # Chunked prefill and prefix hits: context on and off block boundaries, single-token chunks.
        (9, 3, 64, 16, [(16, 16), (17, 1), (5, 30), (32, 64), (100, 7)]),
        # No grouping, head size 128, blocks of 32.
        (4, 4, 128, 32, [(0, 65), (31, 2), (64, 64)]),
        # Eight query heads per KV head.
        (16, 2, 64, 32, [(0, 96), (40, 25)]),
        # A block size that is not a multiple of the kernel's 16 lanes.
        (6, 2, 64, 24, [(0, 49), (23, 26)]),
        # One long prompt past a thousand tokens (many query and key tiles), and a long chunk after a long context.
        (9, 3, 64, 16, [(0, 1100)]),
        (8, 1, 128, 16, [(1500, 300)]),
    ],
)
def test_prefill_kernel_matches_torch_reference(num_q_heads, num_kv_heads, head_dim, block_size, chunks):
    case = prefill_case(num_q_heads, num_kv_heads, head_dim, block_size, chunks)
    query, key, value, key_cache, value_cache, spans, scale = case
    assert not key_cache.is_contiguous()
    expected = prefill_reference(*case)
    actual = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
    assert actual.shape == expected.shape
    # float32 both ways; the kernel sums in another order and fuses multiply-adds (as SDPA's BLAS does):
    # differences stay within a few units in the last place of scores near 1.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)


def test_prefill_kernel_reads_only_visible_keys():
    """Slots past each chunk's last token (and future tokens of the chunk) hold huge values: any leak past
    the causal mask or the request's end would show."""
    query, key, value, key_cache, value_cache, spans, scale = prefill_case(9, 3, 64, 16, [(3, 20), (0, 17)], seed=1)
    expected = prefill_reference(query, key, value, key_cache, value_cache, spans, scale)
    for span in spans:
        end = span.num_context_tokens + span.query_end - span.query_start
        last_block = span.block_table[(end - 1) // 16]
        key_cache[:, last_block, (end - 1) % 16 + 1 :] = 1e4
        value_cache[:, last_block, (end - 1) % 16 + 1 :] = 1e4
    actual = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)
    # The first token of a fresh prompt sees only itself: its output is its own value row, exactly weighted 1.
    first = spans[1].query_start
    torch.testing.assert_close(actual[first], value[first].repeat_interleave(3, dim=0), rtol=1e-6, atol=1e-6)


def test_prefill_kernel_takes_an_empty_batch_and_refuses_bad_input():
    kernels = _kernels()
    key_cache, value_cache = block_major_caches(3, 4, 16, 64)
    empty = kernels.paged_prefill_attention(torch.zeros(0, 9, 64), key_cache, value_cache,
                                            torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                            torch.zeros(0, 1, dtype=torch.int64), 0.125)
    assert empty.shape == (0, 9, 64)
    query = torch.zeros(5, 9, 64)
    starts, contexts = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_prefill_attention(query, key_cache, value_cache, starts, contexts, torch.tensor([[9]]), 0.125)
    with pytest.raises(RuntimeError, match="context exceeds the block table"):
        kernels.paged_prefill_attention(query, key_cache, value_cache, starts, torch.tensor([12], dtype=torch.int32),
                                        torch.tensor([[1]]), 0.125)
    with pytest.raises(RuntimeError, match="must cover the query rows"):
        kernels.paged_prefill_attention(query, key_cache, value_cache, torch.tensor([0, 4], dtype=torch.int32),
                                        contexts, torch.tensor([[1]]), 0.125)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        small_k, small_v = block_major_caches(3, 4, 16, 32)
        kernels.paged_prefill_attention(torch.zeros(5, 9, 32), small_k, small_v, starts, contexts,
                                        torch.tensor([[1]]), 0.125)
    assert not kernels.prefill_supports(32) and kernels.prefill_supports(64) and kernels.prefill_supports(128)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_writes_into_rows_of_a_larger_tensor(dtype):
    """out: the MLP's pieces each write their rows of one tensor; the same bits as a new tensor, the rows around
    untouched; an out the kernel cannot write is refused."""
    kernels = _kernels()
    gate_up = (torch.randn(9, 2 * 1539, generator=torch.Generator().manual_seed(8)) * 6).to(dtype)
    whole = torch.full((20, 1539), 7.0, dtype=dtype)
    returned = kernels.silu_and_mul(gate_up, out=whole[4:13])
    assert returned.data_ptr() == whole[4].data_ptr()
    assert torch.equal(whole[4:13], kernels.silu_and_mul(gate_up))
    assert bool((whole[:4] == 7).all()) and bool((whole[13:] == 7).all())
    for wrong in (torch.empty(9, 1538, dtype=dtype), torch.empty(1539, 9, dtype=dtype).t(),
                  torch.empty(9, 1539, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="out must be a contiguous"):
            kernels.silu_and_mul(gate_up, out=wrong)


def test_apply_token_bitmask_is_the_torch_reference_on_every_shape():
    """Random bitmasks with whole words allowed and refused and bit 31 set, vocabularies around the 32-token words,
    fewer words than the vocabulary needs, a subset of rows in any order, rows 50,000 apart: the torch
    reference's logits; rows not listed are untouched."""
    from splitserve.engine.structured_output import apply_token_bitmask

    kernels = _kernels()
    generator = torch.Generator().manual_seed(12)
    for vocab in (1, 31, 32, 33, 64, 100, 49152):
        for num_words in {(vocab + 31) // 32, max(1, (vocab + 31) // 32 - 1)}:
            logits = torch.randn(5, vocab, generator=generator)
            bitmask = torch.randint(-2**31, 2**31 - 1, (3, num_words), dtype=torch.int32, generator=generator)
            bitmask[0, 0], bitmask[1, -1], bitmask[2, 0] = -1, 0, -2**31  # all allowed, none, only bit 31
            rows = [4, 0, 2]
            expected = apply_token_bitmask(logits, rows, bitmask)
            ours = apply_token_bitmask(logits, rows, bitmask, kernels)
            assert torch.equal(ours, expected), (vocab, num_words)
            assert torch.equal(ours[[1, 3]], logits[[1, 3]])
    wide = torch.randn(3, 50000, generator=generator)
    view = wide[:, 3:49155]  # rows 50,000 apart
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 1536), dtype=torch.int32, generator=generator)
    expected = apply_token_bitmask(view.contiguous(), [2, 1], bitmask)
    kernels.apply_token_bitmask_(view, torch.tensor([2, 1]), bitmask)
    assert torch.equal(view, expected)
    for bad, words in ((dict(rows=torch.tensor([3])), "out of range"), (dict(rows=torch.tensor([0], dtype=torch.int32)), "int64"),
                       (dict(logits=torch.zeros(2, 40, dtype=torch.float64)), "float32"),
                       (dict(bitmask=torch.zeros(2, 2, dtype=torch.int32)), "len\\(rows\\)")):
        arguments = {"logits": torch.zeros(2, 40), "rows": torch.tensor([1]), "bitmask": torch.zeros(1, 2, dtype=torch.int32)}
        with pytest.raises(RuntimeError, match=words):
            kernels.apply_token_bitmask_(**{**arguments, **bad})


def test_argmax_rows_is_torch_argmax_ties_nans_infinities_and_tails_included():
    """The first of tied maxima, a NaN as the largest (the first NaN), +-inf, signed zeros, rows of every width
    around the kernel's 8- and 32-wide steps, strided rows and no rows: the indices torch.argmax gives."""
    kernels = _kernels()
    nan, inf = float("nan"), float("inf")
    edge = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [2.0, inf, inf, 0.0], [-inf] * 3 + [-1.0],
                         [-inf] * 4, [-0.0, 0.0, 0.0, -0.0], [0.0, -0.0, 1e-45, 1e-45]])
    assert kernels.argmax_rows(edge).tolist() == edge.argmax(-1).tolist() == [1, 0, 1, 3, 0, 0, 2]
    generator = torch.Generator().manual_seed(11)
    for vocab in (1, 7, 8, 9, 31, 32, 33, 63, 65, 49152, 49157):
        for rows in (0, 1, 5, 64):
            logits = torch.randn(rows, vocab, generator=generator)
            assert torch.equal(kernels.argmax_rows(logits), logits.argmax(-1)), (rows, vocab)
            if rows == 0 or vocab < 3:
                continue
            tied = logits.clone()
            tied[:, vocab // 2] = tied[:, -1] = tied[:, 1] = 1e9  # tied maxima in the body, the tail and lane 1
            with_nans = logits.clone()
            with_nans[0, -1] = nan  # in the tail (or the last step)
            with_nans[-1, vocab // 3] = with_nans[-1, -1] = with_nans[-1, vocab - 2] = nan
            with_nans[rows // 2, : vocab // 2] = inf  # infinities before a NaN
            with_nans[rows // 2, vocab // 2 + 1] = nan
            for case in (tied, with_nans, torch.full((rows, vocab), -inf), torch.full((rows, vocab), inf)):
                assert torch.equal(kernels.argmax_rows(case), case.argmax(-1)), (rows, vocab)
    wide = torch.randn(6, 50000, generator=generator)
    assert torch.equal(kernels.argmax_rows(wide[:, 3:49160]), wide[:, 3:49160].argmax(-1))  # rows 50,000 apart
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(edge.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(wide.t())
    with pytest.raises(RuntimeError, match="at least one logit"):
        kernels.argmax_rows(torch.empty(3, 0))


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


# ---- linear layers of decode-sized batches --------------------------------------------------------


def _small_gemm_kernels():
    kernels = _kernels()
    if not kernels.small_gemm_supported():
        pytest.skip("small_gemm needs AVX-512, or AVX2 with FMA, which this build of the kernels lacks (the engine keeps oneDNN there)")
    return kernels


@pytest.mark.parametrize(
    "rows, in_features, out_features, with_bias",
    [
        (1, 576, 960, False),  # batch 1: SmolLM's qkv
        (2, 300, 45, True),  # AVX2's whole-row tiles (1-3 rows): k-blocks resumed, a panel of 13 columns, a bias
        (3, 129, 200, False),  # three rows, one step past a k-block, a panel of 8 columns
        (7, 17, 45, True),  # a partial row tile, an odd depth, a partial last panel, a bias
        (8, 64, 32, True),  # exactly one tile and one panel
        (9, 40, 31, False),  # one row past a tile; fewer columns than one panel
        (64, 576, 3072, False),  # a decode step of SmolLM's gate/up (4.5 k-blocks of 128, 3 of 192)
        (192, 1536, 576, True),  # the largest batch the engine sends with AVX-512 (small_gemm_max_rows), down's shape
        (96, 576, 3072, False),  # the largest it sends with AVX2, gate/up's shape (16 row tiles of 6)
        (16, 128, 70, True),  # exactly one k-block of 128
        (24, 129, 64, False),  # one step past a k-block of 128, three row tiles
        (40, 300, 96, True),  # a partial last k-block after two whole ones of 128 (one of 192)
        (24, 193, 64, False),  # one step past a k-block of 192
    ],
)
def test_small_gemm_matches_linear(rows, in_features, out_features, with_bias):
    kernels = _small_gemm_kernels()
    assert kernels.small_gemm_max_rows() == (192 if _target_has_avx512(cpu_ops.target_march()) else 96)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    # Rows at a stride (a view into a wider tensor), as a slice of the model's activations may be.
    x = torch.randn(rows, in_features + 5, generator=generator)[:, :in_features]
    panels = kernels.pack_panels(weight)
    assert panels.shape == (-(-out_features // 32), in_features, 32)
    actual = kernels.small_gemm(x, panels, bias, out_features)
    assert actual.shape == (rows, out_features) and actual.is_contiguous()
    # Sums of in_features products of unit normals, in another order than MKL's: float32 rounding only.
    torch.testing.assert_close(actual, F.linear(x, weight, bias), atol=2e-5 * in_features**0.5, rtol=1e-5)


def test_small_gemm_rows_do_not_depend_on_their_batch():
    """Each output is one fused multiply-add sum over in_features in order, whichever row tile and k-block it ran in:
    a row's result is bit for bit the same alone, in any batch and at any place in it (what keeps greedy tokens
    independent of what else a decode step holds)."""
    kernels = _small_gemm_kernels()
    generator = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(200, 300, generator=generator), torch.randn(200, generator=generator)
    panels, x = kernels.pack_panels(weight), torch.randn(70, 300, generator=generator)
    whole = kernels.small_gemm(x, panels, bias, 200)
    for row in (0, 7, 8, 37, 69):
        assert torch.equal(kernels.small_gemm(x[row : row + 1], panels, bias, 200)[0], whole[row])
    # With AVX2, tiles of 1 to 3 rows walk each panel row whole, larger ones in halves: the same sums.
    for start, stop in ((10, 12), (20, 23), (5, 45), (30, 34)):
        assert torch.equal(kernels.small_gemm(x[start:stop], panels, bias, 200), whole[start:stop]), (start, stop)


def test_small_gemm_k_blocks_change_no_result():
    """Any k-block gives the same bits as whole panels (each output one sum in k order, resumed across blocks):
    blocks of 1 step, of 7 (most blocks partial), the defaults (128; 192 on AMD with a 48 KB L1; whole panels on
    other AMD CPUs in an AVX-512 build; 256 on other CPUs with a 48 KB L1 in an AVX-512 build) and larger than the
    depth, on depths one past, exactly on and between their boundaries. The default is the one the kernel's comment
    gives for this CPU and build."""
    kernels = _small_gemm_kernels()
    default = kernels.default_small_gemm_block_steps()
    assert default == _expected_small_gemm_block_steps()
    generator = torch.Generator().manual_seed(11)
    for in_features in (129, 192, 193, 576):
        weight, bias = torch.randn(70, in_features, generator=generator), torch.randn(70, generator=generator)
        panels, x = kernels.pack_panels(weight), torch.randn(20, in_features, generator=generator)
        with kernels.small_gemm_block_steps(0):
            whole = kernels.small_gemm(x, panels, bias, 70)
        for steps in (1, 7, 128, 192, 256, 1000):
            with kernels.small_gemm_block_steps(steps):
                assert torch.equal(kernels.small_gemm(x, panels, bias, 70), whole), (in_features, steps)
        assert torch.equal(kernels.small_gemm(x, panels, bias, 70), whole)  # the default, restored
    assert kernels.default_small_gemm_block_steps() == default
    with pytest.raises(RuntimeError, match="steps must be positive, 0"):
        with kernels.small_gemm_block_steps(-2):
            pass


def _amd_cpu() -> bool:
    return "AuthenticAMD" in Path("/proc/cpuinfo").read_text()


def _l1_data_cache_bytes() -> int:
    """The L1 data cache's size as the kernels read it (glibc's sysconf(_SC_LEVEL1_DCACHE_SIZE), which Python's
    os.sysconf does not name), 0 where unknown (as in the kernels)."""
    getconf = shutil.which("getconf")
    if getconf is None:
        return 0
    answer = subprocess.run([getconf, "LEVEL1_DCACHE_SIZE"], capture_output=True, text=True)
    return int(answer.stdout) if answer.returncode == 0 and answer.stdout.strip().isdigit() else 0


def _expected_small_gemm_block_steps() -> int:
    """The small GEMM's default k-block for this CPU and this build, by the rule in splitserve/kernels/cpu_small_gemm.cpp."""
    amd, large_l1 = _amd_cpu(), _l1_data_cache_bytes() >= 48 * 1024
    if amd and large_l1:
        return 192
    march = os.environ.get(cpu_ops.MARCH_VARIABLE, "").strip() or "native"
    if not _target_has_avx512(march):
        return 128
    if amd:
        return 0
    return 256 if large_l1 else 128


def test_small_gemm_takes_no_rows_and_refuses_bad_shapes():
    kernels = _small_gemm_kernels()
    panels = kernels.pack_panels(torch.randn(40, 16))
    assert kernels.small_gemm(torch.empty(0, 16), panels, None, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match="x has 15 features, the weight 16"):
        kernels.small_gemm(torch.randn(2, 15), panels, None, 40)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        kernels.small_gemm(torch.randn(2, 16), panels, None, 65)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        kernels.small_gemm(torch.randn(2, 16), panels, torch.randn(39), 40)


def test_packed_linear_sends_decode_batches_to_small_gemm_and_prompt_chunks_to_onednn():
    from splitserve.engine.models.packed_linear import PackedLinear

    kernels = _small_gemm_kernels()
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(96, 80)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=generator))
        linear.bias.copy_(torch.randn(80, generator=generator))
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    packed = PackedLinear(linear)
    packed.use_kernels(kernels)
    assert packed.panels is not None
    calls = []
    original = kernels.small_gemm
    try:
        kernels.small_gemm = lambda *args: calls.append(args[0].shape[0]) or original(*args)
        most = kernels.small_gemm_max_rows()  # 192 with AVX-512, 96 with AVX2
        for rows in (1, 64, most, most + 1, 512):
            x = torch.randn(rows, 96, generator=generator)
            torch.testing.assert_close(packed(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    finally:
        kernels.small_gemm = original
    assert calls == [1, 64, most]
    packed.use_kernels(None)  # the torch backend: oneDNN for every batch, the second copy dropped
    assert packed.panels is None and packed.small_gemm_kernels is None


def _small_gemm_bfloat16_kernels():
    kernels = _kernels()
    if not kernels.small_gemm_bfloat16_supported():
        pytest.skip("small_gemm_bfloat16 needs AVX512-BF16, which this CPU lacks (oneDNN takes every bfloat16 batch)")
    return kernels


@pytest.mark.parametrize(
    "rows, in_features, out_features, with_bias",
    [
        (1, 576, 960, False),  # batch 1: SmolLM's qkv
        (2, 300, 45, True),  # two rows, a panel of 13 columns, a bias
        (3, 258, 200, False),  # three rows, a panel of 8 columns (a depth is even: a bfloat16 step is a pair of inputs)
        (7, 18, 45, True),  # a partial row tile, a partial last panel, a bias
        (8, 64, 32, False),  # exactly one tile and one panel (SMALL_GEMM_BFLOAT16_MAX_ROWS rows)
        (9, 40, 31, True),  # one row past a tile; fewer columns than one panel
        (3, 1536, 576, False),  # down's shape
    ],
)
def test_small_gemm_bfloat16_matches_linear(rows, in_features, out_features, with_bias):
    """bfloat16 in and out, float32 sums: each output is the exact sum rounded to bfloat16 once, but for the order
    of the float32 additions (oneDNN's differs too), so within one bfloat16 unit of it."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features + 6, generator=generator).bfloat16()[:, :in_features]  # rows at a stride
    # Packing needs no AVX512-BF16, so every CPU checks each case's shape (an odd depth once hid here on the CPUs
    # that skip the product, and failed only on those that run it).
    panels = _kernels().pack_panels_bfloat16(weight)
    assert panels.shape == (-(-out_features // 32), in_features // 2, 64) and panels.dtype == torch.bfloat16
    kernels = _small_gemm_bfloat16_kernels()
    assert kernels.SMALL_GEMM_BFLOAT16_MAX_ROWS == 8
    actual = kernels.small_gemm_bfloat16(x, panels, bias, out_features)
    assert actual.shape == (rows, out_features) and actual.dtype == torch.bfloat16 and actual.is_contiguous()
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert (actual.double() - exact).abs().max() <= (2**-8 * exact.abs()).max() + 1e-4
    assert (actual == exact.bfloat16()).float().mean() > 0.99  # nearly all rounded as the exact sum rounds
    reference = F.linear(x, weight, None if bias is None else bias.bfloat16())
    assert ((actual.float() - reference.float()).abs() <= 2**-7 * reference.float().abs() + 2**-7).all()


def test_small_gemm_bfloat16_refuses_bad_shapes():
    kernels = _small_gemm_bfloat16_kernels()
    panels = kernels.pack_panels_bfloat16(torch.randn(40, 16))
    assert kernels.small_gemm_bfloat16(torch.empty(0, 16).bfloat16(), panels, None, 40).shape == (0, 40)
    with pytest.raises(RuntimeError, match="x has 14 features, the weight 16"):
        kernels.small_gemm_bfloat16(torch.randn(2, 14).bfloat16(), panels, None, 40)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        kernels.small_gemm_bfloat16(torch.randn(2, 16).bfloat16(), panels, None, 65)
    with pytest.raises(RuntimeError, match="an even number of input features"):
        kernels.pack_panels_bfloat16(torch.randn(4, 15))


def test_packed_linear_sends_bfloat16_batches_of_up_to_8_rows_to_small_gemm_bfloat16():
    from splitserve.engine.models.packed_linear import PackedLinear, can_pack_linear_weights

    kernels = _small_gemm_bfloat16_kernels()
    assert can_pack_linear_weights(torch.bfloat16)  # oneDNN reorders bfloat16 wherever AVX512-BF16 is
    generator = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(96, 80, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=generator))
        linear.bias.copy_(torch.randn(80, generator=generator))
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    packed = PackedLinear(linear)
    packed.use_kernels(kernels)
    assert packed.panels is not None and packed.panels.dtype == torch.bfloat16
    calls = []
    original = kernels.small_gemm_bfloat16
    try:
        kernels.small_gemm_bfloat16 = lambda *args: calls.append(args[0].shape[0]) or original(*args)
        for rows in (1, 8, 9, 64):
            x = torch.randn(rows, 96, generator=generator).bfloat16()
            expected = F.linear(x.float(), weight.float(), bias.float())
            assert ((packed(x).float() - expected).abs() <= 2**-7 * expected.abs() + 2**-6).all()
    finally:
        kernels.small_gemm_bfloat16 = original
    assert calls == [1, 8]
    packed.use_kernels(None)
    assert packed.panels is None and packed.small_gemm_kernels is None


def test_bfloat16_logits_of_a_few_rows_run_in_small_gemm_bfloat16():
    """In bfloat16 with the C++ kernels, logits of up to 8 rows come from the head's panels (AVX512-BF16), more rows
    from oneDNN; both within bfloat16 rounding of the float32 product."""
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.models import llama

    kernels = _small_gemm_bfloat16_kernels()
    config = ModelConfig("llama", "LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=True)
    model = llama.LlamaForCausalLM(config, 64).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(1000, 64, generator=generator))
    model.keep_transposed_head()
    model.use_kernels(kernels)
    calls = []
    original = kernels.small_gemm_bfloat16
    try:
        kernels.small_gemm_bfloat16 = lambda *args: calls.append(args[0].shape[0]) or original(*args)
        for rows in (1, 8, 9):
            hidden = torch.randn(rows, 64, generator=generator).bfloat16()
            logits = model.compute_logits(hidden)
            expected = hidden.float() @ model.model.embed_tokens.weight.float().T
            assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
            assert ((logits - expected).abs() <= 2**-8 * expected.abs() + 1e-3).all()
    finally:
        kernels.small_gemm_bfloat16 = original
    assert calls == [1, 8]
    model.use_kernels(None)  # the torch backend: the panels are dropped
    assert model._head_panels is None


def test_float32_logits_of_up_to_64_rows_run_in_small_gemm_from_the_heads_panels():
    """In float32 with the C++ kernels, logits of up to 64 rows come from the head's panels, which replace its
    transposed copy; more rows from oneDNN. A row's logits are bit for bit the same alone and in a batch of 64."""
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.models import llama

    kernels = _small_gemm_kernels()
    config = ModelConfig("llama", "LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-5, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=True)
    model = llama.LlamaForCausalLM(config, 64)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(1000, 64, generator=generator))
    model.pack_linear_weights()
    model.use_kernels(kernels)
    assert model._head_panels is not None and model._transposed_head is None
    calls = []
    original = kernels.small_gemm
    hidden = torch.randn(65, 64, generator=generator)
    try:
        kernels.small_gemm = lambda *args: calls.append(args[0].shape[0]) or original(*args)
        for rows in (1, 4, 64, 65):
            logits = model.compute_logits(hidden[:rows])
            assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
            torch.testing.assert_close(logits, F.linear(hidden[:rows], model.model.embed_tokens.weight),
                                       atol=2e-5 * 64**0.5, rtol=1e-5)
        batch = model.compute_logits(hidden[:64])
        for row in (0, 5, 63):
            assert torch.equal(model.compute_logits(hidden[row : row + 1])[0], batch[row])
    finally:
        kernels.small_gemm = original
    assert calls[:3] == [1, 4, 64] and 65 not in calls
    model.use_kernels(None)  # the torch backend: the panels are dropped, the transposed copy made for a few rows
    assert model._head_panels is None and model._transposed_head is not None
    torch.testing.assert_close(model.compute_logits(hidden[:3]), F.linear(hidden[:3], model.model.embed_tokens.weight),
                               atol=1e-4, rtol=1e-4)


def _tiny_mlp():
    """A Llama MLP of hidden size 64 and intermediate size 96, with random weights."""
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.models import llama

    return llama.LlamaMLP(ModelConfig(
        "llama", "LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64,
        rope_theta=10000.0))


def test_mlp_of_a_step_above_the_chunk_size_equals_the_formula():
    from splitserve.engine.models import llama

    mlp = _tiny_mlp()
    x = torch.randn(2 * llama._MLP_CHUNK_ROWS + 5, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        gate, up = F.linear(x, mlp.gate_up_proj.weight).split(96, dim=-1)
        expected = F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        calls = []
        original = mlp._forward
        mlp._forward = lambda piece: calls.append(piece.shape[0]) or original(piece)
        actual = mlp(x)
    assert calls == [llama._MLP_CHUNK_ROWS, llama._MLP_CHUNK_ROWS, 5]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_mlp_off_the_cpu_runs_a_step_whole():
    """Row pieces are for CPU caches: on another device (here "meta", which runs shapes only, as a GPU
    stands in nowhere in CI) the MLP takes the whole step in one piece."""
    from splitserve.engine.models import llama

    mlp = _tiny_mlp().to("meta")
    calls = []
    original = mlp._forward
    mlp._forward = lambda piece: calls.append(piece.shape[0]) or original(piece)
    with torch.no_grad():
        out = mlp(torch.empty(2 * llama._MLP_CHUNK_ROWS + 5, 64, device="meta"))
    assert calls == [2 * llama._MLP_CHUNK_ROWS + 5] and out.shape == (2 * llama._MLP_CHUNK_ROWS + 5, 64)


def test_mlp_pieces_of_a_prompt_step_run_in_onednn_with_the_kernels():
    """The MLP's row pieces stay above the small GEMM's limit: with the C++ kernels and packed weights, a step of
    two pieces and 5 rows sends only the 5-row remainder's gate/up to the small GEMM. SiLU writes each piece's
    rows of one tensor, which the down projection takes whole (in oneDNN), so nothing is concatenated after it."""
    from splitserve.engine.models import llama
    from splitserve.engine.models.packed_linear import PackedLinear

    kernels = _small_gemm_kernels()
    assert llama._MLP_CHUNK_ROWS > kernels.small_gemm_max_rows()
    mlp = _tiny_mlp()
    gate_up, down = mlp.gate_up_proj.weight.detach().clone(), mlp.down_proj.weight.detach().clone()
    mlp.gate_up_proj, mlp.down_proj = PackedLinear(mlp.gate_up_proj), PackedLinear(mlp.down_proj)
    mlp.kernels = kernels
    mlp.gate_up_proj.use_kernels(kernels)
    mlp.down_proj.use_kernels(kernels)
    x = torch.randn(2 * llama._MLP_CHUNK_ROWS + 5, 64, generator=torch.Generator().manual_seed(7))
    calls, silu_outs, down_rows = [], [], []
    original, original_silu, original_down = kernels.small_gemm, kernels.silu_and_mul, mlp.down_proj.forward
    try:
        kernels.small_gemm = lambda *args: calls.append(args[0].shape[0]) or original(*args)
        kernels.silu_and_mul = lambda gate_up, out=None: silu_outs.append(out) or original_silu(gate_up, out=out)
        mlp.down_proj.forward = lambda h: down_rows.append(h) or original_down(h)
        with torch.no_grad():
            actual = mlp(x)
    finally:
        kernels.small_gemm, kernels.silu_and_mul = original, original_silu
    assert calls == [5]
    assert [out.shape[0] for out in silu_outs] == [llama._MLP_CHUNK_ROWS, llama._MLP_CHUNK_ROWS, 5]
    (whole,) = down_rows
    assert whole.shape == (2 * llama._MLP_CHUNK_ROWS + 5, 96)
    assert [out.data_ptr() for out in silu_outs] == [whole[start].data_ptr() for start in range(0, len(whole), llama._MLP_CHUNK_ROWS)]
    gate, up = F.linear(x, gate_up).split(96, dim=-1)
    torch.testing.assert_close(actual, F.linear(F.silu(gate) * up, down), atol=1e-5, rtol=1e-5)


# ---- the AVX2 build ------------------------------------------------------------------------------------------


def test_the_march_setting_names_the_build_and_refuses_what_is_not_a_name(monkeypatch):
    monkeypatch.delenv(cpu_ops.MARCH_VARIABLE, raising=False)
    assert cpu_ops.target_march() == "native"
    native = cpu_ops.build_folder("/cache")
    monkeypatch.setenv(cpu_ops.MARCH_VARIABLE, "x86-64-v3")
    assert cpu_ops.target_march() == "x86-64-v3"
    avx2 = cpu_ops.build_folder("/cache")
    assert avx2.parent == native.parent and avx2.name.startswith(f"torch-{torch.__version__}-march-x86-64-v3-")
    for bad in ("native -fplugin=/tmp/x.so", "../x", "a;b"):
        monkeypatch.setenv(cpu_ops.MARCH_VARIABLE, bad)
        with pytest.raises(ValueError, match="SPLITSERVE_CPU_MARCH"):
            cpu_ops.target_march()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 (AVX2) is an x86 target")
def test_the_avx2_build_passes_these_tests_too(monkeypatch):
    """Built for AVX2 CPUs (``SPLITSERVE_CPU_MARCH=x86-64-v3``: no AVX-512, so each 16-float vector of the
    attention kernels is a pair of 8-float registers, cpu_vector16.h), the kernels pass this module's tests in a
    child process, against their own build (the small GEMM's AVX2 micro-kernel included); on an AVX-512 machine
    this is the only place that code runs. The library holds no 512-bit instruction, so it is that code that
    ran.

    On a CPU without AVX-512 the native build is that code already (every test above ran it): then the native
    library is checked for 512-bit instructions instead of building and testing a second flavour (three
    minutes of the suite on a 2-core Zen 3)."""
    if not _target_has_avx512("native"):
        _kernels()
        _assert_no_512_bit_instructions(cpu_ops.build_folder(str(cache_dir())))
        return
    monkeypatch.setenv(cpu_ops.MARCH_VARIABLE, "x86-64-v3")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2_build and not avx512_builds"],
        capture_output=True, text=True, timeout=840, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
    _assert_no_512_bit_instructions(cpu_ops.build_folder(str(cache_dir())))


# The attention cases both builds run in test_the_avx2_and_avx512_builds_give_the_same_bits (a child process
# runs this file's function with the AVX2 build and saves what it returns).
_CROSS_BUILD_CHILD = """
import sys, torch
from tests.integration import test_kernels
torch.save(test_kernels._attention_outputs_for_the_cross_build_test(), sys.argv[1])
"""


def _attention_outputs_for_the_cross_build_test() -> dict[str, torch.Tensor]:
    """Prefill and decode attention on seeded float32 inputs: a long prompt (key tiles of 64 and a partial one,
    the causal mask, the online softmax's rescaling), a chunk after its context and a single token; decode per
    (request, KV head) and in whole requests, over blocks of 16 and 128."""
    outputs = {}
    query, _, _, key_cache, value_cache, spans, scale = prefill_case(9, 3, 64, 16, [(0, 1100), (5, 30), (17, 1)])
    outputs["prefill"] = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
    generator = torch.Generator().manual_seed(1)
    for name, lengths, block_size in (("decode, (request, head) pairs", [1, 15, 16, 17, 300, 576], 16),
                                      ("decode, whole requests", [1, 127, 128, 129, 300, 576] * 11, 128)):
        num_blocks = sum(-(-length // block_size) for length in lengths) + 1
        case = decode_case(9, 3, 64, block_size, lengths, num_blocks, generator)
        outputs[name] = _kernels().paged_decode_attention(*case, 0.125)
    return outputs


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 (AVX2) is an x86 target")
def test_the_avx2_and_avx512_builds_give_the_same_bits(tmp_path, monkeypatch):
    """cpu_vector16.h's two forms of a 16-float vector (one AVX-512 register; a pair of AVX2 registers) do the
    same operations in the same order on each lane, exp16 included (one VSCALEFPS with AVX-512, the exponent's
    bits with AVX2): the float32 attention kernels of both builds give the same bits. Runs where this CPU has
    AVX-512 (it runs both builds)."""
    if not _target_has_avx512("native"):
        pytest.skip("this CPU has no AVX-512: only the AVX2 build runs here")
    native = _attention_outputs_for_the_cross_build_test()
    monkeypatch.setenv(cpu_ops.MARCH_VARIABLE, "x86-64-v3")
    saved = tmp_path / "avx2.pt"
    result = subprocess.run([sys.executable, "-c", _CROSS_BUILD_CHILD, str(saved)], capture_output=True, text=True,
                            timeout=840, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    avx2 = torch.load(saved)
    assert avx2.keys() == native.keys()
    for name, output in native.items():
        assert torch.equal(avx2[name], output), f"{name}: largest difference {(avx2[name] - output).abs().max()}"


@functools.cache  # asked by every small GEMM case: one compiler call per target
def _target_has_avx512(march: str) -> bool:
    """Whether the compiler enables AVX-512 for ``-march=march`` (the kernels' build target; "native": this CPU)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return True  # cannot tell: build the AVX2 flavour
    macros = subprocess.run([compiler, f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
                            capture_output=True, text=True, check=True).stdout
    return "__AVX512F__" in macros


def _assert_no_512_bit_instructions(build_dir: Path) -> None:
    """The library built in ``build_dir`` uses 256-bit registers and no 512-bit one (where objdump is here)."""
    if shutil.which("objdump") is None:
        return
    (library,) = build_dir.glob("*.so")
    listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "%zmm" not in listing and "%ymm" in listing


# ---- a bfloat16 cache and bfloat16 layers ---------------------------------------------------------
#
# The attention kernels read a bfloat16 cache by widening each value to float32 (exact) and compute in float32,
# so against the float32 reference on the widened cache they agree as closely as in float32; where the kernels
# multiply queries and keys in AVX512-BF16, the reference gets the queries rounded as they round them
# (cpu_ops.rounds_bfloat16_queries). The fused
# operations compute in float32 and round where torch's bfloat16 operations round: equal to torch's bfloat16
# layer but for the order of the norm's sum and the exp (at most one bfloat16 unit, 2^-8 relative).


def queries_as_the_kernels_multiply(query, scale, head_dim):
    """With AVX512-BF16 and a bfloat16 cache, the kernels multiply the queries times the scale rounded to bfloat16."""
    if not _kernels().rounds_bfloat16_queries(head_dim):
        return query
    return (query * scale).bfloat16().float() / scale


def block_major_like(key_cache, value_cache, dtype):
    """Copies of one layer's caches in ``dtype`` (rounded), laid out block-major as the engine's are."""
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    base = torch.empty(num_blocks, 3, 2, num_kv_heads, block_size, head_dim, dtype=dtype)
    layer = base[:, 1].permute(1, 2, 0, 3, 4)
    layer[0].copy_(key_cache)
    layer[1].copy_(value_cache)
    return layer[0], layer[1]


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, lengths",
    [
        (9, 3, 64, 16, [1, 15, 16, 17, 300, 576]),  # per (request, KV head)
        (9, 3, 64, 16, MANY_LENGTHS),  # whole requests per thread
        (8, 1, 128, 128, [1, 127, 128, 129, 2000] * 8),  # head size 128, eight query heads per KV head
        (16, 2, 64, 16, [1, 127, 128, 129, 300] * 4),  # sixteen query heads per KV head: 4 at once, 4 times
        (6, 2, 48, 16, MANY_LENGTHS),  # the per-key loop
    ],
)
def test_decode_kernel_reads_a_bfloat16_cache(num_q_heads, num_kv_heads, head_dim, block_size, lengths):
    """The AVX-512 (or AVX2) path; on AMX machines test_amx_decode_kernel covers the tiles."""
    kernels = _kernels()
    with kernels.amx_disabled():
        assert not kernels.decodes_in_amx(head_dim, block_size, num_q_heads // num_kv_heads)
        _check_bfloat16_decode(kernels, num_q_heads, num_kv_heads, head_dim, block_size, lengths)


def _check_bfloat16_decode(kernels, num_q_heads, num_kv_heads, head_dim, block_size, lengths):
    generator = torch.Generator().manual_seed(5)
    num_blocks = sum(-(-length // block_size) for length in lengths) + 2
    key_cache, value_cache = block_major_like(*block_major_caches(num_kv_heads, num_blocks, block_size, head_dim,
                                                                  generator), torch.bfloat16)
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    tables = shuffled_block_tables(lengths, block_size, num_blocks, generator)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    expected = reference(queries_as_the_kernels_multiply(query, scale, head_dim), key_cache.float(), value_cache.float(), tables, seq_lens,
                         scale)
    actual = kernels.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # A bfloat16 query (the engine's in bfloat16) is widened, and the output rounded back.
    query = query.bfloat16()
    expected = reference(queries_as_the_kernels_multiply(query.float(), scale, head_dim), key_cache.float(), value_cache.float(), tables,
                         seq_lens, scale)
    actual = kernels.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    assert actual.dtype == torch.bfloat16
    assert torch.equal(actual, expected.bfloat16()) or (actual.float() - expected).abs().max() <= 2**-8 * expected.abs().max()


def weights_rounded_reference(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Decode attention as the AMX kernel rounds it: queries times the scale and the softmax weights
    exp(score - max) rounded to bfloat16 before their products, everything else float32 (a bfloat16 cache)."""
    num_kv_heads, _, block_size, head_dim = key_cache.shape
    num_requests, num_q_heads, _ = query.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_requests, num_q_heads, head_dim)
    weight_max = 0.0
    for r in range(num_requests):
        length = int(seq_lens[r])
        blocks = block_tables[r, : -(-length // block_size)]
        keys = key_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :length].float()
        values = value_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :length].float()
        q = (query[r] * scale).bfloat16().float().view(num_kv_heads, group, head_dim)
        scores = q @ keys.transpose(1, 2)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        denominators = weights.sum(-1, keepdim=True)
        weight_max = max(weight_max, (weights / denominators).max().item())
        out[r] = ((weights.bfloat16().float() @ values) / denominators).reshape(num_q_heads, head_dim)
    return out, weight_max


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, lengths",
    [
        (9, 3, 64, 16, [1, 15, 16, 17, 31, 32, 33, 300, 576]),  # per (request, KV head); chunk and step edges
        (9, 3, 64, 16, MANY_LENGTHS),  # whole requests per thread
        (8, 1, 128, 128, [1, 127, 128, 129, 2000] * 8),  # head size 128 (two passes over the values)
        (16, 1, 64, 32, [1, 63, 64, 65, 1000]),  # sixteen query heads per KV head, blocks of 32
        (4, 4, 64, 16, MANY_LENGTHS),  # no grouping
    ],
)
def test_amx_decode_kernel(num_q_heads, num_kv_heads, head_dim, block_size, lengths):
    """On CPUs with AMX (Sapphire Rapids and later), decode attention over a bfloat16 cache runs in tiles, with the
    softmax weights rounded to bfloat16. Against a reference rounding them the same way, outputs agree to float32
    rounding except where the two exp implementations put a weight on either side of a bfloat16 rounding
    boundary: one unit (at most 2^-7 of the weight) times a value row."""
    kernels = _kernels()
    if not kernels.decodes_in_amx(head_dim, block_size, num_q_heads // num_kv_heads):
        pytest.skip("this CPU has no AMX-BF16 (or Linux does not grant it): the AVX-512 path runs, tested above")
    generator = torch.Generator().manual_seed(11)
    num_blocks = sum(-(-length // block_size) for length in lengths) + 2
    key_cache, value_cache = block_major_like(*block_major_caches(num_kv_heads, num_blocks, block_size, head_dim,
                                                                  generator), torch.bfloat16)
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    tables = shuffled_block_tables(lengths, block_size, num_blocks, generator)
    query = torch.randn(len(lengths), num_q_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    expected, weight_max = weights_rounded_reference(query, key_cache, value_cache, tables, seq_lens, scale)
    actual = kernels.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    difference = (actual - expected).abs()
    assert difference.max().item() <= 1e-5 + 2**-7 * weight_max * value_cache.float().abs().max().item()
    assert difference.mean().item() <= 1e-6
    # Not the AVX-512 path's figures (which keep the weights in float32): the tiles really ran.
    with kernels.amx_disabled():
        other = kernels.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)
    assert (other - expected).abs().max().item() > difference.max().item()


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, chunks",
    [
        (9, 3, 64, 16, [(0, 1), (0, 17), (16, 16), (17, 1), (5, 30), (100, 7)]),
        (8, 1, 128, 128, [(0, 300), (1500, 129)]),
    ],
)
def test_prefill_kernel_reads_a_bfloat16_cache(num_q_heads, num_kv_heads, head_dim, block_size, chunks):
    """The AVX-512 (or AVX2) path; on AMX machines test_amx_prefill_kernel covers the tiles."""
    kernels = _kernels()
    query, key, value, key_cache, value_cache, spans, scale = prefill_case(num_q_heads, num_kv_heads, head_dim,
                                                                           block_size, chunks, seed=6)
    key_cache, value_cache = block_major_like(key_cache, value_cache, torch.bfloat16)
    # The reference attends the chunks' own rows as the cache now holds them: rounded to bfloat16.
    expected = prefill_reference(queries_as_the_kernels_multiply(query, scale, head_dim), key.bfloat16().float(),
                                 value.bfloat16().float(), key_cache.float(), value_cache.float(), spans, scale)
    with kernels.amx_disabled():
        assert not kernels.prefills_in_amx(head_dim, block_size)
        actual = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
        assert actual.dtype == torch.float32
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)
        assert run_prefill_kernel(query.bfloat16(), key_cache, value_cache, spans, scale).dtype == torch.bfloat16


def weights_rounded_prefill_reference(query, key_cache, value_cache, spans, scale):
    """Prompt attention as the AMX kernel rounds it (as weights_rounded_reference for decode): each chunk's
    tokens causally over their request's context and the chunk, read back from a bfloat16 cache. Also returns
    the largest normalized weight."""
    num_kv_heads, _, block_size, head_dim = key_cache.shape
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    weight_max = 0.0
    for span in spans:
        length = span.query_end - span.query_start
        total = span.num_context_tokens + length
        blocks = span.block_table[: -(-total // block_size)]
        keys = key_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :total].float()
        values = value_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :total].float()
        q = (query[span.query_start:span.query_end] * scale).bfloat16().float()
        hidden = torch.arange(total).unsqueeze(0) > (span.num_context_tokens + torch.arange(length)).unsqueeze(1)
        for head in range(num_q_heads):
            scores = (q[:, head] @ keys[head // group].T).masked_fill(hidden, float("-inf"))
            weights = torch.exp(scores - scores.amax(-1, keepdim=True))
            denominators = weights.sum(-1, keepdim=True)
            weight_max = max(weight_max, (weights / denominators).max().item())
            out[span.query_start:span.query_end, head] = (weights.bfloat16().float() @ values[head // group]) / denominators
    return out, weight_max


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, chunks",
    [
        # Whole prompts on and around 16- and 32-token edges, chunked prefill, a single-token chunk.
        (9, 3, 64, 16, [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33), (16, 16), (17, 1), (5, 30), (100, 7)]),
        (8, 1, 128, 128, [(0, 300), (1500, 129)]),  # head size 128 (two passes over the values), 128-token blocks
        (4, 4, 64, 32, [(0, 65), (31, 2), (64, 64)]),  # no grouping, blocks of 32
        (9, 3, 64, 128, [(0, 512), (0, 300), (200, 100)]),  # the offline LLM's blocks
    ],
)
def test_amx_prefill_kernel(num_q_heads, num_kv_heads, head_dim, block_size, chunks):
    """On CPUs with AMX, prompt attention over a bfloat16 cache runs in tiles too, the softmax weights rounded to
    bfloat16: against a reference rounding them the same way, as test_amx_decode_kernel."""
    kernels = _kernels()
    if not kernels.prefills_in_amx(head_dim, block_size):
        pytest.skip("this CPU has no AMX-BF16 (or Linux does not grant it): the AVX-512 path runs, tested above")
    query, key, value, key_cache, value_cache, spans, scale = prefill_case(num_q_heads, num_kv_heads, head_dim,
                                                                           block_size, chunks, seed=12)
    key_cache, value_cache = block_major_like(key_cache, value_cache, torch.bfloat16)
    expected, weight_max = weights_rounded_prefill_reference(query, key_cache, value_cache, spans, scale)
    actual = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
    difference = (actual - expected).abs()
    assert difference.max().item() <= 1e-5 + 2**-7 * weight_max * value_cache.float().abs().max().item()
    assert difference.mean().item() <= 1e-6
    with kernels.amx_disabled():  # the AVX-512 path keeps the weights in float32: not what ran above
        other = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
    assert (other - expected).abs().max().item() > difference.max().item()


def test_write_kv_stores_bfloat16_rows_and_refuses_mixed_dtypes():
    kernels = _kernels()
    generator = torch.Generator().manual_seed(7)
    qkv = torch.randn(40, (9 + 3 + 3) * 16, generator=generator).bfloat16()
    key, value = qkv[:, 9 * 16 : 12 * 16].view(40, 3, 16), qkv[:, 12 * 16 :].view(40, 3, 16)
    slots = torch.randperm(10 * 4, generator=generator)
    keys, values = block_major_like(*block_major_caches(3, 10, 4, 16, generator), torch.bfloat16)
    expected_keys, expected_values = keys.clone(), values.clone()
    write_kv(expected_keys, expected_values, key, value, slots)
    kernels.write_kv_(keys, values, key, value, slots)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    with pytest.raises(RuntimeError, match="the same for the cache"):
        kernels.write_kv_(keys, values, key.float(), value.float(), slots)


def _bfloat16_units(actual, expected):
    """The largest difference between two bfloat16 tensors, in units of the last place of ``expected``."""
    assert actual.dtype == expected.dtype == torch.bfloat16
    unit = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
    return ((actual.float() - expected.float()).abs() / unit).max().item()


def test_fused_operations_in_bfloat16_round_as_torch_does():
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.models.rms_norm import RMSNorm
    from splitserve.engine.models.rotary_embedding import RotaryEmbedding, apply_rotary

    kernels = _kernels()
    generator = torch.Generator().manual_seed(8)
    norm = RMSNorm(576, 1e-5)
    norm.weight.copy_(torch.randn(576, generator=generator))
    norm.to(torch.bfloat16)
    x = (torch.randn(37, 576, generator=generator) * 3).bfloat16()
    residual = torch.randn(37, 576, generator=generator).bfloat16()
    assert _bfloat16_units(kernels.rms_norm(x, norm.weight, 1e-5), norm(x)) <= 1
    expected, expected_residual = norm(x, residual.clone())
    stream = residual.clone()
    out = kernels.add_rms_norm(x, stream, norm.weight, 1e-5)
    assert torch.equal(stream, expected_residual)  # one bfloat16 rounding of the sum, as torch's add
    assert _bfloat16_units(out, expected) <= 1
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.rms_norm(x, norm.weight.float(), 1e-5)

    gate_up = (torch.randn(9, 2 * 1539, generator=generator) * 6).bfloat16()
    gate, up = gate_up.split(1539, dim=-1)
    assert _bfloat16_units(kernels.silu_and_mul(gate_up), F.silu(gate) * up) <= 1

    config = ModelConfig("llama", "LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=100000.0)
    cos, sin = RotaryEmbedding(config, 512).tables(torch.tensor([0, 1, 7, 300, 511]), torch.bfloat16)
    query_key = torch.randn(5, 12, 64, generator=generator).bfloat16()
    expected = apply_rotary(query_key.clone(), cos, sin)
    kernels.rotary_(query_key, cos.squeeze(1), sin.squeeze(1))
    assert torch.equal(query_key, expected)  # products and sum rounded one by one, as torch's


def qkv_view(query):
    """``query`` [rows, heads, head_dim] copied into the front of a wider fused-projection output and returned as
    the model's view of it: each row's heads contiguous, rows 1.5 times as far apart (SmolLM's 960 against 576)."""
    rows, heads, head_dim = query.shape
    fused = torch.full((rows, heads * head_dim * 3 // 2), float("nan"))
    view = fused[:, : heads * head_dim].view(rows, heads, head_dim)
    view.copy_(query)
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernels_read_queries_in_place_at_a_row_stride(dtype):
    """The queries are a view of the fused QKV output; both kernels read them where they are (no copy), over either
    cache dtype and in AMX tiles where the CPU has them: bit for bit what a contiguous copy gives. A layout they
    cannot read (heads not contiguous) is refused, and the Python wrappers copy it first."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 17, 40, 300] + MANY_LENGTHS  # per (request, KV head) and whole requests per thread
    for requests in (lengths[:4], lengths):
        num_blocks = sum(-(-length // 16) for length in requests) + 2
        key_cache, value_cache = block_major_like(*block_major_caches(3, num_blocks, 16, 64, generator), dtype)
        tables = shuffled_block_tables(requests, 16, num_blocks, generator)
        seq_lens = torch.tensor(requests, dtype=torch.int64)
        query = torch.randn(len(requests), 9, 64, generator=generator)
        expected = kernels.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125)
        assert torch.equal(kernels.paged_decode_attention(qkv_view(query), key_cache, value_cache, tables, seq_lens,
                                                          0.125), expected)
    query, _, _, key_cache, value_cache, spans, scale = prefill_case(9, 3, 64, 16, [(0, 70), (33, 40), (0, 1)])
    key_cache, value_cache = block_major_like(key_cache, value_cache, dtype)
    expected = run_prefill_kernel(query, key_cache, value_cache, spans, scale)
    assert torch.equal(run_prefill_kernel(qkv_view(query), key_cache, value_cache, spans, scale), expected)

    heads_apart = query.transpose(0, 1).contiguous().transpose(0, 1)  # [rows, heads, head_dim], heads rows apart
    batch = PrefillBatch.from_spans(spans)
    with pytest.raises(RuntimeError, match="each row's heads contiguous"):
        kernels._module.paged_prefill_attention(heads_apart, key_cache, value_cache, batch.query_start_loc,
                                                batch.context_lens, batch.block_tables, scale, torch.empty(0))
    assert torch.equal(run_prefill_kernel(heads_apart, key_cache, value_cache, spans, scale), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernels_write_a_mixed_steps_rows_into_one_output(dtype):
    """A step of decodes (its first rows) and prompt chunks (the rest) gives each kernel its rows of one output to
    write in place: the values a kernel returns alone, the given tensor returned, and the other rows untouched.
    A bfloat16 output gets the rounded result; an output of another shape is refused."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(9)
    lengths = [5, 40, 17]
    num_blocks = sum(-(-length // 16) for length in lengths) + 2
    key_cache, value_cache = block_major_caches(3, num_blocks, 16, 64, generator)
    tables = shuffled_block_tables(lengths, 16, num_blocks, generator)
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    decode_query = torch.randn(3, 9, 64, generator=generator)
    query, _, _, _, _, spans, scale = prefill_case(9, 3, 64, 16, [(0, 20), (7, 9)])
    batch = PrefillBatch.from_spans(spans)
    output = torch.full((3 + query.shape[0], 9, 64), 7.0, dtype=dtype)

    returned = kernels.paged_decode_attention(decode_query, key_cache, value_cache, tables, seq_lens, scale,
                                              out=output[:3])
    assert returned.data_ptr() == output.data_ptr() and (output[3:] == 7.0).all()
    alone = kernels.paged_decode_attention(decode_query, key_cache, value_cache, tables, seq_lens, scale)
    assert torch.equal(output[:3], alone.to(dtype))
    _, _, _, prompt_keys, prompt_values, _, _ = prefill_case(9, 3, 64, 16, [(0, 20), (7, 9)])
    returned = kernels.paged_prefill_attention(query, prompt_keys, prompt_values, batch.query_start_loc,
                                               batch.context_lens, batch.block_tables, scale, out=output[3:])
    assert returned.data_ptr() == output[3:].data_ptr()
    assert torch.equal(output[3:], run_prefill_kernel(query, prompt_keys, prompt_values, spans, scale).to(dtype))
    assert torch.equal(output[:3], alone.to(dtype))
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor of the query's shape"):
        kernels.paged_decode_attention(decode_query, key_cache, value_cache, tables, seq_lens, scale,
                                       out=torch.empty(4, 9, 64))
