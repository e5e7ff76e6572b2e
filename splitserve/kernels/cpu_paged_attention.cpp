// Paged decode attention for CPUs: one query token per request, keys and values
// read straight from the paged KV cache (no gathered copy), softmax computed
// online block by block (span by span on 16-float vectors: see Span). Parallel with OpenMP over (request, KV head) pairs, or
// over requests when there are enough of them.
//
// Layouts (query and output float32; the cache float32 or bfloat16, read as float32 or, for the keys, in
// AVX512-BF16 dot products: see kBFloat16Dot):
//   query        [num_requests, q_heads, head_dim], each row's heads contiguous, rows at any stride (a view
//                of the fused QKV projection's output)
//   key/value    [kv_heads, num_blocks, block_size, head_dim]   (one layer; a view of the block-major
//                cache: rows of a block contiguous, heads and blocks at any strides)
//   block_tables [num_requests, max_blocks] int64 (entries past a request's end unused)
//   seq_lens     [num_requests] int64 (context length including the new token)
// Returns [num_requests, q_heads, head_dim], contiguous: `out` where the caller gives one (else empty).
//
// Per block, every key and value row is loaded once for all the query heads
// that share its KV head (grouped-query attention: 3 for SmolLM). Head sizes
// that are multiples of 16 run HeadState (16-float vectors: AVX-512 where the
// machine has it; 16 keys' scores at a time), per (request, KV head) or, with
// enough requests, per request over all its heads; others the per-key loop
// attend_one_head (AVX2 + FMA when the compiler targets them, a scalar loop
// otherwise). Reading the cache is the
// floor: 2 x kv_heads x context x head_dim x 4 bytes per request and layer (2 for a bfloat16 cache).
//
// The plain-torch reference is splitserve.engine.attention.decode_attention;
// tests/integration/test_kernels.py compares the two.

#include "cpu_tensor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include <omp.h>

#include "cpu_amx_attention.h"
#include "cpu_vector16.h"
#include "cpu_vector_math.h"

namespace splitserve {

namespace {

constexpr int64_t kMaxBlockSize = 256;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;
// Below this many requests per thread, tasks are (request, KV head) pairs, so that a few requests still
// fill every thread; from it on, whole requests (see attend_request16).
constexpr int64_t kRequestsPerThreadForWholeRequests = 4;

// scores[t] = exp(scores[t] - shift) for t < count; returns their sum.
inline float exp_shifted_sum(float* scores, int64_t count, float shift) {
  float sum = 0.0f;
  int64_t t = 0;
#ifdef SPLITSERVE_AVX2
  const __m256 shift8 = _mm256_set1_ps(shift);
  __m256 sum8 = _mm256_setzero_ps();
  for (; t + 8 <= count; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift8));
    _mm256_storeu_ps(scores + t, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  sum = horizontal_sum(sum8);
#endif
  for (; t < count; ++t) {
    scores[t] = std::exp(scores[t] - shift);
    sum += scores[t];
  }
  return sum;
}

// The dot product of two head_dim vectors.
inline float dot(const float* a, const vec16::BFloat16* b, int64_t head_dim) {
  float result = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) result += a[d] * vec16::to_float(b[d]);
  return result;
}

inline float dot(const float* a, const float* b, int64_t head_dim) {
  int64_t d = 0;
  float result = 0.0f;
#ifdef SPLITSERVE_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; d + 16 <= head_dim; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  result = horizontal_sum(_mm256_add_ps(acc0, acc1));
#endif
  for (; d < head_dim; ++d) result += a[d] * b[d];
  return result;
}

// Where a chunk's successor goes: L1 (prefetcht0) or L2 (prefetcht1). The fit depends on the size of L1:
//  - 32 KB (Zen 3, Zen 4): into L2. A chunk's 8 KB of keys and values fetched ahead into L1 evicted what the
//    chunk in hand was using. 2-core Zen 4, cpu_attention.py --decode 64x320 8x2048 --block-size 128, medians
//    of 9: 41.5-43.7 and 31.1-33.3 ms into L2 against 48.5-50.7 and 36.4-41.2 into L1 (prefetcht2: 43.1,
//    32.2; prefetchnta: 47.9, 37.0).
//  - 48 KB on AMD (Zen 5): into L1. 2-core Zen 5, the same cases and 32x1024, medians of 4 interleaved runs
//    of 5: 31.1, 20.2 and 44.8 ms into L1 against 33.5, 24.6 and 51.5 into L2; after the spans of 2026-11-28
//    (one piece ahead), medians of 7: 27.96, 21.68 and 43.50 into L1 against 29.41, 22.32 and 44.98.
//  - 48 KB on Intel (a 2-core Xeon with AMX, family 6 model 167, 2026-11-28, blocks of 16, medians of 9):
//    into L2. 64x320, 8x2048 and 32x1024: 43.3, 34.9 and 69.6 ms into L2 against 45.7, 37.0 and 77.4 into L1.
// set_decode_prefetch_level changes it for the process, so that benchmarks/cpu_attention.py times both.
int default_prefetch_level() { return amd_with_l1d_of_at_least(48 * 1024) ? 1 : 2; }

std::atomic<int> g_prefetch_level{default_prefetch_level()};

inline void prefetch_row(const char* row, int64_t num_bytes) {
  if (g_prefetch_level.load(std::memory_order_relaxed) == 1) {
    for (int64_t offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 3);
  } else {
    for (int64_t offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 2);
  }
}

// One (request, KV head): the group's query rows over the request's blocks.
template <typename KV>
void attend_one_head(const float* q_group, const KV* k_head, const KV* v_head, const int64_t* table,
                     int64_t length, int64_t group, int64_t block_size, int64_t head_dim, int64_t block_stride,
                     float scale, float* out_group) {
  float running_max[kMaxGroup], denominator[kMaxGroup];
  alignas(32) float accumulator[kMaxGroup * kMaxHeadDim];
  alignas(32) float scores[kMaxGroup * kMaxBlockSize];
  for (int64_t g = 0; g < group; ++g) {
    running_max[g] = -std::numeric_limits<float>::infinity();
    denominator[g] = 0.0f;
  }
  std::fill(accumulator, accumulator + group * head_dim, 0.0f);
  const int64_t block_elements = block_stride;  // from one block's first row to the next block's
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t count = std::min(block_size, length - start);
    const KV* k_block = k_head + table[start / block_size] * block_elements;
    const KV* v_block = v_head + table[start / block_size] * block_elements;
    // The next block is elsewhere in memory: its rows are fetched while this block's rows compute.
    const bool has_next = start + block_size < length;
    const char* k_next = reinterpret_cast<const char*>(k_head + (has_next ? table[start / block_size + 1] : 0) * block_elements);
    const char* v_next = reinterpret_cast<const char*>(v_head + (has_next ? table[start / block_size + 1] : 0) * block_elements);
    const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(KV));
    // Scores: each key row is read once for the whole group.
    for (int64_t t = 0; t < count; ++t) {
      const KV* k = k_block + t * head_dim;
      if (has_next) prefetch_row(k_next + t * row_bytes, row_bytes);
      for (int64_t g = 0; g < group; ++g) scores[g * block_size + t] = dot(q_group + g * head_dim, k, head_dim) * scale;
    }
    // Online softmax: rescale what was accumulated when the maximum grows.
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * block_size;
      const float block_max = *std::max_element(s, s + count);
      const float new_max = std::max(running_max[g], block_max);
      const float correction = std::exp(running_max[g] - new_max);
      denominator[g] = denominator[g] * correction + exp_shifted_sum(s, count, new_max);
      running_max[g] = new_max;
      if (correction != 1.0f) {
        float* acc = accumulator + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
      }
    }
    // Weighted values: each value row is read once for the whole group.
    for (int64_t t = 0; t < count; ++t) {
      const KV* v = v_block + t * head_dim;
      if (has_next) prefetch_row(v_next + t * row_bytes, row_bytes);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + t];
        float* acc = accumulator + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * vec16::to_float(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = denominator[g] > 0.0f ? 1.0f / denominator[g] : 0.0f;
    float* o = out_group + g * head_dim;
    const float* acc = accumulator + g * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] * inverse;
  }
}

