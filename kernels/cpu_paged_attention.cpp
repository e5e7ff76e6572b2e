// Paged decode attention for CPUs: one query token per request, keys and values
// read straight from the paged KV cache (no gathered copy), softmax computed
// online block by block. Parallel over (request, KV head) with OpenMP.
//
// Layouts (float32, contiguous):
//   query        [num_requests, q_heads, head_dim]
//   key/value    [kv_heads, num_blocks, block_size, head_dim]   (one layer)
//   block_tables [num_requests, max_blocks] int64 (entries past a request's end unused)
//   seq_lens     [num_requests] int64 (context length including the new token)
// Returns [num_requests, q_heads, head_dim].
//
// The plain-torch reference is splitserve.engine.attention.decode_attention;
// tests/test_kernels.py compares the two.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxBlockSize = 256;

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
                  value_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  const int64_t num_requests = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0), num_blocks = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "q_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_size <= kMaxBlockSize, "block_size too large");
  const int64_t group = num_q_heads / num_kv_heads;

  auto out = torch::empty_like(query);
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = key_cache.data_ptr<float>();
  const float* v_ptr = value_cache.data_ptr<float>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  // Checked here, not inside the parallel loop (an exception must not leave an OpenMP region).
  for (int64_t r = 0; r < num_requests; ++r) {
    TORCH_CHECK(len_ptr[r] >= 0 && len_ptr[r] <= max_blocks * block_size, "seq_len exceeds the block table");
    for (int64_t i = 0; i < (len_ptr[r] + block_size - 1) / block_size; ++i) {
      const int64_t block = table_ptr[r * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t r = 0; r < num_requests; ++r) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t length = len_ptr[r];
      std::vector<float> running_max(group, -std::numeric_limits<float>::infinity());
      std::vector<float> denominator(group, 0.0f);
      std::vector<float> accumulator(group * head_dim, 0.0f);
      std::vector<float> scores(group * block_size);
      const float* q_group = q_ptr + (r * num_q_heads + h * group) * head_dim;
      for (int64_t start = 0; start < length; start += block_size) {
        const int64_t block = table_ptr[r * max_blocks + start / block_size];
        const int64_t count = std::min(block_size, length - start);
        const float* k_block = k_ptr + (h * num_blocks + block) * block_size * head_dim;
        const float* v_block = v_ptr + (h * num_blocks + block) * block_size * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* q = q_group + g * head_dim;
          float* s = scores.data() + g * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < count; ++t) {
            const float* k = k_block + t * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * k[d];
            s[t] = dot * scale_f;
            block_max = std::max(block_max, s[t]);
          }
          const float new_max = std::max(running_max[g], block_max);
          const float correction = std::exp(running_max[g] - new_max);
          float* acc = accumulator.data() + g * head_dim;
          float sum = denominator[g] * correction;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
          for (int64_t t = 0; t < count; ++t) {
            const float p = std::exp(s[t] - new_max);
            sum += p;
            const float* v = v_block + t * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * v[d];
          }
          denominator[g] = sum;
          running_max[g] = new_max;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out_ptr + (r * num_q_heads + h * group + g) * head_dim;
        const float inverse = denominator[g] > 0.0f ? 1.0f / denominator[g] : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = accumulator[g * head_dim + d] * inverse;
      }
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, float32)");
}
