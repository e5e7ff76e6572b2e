// Fused element-wise operations of the Llama layer for CPUs (float32): each reads
// and writes its tensors once instead of once per torch operation, which is what
// they cost on a memory-bound CPU. Parallel over rows with OpenMP.
//
// Each computes what its plain-torch reference in splitserve.engine.models.llama
// computes, operation by operation and rounding by rounding (built with
// -ffp-contract=off, so no multiply-add is fused behind our back); where the order
// of a sum or the exp differs, tests/test_kernels.py bounds the difference.

#include <torch/extension.h>

#include <cmath>

#include "cpu_vector_math.h"

namespace splitserve {

namespace {

void check_rows(const torch::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == torch::kFloat32, name, ": float32 only");
  TORCH_CHECK(tensor.dim() == 2 && tensor.stride(1) == 1, name, ": expected [rows, features] with unit stride");
}

// Row r: out = weight * (x * (1 / sqrt(mean(x^2) + eps))), as transformers' LlamaRMSNorm in float32.
void normalize_row(const float* x, const float* weight, float* out, int64_t size, float eps) {
  float sum = 0.0f;
  int64_t i = 0;
#ifdef SPLITSERVE_AVX2
  __m256 sum8 = _mm256_setzero_ps();
  for (; i + 8 <= size; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    sum8 = _mm256_add_ps(sum8, _mm256_mul_ps(v, v));
  }
  sum = horizontal_sum(sum8);
#endif
  for (; i < size; ++i) sum += x[i] * x[i];
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(size) + eps);
#pragma omp simd
  for (int64_t j = 0; j < size; ++j) out[j] = weight[j] * (x[j] * inverse);
}

}  // namespace

// x: [rows, hidden]; weight: [hidden]. Returns the normalized rows.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight must be [hidden]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), size = x.size(1), stride = x.stride(0);
  const float *x_ptr = x.data_ptr<float>(), *w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) normalize_row(x_ptr + r * stride, w_ptr, out_ptr + r * size, size, eps);
  return out;
}

// residual += x (in place), then returns rms_norm(residual): the residual add and the next layer's
// norm in one pass. residual: [rows, hidden] contiguous (modified); x: [rows, hidden].
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "add_rms_norm: residual must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight must be [hidden]");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), size = x.size(1), stride = x.stride(0);
  const float *x_ptr = x.data_ptr<float>(), *w_ptr = weight.data_ptr<float>();
  float *res_ptr = residual.data_ptr<float>(), *out_ptr = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    float* res = res_ptr + r * size;
    const float* add = x_ptr + r * stride;
#pragma omp simd
    for (int64_t j = 0; j < size; ++j) res[j] = res[j] + add[j];
    normalize_row(res, w_ptr, out_ptr + r * size, size, eps);
  }
  return out;
}

// gate_up: [rows, 2 * intermediate] (gate, then up). Returns silu(gate) * up: [rows, intermediate],
// silu(g) = g / (1 + e^-g).
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, size}, gate_up.options());
  const float* in_ptr = gate_up.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = in_ptr + r * stride;
    const float* up = gate + size;
    float* o = out_ptr + r * size;
    int64_t j = 0;
#ifdef SPLITSERVE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; j + 8 <= size; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
    }
#endif
    for (; j < size; ++j) o[j] = (gate[j] / (1.0f + std::exp(-gate[j]))) * up[j];
  }
  return out;
}

// Rotary embedding in place. x: [tokens, heads, head_dim] (rows of head_dim contiguous);
// cos, sin: [tokens, head_dim] contiguous. Each head row becomes x * cos + rotate_half(x) * sin with
// rotate_half(x) = [-x[half:], x[:half]]: two products and a sum, each rounded, as torch computes it.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32, "rotary_: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rotary_: cos and sin must be [tokens, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  float* x_ptr = x.data_ptr<float>();
  const float *cos_ptr = cos.data_ptr<float>(), *sin_ptr = sin.data_ptr<float>();
#pragma omp parallel for schedule(static) if (tokens > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos_ptr + t * head_dim;
    const float* s = sin_ptr + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* row = x_ptr + t * token_stride + h * head_stride;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float first = row[d], second = row[d + half];
        row[d] = first * c[d] + (-second) * s[d];
        row[d + half] = second * c[d + half] + first * s[d + half];
      }
    }
  }
}

}  // namespace splitserve