// ---- 16-key tiles on 16-float vectors (head_dim a multiple of 16) ---------------------------------
//
// The same attention, written for wide vectors: per piece of up to 16 keys, each query head's 16 dot
// products are summed into one vector at once (a transpose-and-add tree instead of a horizontal sum
// per key), a span's pieces share one softmax update on those vectors, and the weighted values
// accumulate on vectors. The softmax denominators stay lane-wise vectors until the end, and a span's
// maximum is a shuffle tree, so no piece waits on a chain of scalar operations. Two ways to share the
// work out:
//  - attend_head16: one (request, KV head) per task, as attend_one_head; used when there are few
//    requests, so that one request's heads still spread over the threads.
//  - attend_request16: one request per task, all its KV heads span by span. A block's keys and values
//    of every head of a layer lie together in the cache (2 x kv_heads x block_size x head_dim floats,
//    24 KB for SmolLM), so each block is read as one piece instead of 2 x kv_heads pieces of 4 KB.
//    Measured on a 2-core AMD EPYC (Zen 4), 64 requests x 320 tokens x 30 layers from memory:
//    18.8 GB/s against 16.6 per (request, head), and 24 GB/s for a plain read of random 24 KB pieces
//    against 19 for random 4 KB ones; with 128-token blocks (the offline LLM's on CPU), 27 GB/s.
//    A span's pieces are read in memory order: a block's pieces of one head, then the next head's. Piece by
//    piece across the heads instead (each piece of every head before the next piece) reads a 128-token block
//    as 3 streams 32 KB apart; in memory order the hardware's own prefetcher follows one stream. 2-core AMD
//    EPYC Zen 5, cpu_attention.py --decode 64x320 8x2048 32x1024 --block-size 128 --baseline (the old order),
//    twice: 1.14, 1.27, 1.25x and 1.10, 1.15, 1.28x, the same bits (64-token blocks 1.15-1.96x; 16-token
//    blocks, where the two orders are the same, 1.01-1.02x but one 1.30x; two builds of the same code
//    0.95-1.01x), 2026-12-01. Memory order without the software fetches took 0.99-1.16x the old order's time
//    with them.

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")  // multiply-adds fused here, as in the prefill kernel

