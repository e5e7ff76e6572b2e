// The Python bindings of splitserve's CPU kernels (one extension, compiled on first use).
//
// pybind11 with torch's tensor conversions, not <torch/extension.h>: that header adds the whole C++
// frontend, which these bindings do not use, and took four times as long to parse (32 s against 8 on a
// 2-core Zen 3). The kernel sources include cpu_tensor.h for the same reason.
#include <torch/csrc/utils/pybind.h>

#include "cpu_tensor.h"

namespace splitserve {
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale, at::Tensor out);
at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor query_start_loc, at::Tensor context_lens,
                                   at::Tensor block_tables, double scale, at::Tensor out);
void write_kv_(at::Tensor key_cache, at::Tensor value_cache, at::Tensor key, at::Tensor value,
               at::Tensor slot_mapping);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up, at::Tensor out);
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor argmax_rows(at::Tensor logits);
void apply_token_bitmask_(at::Tensor logits, at::Tensor rows, at::Tensor bitmask);
bool small_gemm_supported();
bool bfloat16_dot_supported();
bool amx_decode_supported(int64_t head_dim, int64_t block_size, int64_t group);
bool set_amx_enabled(bool enabled);
int64_t set_decode_prefetch_level(int64_t level);
int64_t decode_prefetch_level();
bool amx_prefill_supported(int64_t head_dim, int64_t block_size);
at::Tensor pack_panels(at::Tensor weight);
int64_t set_small_gemm_block_steps(int64_t steps);
int64_t default_small_gemm_block_steps();
int64_t small_gemm_max_rows();
at::Tensor small_gemm(at::Tensor x, at::Tensor panels, at::Tensor bias, int64_t out_features);
bool small_gemm_bfloat16_supported();
at::Tensor pack_panels_bfloat16(at::Tensor weight);
at::Tensor small_gemm_bfloat16(at::Tensor x, at::Tensor panels, at::Tensor bias, int64_t out_features);
}  // namespace splitserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &splitserve::paged_decode_attention, "Paged decode attention (float32 query, float32 or bfloat16 cache)");
  m.def("paged_prefill_attention", &splitserve::paged_prefill_attention,
        "Paged causal attention of prompt chunks over their cached context (float32 query, float32 or bfloat16 cache)");
  m.def("write_kv_", &splitserve::write_kv_, "store keys and values into their cache slots (float32 or bfloat16)");
  m.def("rms_norm", &splitserve::rms_norm, "RMSNorm of rows (float32 or bfloat16)");
  m.def("add_rms_norm", &splitserve::add_rms_norm, "residual += x, then RMSNorm of residual (float32 or bfloat16)");
  m.def("silu_and_mul", &splitserve::silu_and_mul, "silu(gate) * up (float32 or bfloat16), into out where given");
  m.def("rotary_", &splitserve::rotary_, "rotary embedding in place (float32 or bfloat16)");
  m.def("argmax_rows", &splitserve::argmax_rows,
        "each row's argmax, the first of tied maxima, a NaN the largest (float32 [rows, vocab] -> int64 [rows])");
  m.def("apply_token_bitmask_", &splitserve::apply_token_bitmask_,
        "-inf in place on each listed row's tokens its int32 bitmask does not allow (float32 logits)");
  m.def("small_gemm_supported", &splitserve::small_gemm_supported, "whether small_gemm was built (AVX-512, or AVX2 and FMA)");
  m.def("bfloat16_dot_supported", &splitserve::bfloat16_dot_supported,
        "whether attention over a bfloat16 cache multiplies in AVX512-BF16 (queries rounded to bfloat16)");
  m.def("amx_decode_supported", &splitserve::amx_decode_supported,
        "whether decode attention over a bfloat16 cache of this head size, block size and group runs in AMX tiles");
  m.def("amx_prefill_supported", &splitserve::amx_prefill_supported,
        "whether prefill attention over a bfloat16 cache of this head size and block size runs in AMX tiles");
  m.def("set_decode_prefetch_level", &splitserve::set_decode_prefetch_level,
        "the cache level (1 or 2; 0: this CPU's default) decode attention fetches ahead into; returns the previous one");
  m.def("decode_prefetch_level", &splitserve::decode_prefetch_level, "the cache level decode attention fetches ahead into");
  m.def("set_amx_enabled", &splitserve::set_amx_enabled, "allow or forbid AMX tiles in the kernels; returns the previous setting");
  m.def("pack_panels", &splitserve::pack_panels, "an [out, in] weight as [panels, in, 32] (float32)");
  m.def("set_small_gemm_block_steps", &splitserve::set_small_gemm_block_steps,
        "the float32 small GEMM's k-block in 128-byte steps (0: whole panels; -1: this CPU's default); returns the "
        "previous one");
  m.def("default_small_gemm_block_steps", &splitserve::default_small_gemm_block_steps,
        "this CPU's k-block for the float32 small GEMM, in 128-byte steps");
  m.def("small_gemm_max_rows", &splitserve::small_gemm_max_rows,
        "the most rows the engine sends to the float32 small GEMM (0: not built)");
  m.def("small_gemm", &splitserve::small_gemm, "x @ weight^T + bias for decode-sized batches (float32)");
  m.def("small_gemm_bfloat16_supported", &splitserve::small_gemm_bfloat16_supported,
        "whether small_gemm_bfloat16 was built (AVX512-BF16)");
  m.def("pack_panels_bfloat16", &splitserve::pack_panels_bfloat16, "an [out, in] weight as [panels, in / 2, 64] (bfloat16)");
  m.def("small_gemm_bfloat16", &splitserve::small_gemm_bfloat16,
        "x @ weight^T + bias for a few rows, bfloat16 in and out, float32 sums (AVX512-BF16)");
}
