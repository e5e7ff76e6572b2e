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

// Prompt chunks (prefill_item): head sizes 64 and 128, blocks of a multiple of 16 tokens.
inline bool prefill_supported(int64_t head_dim, int64_t block_size) {
  return enabled().load(std::memory_order_relaxed) && granted() && (head_dim == 64 || head_dim == 128) &&
         block_size % 16 == 0;
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

// ---- prompt chunks ----------------------------------------------------------------------------------
//
// Paged prefill attention over a bfloat16 cache (cpu_prefill_attention.cpp's contract), in AMX tiles. A work
// item is one (chunk, query head, tile of up to 16 query tokens), attended in two passes over the keys it sees
// (its request's context and its chunk up to its last token):
//
//  1. Scores, transposed: 16 key rows loaded into a tile straight from the cache, times the tile's queries
//     (scale applied, rounded to bfloat16, in pair layout): [16 keys, 16 tokens] float32, stored as rows of a
//     scratch [keys, 16]. One lane per query token, so the causal mask, the maximum and the softmax sums are
//     lane-wise: no horizontal operation anywhere.
//  2. Weighted values, transposed: the weights exp(score - max) of two keys interleaved per 32-bit lane form the
//     second operand [32 keys, 16 tokens]; the values, transposed into [16 dims, 32 keys] tiles once per (chunk,
//     KV head) for all its items and query heads (prefill_values below), the first; four accumulator tiles hold
//     [64 dims, 16 tokens] for the whole context (head sizes above 64 take this pass once per 64 dims).
//
// The weights are rounded to bfloat16 before they multiply the values, as in the decode kernel above.

// A chunk's values for one KV head as pass 2's first operand: for each 32 keys and 16 dims, a [16 dims, 16 key
// pairs] tile whose row d holds (value[2j][d], value[2j + 1][d]) for j = 0 .. 15; zero past the chunk's keys.
// `tiles` holds padded / 32 x head_dim / 16 tiles of 256 words.
inline void prefill_values(const vec16::BFloat16* v_head, const int64_t* table, int64_t keys, int64_t padded,
                           int64_t head_dim, int64_t block_size, int64_t block_stride, uint32_t* tiles) {
  const int64_t blocks_of_dims = head_dim / 16;
  alignas(64) uint32_t pairs[16][16];  // [key pair][dim]
  for (int64_t start = 0; start < padded; start += 32) {
    for (int64_t dims = 0; dims < blocks_of_dims; ++dims) {
      for (int64_t j = 0; j < 16; ++j) {
        __m512i both = _mm512_setzero_si512();
        for (int64_t k = 0; k < 2; ++k) {
          const int64_t t = start + 2 * j + k;
          if (t >= keys) continue;
          const vec16::BFloat16* row = v_head + table[t / block_size] * block_stride + (t % block_size) * head_dim;
          const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * dims)));
          both = _mm512_or_si512(both, k == 0 ? wide : _mm512_slli_epi32(wide, 16));
        }
        _mm512_store_si512(pairs[j], both);
      }
      uint32_t* tile = tiles + (start / 32 * blocks_of_dims + dims) * 256;
      for (int64_t d = 0; d < 16; ++d)  // transposed: row d, one column per key pair
        for (int64_t j = 0; j < 16; ++j) tile[d * 16 + j] = pairs[j][d];
    }
  }
}

// Per thread: one item's scores and staging areas.
struct PrefillScratch {
  std::vector<float> scores;                  // [keys padded to 32, 16 tokens]
  alignas(64) uint32_t queries[4][16 * 16];   // the tile's queries, per 32 dims (head_dim up to 128)
  alignas(64) uint32_t weights[16 * 16];      // pass 2's second operand: [16 key pairs, 16 tokens]
  alignas(64) float accumulated[4][16 * 16];  // tiles 4-7 stored: [16 dims, 16 tokens] each
};

// The tiles of the prefill item: 0 scores [16 keys, 16 tokens]; 1 key rows, then values [16, 32 bfloat16]; 2-3
// the queries of two 32-dim slices, then (2) the weights; 4-7 the weighted values [16 dims, 16 tokens]. All
// 16 rows x 64 bytes.
inline TileConfig prefill_tiles() { return score_tiles(); }

