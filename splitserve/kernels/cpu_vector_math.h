// Vector helpers shared by splitserve's CPU kernels: AVX2 + FMA when the compiler
// targets them (-march=native on x86), nothing otherwise (callers keep a scalar path).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITSERVE_AVX2 1

namespace splitserve {

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial
// (Cephes' expf coefficients), 2^n through the exponent bits. Relative error ~2e-7;
// inputs are clamped to [-87.3, 88.3] (e^-87.3 is ~1e-38, the last normal floats).
inline __m256 exp8(__m256 x) {
  const __m256 lower = _mm256_set1_ps(-87.3f), upper = _mm256_set1_ps(88.3f);
  x = _mm256_min_ps(_mm256_max_ps(x, lower), upper);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

}  // namespace splitserve
#endif