// Where the CPU has AVX512-BF16 (Zen 4 and later, Intel from Cooper Lake), a bfloat16 cache's keys meet the
// queries in VDPBF16PS: each lane multiplies a pair of bfloat16 and adds both products to a float32 sum, 32
// elements an instruction, with no widening of the keys. The queries (times the scale) are rounded to
// bfloat16 for it, as vLLM's CPU kernels and GPU attention do in bfloat16; scores, softmax and the weighted
// values stay float32. Head sizes of 32 and more (an even number of 16-float vectors).
using vec16::kBFloat16Dot;

// The geometry both drivers share: query heads per KV head, and one layer of the cache.
struct DecodeShape {
  int64_t group, block_size, block_stride, head_stride;
};

// The rows one softmax update covers: a request's consecutive blocks, up to kSpanRows rows, cut into pieces
// of at most 16 contiguous rows (a 16-row chunk of a block, or a block of 16 tokens or fewer). 16-token blocks
// (the workers' default) lie anywhere in the cache, so a span of them is up to 8 pieces at 8 addresses; one
// 128-token block is 8 pieces at one. The same span serves every KV head of a request: offsets are in
// elements from a head's first block, which is where the cache views of a head begin.
constexpr int64_t kSpanRows = 128;
constexpr int64_t kMaxPieces = kMaxBlockSize / 16;
// How far ahead attend_request16 fetches, in pieces of its read order (memory order; see there). 3 is one 16-token
// block of SmolLM's 3 KV heads, as far as it fetched before the order. 2-core AMD EPYC Zen 5, cpu_attention.py
// --decode 64x320 8x2048 32x1024 --block-size 128, each against 3 in one process: 1, 2, 4 and 6 pieces all
// read 0.99-1.03x (2026-12-01).
constexpr int64_t kReadAhead = 3;

struct Span {
  int64_t offset[kMaxPieces];  // from the head's base to the piece's first row
  int64_t rows[kMaxPieces];    // 1 to 16
  int64_t pieces = 0;
  int64_t next_offset = 0;      // from the head's base to the next span's first row
  int64_t next_block_rows = 0;  // rows of the next span's first block (0: this span is the last)
  int64_t pieces_per_block = 1;  // pieces of one block in this span (the last block may have fewer)

  // Blocks per span: as many as fit kSpanRows rows and kMaxPieces pieces, at least one.
  static int64_t blocks_for(int64_t block_size) {
    const int64_t pieces_per_block = (block_size + 15) / 16;
    return std::max<int64_t>(1, std::min(kSpanRows / block_size, kMaxPieces / pieces_per_block));
  }

  // Rows [start, start + count) of a request of `length` rows (start at a block's first row) whose blocks are
  // `table`.
  Span(const int64_t* table, int64_t start, int64_t count, int64_t length, const DecodeShape& shape,
       int64_t head_dim) {
    for (int64_t row = 0; row < count;) {
      const int64_t position = start + row, in_block = position % shape.block_size;
      const int64_t rows_here = std::min({int64_t{16}, shape.block_size - in_block, count - row});
      offset[pieces] = table[position / shape.block_size] * shape.block_stride + in_block * head_dim;
      this->rows[pieces++] = rows_here;
      row += rows_here;
    }
    pieces_per_block = std::min(pieces, (shape.block_size + 15) / 16);
    if (start + count < length) {
      next_offset = table[(start + count) / shape.block_size] * shape.block_stride;
      next_block_rows = std::min(shape.block_size, length - start - count);
    }
  }

  // What is read after key piece p, and after value piece p: where it lies from a head's base (the keys' or the
  // values'), and its rows (none: nothing follows).
  struct Ahead {
    bool values;
    int64_t offset, rows;
  };
  Ahead after_keys(int64_t p) const {
    return p + 1 < pieces ? Ahead{false, offset[p + 1], rows[p + 1]} : Ahead{true, offset[0], rows[0]};
  }
  Ahead after_values(int64_t p) const {
    return p + 1 < pieces ? Ahead{true, offset[p + 1], rows[p + 1]}
                          : Ahead{false, next_offset, std::min<int64_t>(16, next_block_rows)};
  }
};

// The online softmax of one KV head's query group (head_dim = 16 * D).
template <int D>
struct HeadState {
  static constexpr bool kPairs = kBFloat16Dot && D % 2 == 0;
  vec16::f32x16 q[kMaxGroup][D];    // the queries, times the scale
  vec16::f32x16 acc[kMaxGroup][D];  // the weighted values so far
  vec16::f32x16 denominator[kMaxGroup];  // the weights so far, lane-wise
  float running_max[kMaxGroup];
#ifdef SPLITSERVE_BFLOAT16_DOT
  __m512bh q_pairs[kPairs ? kMaxGroup : 1][kPairs ? D / 2 : 1];  // q rounded to bfloat16, 32 to a vector
#endif

  void start(const float* q_group, int64_t group, float scale) {
    for (int64_t g = 0; g < group; ++g) {
      for (int d = 0; d < D; ++d) {
        q[g][d] = vec16::load16(q_group + g * 16 * D + 16 * d) * scale;
        acc[g][d] = vec16::splat(0.0f);
      }
      denominator[g] = vec16::splat(0.0f);
      running_max[g] = vec16::kNegativeInfinity;
    }
  }

