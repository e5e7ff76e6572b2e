// Fused element-wise operations of the Llama layer for CPUs (float32 or bfloat16): each
// reads and writes its tensors once instead of once per torch operation, which is
// what they cost on a memory-bound CPU. Parallel over rows with OpenMP.
//
// Each computes what its plain-torch reference in splitserve.engine.models.llama
// computes, operation by operation and rounding by rounding (built with
// -ffp-contract=off, so no multiply-add is fused behind our back); where the order
// of a sum or the exp differs, tests/test_kernels.py bounds the difference. In
// bfloat16 every operation computes in float32 and rounds its result to bfloat16
// where torch's bfloat16 operation does (rounded<T> below), so the two differ by
// the order of the norm's sum and the exp only.

#include "cpu_tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_vector16.h"
#include "cpu_vector_math.h"

namespace splitserve {

namespace {

using vec16::BFloat16;
using vec16::f32x16;
using vec16::to_float;

// A float32 result stored as T.
template <typename T>
inline T store_as(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return vec16::to_bfloat16(x);
}

// x rounded as a torch operation on T-tensors rounds its result.
template <typename T>
inline float rounded(float x) {
  return to_float(store_as<T>(x));
}

// The element type of a tensor the fused operations take: float32 or bfloat16.
bool is_bfloat16(const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 only");
  return tensor.scalar_type() == at::kBFloat16;
}

void check_rows(const at::Tensor& tensor, const char* name) {
  is_bfloat16(tensor, name);
  TORCH_CHECK(tensor.dim() == 2 && tensor.stride(1) == 1, name, ": expected [rows, features] with unit stride");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, ": all tensors must have one dtype");
}

template <typename T>
T* data(const at::Tensor& tensor) {
  return reinterpret_cast<T*>(tensor.data_ptr());
}

// ---- bfloat16 rows on 16-float vectors: each function does the first 16 * floor(n / 16) elements and returns
// how many that is (the callers' scalar loops do the rest). They sit under fp-contract=fast, as the vector
// helpers of cpu_vector16.h do: GCC inlines a function only into callers built with its own setting, and a
// call per vector would cost more than the work. Contraction changes nothing here that torch fixes: every
// product is rounded to bfloat16 before a sum reads it, except in the norm's sum of squares, whose order
// differs from torch's anyway.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
namespace bf16_rows {

using vec16::load16;
using vec16::round_to_bfloat16;
using vec16::store16;

int64_t sum_of_squares(const BFloat16* x, int64_t n, float* sum) {
  f32x16 sum16 = vec16::splat(0.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 v = load16(x + i);
    sum16 += v * v;
  }
  *sum = vec16::horizontal_sum(sum16);
  return i;
}

int64_t scale_by_weight(const BFloat16* x, const BFloat16* weight, float inverse, BFloat16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, load16(weight + i) * round_to_bfloat16(load16(x + i) * inverse));
  return i;
}

int64_t add_into(BFloat16* residual, const BFloat16* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(residual + i, load16(residual + i) + load16(x + i));
  return i;
}

int64_t silu_and_mul(const BFloat16* gate, const BFloat16* up, BFloat16* out, int64_t n) {
  const f32x16 one = vec16::splat(1.0f), zero = vec16::splat(0.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 g = load16(gate + i);
    store16(out + i, round_to_bfloat16(g / (one + vec16::exp16(zero - g))) * load16(up + i));
  }
  return i;
}

int64_t rotate(BFloat16* row, const BFloat16* c, const BFloat16* s, int64_t half) {
  const f32x16 zero = vec16::splat(0.0f);
  int64_t d = 0;
  for (; d + 16 <= half; d += 16) {
    const f32x16 first = load16(row + d), second = load16(row + d + half);
    store16(row + d, round_to_bfloat16(first * load16(c + d)) + round_to_bfloat16((zero - second) * load16(s + d)));
    store16(row + d + half,
            round_to_bfloat16(second * load16(c + d + half)) + round_to_bfloat16(first * load16(s + d + half)));
  }
  return d;
}

}  // namespace bf16_rows
#pragma GCC pop_options

// Row r: out = weight * (x * (1 / sqrt(mean(x^2) + eps))), as transformers' LlamaRMSNorm: in float32 (for
// bfloat16 x, the normalized row is rounded to bfloat16 before the weight multiplies it).
template <typename T>
void normalize_row(const T* x, const T* weight, T* out, int64_t size, float eps) {
  float sum = 0.0f;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
#ifdef SPLITSERVE_AVX2
    __m256 sum8 = _mm256_setzero_ps();
    for (; i + 8 <= size; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      sum8 = _mm256_add_ps(sum8, _mm256_mul_ps(v, v));
    }
    sum = horizontal_sum(sum8);
#endif
  } else {
    i = bf16_rows::sum_of_squares(x, size, &sum);
  }
  for (; i < size; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(size) + eps);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, BFloat16>) j = bf16_rows::scale_by_weight(x, weight, inverse, out, size);
