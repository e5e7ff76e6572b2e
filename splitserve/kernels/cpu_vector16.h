// 16-float vectors for splitserve's CPU attention kernels, written with GCC's vector extensions.
//
// Where the target has AVX-512, f32x16 is one 64-byte vector (one register). Where it does not
// (AVX2 machines: AMD Zen 2 and 3, Intel client CPUs), f32x16 is a pair of 32-byte vectors. A
// plain 64-byte vector there is not split into registers: GCC 12 builds each one on the stack,
// through general-purpose registers, and the prefill kernel ran at 3 GFLOP/s instead of 70 on one
// core (built with -march=x86-64-v3 on a Zen 4). The pair is two ymm registers, as if written by hand.
//
// Kernels use only what is defined here: the arithmetic operators, load16/store16/splat, maximum,
// exp16, lane/keep_first, horizontal_max/horizontal_sum, sum_each and transpose16, and for bfloat16 data
// load16/store16 on BFloat16 and round_to_bfloat16. Both forms give
// the same results: the same operations in the same order on each lane (exp16's AVX-512 instructions compute
// what the AVX2 form's do; tests/integration/test_kernels.py compares the attention kernels of both builds
// bit for bit). kVectorRegisters says how
// many registers a kernel's micro-tiles may hold. Multiply-adds are fused here (fp-contract=fast),
// as BLAS does for torch's matmuls.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>  // exp16's MAXPS, MINPS and VSCALEFPS
#endif

// AVX512-BF16 (Zen 4 and later, Intel from Cooper Lake): VDPBF16PS multiplies pairs of bfloat16 and adds both
// products to a float32 lane, 32 elements an instruction. The attention kernels use it on a bfloat16 cache.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SPLITSERVE_BFLOAT16_DOT 1
#include <immintrin.h>
#endif

namespace splitserve {
namespace vec16 {

// Scalar helpers, outside the fp-contract region below: a function under another optimize setting than its
// caller's is not inlined by GCC, and the fused operations (built with fp-contract=off) call these per element.

// A bfloat16 as stored (torch's kBFloat16): the high 16 bits of a float32. The attention kernels read a
// bfloat16 KV cache through load16 / to_float below and compute in float32.
struct BFloat16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// Rounded to the nearest bfloat16, ties to even, as torch rounds (a NaN stays a NaN).
inline BFloat16 to_bfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BFloat16{0x7fc0};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

}  // namespace vec16
}  // namespace splitserve

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