  // The bfloat16 queries for attend_span's dot products (with a bfloat16 cache, after start).
  void start_pairs(int64_t group) {
#ifdef SPLITSERVE_BFLOAT16_DOT
    if constexpr (kPairs)
      for (int64_t g = 0; g < group; ++g)
        for (int d = 0; d < D / 2; ++d)
          q_pairs[g][d] = _mm512_cvtne2ps_pbh((__m512)q[g][2 * d + 1], (__m512)q[g][2 * d]);
#else
    (void)group;
#endif
  }

  // Attending to a span takes three stages: every piece's scores (score_piece, reading the keys as one stream),
  // one softmax update for the whole span (update), then the weighted values (add_values, reading the values as
  // one stream). `weights` holds the group's scores, then weights: query head g's of piece p at
  // weights[g * kMaxPieces * 16 + p * 16], 16 lanes, those past the piece's rows masked. A span of one piece is
  // the same arithmetic, in the same order, as that piece alone. Against the 16-row chunks of a 128-token
  // block one by one (each with its own softmax update, keys and values read side by side), the offline
  // workload's decode attention took 1.39 s instead of 1.72 and the run 15.20 s instead of 15.61, with the
  // same tokens (2-core AMD EPYC Zen 5, medians of 5 alternating runs in one process).
  //
  // Each stage fetches the piece read after it (`ahead`, `ahead_rows` rows), one row per key or value row it
  // reads (in the first batch of heads), so that the fetches spread over the piece's arithmetic. Fetching every
  // head's next piece at once (12 KB for SmolLM) before computing stalled on the prefetches: a profile put a
  // quarter of the kernel's time on them, the core waiting for free miss buffers. The values' stage still
  // fetched one head's piece (4 KB) in a burst before its rows until a 2-core Intel Xeon with AMX put a third
  // of the kernel's samples on that burst; spread, the offline workload ran 1.011x faster there (6 of 6
  // alternating runs), and on a 2-core AMD EPYC Zen 5 the kernel 1.08-1.13x (64x320, 8x2048 and 32x1024, blocks
  // of 16 and 128, both builds alternating in one process: cpu_attention.py --baseline). Spread out, 64 requests
  // x 320 tokens x 30 layers read the cache at 29 GB/s against 22-24 (2-core AMD EPYC Zen 4, 128- and 16-token
  // blocks alike). Fetching ahead at all matters because with
  // head_dim 64 a piece's keys (and its values) fill one 4 KB page, where the hardware prefetcher stops: one
  // chunk ahead read 64 requests x 320 tokens in 128-token blocks at 33.5 GB/s against 26.2 without (Zen 5,
  // C++ harness, medians of 7; two chunks ahead: 29.9).
  // Query heads at once in score_piece and add_values: as many as keep their queries (or accumulators) in half
  // the vector registers, up to 4. Each key or value row is then loaded once for them all: Zen 4 loads one
  // 64-byte vector a cycle, and loading a row (and the queries) again for each head left the multiply-adds
  // waiting on loads.
  static constexpr int kHeadsAtOnce = std::clamp((vec16::kVectorRegisters == 32 ? 16 : 4) / D, 1, 4);

  // f(g, heads) for the group's query heads in batches of up to kHeadsAtOnce, starting at g; `heads` is the
  // batch's size as a std::integral_constant, for the kernels' template argument.
  template <typename F>
  static void for_head_batches(int64_t group, F&& f) {
    for (int64_t g = 0; g < group; g += kHeadsAtOnce) {
      switch (std::min<int64_t>(kHeadsAtOnce, group - g)) {
        case 1: f(g, std::integral_constant<int, 1>{}); break;
        case 2: f(g, std::integral_constant<int, std::min(2, kHeadsAtOnce)>{}); break;
        case 3: f(g, std::integral_constant<int, std::min(3, kHeadsAtOnce)>{}); break;
        default: f(g, std::integral_constant<int, kHeadsAtOnce>{}); break;
      }
    }
  }

  template <typename KV>
  void score_piece(const KV* keys, int64_t rows, int64_t p, float* weights, vec16::f32x16* span_max,
                   int64_t group, const KV* ahead, int64_t ahead_rows) const {
    for_head_batches(group, [&](int64_t g, auto heads) {
      score_heads<decltype(heads)::value>(g, keys, rows, p, weights, span_max, ahead, g == 0 ? ahead_rows : 0);
    });
  }

