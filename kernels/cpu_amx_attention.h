// Paged decode attention over a bfloat16 cache in AMX tiles (Intel Xeon from Sapphire Rapids), included by
// cpu_paged_attention.cpp.
//
// The AVX-512 kernel there spends most of its instructions on arithmetic, not on reading the cache: for each
// key, each query head of the group takes two VDPBF16PS and its share of a sum tree, and each value row is
// widened to float32 and multiplied in for every head. Here both products run in TDPBF16PS, which multiplies
// a 16 x 32 bfloat16 tile by a 32 x 16 one in a single instruction, and one (request, KV head) is attended in
// two passes over its context:
//
//  1. Scores. A chunk of 16 key rows, loaded into a tile straight from the cache (rows of a block are
//     contiguous), times the group's queries transposed (scale applied, rounded to bfloat16, in AMX's pair
//     layout): 16 keys x 16 columns of float32 scores, one column per query head. Each head's column goes to
//     a row of scores for the whole context, and its maximum is kept.
//  2. Values. The softmax weights exp(score - max), summed in float32 for the denominator and rounded to
//     bfloat16 (as GPU flash attention rounds them before the second product), form a [group, 32 keys] tile;
//     the value rows, two keys interleaved per 32-bit column as TDPBF16PS reads its second operand, form
//     four [32 keys, 16 dims] tiles; four accumulator tiles hold [group, 64 dims] for the whole context.
//     Head sizes above 64 take this pass once per 64 dims.
//
// Interleaving two value rows with VPUNPCKLWD/VPUNPCKHWD works within 128-bit lanes, so the accumulator
// tiles hold the dims in a fixed shuffled order (see kUnshuffle), put back once per head at the end.
//
// Requirements (checked by amx_decode_supported): AMX-BF16 compiled in and granted by Linux (a process asks
// once, arch_prctl ARCH_REQ_XCOMP_PERM), head_dim a multiple of 64, block_size a multiple of 16. Elsewhere the
// AVX-512 kernel runs. The reference is splitserve.engine.attention.decode_attention, as for the others.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPLITSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_vector16.h"

namespace splitserve {
namespace amx {

// Whether this build has the AMX kernel and Linux lets this process use the tiles (asked once).
inline bool granted() {
#ifdef SPLITSERVE_AMX
  static const bool permission = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permission;
#else
  return false;
#endif
}

// Whether kernels may use AMX at all (on by default; cpu_ops.use_amx turns it off, so that tests and benchmarks
// run the AVX-512 path on AMX machines too).
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> flag{true};
  return flag;
}

inline bool decode_supported(int64_t head_dim, int64_t block_size, int64_t group) {
  return enabled().load(std::memory_order_relaxed) && granted() && (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 && group >= 1 && group <= 16;
}

#ifdef SPLITSERVE_AMX

// LDTILECFG's 64-byte operand: palette 1, then bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Pass 1's tiles (scores): 0 and 1 two chunks' scores [16 keys, 16 heads] float32; 2-5 their key rows [16 keys,
// 32 dims] bfloat16 (two chunks x two 32-dim slices); 6 and 7 the queries of two slices [16 pairs, 16 heads].
// Two chunks in flight, each with its own tiles, so that one chunk's products need not wait on the other's.
inline TileConfig score_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = 16;
  }
  return config;
}

// Pass 2's tiles (values): 0 the weights [group, 32 keys] bfloat16; 1 and 2 interleaved value rows [16 key pairs,
// 16 dims] (two, so that loading one overlaps the product of the other); 4-7 the weighted values [group, 16
// dims] float32 each.
inline TileConfig value_tiles(int64_t group) {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    if (tile == 3) continue;
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = tile == 1 || tile == 2 ? 16 : static_cast<uint8_t>(group);
  }
  return config;
}

struct DecodeTiles {
  TileConfig scores, values;
  explicit DecodeTiles(int64_t group) : scores(score_tiles()), values(value_tiles(group)) {}
};

