// The part of ATen the kernel sources use: tensors, their checks and the three allocating operations.
//
// Not <torch/extension.h>: it brings pybind11 and the whole C++ frontend, and parsing it took 32 s per
// source on a 2-core Zen 3 against 7 s for these headers, most of the first start's compile.
// torch::Tensor is at::Tensor: a caller compiled against torch's headers names the same functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <unistd.h>

namespace splitserve {

// Whether this is an AMD CPU. The kernels' tuning that was measured to differ between CPUs asks this and the next.
inline bool amd_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // callers run from static initializers, possibly before the runtime's own init of the CPU model
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

// Whether this CPU's L1 data cache holds at least `bytes` (Zen 5 and Intel since Ice Lake: 48 KB; Zen 3 and 4: 32
// KB). False where the size is unknown.
inline bool l1d_of_at_least(long bytes) {
#ifdef _SC_LEVEL1_DCACHE_SIZE  // glibc; where the size is unknown (0 or -1) or cannot be asked, false
  const long l1_bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#else
  const long l1_bytes = 0;
#endif
  return l1_bytes >= bytes;
}

// Whether this is an AMD CPU whose L1 data cache holds at least `bytes` (Zen 5).
inline bool amd_with_l1d_of_at_least(long bytes) { return amd_cpu() && l1d_of_at_least(bytes); }

// The query both attention kernels read in place: float32 [rows, q_heads, head_dim], each row's heads contiguous,
// rows at any stride of at least a row (a view of the fused QKV projection's output).
inline void check_query_rows(const at::Tensor& query, const char* name) {
  TORCH_CHECK(query.scalar_type() == at::kFloat, name, ": the query must be float32");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  query.stride(0) >= query.size(1) * query.size(2),
              name, ": query must be [rows, heads, head_dim] with each row's heads contiguous");
}

// An attention kernel's output [rows, q_heads, head_dim] float32: `out` when the caller passes one (3-D: a
// contiguous slice of a larger step's output, written in place), else a new tensor (an empty `out`).
inline at::Tensor attention_output(const at::Tensor& out, int64_t rows, int64_t q_heads, int64_t head_dim,
                                   const at::TensorOptions& options, const char* name) {
  if (out.dim() != 3) return at::empty({rows, q_heads, head_dim}, options);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == rows &&
                  out.size(1) == q_heads && out.size(2) == head_dim,
              name, ": out must be a contiguous float32 tensor of the query's shape");
  return out;
}

}  // namespace splitserve
