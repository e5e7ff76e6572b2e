"""The Triton element-wise kernels and KV block copies against their plain-torch references (and against
the C++ kernels where they build).

On a machine without a CUDA GPU they run on CPU tensors through Triton's interpreter, which
``TRITON_INTERPRET=1`` must have switched on before ``triton`` was first imported in the process (Triton
wraps its own library functions then): ``tests/conftest.py`` sets it before any test module is imported.

Tolerances. float32: RMSNorm and SiLU-and-multiply within 2e-6 (a sum in another order, exp and sqrt
of another library); rotary bit-identical (no multiply-add contraction); block copies bit-identical.
bfloat16: the kernels round where torch rounds, so on a GPU the residual add and rotary are exact; the
interpreter of triton 3.9 rounds float32 to bfloat16 toward zero where torch rounds to nearest, so
under it each rounding may be one bfloat16 unit (at most 2^-7 relative) off: two roundings in a row,
2 units (rtol 2^-6, about torch's own default of 1.6e-2 for bfloat16), are allowed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from splitserve.common.model_info import ModelConfig, cache_dir
from splitserve.engine.models.rms_norm import RMSNorm
from splitserve.engine.models.rotary_embedding import RotaryEmbedding, apply_rotary
from splitserve.kernels import cpu_ops, triton_ops
from splitserve.kvtransfer import blocks as reference_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("Triton kernels run on CPU only under TRITON_INTERPRET=1, set before triton is first "
                       "imported: run the tests through pytest from the repository (tests/conftest.py sets it).")
pytestmark = pytest.mark.timeout(120)


EXACT_ROUNDING = DEVICE == "cuda"  # the interpreter truncates float32 -> bfloat16 (see the module docstring)
BFLOAT16_UNIT = 2**-7  # the most a bfloat16 rounding is off, relative
TOLERANCES = {torch.float32: {"rtol": 2e-6, "atol": 2e-6}, torch.bfloat16: {"rtol": 2 * BFLOAT16_UNIT, "atol": 1e-3}}
DTYPES = [torch.float32, torch.bfloat16]


def _cpu_kernels():
    """cpu_ops for float32 comparisons on CPU tensors (the C++ extension builds wherever the test command
    ran); None on a GPU, whose tensors the C++ kernels do not take."""
    if DEVICE != "cpu":
        return None
    assert cpu_ops.available(str(cache_dir())), "the C++ CPU kernels do not build here"
    return cpu_ops


def _within_one_bfloat16_unit(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Each element equal, or the neighbouring bfloat16 value (one unit in the last place)."""
    a = actual.view(torch.int16).to(torch.int32)
    b = expected.view(torch.int16).to(torch.int32)
    return bool(((a - b).abs() <= 1).all())