  // Query heads [g0, g0 + NG) against a piece's keys: each key row loaded once, then its NG dot products, each
  // as 16 lanes whose sum is the product (in VDPBF16PS for a bfloat16 cache where the CPU has it).
  template <int NG, typename KV>
  void score_heads(int64_t g0, const KV* keys, int64_t rows, int64_t p, float* weights, vec16::f32x16* span_max,
                   const KV* ahead, int64_t ahead_rows) const {
    using namespace vec16;
    constexpr int64_t row_bytes = 16 * D * static_cast<int64_t>(sizeof(KV));
    f32x16 products[NG][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t < ahead_rows) prefetch_row(reinterpret_cast<const char*>(ahead + t * 16 * D), row_bytes);
      const KV* key = keys + std::min(t, rows - 1) * 16 * D;
#ifdef SPLITSERVE_BFLOAT16_DOT
      if constexpr (kPairs && !std::is_same_v<KV, float>) {
        __m512bh pairs[D / 2];
        for (int d = 0; d < D / 2; ++d) pairs[d] = (__m512bh)_mm512_loadu_si512(key + 32 * d);
        for (int i = 0; i < NG; ++i) {
          __m512 sum = _mm512_setzero_ps();
          for (int d = 0; d < D / 2; ++d) sum = _mm512_dpbf16_ps(sum, q_pairs[g0 + i][d], pairs[d]);
          products[i][t] = (f32x16)sum;
        }
        continue;
      }
#endif
      f32x16 k[D];
      for (int d = 0; d < D; ++d) k[d] = load16(key + 16 * d);
      for (int i = 0; i < NG; ++i) {
        f32x16 sum = q[g0 + i][0] * k[0];
        for (int d = 1; d < D; ++d) sum += q[g0 + i][d] * k[d];
        products[i][t] = sum;
      }
    }
    for (int i = 0; i < NG; ++i) {
      const f32x16 scores = keep_first(sum_each(products[i]), rows, kNegativeInfinity);  // lanes past rows masked
      store16(weights + (g0 + i) * kMaxPieces * 16 + 16 * p, scores);
      span_max[g0 + i] = p == 0 ? scores : maximum(span_max[g0 + i], scores);
    }
  }

  void update(float* weights, const vec16::f32x16* span_max, int64_t pieces, int64_t group) {
    using namespace vec16;
    for (int64_t g = 0; g < group; ++g) {  // the softmax update, then the span's weights
      const float new_max = horizontal_max(span_max[g]);
      if (new_max > running_max[g]) {  // rescale what was accumulated (by 0 on the first span)
        const float correction = std::exp(running_max[g] - new_max);
        running_max[g] = new_max;
        for (int d = 0; d < D; ++d) acc[g][d] *= correction;
        denominator[g] *= correction;
      }
      float* w = weights + g * kMaxPieces * 16;
      for (int64_t p = 0; p < pieces; ++p) {
        const f32x16 weight = exp16(load16(w + 16 * p) - running_max[g]);
        denominator[g] += weight;
        store16(w + 16 * p, weight);
      }
    }
  }

  template <typename KV>
  void add_values(const KV* values, int64_t rows, int64_t p, const float* weights, int64_t group, const KV* ahead,
                  int64_t ahead_rows) {
    using namespace vec16;
    constexpr int64_t row_bytes = 16 * D * static_cast<int64_t>(sizeof(KV));
    // The first batch of heads fetches the next piece a row per value row it reads (add_heads); what a short piece
    // leaves over is fetched after it.
    for_head_batches(group, [&](int64_t g, auto heads) {
      add_heads<decltype(heads)::value>(g, values, rows, p, weights, ahead, g == 0 ? ahead_rows : 0);
    });
    for (int64_t t = rows; t < ahead_rows; ++t) prefetch_row(reinterpret_cast<const char*>(ahead + t * 16 * D), row_bytes);
  }

  // Query heads [g0, g0 + NG), their accumulators in registers over the piece's rows, each value row loaded
  // once for them all (the same operations, in the same order, for each head).
  template <int NG, typename KV>
  void add_heads(int64_t g0, const KV* values, int64_t rows, int64_t p, const float* weights, const KV* ahead,
                 int64_t ahead_rows) {
    using namespace vec16;
    constexpr int64_t row_bytes = 16 * D * static_cast<int64_t>(sizeof(KV));
    f32x16 sum[NG][D];
    for (int i = 0; i < NG; ++i)
      for (int d = 0; d < D; ++d) sum[i][d] = acc[g0 + i][d];
    for (int64_t t = 0; t < rows; ++t) {
      if (t < ahead_rows) prefetch_row(reinterpret_cast<const char*>(ahead + t * 16 * D), row_bytes);
      f32x16 value[D];
      for (int d = 0; d < D; ++d) value[d] = load16(values + t * 16 * D + 16 * d);
      for (int i = 0; i < NG; ++i) {
        const f32x16 weight = splat(weights[(g0 + i) * kMaxPieces * 16 + 16 * p + t]);
        for (int d = 0; d < D; ++d) sum[i][d] += weight * value[d];
      }
    }
    for (int i = 0; i < NG; ++i)
      for (int d = 0; d < D; ++d) acc[g0 + i][d] = sum[i][d];
  }

  // One head's span, the three stages in turn, each fetching what the next reads.
  template <typename KV>
  void attend_span(const KV* k_base, const KV* v_base, const Span& span, int64_t group) {
    alignas(64) float weights[kMaxGroup * kMaxPieces * 16];
    vec16::f32x16 span_max[kMaxGroup];
    for (int64_t p = 0; p < span.pieces; ++p) {
      const Span::Ahead ahead = span.after_keys(p);
      score_piece(k_base + span.offset[p], span.rows[p], p, weights, span_max, group,
                  (ahead.values ? v_base : k_base) + ahead.offset, ahead.rows);
    }
    update(weights, span_max, span.pieces, group);
    for (int64_t p = 0; p < span.pieces; ++p) {
      const Span::Ahead ahead = span.after_values(p);
      add_values(v_base + span.offset[p], span.rows[p], p, weights, group,
                 (ahead.values ? v_base : k_base) + ahead.offset, ahead.rows);
    }
  }

  void finish(float* out_group, int64_t group) const {
    for (int64_t g = 0; g < group; ++g) {
      const float total = vec16::horizontal_sum(denominator[g]);
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int d = 0; d < D; ++d) vec16::store16(out_group + g * 16 * D + 16 * d, acc[g][d] * inverse);
    }
  }
};