// Per thread: the scores and weights of a request's heads for its whole context, and small staging areas.
struct DecodeScratch {
  std::vector<float> scores;                  // [heads, group, padded context]
  std::vector<vec16::BFloat16> weights;       // [heads, group, padded context]
  std::vector<uint32_t> queries;              // [heads, head_dim / 32, 16 pairs x 16 heads]: pass 1's tiles 6-7
  alignas(64) float chunk[2][16 * 16];        // tiles 0 and 1 of pass 1 stored
  alignas(64) uint32_t values[4][16 * 16];    // pass 2's interleaved value rows, per 16 (shuffled) dims
  alignas(64) float accumulated[4][16 * 16];  // tiles 4-7 stored
};

// Lane i of the first (second) 16 dims of a 32-dim slice is column index[i] of the low (high) accumulator tile
// of the pair, the high tile's columns counted from 16: the inverse of VPUNPCKLWD/VPUNPCKHWD's order.
inline __m512i unshuffle_index(int half) {
  alignas(64) int32_t index[16];
  for (int i = 0; i < 16; ++i) {
    const int dim = 16 * half + i;  // 0..31 within the slice
    const int lane = dim / 8, within = dim % 8;
    index[i] = (within < 4 ? 0 : 16) + 4 * lane + within % 4;
  }
  return _mm512_load_si512(index);
}

// Where one request's context lies in one layer's cache, and the sizes every step needs.
struct RequestView {
  const vec16::BFloat16* keys;    // head 0's keys: k_layer (a head's are head_stride further on)
  const vec16::BFloat16* values;  // head 0's values
  const int64_t* table;
  int64_t length, padded, group, head_dim, block_size, block_stride, head_stride;

  const vec16::BFloat16* row(const vec16::BFloat16* head, int64_t t) const {
    return head + table[t / block_size] * block_stride + (t % block_size) * head_dim;
  }
};

// The queries of head h's group, times the scale, in TDPBF16PS's pair layout: row j of slice i holds dims
// 32i + 2j and 32i + 2j + 1 of each query (16 columns; those past the group zero).
inline void stage_queries(const float* q_group, float scale, const RequestView& view, uint32_t* tiles) {
  for (int64_t i = 0; i < view.head_dim / 32; ++i)
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t g = 0; g < 16; ++g) {
        uint32_t pair = 0;
        if (g < view.group) {
          const float* q = q_group + g * view.head_dim + 32 * i + 2 * j;
          pair = vec16::to_bfloat16(q[0] * scale).bits | (static_cast<uint32_t>(vec16::to_bfloat16(q[1] * scale).bits) << 16);
        }
        tiles[(i * 16 + j) * 16 + g] = pair;
      }
}

// Pass 1 for one head, keys start .. start + 31: scores into rows of `scores` ([group, padded]), their running
// maximum into `maximum`. Tiles as score_tiles.
inline void score_step(const vec16::BFloat16* k_head, const uint32_t* queries, int64_t start, const RequestView& view,
                       float* scores, __m512* maximum, DecodeScratch& scratch) {
  const int64_t row_bytes = view.head_dim * 2;
  const vec16::BFloat16* first = view.row(k_head, start);
  const vec16::BFloat16* second = start + 16 < view.length ? view.row(k_head, start + 16) : first;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t i = 0; i < view.head_dim / 32; i += 2) {
    _tile_loadd(6, queries + i * 256, 64);
    _tile_loadd(7, queries + (i + 1) * 256, 64);
    _tile_loadd(2, first + 32 * i, row_bytes);
    _tile_loadd(3, first + 32 * (i + 1), row_bytes);
    _tile_loadd(4, second + 32 * i, row_bytes);
    _tile_loadd(5, second + 32 * (i + 1), row_bytes);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(0, 3, 7);
    _tile_dpbf16ps(1, 5, 7);
  }
  _tile_stored(0, scratch.chunk[0], 64);
  _tile_stored(1, scratch.chunk[1], 64);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int64_t c = 0; c < 2 && start + 16 * c < view.length; ++c) {
    const int64_t count = std::min<int64_t>(16, view.length - start - 16 * c);
    const __mmask16 present = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
    for (int64_t g = 0; g < view.group; ++g) {
      __m512 s = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(g))),
                                     scratch.chunk[c], 4);
      s = _mm512_mask_blend_ps(present, _mm512_set1_ps(vec16::kNegativeInfinity), s);
      _mm512_storeu_ps(scores + g * view.padded + start + 16 * c, s);
      maximum[g] = _mm512_max_ps(maximum[g], s);
    }
  }
}