namespace splitserve {
namespace vec16 {

constexpr int64_t kLanes = 16;
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
#ifdef SPLITSERVE_BFLOAT16_DOT
constexpr bool kBFloat16Dot = true;
#else
constexpr bool kBFloat16Dot = false;
#endif

// p * 2^n lane by lane, n integral in [-126, 127]: through the exponent bits (exact, a multiplication by a
// power of two). The AVX-512 form below does it in one VSCALEFPS, which rounds the same product the same way.
template <typename F, typename I>
inline F scale_lanes(F p, F n) {
  const I exponent = (__builtin_convertvector(n, I) + 127) << 23;
  return p * (F)exponent;
}

// x clamped to [lower, upper] lane by lane; a NaN x stays a NaN. The AVX-512 form below is one MAXPS and one
// MINPS (each returns its second operand, x, where a lane is unordered), which GCC does not make of these.
template <typename F>
inline F clamp_lanes(F x, F lower, F upper) {
  x = lower > x ? lower : x;
  return upper < x ? upper : x;
}

// e^x lane by lane, for any width of GCC vector: Cephes' polynomial, 2^n through scale_lanes (the method of
// cpu_vector_math.h's exp8); x = -inf gives exactly 0, a NaN stays a NaN.
template <typename F, typename I>
inline F exp_lanes(F x) {
  const I is_minus_infinity = x == F{} + kNegativeInfinity;
  x = clamp_lanes<F>(x, F{} + -87.3f, F{} + 88.3f);
  const F magic = F{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  const F n = (x * 1.44269504088896341f + magic) - magic;
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  const F result = scale_lanes<F, I>(p, n);
  return is_minus_infinity ? F{} : result;
}

// Each lane of x (any width of GCC float vector; U: the unsigned vector of its width) rounded to the nearest
// bfloat16, ties to even, still as a float32 (its low 16 bits cleared): what a torch operation on bfloat16
// tensors stores. A NaN stays a NaN.
template <typename F, typename U>
inline F round_lanes_to_bfloat16(F x) {
  U bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const U result = (bits & 0x7fffffffu) > 0x7f800000u ? U{} + 0x7fc00000u : rounded;
  std::memcpy(&x, &result, sizeof(x));
  return x;
}

#ifdef __AVX512F__

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int kVectorRegisters = 32;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// Each lane rounded to the nearest bfloat16, ties to even, still as a float32 (its low 16 bits cleared): what
// a torch operation on bfloat16 tensors stores. A NaN stays a NaN.
inline f32x16 round_to_bfloat16(f32x16 x) {
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  return round_lanes_to_bfloat16<f32x16, u32x16>(x);
}

// v rounded to bfloat16 and stored.
inline void store16(BFloat16* p, f32x16 v) {
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u32x16 bits;
  v = round_to_bfloat16(v);
  std::memcpy(&bits, &v, sizeof(bits));
  const u16x16 high = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &high, sizeof(high));
}

// 16 bfloat16 values widened to float32 (exact: the bits move up by 16).
inline f32x16 load16(const BFloat16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 half;
  std::memcpy(&half, p, sizeof(half));
  const u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline f32x16 splat(float x) { return f32x16{} + x; }

inline f32x16 maximum(f32x16 a, f32x16 b) { return a > b ? a : b; }

template <>
inline f32x16 clamp_lanes<f32x16>(f32x16 x, f32x16 lower, f32x16 upper) {
  return (f32x16)_mm512_min_ps((__m512)upper, _mm512_max_ps((__m512)lower, (__m512)x));
}

template <>
inline f32x16 scale_lanes<f32x16, i32x16>(f32x16 p, f32x16 n) {
  return (f32x16)_mm512_scalef_ps((__m512)p, (__m512)n);
}

inline f32x16 exp16(f32x16 x) { return exp_lanes<f32x16, i32x16>(x); }

inline float lane(f32x16 v, int i) { return v[i]; }

// v with its lanes from `count` on replaced by `fill`.
inline f32x16 keep_first(f32x16 v, int64_t count, float fill) {
  const i32x16 index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return index < static_cast<int32_t>(count) ? v : splat(fill);
}

// The largest of the 16 lanes, by a tree of shuffles (4 steps, not a chain of 15).
inline float horizontal_max(f32x16 v) {
  v = maximum(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = maximum(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = maximum(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = maximum(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Lane t of the result = the sum of the 16 lanes of v[t], for t < 16: a transpose-and-add tree, each
// level adding the two halves of what the last one left.
inline f32x16 sum_each(const f32x16* v) {
  f32x16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The 16 x 16 matrix whose rows are r[0 .. 16) transposed in place, in registers: four rounds, each
// swapping the off-diagonal h x h blocks of every 2h x 2h diagonal block (h = 8, 4, 2, 1). Lane l of
// a pair's first row takes the first row's lane l where bit h of l is clear, else the second row's lane
// l - h; the second row takes the first's lane l + h, or its own lane l.
constexpr int swap_low(int l, int h) { return (l & h) == 0 ? l : 16 + l - h; }
constexpr int swap_high(int l, int h) { return (l & h) == 0 ? l + h : 16 + l; }

template <int H>
inline void transpose_round(f32x16* r) {
#define SPLITSERVE_SWAP(which) \
  __builtin_shufflevector(r[i], r[i + H], which(0, H), which(1, H), which(2, H), which(3, H), which(4, H), \
                          which(5, H), which(6, H), which(7, H), which(8, H), which(9, H), which(10, H), \
                          which(11, H), which(12, H), which(13, H), which(14, H), which(15, H))
  for (int i = 0; i < 16; ++i) {
    if (i & H) continue;
    const f32x16 a = SPLITSERVE_SWAP(swap_low), b = SPLITSERVE_SWAP(swap_high);
    r[i] = a;
    r[i + H] = b;
  }
#undef SPLITSERVE_SWAP
}

inline void transpose16(f32x16* r) {
  transpose_round<8>(r);
  transpose_round<4>(r);
  transpose_round<2>(r);
  transpose_round<1>(r);
}

#else  // no AVX-512: a pair of 8-float vectors

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
constexpr int kVectorRegisters = 16;  // ymm registers; an f32x16 takes two

struct f32x16 {
  f32x8 lo, hi;  // lanes 0-7, 8-15
};

inline f32x16 operator+(f32x16 a, f32x16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline f32x16 operator-(f32x16 a, f32x16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline f32x16 operator*(f32x16 a, f32x16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline f32x16 operator/(f32x16 a, f32x16 b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline f32x16 operator*(f32x16 a, float s) { return {a.lo * s, a.hi * s}; }
inline f32x16 operator*(float s, f32x16 a) { return {s * a.lo, s * a.hi}; }
inline f32x16 operator-(f32x16 a, float s) { return {a.lo - s, a.hi - s}; }
inline f32x16& operator+=(f32x16& a, f32x16 b) { return a = a + b; }
inline f32x16& operator*=(f32x16& a, float s) { return a = a * s; }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v.lo, p, sizeof(v.lo));
  std::memcpy(&v.hi, p + 8, sizeof(v.hi));
  return v;
}

inline void store16(float* p, f32x16 v) {
  std::memcpy(p, &v.lo, sizeof(v.lo));
  std::memcpy(p + 8, &v.hi, sizeof(v.hi));
}

inline f32x16 load16(const BFloat16* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 lo, hi;
  std::memcpy(&lo, p, sizeof(lo));
  std::memcpy(&hi, p + 8, sizeof(hi));
  const u32x8 wide_lo = __builtin_convertvector(lo, u32x8) << 16, wide_hi = __builtin_convertvector(hi, u32x8) << 16;
  f32x16 v;
  std::memcpy(&v.lo, &wide_lo, sizeof(v.lo));
  std::memcpy(&v.hi, &wide_hi, sizeof(v.hi));
  return v;
}

inline f32x16 round_to_bfloat16(f32x16 x) {
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  return {round_lanes_to_bfloat16<f32x8, u32x8>(x.lo), round_lanes_to_bfloat16<f32x8, u32x8>(x.hi)};
}

inline void store16(BFloat16* p, f32x16 v) {
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  v = round_to_bfloat16(v);
  u32x8 lo, hi;
  std::memcpy(&lo, &v.lo, sizeof(lo));
  std::memcpy(&hi, &v.hi, sizeof(hi));
  const u16x8 high_lo = __builtin_convertvector(lo >> 16, u16x8), high_hi = __builtin_convertvector(hi >> 16, u16x8);
  std::memcpy(p, &high_lo, sizeof(high_lo));
  std::memcpy(p + 8, &high_hi, sizeof(high_hi));
}

inline f32x16 splat(float x) { return {f32x8{} + x, f32x8{} + x}; }

inline f32x8 maximum8(f32x8 a, f32x8 b) { return a > b ? a : b; }
inline f32x16 maximum(f32x16 a, f32x16 b) { return {maximum8(a.lo, b.lo), maximum8(a.hi, b.hi)}; }

inline f32x16 exp16(f32x16 x) { return {exp_lanes<f32x8, i32x8>(x.lo), exp_lanes<f32x8, i32x8>(x.hi)}; }

inline float lane(f32x16 v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }

inline f32x16 keep_first(f32x16 v, int64_t count, float fill) {
  const i32x8 index = {0, 1, 2, 3, 4, 5, 6, 7};
  const f32x8 filled = f32x8{} + fill;
  const int32_t n = static_cast<int32_t>(count);
  return {index < n ? v.lo : filled, index + 8 < n ? v.hi : filled};
}

inline float horizontal_max(f32x16 v) {
  f32x8 m = maximum8(v.lo, v.hi);
  m = maximum8(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
  m = maximum8(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
  m = maximum8(m, __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6));
  return m[0];
}

// The same tree as the AVX-512 form's, level by level, on halves.
inline f32x16 sum_each(const f32x16* v) {
  f32x16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) w[i] = {v[2 * i].lo + v[2 * i].hi, v[2 * i + 1].lo + v[2 * i + 1].hi};
  auto fold4 = [](f32x16 a) {  // lanes 0-3 + 4-7 and 8-11 + 12-15 of a
    return __builtin_shufflevector(a.lo, a.hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a.lo, a.hi, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  for (int i = 0; i < 4; ++i) x[i] = {fold4(w[2 * i]), fold4(w[2 * i + 1])};
  auto fold2 = [](f32x16 a) {
    return __builtin_shufflevector(a.lo, a.hi, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a.lo, a.hi, 2, 3, 6, 7, 10, 11, 14, 15);
  };
  for (int i = 0; i < 2; ++i) y[i] = {fold2(x[2 * i]), fold2(x[2 * i + 1])};
  auto fold1 = [](f32x16 a) {
    return __builtin_shufflevector(a.lo, a.hi, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a.lo, a.hi, 1, 3, 5, 7, 9, 11, 13, 15);
  };
  return {fold1(y[0]), fold1(y[1])};
}

inline void transpose16(f32x16* r) {
  float m[16][16];
  for (int i = 0; i < 16; ++i) store16(m[i], r[i]);
  for (int i = 0; i < 16; ++i) {
    float column[16];
    for (int j = 0; j < 16; ++j) column[j] = m[j][i];
    r[i] = load16(column);
  }
}

#endif  // __AVX512F__

// The sum of the 16 lanes, in lane order.
inline float horizontal_sum(f32x16 v) {
  float result = 0.0f;
  for (int i = 0; i < 16; ++i) result += lane(v, i);
  return result;
}

}  // namespace vec16
}  // namespace splitserve

#pragma GCC pop_options