// One (request, KV head) as attend_one_head, head_dim = 16 * D.
template <int D, typename KV>
void attend_head16(const float* q_group, const KV* k_head, const KV* v_head, const int64_t* table,
                   int64_t length, const DecodeShape& shape, float scale, float* out_group) {
  HeadState<D> state;
  state.start(q_group, shape.group, scale);
  if constexpr (!std::is_same_v<KV, float>) state.start_pairs(shape.group);
  const int64_t span_rows = Span::blocks_for(shape.block_size) * shape.block_size;
  for (int64_t start = 0; start < length; start += span_rows)
    state.attend_span(k_head, v_head, Span(table, start, std::min(span_rows, length - start), length, shape, 16 * D),
                      shape.group);
  state.finish(out_group, shape.group);
}

// One request, all num_kv_heads heads, span by span (heads in passes of as many as fit 64 KB of state and 64 KB
// of weights).
template <int D, typename KV>
void attend_request16(const float* q_request, const KV* k_layer, const KV* v_layer, const int64_t* table,
                      int64_t length, int64_t num_kv_heads, const DecodeShape& shape, float scale,
                      float* out_request) {
  constexpr int64_t kHeadsPerPass = std::max<int64_t>(1, 65536 / sizeof(HeadState<D>));
  constexpr int64_t head_dim = 16 * D;
  const int64_t span_rows = Span::blocks_for(shape.block_size) * shape.block_size;
  // A head's scores and weights take group x kMaxPieces x 16 floats: at most 64 KB of them for a pass.
  const int64_t head_weights = shape.group * kMaxPieces * 16;
  const int64_t heads_per_pass = std::min<int64_t>(kHeadsPerPass, 16384 / head_weights);
  HeadState<D> states[kHeadsPerPass];
  struct Read {
    const KV* at;  // the piece's first row
    int64_t rows, head, piece;  // head: of this pass
  };
  alignas(64) float weights[16384];
  vec16::f32x16 span_max[kHeadsPerPass][kMaxGroup];
  for (int64_t first = 0; first < num_kv_heads; first += heads_per_pass) {
    const int64_t heads = std::min(heads_per_pass, num_kv_heads - first);
    for (int64_t h = 0; h < heads; ++h) {
      states[h].start(q_request + (first + h) * shape.group * head_dim, shape.group, scale);
      if constexpr (!std::is_same_v<KV, float>) states[h].start_pairs(shape.group);
    }
    for (int64_t start = 0; start < length; start += span_rows) {
      const Span span(table, start, std::min(span_rows, length - start), length, shape, head_dim);
      // The span's pieces of every head in the order they lie in memory, keys then values: block by block, in a
      // block head by head (a layer's block holds each head's rows together, then the next head's), in a head
      // piece by piece; then the next span's first pieces. Each piece fetches the one kReadAhead places after it.
      Read order[2 * kHeadsPerPass * kMaxPieces + kReadAhead];
      int64_t n = 0;
      for (const KV* layer : {k_layer, v_layer})
        for (int64_t b = 0; b < span.pieces; b += span.pieces_per_block)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t p = b; p < std::min(b + span.pieces_per_block, span.pieces); ++p)
              order[n++] = Read{layer + (first + h) * shape.head_stride + span.offset[p], span.rows[p], h, p};
      const int64_t keys = n / 2;
      const int64_t next_pieces = (span.next_block_rows + 15) / 16;  // per head; none after the last span
      for (int64_t j = 0; j < kReadAhead; ++j) {
        const int64_t h = next_pieces > 0 ? j / next_pieces : heads, q = j - h * next_pieces;
        order[n + j] = Read{k_layer, 0, 0, 0};  // nothing to fetch
        if (h < heads)
          order[n + j] = Read{k_layer + (first + h) * shape.head_stride + span.next_offset + 16 * q * head_dim,
                              std::min<int64_t>(16, span.next_block_rows - 16 * q), h, q};
      }
      for (int64_t i = 0; i < keys; ++i) {
        const Read& read = order[i];
        const Read& ahead = order[i + kReadAhead];
        states[read.head].score_piece(read.at, read.rows, read.piece, weights + read.head * head_weights,
                                      span_max[read.head], shape.group, ahead.at, ahead.rows);
      }
      for (int64_t h = 0; h < heads; ++h)
        states[h].update(weights + h * head_weights, span_max[h], span.pieces, shape.group);
      for (int64_t i = keys; i < n; ++i) {
        const Read& read = order[i];
        const Read& ahead = order[i + kReadAhead];
        states[read.head].add_values(read.at, read.rows, read.piece, weights + read.head * head_weights,
                                     shape.group, ahead.at, ahead.rows);
      }
    }
    for (int64_t h = 0; h < heads; ++h) states[h].finish(out_request + (first + h) * shape.group * head_dim, shape.group);
  }
}