#pragma omp simd
  for (int64_t k = j; k < size; ++k) out[k] = store_as<T>(to_float(weight[k]) * rounded<T>(to_float(x[k]) * inverse));
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), size = x.size(1), stride = x.stride(0);
  const T *x_ptr = data<T>(x), *w_ptr = data<T>(weight);
  T* out_ptr = data<T>(out);
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) normalize_row(x_ptr + r * stride, w_ptr, out_ptr + r * size, size, eps);
}

template <typename T>
void add_rms_norm_rows(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), size = x.size(1), stride = x.stride(0);
  const T *x_ptr = data<T>(x), *w_ptr = data<T>(weight);
  T *res_ptr = data<T>(residual), *out_ptr = data<T>(out);
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    T* res = res_ptr + r * size;
    const T* add = x_ptr + r * stride;
    int64_t j = 0;
    if constexpr (std::is_same_v<T, BFloat16>) j = bf16_rows::add_into(res, add, size);
#pragma omp simd
    for (int64_t k = j; k < size; ++k) res[k] = store_as<T>(to_float(res[k]) + to_float(add[k]));
    normalize_row(res, w_ptr, out_ptr + r * size, size, eps);
  }
}

// silu(g) = g / (1 + e^-g), rounded as torch's silu, times up.
template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const T* in_ptr = data<T>(gate_up);
  T* out_ptr = data<T>(out);
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = in_ptr + r * stride;
    const T* up = gate + size;
    T* o = out_ptr + r * size;
    int64_t j = 0;
    if constexpr (std::is_same_v<T, float>) {
#ifdef SPLITSERVE_AVX2
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; j + 8 <= size; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
      }
#endif
    } else {
      j = bf16_rows::silu_and_mul(gate, up, o, size);
    }
    for (; j < size; ++j) {
      const float g = to_float(gate[j]);
      o[j] = store_as<T>(rounded<T>(g / (1.0f + std::exp(-g))) * to_float(up[j]));
    }
  }
}

// Each head row of x becomes x * cos + rotate_half(x) * sin: two products and a sum, each rounded to T.
template <typename T>
void rotary_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* x_ptr = data<T>(x);
  const T *cos_ptr = data<T>(cos), *sin_ptr = data<T>(sin);
#pragma omp parallel for schedule(static) if (tokens > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos_ptr + t * head_dim;
    const T* s = sin_ptr + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x_ptr + t * token_stride + h * head_stride;
      int64_t d = 0;
      if constexpr (std::is_same_v<T, BFloat16>) d = bf16_rows::rotate(row, c, s, half);
#pragma omp simd
      for (int64_t e = d; e < half; ++e) {
        const float first = to_float(row[e]), second = to_float(row[e + half]);
        row[e] = store_as<T>(rounded<T>(first * to_float(c[e])) + rounded<T>((-second) * to_float(s[e])));
        row[e + half] = store_as<T>(rounded<T>(second * to_float(c[e + half])) + rounded<T>(first * to_float(s[e + half])));
      }
    }
  }
}

}  // namespace

// x: [rows, hidden]; weight: [hidden]. Returns the normalized rows.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  check_same_dtype(x, weight, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight must be [hidden]");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (is_bfloat16(x, "rms_norm")) rms_norm_rows<BFloat16>(x, weight, out, eps);
  else rms_norm_rows<float>(x, weight, out, eps);
  return out;
}

// residual += x (in place), then returns rms_norm(residual): the residual add and the next layer's
// norm in one pass. residual: [rows, hidden] contiguous (modified); x: [rows, hidden].
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "add_rms_norm: residual must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight must be [hidden]");
  check_same_dtype(x, residual, "add_rms_norm");
  check_same_dtype(x, weight, "add_rms_norm");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (is_bfloat16(x, "add_rms_norm")) add_rms_norm_rows<BFloat16>(x, residual, weight, out, eps);
  else add_rms_norm_rows<float>(x, residual, weight, out, eps);
  return out;
}

// gate_up: [rows, 2 * intermediate] (gate, then up). Returns silu(gate) * up: [rows, intermediate],
// silu(g) = g / (1 + e^-g).
at::Tensor silu_and_mul(at::Tensor gate_up, at::Tensor out_arg) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  auto out = out_arg.dim() == 2 ? out_arg : at::empty({rows, size}, gate_up.options());
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type() && out.is_contiguous() && out.size(0) == rows &&
                  out.size(1) == size,
              "silu_and_mul: out must be a contiguous [rows, features / 2] tensor of gate_up's dtype");
  if (is_bfloat16(gate_up, "silu_and_mul")) silu_and_mul_rows<BFloat16>(gate_up, out);
  else silu_and_mul_rows<float>(gate_up, out);
  return out;
}

// Rotary embedding in place. x: [tokens, heads, head_dim] (rows of head_dim contiguous);
// cos, sin: [tokens, head_dim] contiguous. Each head row becomes x * cos + rotate_half(x) * sin with
// rotate_half(x) = [-x[half:], x[:half]]: two products and a sum, each rounded, as torch computes it.
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_same_dtype(x, cos, "rotary_");
  check_same_dtype(x, sin, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rotary_: cos and sin must be [tokens, head_dim]");
  if (is_bfloat16(x, "rotary_")) rotary_rows<BFloat16>(x, cos, sin);
  else rotary_rows<float>(x, cos, sin);
}