// The softmax weights of one head's group: exp(score - max) summed in float32 (the inverses of the sums into
// `inverse`) and rounded to bfloat16 into `weights`, zero past the context up to `padded`.
inline void weigh(const float* scores, const __m512* maximum, const RequestView& view, vec16::BFloat16* weights,
                  float* inverse) {
  const int64_t written = (view.length + 15) / 16 * 16;
  for (int64_t g = 0; g < view.group; ++g) {
    const vec16::f32x16 shift = vec16::splat(_mm512_reduce_max_ps(maximum[g]));
    vec16::f32x16 sum = vec16::splat(0.0f);
    vec16::BFloat16* row = weights + g * view.padded;
    for (int64_t t = 0; t < written; t += 16) {
      const vec16::f32x16 p = vec16::exp16(vec16::load16(scores + g * view.padded + t) - shift);
      sum += p;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + t), (__m256i)_mm512_cvtneps_pbh((__m512)p));
    }
    if (written < view.padded) std::memset(row + written, 0, (view.padded - written) * sizeof(vec16::BFloat16));
    const float total = vec16::horizontal_sum(sum);
    inverse[g] = total > 0.0f ? 1.0f / total : 0.0f;
  }
}

// Pass 2 for one head: out[g] = inverse[g] * sum_t weights[g][t] * value[t], 64 dims at a time, 32 keys a step.
// Tiles as value_tiles.
inline void weighted_values(const vec16::BFloat16* v_head, const vec16::BFloat16* weights, const float* inverse,
                            const RequestView& view, float* out_group, DecodeScratch& scratch) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i first = unshuffle_index(0), second = unshuffle_index(1);
  for (int64_t quarter = 0; quarter < view.head_dim / 64; ++quarter) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t start = 0; start < view.padded; start += 32) {
      for (int64_t pair = 0; pair < 16; ++pair) {
        __m512i rows[2][2];  // [key of the pair][32 dims]
        for (int64_t k = 0; k < 2; ++k) {
          const int64_t t = start + 2 * pair + k;
          if (t >= view.length) {
            rows[k][0] = rows[k][1] = zero;
            continue;
          }
          const vec16::BFloat16* v = view.row(v_head, t) + 64 * quarter;
          rows[k][0] = _mm512_loadu_si512(v);
          rows[k][1] = _mm512_loadu_si512(v + 32);
        }
        for (int64_t half = 0; half < 2; ++half) {
          _mm512_store_si512(scratch.values[2 * half] + pair * 16, _mm512_unpacklo_epi16(rows[0][half], rows[1][half]));
          _mm512_store_si512(scratch.values[2 * half + 1] + pair * 16, _mm512_unpackhi_epi16(rows[0][half], rows[1][half]));
        }
      }
      _tile_loadd(0, weights + start, view.padded * static_cast<int64_t>(sizeof(vec16::BFloat16)));
      _tile_loadd(1, scratch.values[0], 64);
      _tile_loadd(2, scratch.values[1], 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_dpbf16ps(5, 0, 2);
      _tile_loadd(1, scratch.values[2], 64);
      _tile_loadd(2, scratch.values[3], 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_dpbf16ps(7, 0, 2);
    }
    _tile_stored(4, scratch.accumulated[0], 64);
    _tile_stored(5, scratch.accumulated[1], 64);
    _tile_stored(6, scratch.accumulated[2], 64);
    _tile_stored(7, scratch.accumulated[3], 64);
    for (int64_t g = 0; g < view.group; ++g) {
      const __m512 norm = _mm512_set1_ps(inverse[g]);
      float* out = out_group + g * view.head_dim + 64 * quarter;
      for (int64_t half = 0; half < 2; ++half) {
        const __m512 low = _mm512_load_ps(scratch.accumulated[2 * half] + g * 16);
        const __m512 high = _mm512_load_ps(scratch.accumulated[2 * half + 1] + g * 16);
        _mm512_storeu_ps(out + 32 * half, _mm512_mul_ps(_mm512_permutex2var_ps(low, first, high), norm));
        _mm512_storeu_ps(out + 32 * half + 16, _mm512_mul_ps(_mm512_permutex2var_ps(low, second, high), norm));
      }
    }
  }
}

