"""The Triton attention kernels (store_kv, split-K paged decode, varlen paged prefill) against the
plain-torch references in ``splitserve.engine.attention``.

On a CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1``, which must be set before the
process first imports triton (``triton.language`` is built for the compiler or the interpreter then), is set
by ``tests/conftest.py`` before any test module is imported. With a CUDA device the same tests run
compiled, on the GPU.

Tolerances. float32: atol = rtol = 1e-5; the kernels differ from the references only in summation
order and in exp2 against exp (observed differences under 1e-6). bfloat16: inputs are rounded to
bfloat16 (the references then compute in float32 from those same values), and the kernels round the
softmax weights to bfloat16 before the weighted sum of values and round the output to bfloat16:
each rounding is at most 2^-9 (0.2%) relative, and outputs are weighted means of values drawn from
N(0, 1), mostly below 3 in magnitude, so atol 2e-2 with rtol 1.6e-2 (torch's own bfloat16 rtol)
allows a few units in the last place and still catches any wrong key, mask or weight (errors of
order 0.1 to 1).
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.attention import DecodeGroup, PrefillSpan, decode_attention, prefill_attention, write_kv
from splitserve.kernels import triton_attention

pytestmark = pytest.mark.timeout(300)

ON_GPU = torch.cuda.is_available()

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
if not (ON_GPU or triton_attention.language_interpreted()):
    raise RuntimeError("Triton kernels run on CPU only under TRITON_INTERPRET=1, set before triton is first "
                       "imported: run the tests through pytest from the repository (tests/conftest.py sets it).")
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2}}


# ---- helpers ------------------------------------------------------------------------------------


def block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, dtype, generator):
    """One layer's key and value caches [kv_heads, num_blocks, block_size, head_dim]: strided views
    of a block-major [num_blocks, layers, 2, kv_heads, block_size, head_dim] cache, as the engine's."""
    cache = torch.randn(num_blocks, 3, 2, num_kv_heads, block_size, head_dim, generator=generator).to(dtype)
    layer = cache.to(DEVICE)[:, 1].permute(1, 2, 0, 3, 4)  # [2, kv_heads, num_blocks, block_size, head_dim]
    assert not layer[0].is_contiguous()
    return layer[0], layer[1]