template <typename KV>
struct WideFunctions {
  void (*head)(const float*, const KV*, const KV*, const int64_t*, int64_t, const DecodeShape&, float, float*);
  void (*request)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, const DecodeShape&,
                  float, float*);
};

// The 16-float drivers for this head size, or nulls (the per-key loop then).
template <typename KV>
WideFunctions<KV> wide_functions(int64_t head_dim) {
  switch (head_dim) {
    case 16: return {attend_head16<1, KV>, attend_request16<1, KV>};
    case 32: return {attend_head16<2, KV>, attend_request16<2, KV>};
    case 64: return {attend_head16<4, KV>, attend_request16<4, KV>};
    case 128: return {attend_head16<8, KV>, attend_request16<8, KV>};
    case 256: return {attend_head16<16, KV>, attend_request16<16, KV>};
    default: return {nullptr, nullptr};
  }
}

#pragma GCC pop_options

// The cache's element type (float or BFloat16), checked by the caller.
template <typename KV>
const KV* cache_data(const at::Tensor& cache) {
  return reinterpret_cast<const KV*>(cache.data_ptr());
}

template <typename KV>
void decode_all(const float* q_ptr, int64_t q_stride, const KV* k_ptr, const KV* v_ptr, const int64_t* table_ptr,
                const int64_t* len_ptr, int64_t num_requests, int64_t num_q_heads, int64_t num_kv_heads,
                int64_t head_dim, int64_t max_blocks, const DecodeShape& shape, float scale_f, float* out_ptr) {
  const WideFunctions<KV> wide = wide_functions<KV>(head_dim);
  const int64_t group = shape.group, head_stride = shape.head_stride;
  // Whole requests per task once there are enough of them to keep every thread busy.
  if (wide.request != nullptr && num_requests >= kRequestsPerThreadForWholeRequests * omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < num_requests; ++r)
      wide.request(q_ptr + r * q_stride, k_ptr, v_ptr, table_ptr + r * max_blocks, len_ptr[r],
                   num_kv_heads, shape, scale_f, out_ptr + r * num_q_heads * head_dim);
    return;
  }
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t r = 0; r < num_requests; ++r) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t first_row = r * num_q_heads + h * group;
      if (wide.head != nullptr) {
        wide.head(q_ptr + r * q_stride + h * group * head_dim, k_ptr + h * head_stride, v_ptr + h * head_stride,
                  table_ptr + r * max_blocks, len_ptr[r], shape, scale_f, out_ptr + first_row * head_dim);
        continue;
      }
      attend_one_head(q_ptr + r * q_stride + h * group * head_dim, k_ptr + h * head_stride,
                      v_ptr + h * head_stride, table_ptr + r * max_blocks, len_ptr[r], group, shape.block_size,
                      head_dim, shape.block_stride, scale_f, out_ptr + first_row * head_dim);
    }
  }
}

#ifdef SPLITSERVE_AMX
// A bfloat16 cache in AMX tiles (cpu_amx_attention.h), shared out as decode_all does: whole requests per task
// when there are enough of them, else (request, KV head) pairs. Each thread releases the tiles when done
// (oneDNN configures its own before each use).
void decode_all_amx(const float* q_ptr, int64_t q_stride, const vec16::BFloat16* k_ptr, const vec16::BFloat16* v_ptr,
                    const int64_t* table_ptr, const int64_t* len_ptr, int64_t num_requests, int64_t num_q_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks, const DecodeShape& shape,
                    float scale_f, float* out_ptr) {
  const amx::DecodeTiles config(shape.group);
  const bool whole_requests = num_requests >= kRequestsPerThreadForWholeRequests * omp_get_max_threads();
  const int64_t heads_per_task = whole_requests ? num_kv_heads : 1;
  const int64_t tasks_per_request = num_kv_heads / heads_per_task;
#pragma omp parallel
  {
    auto scratch = std::make_unique<amx::DecodeScratch>();
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_requests * tasks_per_request; ++task) {
      const int64_t r = task / tasks_per_request, first = task % tasks_per_request * heads_per_task;
      const amx::RequestView view{k_ptr, v_ptr, table_ptr + r * max_blocks, len_ptr[r], (len_ptr[r] + 31) / 32 * 32,
                                  shape.group, head_dim, shape.block_size, shape.block_stride, shape.head_stride};
      amx::attend_heads(q_ptr + r * q_stride, first, heads_per_task, view, scale_f,
                        out_ptr + r * num_q_heads * head_dim, *scratch, config);
    }
    _tile_release();
  }
}
#endif

}  // namespace

bool bfloat16_dot_supported() { return kBFloat16Dot; }

bool amx_decode_supported(int64_t head_dim, int64_t block_size, int64_t group) {
  return amx::decode_supported(head_dim, block_size, group);
}

bool set_amx_enabled(bool enabled) { return amx::enabled().exchange(enabled); }