def _assert_rounded_as_torch(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical, except one bfloat16 unit where the interpreter rounds toward zero."""
    if actual.dtype == torch.float32 or EXACT_ROUNDING:
        assert torch.equal(actual, expected)
    else:
        assert _within_one_bfloat16_unit(actual, expected)


def _norm(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], 1e-5).to(device=weight.device, dtype=weight.dtype)
    norm.weight.copy_(weight)
    return norm


# ---- RMSNorm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(37, 576), (1, 576), (0, 576), (5, 1000), (3, 7)])
def test_rms_norm_matches_the_torch_layer(dtype, rows, hidden):
    generator = torch.Generator().manual_seed(rows * 1000 + hidden)
    weight = torch.randn(hidden, generator=generator).to(DEVICE, dtype)
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(DEVICE, dtype)
    before = x.clone()
    actual = triton_ops.rms_norm(x, weight, 1e-5)
    assert actual.shape == (rows, hidden) and actual.dtype == dtype and actual.is_contiguous()
    torch.testing.assert_close(actual, _norm(weight)(x), **TOLERANCES[dtype])
    assert torch.equal(x, before)


def test_rms_norm_reads_strided_rows_and_matches_the_cpp_kernel():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(576, generator=generator).to(DEVICE)
    wide = torch.randn(6, 1000, generator=generator).to(DEVICE)
    x = wide[:, :576]  # rows 1000 apart, as a slice of a wider activation
    expected = _norm(weight)(x.contiguous())
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-5), expected, rtol=2e-6, atol=2e-6)
    kernels = _cpu_kernels()
    if kernels is not None:
        torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-5), kernels.rms_norm(x, weight, 1e-5),
                                   rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(37, 576), (1, 576), (0, 576), (4, 1000)])
def test_add_rms_norm_adds_into_the_residual_in_place(dtype, rows, hidden):
    generator = torch.Generator().manual_seed(2 + rows + hidden)
    weight = torch.randn(hidden, generator=generator).to(DEVICE, dtype)
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(DEVICE, dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(DEVICE, dtype)
    expected, expected_residual = _norm(weight)(x, residual.clone())
    x_before = x.clone()
    stream = residual.clone()
    actual = triton_ops.add_rms_norm(x, stream, weight, 1e-5)
    _assert_rounded_as_torch(stream, expected_residual)  # the residual changed in place, to residual + x
    assert torch.equal(x, x_before)
    if dtype == torch.float32 or EXACT_ROUNDING:
        torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
    else:  # normalizes the residual it stored: compare with the torch norm of that very residual
        torch.testing.assert_close(actual, _norm(weight)(stream), **TOLERANCES[dtype])
        torch.testing.assert_close(actual.float(), expected.float(), rtol=3 * BFLOAT16_UNIT, atol=1e-2)
    kernels = _cpu_kernels() if dtype == torch.float32 else None
    if kernels is not None:
        cpp_stream = residual.clone()
        torch.testing.assert_close(actual, kernels.add_rms_norm(x, cpp_stream, weight, 1e-5), rtol=2e-6, atol=2e-6)
        assert torch.equal(stream, cpp_stream)


def test_add_rms_norm_refuses_mismatched_tensors():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        triton_ops.add_rms_norm(x, torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        triton_ops.rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)


# ---- SiLU-and-multiply ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, intermediate", [(9, 1539), (1, 1536), (0, 1536), (3, 5)])
def test_silu_and_mul_matches_torch(dtype, rows, intermediate):
    generator = torch.Generator().manual_seed(3 + rows + intermediate)
    # Odd widths and more than one program's chunk per row (1024): masked tails.
    gate_up = (torch.randn(rows, 2 * intermediate, generator=generator) * 6).to(DEVICE, dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    actual = triton_ops.silu_and_mul(gate_up)
    assert actual.shape == (rows, intermediate) and actual.dtype == dtype
    torch.testing.assert_close(actual, F.silu(gate) * up, **TOLERANCES[dtype])
    kernels = _cpu_kernels() if dtype == torch.float32 and rows else None
    if kernels is not None:
        torch.testing.assert_close(actual, kernels.silu_and_mul(gate_up), rtol=2e-6, atol=2e-6)


def test_silu_and_mul_reads_strided_rows():
    generator = torch.Generator().manual_seed(4)
    wide = torch.randn(5, 3000, generator=generator).to(DEVICE)
    gate_up = wide[:, : 2 * 1400]
    gate, up = gate_up.split(1400, dim=-1)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="even"):
        triton_ops.silu_and_mul(wide[:, :7])


def test_silu_and_mul_writes_into_rows_of_a_larger_tensor():
    """out, as the CPU kernel takes it: the same values as a new tensor, the rows around untouched; an out it
    cannot write is refused."""
    generator = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(6, 2 * 1400, generator=generator) * 6).to(DEVICE)
    whole = torch.full((10, 1400), 7.0, device=DEVICE)
    returned = triton_ops.silu_and_mul(gate_up, out=whole[2:8])
    assert returned.data_ptr() == whole[2].data_ptr()
    torch.testing.assert_close(whole[2:8], triton_ops.silu_and_mul(gate_up), rtol=0, atol=0)
    assert bool((whole[:2] == 7).all()) and bool((whole[8:] == 7).all())
    for wrong in (torch.empty(6, 1399, device=DEVICE), torch.empty(1400, 6, device=DEVICE).t(),
                  torch.empty(6, 1400, dtype=torch.float64, device=DEVICE)):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            triton_ops.silu_and_mul(gate_up, out=wrong)


# ---- Rotary --------------------------------------------------------------------------------------------


def _rotary_tables(head_dim: int, positions: list[int], dtype: torch.dtype):
    config = ModelConfig("llama", "LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=head_dim,
                         rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=100000.0)
    cos, sin = RotaryEmbedding(config, 4096).tables(torch.tensor(positions, dtype=torch.long), dtype)  # [tokens, 1, head_dim]
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim, positions",
    [
        (9, 3, 64, [0, 1, 7, 300, 4095]),  # SmolLM2's shape: 12 heads rotated together
        (8, 8, 128, [5]),  # one token, head size 128
        (3, 1, 16, []),  # no token
        (5, 2, 6, [2, 3, 11]),  # half of 3: not a power of two
    ],
)
def test_rotary_rotates_a_strided_view_in_place_as_torch(dtype, q_heads, kv_heads, head_dim, positions):
    tokens = len(positions)
    cos, sin = _rotary_tables(head_dim, positions, dtype)
    generator = torch.Generator().manual_seed(5 + head_dim + tokens)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    rotated = (q_heads + kv_heads) * head_dim
    query_key = qkv[:, :rotated].view(tokens, q_heads + kv_heads, head_dim)  # strided, as the model passes it
    before = query_key.clone()
    expected = apply_rotary(before, cos, sin)
    half = head_dim // 2
    values_before = qkv[:, rotated:].clone()
    triton_ops.rotary_(query_key, cos.squeeze(1), sin.squeeze(1))
    if dtype == torch.float32 or EXACT_ROUNDING:
        assert torch.equal(query_key, expected)
    else:  # three roundings toward zero: each off by up to one unit of its product, or of the sum
        start = before.float()
        products = (start * cos.float()).abs() + (torch.cat((start[..., half:], start[..., :half]), -1) * sin.float()).abs()
        bound = BFLOAT16_UNIT * (products + expected.float().abs())
        assert bool(((query_key.float() - expected.float()).abs() <= bound).all())
    assert torch.equal(qkv[:, rotated:], values_before)  # the value heads beside them are untouched
    kernels = _cpu_kernels() if dtype == torch.float32 and tokens else None
    if kernels is not None:
        start = torch.randn(tokens, q_heads + kv_heads, head_dim, generator=generator).to(DEVICE)
        cpp, triton_result = start.clone(), start.clone()
        kernels.rotary_(cpp, cos.squeeze(1), sin.squeeze(1))
        triton_ops.rotary_(triton_result, cos.squeeze(1), sin.squeeze(1))
        assert torch.equal(triton_result, cpp)


def test_a_partial_rotary_turns_the_heads_leading_dimensions_and_leaves_the_rest():
    """Phi-4-mini's partial rotary: the model passes a view of each head's leading rotary_dim dimensions (96 of 128
    there; 24 of 32 here) and tables of that width."""
    heads, head_dim, rotary_dim, positions = 5, 32, 24, [0, 3, 200]
    cos, sin = _rotary_tables(rotary_dim, positions, torch.float32)
    query_key = torch.randn(len(positions), heads, head_dim, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    before = query_key.clone()
    triton_ops.rotary_(query_key[..., :rotary_dim], cos.squeeze(1), sin.squeeze(1))
    assert torch.equal(query_key[..., :rotary_dim], apply_rotary(before[..., :rotary_dim], cos, sin))
    assert torch.equal(query_key[..., rotary_dim:], before[..., rotary_dim:])
    kernels = _cpu_kernels()
    if kernels is not None:
        cpp = before.clone()
        kernels.rotary_(cpp[..., :rotary_dim], cos.squeeze(1), sin.squeeze(1))
        assert torch.equal(cpp, query_key)


def test_rotary_refuses_tables_of_another_shape():
    x = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos"):
        triton_ops.rotary_(x, torch.zeros(2, 4, device=DEVICE), torch.zeros(2, 8, device=DEVICE))


# ---- Gather and scatter of KV blocks -------------------------------------------------------------------


def _random_bits_cache(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """A block-major cache whose elements are random bit patterns (NaNs and infinities included)."""
    generator = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    count = num_blocks * int(torch.tensor(block_shape).prod()) * size
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(num_blocks, *block_shape).to(DEVICE)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "dtype, block_shape",
    [
        (torch.float32, (2, 2, 3, 16, 64)),  # [layers, 2, kv_heads, block_size, head_dim]: SmolLM2's, 2 layers
        (torch.bfloat16, (3, 2, 3, 16, 64)),
        (torch.bfloat16, (1, 2, 1, 3, 5)),  # 30 bytes a block: 2-byte words
        (torch.uint8, (1, 2, 1, 1, 7)),  # 14 bytes: 2-byte words; odd offsets below
    ],
)
def test_gather_then_scatter_round_trips_bit_exact_with_shuffled_ids(dtype, block_shape):
    num_blocks = 41
    cache = _random_bits_cache(num_blocks, block_shape, dtype, seed=6)
    generator = torch.Generator().manual_seed(7)
    block_ids = torch.randperm(num_blocks, generator=generator)[:17].tolist()  # shuffled, with gaps
    buffer = triton_ops.gather_blocks(cache, block_ids)
    assert buffer.shape == (17, *block_shape) and buffer.is_contiguous()
    assert torch.equal(_bits(buffer), _bits(cache[block_ids]))
    if DEVICE == "cpu":
        assert torch.equal(_bits(buffer), _bits(reference_blocks.gather_blocks(cache, block_ids)))

    target = _random_bits_cache(num_blocks, block_shape, dtype, seed=8)
    expected = target.clone()
    expected.index_copy_(0, torch.tensor(block_ids, device=DEVICE), buffer)
    triton_ops.scatter_blocks(target, torch.tensor(block_ids), buffer)  # ids as a tensor this time
    assert torch.equal(_bits(target), _bits(expected))  # the blocks written, every other block untouched
    assert torch.equal(_bits(target[block_ids]), _bits(cache[block_ids]))


def test_gather_reads_blocks_of_a_cache_view_at_an_odd_offset():
    # A view starting one byte into its storage: the copy falls back to single bytes.
    storage = _random_bits_cache(1, (1 + 9 * 14,), torch.uint8, seed=9).view(-1)
    cache = storage[1:].view(9, 2, 7)
    block_ids = [8, 0, 4, 3]
    assert torch.equal(triton_ops.gather_blocks(cache, block_ids), cache[block_ids])


def test_gather_and_scatter_of_no_blocks_and_repeats():
    cache = _random_bits_cache(5, (2, 4), torch.float32, seed=10)
    assert triton_ops.gather_blocks(cache, []).shape == (0, 2, 4)
    triton_ops.scatter_blocks(cache, [], torch.empty(0, 2, 4, device=DEVICE))
    assert torch.equal(_bits(triton_ops.gather_blocks(cache, [3, 3, 1])), _bits(cache[[3, 3, 1]]))


@pytest.mark.parametrize("dtype, block_shape", [(torch.float32, (2, 2, 3, 16, 64)), (torch.bfloat16, (1, 2, 1, 3, 5))])
def test_copy_blocks_moves_blocks_between_caches_in_one_pass(dtype, block_shape):
    # A p2p pair on one GPU lands the sender's blocks in the decode cache this way: the source seen as rows of
    # bytes (the peer's memory), the destination the cache itself.
    source = _random_bits_cache(23, block_shape, dtype, seed=11)
    target = _random_bits_cache(31, block_shape, dtype, seed=12)
    expected = target.clone()
    source_ids, destination_ids = [17, 3, 3, 22, 0], [30, 1, 7, 12, 0]
    expected[destination_ids] = source[source_ids]
    rows = source.view(source.shape[0], -1).view(torch.uint8)
    triton_ops.copy_blocks(rows, source_ids, target, torch.tensor(destination_ids))
    assert torch.equal(_bits(target), _bits(expected))
    triton_ops.copy_blocks(rows, [], target, [])
    assert torch.equal(_bits(target), _bits(expected))
    with pytest.raises(ValueError, match="twice"):
        triton_ops.copy_blocks(rows, [1, 2], target, [4, 4])
    with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
        triton_ops.copy_blocks(rows, [1, 2], target, [4])
    with pytest.raises(ValueError, match="blocks of"):
        triton_ops.copy_blocks(rows[:, 1:], [1], target, [4])
    with pytest.raises(IndexError, match=r"\[0, 23\)"):
        triton_ops.copy_blocks(rows, [23], target, [4])


def test_gather_and_scatter_refuse_bad_ids_and_buffers():
    cache = torch.zeros(5, 2, 4, device=DEVICE)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        triton_ops.gather_blocks(cache, [1, 5])
    with pytest.raises(IndexError):
        triton_ops.scatter_blocks(cache, [-1], torch.zeros(1, 2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="twice"):
        triton_ops.scatter_blocks(cache, [2, 2], torch.zeros(2, 2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="buffer"):
        triton_ops.scatter_blocks(cache, [2, 3], torch.zeros(3, 2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.gather_blocks(cache.transpose(1, 2), [0])


def test_cpu_tensors_without_the_interpreter_get_a_sentence(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_ops.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-5)