// Heads first .. first + heads - 1 of one request (query rows q_request[h * group ..], output likewise): pass 1
// walks the context once for all of them, so that a block's keys and values of every head, which lie together
// in the cache, are fetched together (the values into L2, for pass 2); then each head's weights and values.
inline void attend_heads(const float* q_request, int64_t first, int64_t heads, const RequestView& view, float scale,
                         float* out_request, DecodeScratch& scratch, const DecodeTiles& config) {
  const int64_t rows = view.group * view.padded, slice_words = view.head_dim / 32 * 256;
  if (static_cast<int64_t>(scratch.scores.size()) < heads * rows) {
    scratch.scores.resize(heads * rows);
    scratch.weights.resize(heads * rows);
  }
  if (static_cast<int64_t>(scratch.queries.size()) < heads * slice_words) scratch.queries.resize(heads * slice_words);
  const int64_t q_stride = view.group * view.head_dim;
  for (int64_t h = 0; h < heads; ++h)
    stage_queries(q_request + (first + h) * q_stride, scale, view, scratch.queries.data() + h * slice_words);

  _tile_loadconfig(&config.scores);
  std::vector<__m512> maximum(heads * 16, _mm512_set1_ps(vec16::kNegativeInfinity));
  const int64_t row_bytes = view.head_dim * 2;
  for (int64_t start = 0; start < view.length; start += 32) {
    // The next step's keys (another page, often another block), and this step's values for pass 2.
    for (int64_t h = first; h < first + heads; ++h) {
      for (int64_t t = start + 32; t < std::min(start + 64, view.length); t += 16)
        for (int64_t offset = 0; offset < 16 * row_bytes; offset += 64)
          _mm_prefetch(reinterpret_cast<const char*>(view.row(view.keys + h * view.head_stride, t)) + offset, _MM_HINT_T0);
      for (int64_t t = start; t < std::min(start + 32, view.length); t += 16)
        for (int64_t offset = 0; offset < 16 * row_bytes; offset += 64)
          _mm_prefetch(reinterpret_cast<const char*>(view.row(view.values + h * view.head_stride, t)) + offset, _MM_HINT_T1);
    }
    for (int64_t h = 0; h < heads; ++h)
      score_step(view.keys + (first + h) * view.head_stride, scratch.queries.data() + h * slice_words, start, view,
                 scratch.scores.data() + h * rows, maximum.data() + h * 16, scratch);
  }
  float inverse[16];
  _tile_loadconfig(&config.values);
  for (int64_t h = 0; h < heads; ++h) {
    weigh(scratch.scores.data() + h * rows, maximum.data() + h * 16, view, scratch.weights.data() + h * rows, inverse);
    weighted_values(view.values + (first + h) * view.head_stride, scratch.weights.data() + h * rows, inverse, view,
                    out_request + (first + h) * q_stride, scratch);
  }
}

#endif  // SPLITSERVE_AMX

}  // namespace amx
}  // namespace splitserve