def shuffled_block_tables(lengths, block_size, num_blocks, generator):
    """[requests, max_blocks] int64: distinct blocks in shuffled order, padded with block 0."""
    counts = [-(-length // block_size) for length in lengths]
    assert sum(counts) <= num_blocks
    permutation = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max(counts, default=1), dtype=torch.int64)
    offset = 0
    for row, count in enumerate(counts):
        tables[row, :count] = permutation[offset : offset + count]
        offset += count
    return tables


def reference_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """engine.attention.decode_attention in float32 on the CPU."""
    num_requests = query.shape[0]
    num_kv_heads, _, block_size, _ = key_cache.shape
    block_tables, seq_lens = block_tables.cpu(), seq_lens.cpu()
    padding = torch.arange(block_tables.shape[1] * block_size).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = padding.unsqueeze(0).expand(num_kv_heads, -1, -1).reshape(num_kv_heads * num_requests, 1, -1)
    group = DecodeGroup(0, num_requests, block_tables, seq_lens, mask)
    return decode_attention(query.float().cpu(), key_cache.float().cpu(), value_cache.float().cpu(), group, scale)


def decode_inputs(num_q_heads, num_kv_heads, head_dim, block_size, lengths, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-length // block_size) for length in lengths) + 3
    key_cache, value_cache = block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, dtype, generator)
    tables = shuffled_block_tables(lengths, block_size, num_blocks, generator).to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    # The query is a strided view, as the engine's (queries and keys rotated together, then split).
    query_key = torch.randn(len(lengths), num_q_heads + num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    query = query_key[:, :num_q_heads]
    return query, key_cache, value_cache, tables, seq_lens


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCES[dtype])


# ---- store_kv -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(1, 64, 16), (3, 128, 32), (2, 64, 32)])
def test_store_kv_writes_the_slots_write_kv_writes(num_kv_heads, head_dim, block_size, dtype):
    generator = torch.Generator().manual_seed(1)
    num_blocks = 6
    key_cache, value_cache = block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, dtype, generator)
    whole_cache = key_cache._base if key_cache._base is not None else key_cache
    before = whole_cache.clone()
    num_tokens = 9
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    # Edge slots: the first row of a block, the last row of a block, the cache's last slot.
    slots[:3] = torch.tensor([block_size, block_size - 1, num_blocks * block_size - 1])
    key_value = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    key, value = key_value[:, :num_kv_heads], key_value[:, num_kv_heads:]  # strided views
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    write_kv(expected_key, expected_value, key, value, slots.to(DEVICE))

    triton_attention.store_kv(key_cache, value_cache, key, value, slots.to(DEVICE))

    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)
    # Nothing outside this layer's K/V slots changed (the strides were followed).
    changed = (whole_cache != before).reshape(num_blocks, 3, -1).any(dim=2)  # [blocks, layers]
    assert not changed[:, 0].any() and not changed[:, 2].any()
    assert changed[:, 1].sum() == len(set((slots // block_size).tolist()))


def test_store_kv_skips_negative_slots_and_empty_steps():
    generator = torch.Generator().manual_seed(2)
    key_cache, value_cache = block_major_caches(2, 4, 16, 64, torch.float32, generator)
    before_key, before_value = key_cache.clone(), value_cache.clone()
    key = torch.randn(2, 2, 64, generator=generator).to(DEVICE)
    triton_attention.store_kv(key_cache, value_cache, key, key, torch.tensor([-1, 5], device=DEVICE))
    assert torch.equal(key_cache[:, 0, 5], key[1])
    key_cache[:, 0, 5], value_cache[:, 0, 5] = before_key[:, 0, 5], before_value[:, 0, 5]
    assert torch.equal(key_cache, before_key) and torch.equal(value_cache, before_value)
    empty = torch.empty(0, 2, 64, device=DEVICE)
    triton_attention.store_kv(key_cache, value_cache, empty, empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(key_cache, before_key)


# ---- paged decode -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, lengths, dtype",
    [
        # GQA ratio 1; lengths on and one past block boundaries.
        (1, 1, 64, 16, [1, 15, 16, 17, 32, 33], torch.float32),
        (2, 2, 128, 32, [31, 32, 33, 64, 65], torch.bfloat16),
        # Ratio 3 (SmolLM's), two KV heads.
        (6, 2, 64, 16, [1, 47, 48, 49, 200], torch.float32),
        (3, 1, 128, 32, [96, 97, 300], torch.bfloat16),
        # Ratio 8, one long sequence alone (a few thousand tokens, split automatically).
        (8, 1, 64, 32, [2049], torch.float32),
        (8, 1, 128, 16, [3000], torch.bfloat16),
    ],
)
def test_decode_matches_torch_reference(num_q_heads, num_kv_heads, head_dim, block_size, lengths, dtype):
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(
        num_q_heads, num_kv_heads, head_dim, block_size, lengths, dtype, seed=len(lengths) + head_dim
    )
    scale = head_dim**-0.5
    expected = reference_decode(query, key_cache, value_cache, tables, seq_lens, scale)

    actual = triton_attention.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale)

    assert actual.shape == (len(lengths), num_q_heads, head_dim)
    assert_close(actual, expected, dtype)


def test_decode_split_counts_agree():
    """Split-K: one split, a few, and more splits than the context fills (empty splits) give the same
    output; the long sequence beside short ones leaves the short ones' later splits empty."""
    lengths = [1, 63, 64, 65, 700]
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(3, 1, 64, 16, lengths, torch.float32, seed=3)
    expected = reference_decode(query, key_cache, value_cache, tables, seq_lens, 64**-0.5)
    outputs = {}
    for num_splits in (1, 2, 5, 16):
        outputs[num_splits] = triton_attention.paged_decode_attention(
            query, key_cache, value_cache, tables, seq_lens, 64**-0.5, num_splits=num_splits
        )
        assert_close(outputs[num_splits], expected, torch.float32)
    for num_splits in (2, 5, 16):
        torch.testing.assert_close(outputs[num_splits], outputs[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_tile_shapes_agree(dtype):
    """The key tiles the launch chooses from (32 keys for float32, 64 for half precision; see
    decode_tiles, sized so they compile without spills) give the reference's output in either dtype,
    with one split and with splits cut at tile multiples."""
    lengths = [1, 31, 32, 33, 64, 65, 300]
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(6, 2, 64, 16, lengths, dtype, seed=5)
    expected = reference_decode(query, key_cache, value_cache, tables, seq_lens, 0.125)
    for tiles in (triton_attention.decode_tiles(torch.float32, 64), triton_attention.decode_tiles(torch.bfloat16, 64)):
        for num_splits in (1, 3):
            actual = triton_attention.paged_decode_attention(
                query, key_cache, value_cache, tables, seq_lens, 0.125, num_splits=num_splits, tiles=tiles
            )
            assert_close(actual, expected, dtype)


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_decode_random_shapes(seed):
    generator = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[torch.randint(len(options), (1,), generator=generator).item()]

    num_kv_heads, ratio, head_dim, block_size = pick([1, 2]), pick([1, 3, 8]), pick([64, 128]), pick([16, 32])
    dtype = pick([torch.float32, torch.bfloat16])
    lengths = torch.randint(1, 400, (pick([1, 2, 3]),), generator=generator).tolist()
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(
        num_kv_heads * ratio, num_kv_heads, head_dim, block_size, lengths, dtype, seed
    )
    expected = reference_decode(query, key_cache, value_cache, tables, seq_lens, 0.1)
    actual = triton_attention.paged_decode_attention(
        query, key_cache, value_cache, tables, seq_lens, 0.1, num_splits=pick([None, 1, 3])
    )
    assert_close(actual, expected, dtype)


def test_decode_of_an_empty_batch_is_empty():
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(3, 1, 64, 16, [5], torch.float32, seed=4)
    actual = triton_attention.paged_decode_attention(query[:0], key_cache, value_cache, tables[:0], seq_lens[:0], 0.125)
    assert actual.shape == (0, 3, 64)


def test_decode_refuses_heads_that_do_not_group():
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(4, 2, 64, 16, [5], torch.float32, seed=5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_attention.paged_decode_attention(query[:, :3], key_cache, value_cache, tables, seq_lens, 0.125)


def test_choose_num_splits_splits_long_contexts_of_small_batches_only():
    cpu = torch.device("cpu")
    assert triton_attention.choose_num_splits(1, 1, 100, cpu) == 1
    assert triton_attention.choose_num_splits(1, 1, 4096, cpu) == 4096 // triton_attention.MIN_TOKENS_PER_SPLIT
    assert triton_attention.choose_num_splits(256, 8, 4096, cpu) == 1
    assert triton_attention.choose_num_splits(1, 1, 10**6, cpu) == triton_attention.MAX_NUM_SPLITS


# ---- paged prefill ------------------------------------------------------------------------------


def run_prefill_case(num_q_heads, num_kv_heads, head_dim, block_size, contexts, chunks, dtype, seed, tiles=None,
                     num_splits=None):
    """A flattened batch of chunks, chunk i at positions contexts[i]..contexts[i] + chunks[i] of its
    request; the context's K/V already in the cache. Compares with prefill_attention per chunk; returns
    the kernel's output."""
    generator = torch.Generator().manual_seed(seed)
    totals = [context + chunk for context, chunk in zip(contexts, chunks)]
    num_blocks = sum(-(-total // block_size) for total in totals) + 2
    key_cache, value_cache = block_major_caches(num_kv_heads, num_blocks, block_size, head_dim, dtype, generator)
    tables = shuffled_block_tables(totals, block_size, num_blocks, generator)
    num_tokens = sum(chunks)
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    query, key, value = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + chunk)
    slots = torch.cat([
        tables[row][positions // block_size] * block_size + positions % block_size
        for row, positions in enumerate(torch.arange(context, total) for context, total in zip(contexts, totals))
    ]) if num_tokens else torch.empty(0, dtype=torch.int64)
    # The engine writes the chunk's K/V before attending; the kernel reads only the context from the cache.
    write_kv(key_cache, value_cache, key, value, slots.to(DEVICE))
    scale = head_dim**-0.5

    actual = triton_attention.paged_prefill_attention(
        query, key, value, key_cache, value_cache, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(contexts, dtype=torch.int32, device=DEVICE), tables.to(DEVICE), scale, tiles=tiles,
        num_splits=num_splits,
    )

    assert actual.shape == (num_tokens, num_q_heads, head_dim)
    float_caches = key_cache.float().cpu(), value_cache.float().cpu()
    for row, (context, chunk) in enumerate(zip(contexts, chunks)):
        if chunk == 0:
            continue
        rows = slice(starts[row], starts[row + 1])
        span = PrefillSpan(rows.start, rows.stop, context, tables[row])
        expected = prefill_attention(query[rows].float().cpu(), key[rows].float().cpu(), value[rows].float().cpu(),
                                     *float_caches, span, scale)
        assert_close(actual[rows], expected, dtype)
    return actual


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size, contexts, chunks, dtype",
    [
        # Fresh prompts (no context), on and one past block and tile boundaries.
        (3, 1, 64, 16, [0, 0, 0, 0], [1, 16, 17, 33], torch.float32),
        # Context in the cache (prefix hits, later chunks of chunked prefill), ratio 8.
        (8, 1, 128, 32, [32, 33, 0, 100], [5, 32, 1, 70], torch.bfloat16),
        # Ratio 1, two KV heads.
        (2, 2, 64, 16, [15, 16, 17], [2, 64, 65], torch.float32),
        # Ratio 3, block size 32, float32.
        (6, 2, 128, 32, [31, 0], [34, 40], torch.float32),
    ],
)
def test_prefill_matches_torch_reference(num_q_heads, num_kv_heads, head_dim, block_size, contexts, chunks, dtype):
    run_prefill_case(num_q_heads, num_kv_heads, head_dim, block_size, contexts, chunks, dtype, seed=sum(chunks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_single_chunk_after_a_long_context(dtype):
    run_prefill_case(1, 1, 64, 16, [2000], [40], dtype, seed=7)


@pytest.mark.parametrize("tiles", [
    triton_attention.prefill_tiles(torch.float32, 64),
    triton_attention.prefill_tiles(torch.bfloat16, 64),
    triton_attention.prefill_tiles(torch.bfloat16, 128),
    triton_attention.prefill_tiles(torch.bfloat16, 128, arch=90),
    triton_attention.prefill_tiles(torch.float32, 128, arch=90),
    triton_attention.Tiles(rows=32, key_tile=16, num_warps=8, num_stages=2),
], ids=lambda tiles: f"{tiles.rows}x{tiles.key_tile}x{tiles.num_warps}x{tiles.num_stages}")
def test_prefill_tile_shapes_agree(tiles):
    """Every tile shape the launch chooses from by dtype and head size (prefill_tiles, sized so they
    compile without spills) gives the reference's output on one case whose chunks cross row-tile, key-
    tile and block boundaries, with context in the cache and grouped-query ratio 3."""
    run_prefill_case(6, 2, 64, 16, [20, 0, 47], [33, 70, 17], torch.float32, seed=21, tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_split_counts_agree(dtype):
    """Each chunk's context split across programs and combined by the reduction gives the reference's output
    at any split count, including more splits than the context has key tiles (empty splits), a chunk with no
    context (only the last split has keys) and a split boundary inside a chunk's own keys' reach; in float32
    the same numbers as one split up to rounding."""
    case = (6, 2, 64, 16, [300, 0, 65, 130], [40, 33, 64, 1])
    whole = run_prefill_case(*case, dtype, seed=31, num_splits=1)
    for num_splits in (3, 16):  # an uneven split of the keys, and more splits than some contexts have tiles
        split = run_prefill_case(*case, dtype, seed=31, num_splits=num_splits)
        if dtype == torch.float32:
            torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)


def test_prefill_splits_with_the_chosen_tiles():
    """Splits with every tile shape the launch chooses from (their own key tiles decide the parts)."""
    for tiles in (triton_attention.prefill_tiles(torch.bfloat16, 128, arch=90),
                  triton_attention.prefill_tiles(torch.float32, 64)):
        run_prefill_case(8, 1, 128, 32, [300, 77], [70, 5], torch.bfloat16, seed=32, tiles=tiles, num_splits=4)


def test_choose_prefill_splits_splits_long_contexts_of_few_programs_only():
    cpu = torch.device("cpu")
    min_context = triton_attention.MIN_CONTEXT_PER_SPLIT
    choose = triton_attention.choose_prefill_splits
    assert choose(24, min_context - 1, cpu, 3) == 1
    assert choose(24, 3 * min_context, cpu, 3) == 3
    assert choose(24, 10**6, cpu, 3) == 128 // 24
    assert choose(65, 10**6, cpu, 3) == 1
    assert choose(1, 10**6, cpu, 1) == triton_attention.MAX_PREFILL_SPLITS
    assert choose(128, 10**6, cpu, 1) == 1
    bfloat16_64, bfloat16_128 = (triton_attention.prefill_tiles(torch.bfloat16, d, arch=90) for d in (64, 128))
    assert triton_attention.prefill_programs_per_sm(bfloat16_64) == 3
    assert triton_attention.prefill_programs_per_sm(bfloat16_128) == 1


def test_prefill_of_an_empty_batch_is_empty():
    run_prefill_case(3, 1, 64, 16, [], [], torch.float32, seed=8)
    run_prefill_case(3, 1, 64, 16, [4, 0, 9], [0, 3, 0], torch.float32, seed=9)  # chunks of no tokens


def test_both_launches_write_into_rows_of_a_given_output():
    """``out``: the engine's step output, decode rows first and prefill rows after, each launch writing its rows in
    place through the view's strides (no copy), the same numbers as into a tensor of its own, the rest untouched."""
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(6, 2, 64, 16, [5, 40, 70], torch.float32, seed=4)
    expected = triton_attention.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125)
    step = torch.full((3 + 7, 6, 64), 7.0, device=DEVICE)
    returned = triton_attention.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125,
                                                       num_splits=2, out=step[:3])
    assert returned.data_ptr() == step.data_ptr()
    torch.testing.assert_close(step[:3], expected, atol=1e-6, rtol=1e-6)
    assert bool((step[3:] == 7.0).all())

    prompt = torch.randn(7, 6 + 2 + 2, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    prompt_query, prompt_key, prompt_value = prompt.split([6, 2, 2], dim=1)
    starts, contexts = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    arguments = (prompt_query, prompt_key, prompt_value, key_cache, value_cache, starts, contexts, tables[:1], 0.125)
    expected = triton_attention.paged_prefill_attention(*arguments)
    triton_attention.paged_prefill_attention(*arguments, out=step[3:])
    torch.testing.assert_close(step[3:], expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(step[:3], returned, atol=0, rtol=0)


def test_an_output_that_does_not_match_the_query_is_refused():
    query, key_cache, value_cache, tables, seq_lens = decode_inputs(3, 1, 64, 16, [5, 9], torch.float32, seed=6)
    for wrong in (torch.empty(3, 3, 64), torch.empty(2, 3, 64, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out must match the query"):
            triton_attention.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125,
                                                    out=wrong.to(DEVICE))