// Each row's argmax (greedy sampling): logits [rows, vocab] float32 with contiguous rows (any row stride) -> int64
// [rows], the index of the first of tied maxima, a NaN counting as larger than anything (the first NaN's index),
// as torch.argmax and torch.max(dim).indices give. Two passes over a row: its maximum (NaNs noted, not compared),
// then the first index holding it (or the first NaN). A row of SmolLM2's 49,152 logits is 192 KB, so the second
// pass reads it from L2. torch's max(dim) took 2.9 ms for 64 such rows on two Emerald Rapids cores (its loop
// carries an index per element); this reads them at the cache's speed.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: logits must be float32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), row_stride = logits.stride(0);
  TORCH_CHECK(vocab > 0, "argmax_rows: a row needs at least one logit");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef int32_t i32x8 __attribute__((vector_size(32)));
  constexpr int64_t kWidth = 8, kChains = 4;  // four independent maxima, so the compares do not wait on each other
  const int64_t whole = vocab / kWidth * kWidth, chained = vocab / (kWidth * kChains) * (kWidth * kChains);
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = base + r * row_stride;
    f32x8 best[kChains];
    i32x8 nan_lanes = i32x8{};
    for (int c = 0; c < kChains; ++c) best[c] = f32x8{} + -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < chained; i += kWidth * kChains) {
      for (int c = 0; c < kChains; ++c) {
        f32x8 v;
        std::memcpy(&v, row + i + c * kWidth, sizeof(v));
        nan_lanes |= v != v;
        best[c] = v > best[c] ? v : best[c];
      }
    }
    for (int64_t i = chained; i < whole; i += kWidth) {
      f32x8 v;
      std::memcpy(&v, row + i, sizeof(v));
      nan_lanes |= v != v;
      best[0] = v > best[0] ? v : best[0];
    }
    float maximum = -std::numeric_limits<float>::infinity();
    bool has_nan = false;
    for (int lane = 0; lane < kWidth; ++lane) {
      has_nan |= nan_lanes[lane] != 0;
      for (int c = 0; c < kChains; ++c) {
        if (best[c][lane] > maximum) maximum = best[c][lane];
      }
    }
    for (int64_t i = whole; i < vocab; ++i) {
      has_nan |= row[i] != row[i];
      if (row[i] > maximum) maximum = row[i];
    }
    int64_t found = vocab;
    const f32x8 target = f32x8{} + maximum;
    for (int64_t i = 0; i < whole && found == vocab; i += kWidth) {
      f32x8 v;
      std::memcpy(&v, row + i, sizeof(v));
      const i32x8 hit = has_nan ? (v != v) : (v == target);
      bool any = false;
      for (int lane = 0; lane < kWidth; ++lane) any |= hit[lane] != 0;
      if (!any) continue;
      for (int lane = 0; lane < kWidth; ++lane) {
        if (hit[lane] != 0) {
          found = i + lane;
          break;
        }
      }
    }
    for (int64_t i = whole; i < vocab && found == vocab; ++i) {
      if (has_nan ? row[i] != row[i] : row[i] == maximum) found = i;
    }
    indices[r] = found;
  }
  return out;
}

// Structured outputs' token masks (engine/structured_output.py): on each listed row of the logits, -inf on every
// token its bitmask does not allow (bit j of word w allows token 32 w + j; tokens past the words are not allowed).
// A word of all ones is skipped whole, and a set bit leaves its logit alone, so a row costs its refused tokens' stores.
// torch's version (expand the bits to a bool per token, then masked_fill) took 5-10 ms for 32 rows of SmolLM2's
// 49,152 logits on two Zen 5 cores, a tenth of a decode step; its reference is apply_token_bitmask's torch path.
void apply_token_bitmask_(at::Tensor logits, at::Tensor rows, at::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask_: rows must be a contiguous int64 vector");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0),
              "apply_token_bitmask_: bitmask must be contiguous int32 [len(rows), words]");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), row_stride = logits.stride(0);
  const int64_t count = rows.size(0), words = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_rows, "apply_token_bitmask_: row ", row_ids[i], " out of range");
  float* base = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr float kRefused = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (count > 1)
  for (int64_t i = 0; i < count; ++i) {
    float* row = base + row_ids[i] * row_stride;
    const uint32_t* mask = masks + i * words;
    for (int64_t w = 0; w < words && 32 * w < vocab; ++w) {
      const uint32_t word = mask[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t first = 32 * w, last = std::min<int64_t>(first + 32, vocab);
      for (int64_t token = first; token < last; ++token)
        if (!((word >> (token - first)) & 1u)) row[token] = kRefused;
    }
    for (int64_t token = 32 * words; token < vocab; ++token) row[token] = kRefused;
  }
}

}  // namespace splitserve