int64_t set_decode_prefetch_level(int64_t level) {
  TORCH_CHECK(level == 0 || level == 1 || level == 2,
              "set_decode_prefetch_level: the level must be 1 (L1), 2 (L2) or 0 (this CPU's default), not ", level);
  return g_prefetch_level.exchange(level == 0 ? default_prefetch_level() : static_cast<int>(level));
}

int64_t decode_prefetch_level() { return g_prefetch_level.load(); }

at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale, at::Tensor out_arg) {
  check_query_rows(query, "paged_decode_attention");
  TORCH_CHECK((key_cache.scalar_type() == at::kFloat || key_cache.scalar_type() == at::kBFloat16) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_decode_attention: the cache must be float32 or bfloat16, keys and values alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: block_tables and seq_lens must be contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides() &&
                  key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3),
              "paged_decode_attention: each cache block's rows must be contiguous, keys and values alike");
  const int64_t num_requests = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0), num_blocks = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "q_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_size <= kMaxBlockSize, "block_size too large");
  TORCH_CHECK(head_dim <= kMaxHeadDim, "head_dim too large");
  const int64_t group = num_q_heads / num_kv_heads;
  TORCH_CHECK(group <= kMaxGroup, "more than 16 query heads per KV head");

  auto out = attention_output(out_arg, num_requests, num_q_heads, head_dim, query.options(), "paged_decode_attention");
  const float* q_ptr = query.data_ptr<float>();
  const int64_t q_stride = query.stride(0);
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
  const DecodeShape shape{group, block_size, key_cache.stride(1), key_cache.stride(0)};
#ifdef SPLITSERVE_AMX
  if (key_cache.scalar_type() == at::kBFloat16 && amx::decode_supported(head_dim, block_size, group)) {
    decode_all_amx(q_ptr, q_stride, cache_data<vec16::BFloat16>(key_cache), cache_data<vec16::BFloat16>(value_cache),
                   table_ptr, len_ptr, num_requests, num_q_heads, num_kv_heads, head_dim, max_blocks, shape, scale_f,
                   out_ptr);
    return out;
  }
#endif
  if (key_cache.scalar_type() == at::kBFloat16)
    decode_all(q_ptr, q_stride, cache_data<vec16::BFloat16>(key_cache), cache_data<vec16::BFloat16>(value_cache),
               table_ptr, len_ptr, num_requests, num_q_heads, num_kv_heads, head_dim, max_blocks, shape, scale_f,
               out_ptr);
  else
    decode_all(q_ptr, q_stride, cache_data<float>(key_cache), cache_data<float>(value_cache), table_ptr, len_ptr,
               num_requests, num_q_heads, num_kv_heads, head_dim, max_blocks, shape, scale_f, out_ptr);
  return out;
}

// Store a step's keys and values into their slots of one layer's cache (in place).
//   key_cache/value_cache [kv_heads, num_blocks, block_size, head_dim], rows contiguous (modified)
//   key/value             [num_tokens, kv_heads, head_dim], rows of head_dim contiguous
//   slot_mapping          [num_tokens] int64: block * block_size + offset
// The reference is splitserve.engine.attention.write_kv (an index_copy_ per cache).
void write_kv_(at::Tensor key_cache, at::Tensor value_cache, at::Tensor key, at::Tensor value,
               at::Tensor slot_mapping) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && value_cache.scalar_type() == dtype &&
                  key.scalar_type() == dtype && value.scalar_type() == dtype,
              "write_kv_: float32 or bfloat16, the same for the cache and the new keys and values");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides() &&
                  key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3),
              "write_kv_: each cache block's rows must be contiguous, keys and values alike");
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.dim() == 3 && value.stride(2) == 1 &&
                  key.sizes() == value.sizes(), "write_kv_: key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0), "write_kv_: one int64 slot per token");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  TORCH_CHECK(key_cache.size(0) == num_kv_heads && key_cache.size(3) == head_dim, "write_kv_: shapes differ");
  const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(1) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  // Rows are copied as bytes, so one loop serves both element types (strides below are in bytes).
  const int64_t element = key_cache.element_size();
  char *k_cache = static_cast<char*>(key_cache.data_ptr()), *v_cache = static_cast<char*>(value_cache.data_ptr());
  const char *k_ptr = static_cast<const char*>(key.data_ptr()), *v_ptr = static_cast<const char*>(value.data_ptr());
  const int64_t k_token = key.stride(0) * element, k_head = key.stride(1) * element;
  const int64_t v_token = value.stride(0) * element, v_head = value.stride(1) * element;
  const int64_t head_stride = key_cache.stride(0) * element, block_stride = key_cache.stride(1) * element;
  const size_t row_bytes = head_dim * element;
#pragma omp parallel for schedule(static) if (num_tokens > 16)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = (slots[t] / block_size) * block_stride + (slots[t] % block_size) * static_cast<int64_t>(row_bytes);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::memcpy(k_cache + h * head_stride + slot, k_ptr + t * k_token + h * k_head, row_bytes);
      std::memcpy(v_cache + h * head_stride + slot, v_ptr + t * v_token + h * v_head, row_bytes);
    }
  }
}

}  // namespace splitserve
