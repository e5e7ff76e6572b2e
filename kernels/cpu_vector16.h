// 16-float vectors for splitserve's CPU prefill attention kernel, written with GCC's vector
// extensions: they compile to AVX-512 where the machine has it and to pairs of AVX2
// (or narrower) registers where not, so one source serves every x86 CPU and others.
// Multiply-adds are fused here (fp-contract=fast), as BLAS does for torch's matmuls.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

namespace splitserve {
namespace vec16 {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

inline f32x16 splat(float x) { return f32x16{} + x; }

inline f32x16 maximum(f32x16 a, f32x16 b) { return a > b ? a : b; }

// e^x for 16 floats, the method of cpu_vector_math.h's exp8 (Cephes' polynomial,
// 2^n through the exponent bits); x = -inf gives exactly 0.
inline f32x16 exp16(f32x16 x) {
  const f32x16 lower = splat(-87.3f), upper = splat(88.3f);
  const i32x16 is_minus_infinity = x == splat(kNegativeInfinity);
  x = x < lower ? lower : x;
  x = x > upper ? upper : x;
  const f32x16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  f32x16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  const f32x16 result = p * (f32x16)exponent;
  return is_minus_infinity ? splat(0.0f) : result;
}

}  // namespace vec16
}  // namespace splitserve

#pragma GCC pop_options