// One item: query rows `query` [tokens, q_heads, head_dim] (float32) of `tokens` (<= 16) consecutive tokens at
// positions context + first ..; `values` from prefill_values for this chunk and KV head; out likewise.
inline void prefill_item(const float* query, int64_t q_row_stride, int64_t tokens, int64_t first_position,
                         const vec16::BFloat16* k_head, const int64_t* table, int64_t block_size, int64_t block_stride,
                         int64_t head_dim, const uint32_t* values, float scale, float* out, int64_t out_row_stride,
                         PrefillScratch& scratch) {
  const int64_t visible = first_position + tokens;  // keys 0 .. visible - 1: the last token's context and itself
  const int64_t padded = (visible + 31) / 32 * 32, slices = head_dim / 32, row_bytes = head_dim * 2;
  if (static_cast<int64_t>(scratch.scores.size()) < padded * 16) scratch.scores.resize(padded * 16);
  float* scores = scratch.scores.data();

  // Row j of slice i: dims 32i + 2j and 32i + 2j + 1 of each token, side by side (tokens past the tile zero).
  // Each token's 32 dims of a slice, rounded, are its 16 pairs in order: rounded as a row, then transposed.
  alignas(64) uint32_t rows[16][16];
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < slices; ++i) {
    for (int64_t q = 0; q < 16; ++q) {
      __m512i pairs = _mm512_setzero_si512();
      if (q < tokens) {
        const float* x = query + q * q_row_stride + 32 * i;
        pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale16),
                                             _mm512_mul_ps(_mm512_loadu_ps(x), scale16));
      }
      _mm512_store_si512(rows[q], pairs);
    }
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t q = 0; q < 16; ++q) scratch.queries[i][j * 16 + q] = rows[q][j];
  }

  // Pass 1. Lane q sees keys up to first_position + q; lanes past the tile's tokens see them all (their
  // queries are zero and their results dropped), so that no lane is left without a key.
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last_key = _mm512_mask_blend_epi32(
      _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(tokens))),
      _mm512_set1_epi32(static_cast<int>(visible - 1)),
      _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(first_position))));
  const __m512 minus_infinity = _mm512_set1_ps(vec16::kNegativeInfinity);
  __m512 maximum = minus_infinity;
  // Two chunks of 16 keys a step, in tiles 0 and 4 with their keys in 1 and 5 (4-7 are free until pass 2), so
  // that one chunk's products need not wait on the other's.
  for (int64_t start = 0; start < visible; start += 32) {
    const vec16::BFloat16* keys = k_head + table[start / block_size] * block_stride + (start % block_size) * head_dim;
    const vec16::BFloat16* next = start + 16 < visible
        ? k_head + table[(start + 16) / block_size] * block_stride + ((start + 16) % block_size) * head_dim : keys;
    _tile_zero(0);
    _tile_zero(4);
    for (int64_t i = 0; i < slices; i += 2) {
      _tile_loadd(2, scratch.queries[i], 64);
      _tile_loadd(3, scratch.queries[i + 1], 64);
      _tile_loadd(1, keys + 32 * i, row_bytes);
      _tile_loadd(5, next + 32 * i, row_bytes);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(4, 5, 2);
      _tile_loadd(1, keys + 32 * (i + 1), row_bytes);
      _tile_loadd(5, next + 32 * (i + 1), row_bytes);
      _tile_dpbf16ps(0, 1, 3);
      _tile_dpbf16ps(4, 5, 3);
    }
    _tile_stored(0, scores + start * 16, 64);
    _tile_stored(4, scores + (start + 16) * 16, 64);
    for (int64_t c = start; c < std::min(start + 32, visible); c += 16) {
      float* chunk = scores + c * 16;
      const bool masked = c + 15 > first_position;  // a key past some token's position, or past the keys
      for (int64_t t = 0; t < 16; ++t) {
        __m512 row = _mm512_loadu_ps(chunk + t * 16);
        if (masked) {
          row = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(c + t)), last_key),
                                     row, minus_infinity);
          _mm512_storeu_ps(chunk + t * 16, row);
        }
        maximum = _mm512_max_ps(maximum, row);
      }
    }
  }
  for (int64_t t = (visible + 15) / 16 * 16; t < padded; ++t) _mm512_storeu_ps(scores + t * 16, minus_infinity);

  // Pass 2.
  // Word 2q of a row of the second operand is token q's weight of the first key of the pair, word 2q + 1 its
  // weight of the second.
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int64_t blocks_of_dims = head_dim / 16;
  __m512 sum = _mm512_setzero_ps();
  for (int64_t quarter = 0; quarter < head_dim / 64; ++quarter) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t start = 0; start < padded; start += 32) {
      for (int64_t j = 0; j < 16; ++j) {
        const float* rows = scores + (start + 2 * j) * 16;
        const __m512 first = (__m512)vec16::exp16(vec16::load16(rows) - (vec16::f32x16)maximum);
        const __m512 second = (__m512)vec16::exp16(vec16::load16(rows + 16) - (vec16::f32x16)maximum);
        if (quarter == 0) sum = _mm512_add_ps(sum, _mm512_add_ps(first, second));
        // 16-bit lanes: first[0], second[0], first[1], second[1], ...: each token's two weights side by side.
        const __m512i low = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(first));
        const __m512i both = _mm512_inserti64x4(low, (__m256i)_mm512_cvtneps_pbh(second), 1);
        const __m512i words = _mm512_permutexvar_epi16(interleave, both);
        _mm512_store_si512(scratch.weights + j * 16, words);
      }
      _tile_loadd(2, scratch.weights, 64);
      const uint32_t* tiles = values + (start / 32 * blocks_of_dims + 4 * quarter) * 256;
      _tile_loadd(1, tiles, 64);
      _tile_dpbf16ps(4, 1, 2);
      _tile_loadd(1, tiles + 256, 64);
      _tile_dpbf16ps(5, 1, 2);
      _tile_loadd(1, tiles + 512, 64);
      _tile_dpbf16ps(6, 1, 2);
      _tile_loadd(1, tiles + 768, 64);
      _tile_dpbf16ps(7, 1, 2);
    }
    _tile_stored(4, scratch.accumulated[0], 64);
    _tile_stored(5, scratch.accumulated[1], 64);
    _tile_stored(6, scratch.accumulated[2], 64);
    _tile_stored(7, scratch.accumulated[3], 64);
    alignas(64) float inverse[16];
    _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    for (int64_t q = 0; q < tokens; ++q)
      for (int64_t d = 0; d < 64; ++d)
        out[q * out_row_stride + 64 * quarter + d] = scratch.accumulated[d / 16][(d % 16) * 16 + q] * inverse[q];
  }
}

#endif  // SPLITSERVE_AMX

}  // namespace amx
}  // namespace splitserve
