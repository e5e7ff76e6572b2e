// Paged prefill attention for CPUs: a flattened batch of prompt chunks, each token
// causally over its request's context and its own chunk, keys and values read
// straight from the paged KV cache (no gathered copy) in flash-attention style:
// scores for a tile of queries against a tile of keys, an online softmax, and the
// weighted values accumulated tile by tile, so no [queries, keys] matrix is ever
// materialized. The chunk's own keys and values are already in the cache (the
// engine writes a step's K/V before it attends).
//
// Layouts (query and output float32; the cache float32 or bfloat16, read as float32):
//   query            [rows, q_heads, head_dim], each row's heads contiguous, rows at any stride (a view of the
//                    fused QKV projection's output; the chunks' rows, back to back)
//   key/value        [kv_heads, num_blocks, block_size, head_dim]  (one layer; as in cpu_paged_attention.cpp)
//   query_start_loc  [chunks + 1] int32: chunk c is rows query_start_loc[c] .. query_start_loc[c + 1]
//   context_lens     [chunks] int32: tokens of chunk c's request already cached before the chunk
//   block_tables     [chunks, max_blocks] int64: each request's blocks (entries past its end unused)
// Returns [rows, q_heads, head_dim], contiguous: `out` where the caller gives one (else empty).
//
// Work item: one (chunk, KV head, tile of query tokens). The tile's rows are its
// tokens times the query heads sharing the KV head (grouped-query attention), so a
// key row is loaded once for the whole group. Keys are walked in tiles of whole
// cache blocks (64 keys or one block), up to the tile's last query position only:
// the causal upper triangle beyond it is never computed.
//
// The micro-kernels are written on 16-float vectors (cpu_vector16.h: AVX-512 where
// the machine has it, pairs of AVX2 registers where not). This file fuses multiply-adds (fp-contract=fast below), as
// BLAS does for torch's scaled_dot_product_attention; the sums run in a different
// order than the reference's, and tests/integration/test_kernels.py bounds the
// difference. The plain-torch reference is splitserve.engine.attention.prefill_attention.

#include "cpu_tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_amx_attention.h"
#include "cpu_vector16.h"

#pragma GCC optimize("fp-contract=fast")

namespace splitserve {

namespace {

using namespace vec16;

constexpr int64_t kKeysPerTile = 64;   // keys per online-softmax step
constexpr int64_t kRowsPerTile = 64;   // score rows per work item (at most): query tokens x group
// The micro-kernels' register tiles, sized to the target's vector registers (cpu_vector16.h):
//  - score_keys holds kKeysPerPass keys x kRowVectorsPerPass vectors of rows of scores;
//  - accumulate_values holds kRowsPerPass rows x kValueVectors vectors of the output row.
// With AVX-512's 32 registers: 6 x 4 scores (24 registers; 4 keys per pass, 16 registers, ran 9-30%
// slower on a Zen 4, one core and two) and 4 x 4 outputs. With AVX2's 16, where each vector takes two:
// 3 x 2 scores (12, the queries read from L1) and 2 x 2 outputs, the best of six shapes tried (AVX2
// code on the Zen 4, one core: 64 GFLOP/s, against 46-60 for the others).
constexpr bool kWideRegisters = kVectorRegisters >= 32;
constexpr int64_t kKeysPerPass = kWideRegisters ? 6 : 3;
constexpr int kRowVectorsPerPass = kWideRegisters ? 4 : 2;
constexpr int64_t kRowsPerPass = kWideRegisters ? 4 : 2;
constexpr int kValueVectors = kWideRegisters ? 4 : 2;

struct Shape {
  int64_t num_q_heads, group, head_dim, block_size, head_stride, block_stride;
};

// scores_t[k][0 .. 16 * ROW_VECTORS) = keys[k] . q_t[:, rows ...] for the kKeysPerPass keys (k < count
// stored; the others repeat key 0 and are dropped); q_t is the tile's queries transposed, [head_dim][rows].
// With bfloat16 keys and AVX512-BF16, q_pairs instead: the same queries rounded to bfloat16, each pair of
// dimensions side by side, [head_dim / 2][rows][2], against which a key's pair is one VDPBF16PS per 16 rows
// (half the instructions of the float32 multiply-adds).
template <int ROW_VECTORS, typename KV>
void score_keys(const KV* const* keys, int64_t count, const float* q_t, const BFloat16* q_pairs, int64_t q_stride,
                int64_t head_dim, float* scores_t, int64_t scores_stride) {
  const KV* key[kKeysPerPass];
  for (int64_t k = 0; k < kKeysPerPass; ++k) key[k] = keys[k < count ? k : 0];
#ifdef SPLITSERVE_BFLOAT16_DOT
  if constexpr (std::is_same_v<KV, BFloat16>) {
    __m512 sums[kKeysPerPass][ROW_VECTORS];
    for (int64_t k = 0; k < kKeysPerPass; ++k)
      for (int v = 0; v < ROW_VECTORS; ++v) sums[k][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < head_dim / 2; ++p) {
      __m512bh q[ROW_VECTORS];
      for (int v = 0; v < ROW_VECTORS; ++v)
        q[v] = (__m512bh)_mm512_loadu_si512(q_pairs + 2 * (p * q_stride + v * kLanes));
      for (int64_t k = 0; k < kKeysPerPass; ++k) {
        int32_t pair;
        std::memcpy(&pair, key[k] + 2 * p, sizeof(pair));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < ROW_VECTORS; ++v) sums[k][v] = _mm512_dpbf16_ps(sums[k][v], x, q[v]);
      }
    }
    for (int64_t k = 0; k < count; ++k)
      for (int v = 0; v < ROW_VECTORS; ++v) _mm512_storeu_ps(scores_t + k * scores_stride + v * kLanes, sums[k][v]);
    return;
  }
#endif
  (void)q_pairs;
  f32x16 acc[kKeysPerPass][ROW_VECTORS] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    f32x16 q[ROW_VECTORS];
    for (int v = 0; v < ROW_VECTORS; ++v) q[v] = load16(q_t + d * q_stride + v * kLanes);
    for (int64_t k = 0; k < kKeysPerPass; ++k) {
      const float x = to_float(key[k][d]);
      for (int v = 0; v < ROW_VECTORS; ++v) acc[k][v] += x * q[v];
    }
  }
  for (int64_t k = 0; k < count; ++k)
    for (int v = 0; v < ROW_VECTORS; ++v) store16(scores_t + k * scores_stride + v * kLanes, acc[k][v]);
}

// out[r][d .. d + 16 kValueVectors) = out[r][...] * correction[r] + sum_t p_t[t][r] * values[t][d ...] for
// kRowsPerPass rows (r < rows stored).
template <typename KV>
void accumulate_values(const float* p_t, int64_t p_stride, int64_t count, const KV* const* values, int64_t d,
                       const float* correction, int64_t head_dim, int64_t rows, float* out) {
  constexpr int kVectors = kValueVectors;
  f32x16 acc[kRowsPerPass][kVectors];
  for (int64_t r = 0; r < kRowsPerPass; ++r)
    for (int v = 0; v < kVectors; ++v)
      acc[r][v] = r < rows ? load16(out + r * head_dim + d + v * kLanes) * correction[r] : splat(0.0f);
  for (int64_t t = 0; t < count; ++t) {
    const KV* value = values[t] + d;
    f32x16 x[kVectors];
    for (int v = 0; v < kVectors; ++v) x[v] = load16(value + v * kLanes);
    for (int64_t r = 0; r < kRowsPerPass; ++r) {
      const float weight = p_t[t * p_stride + r];
      for (int v = 0; v < kVectors; ++v) acc[r][v] += weight * x[v];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < kVectors; ++v) store16(out + r * head_dim + d + v * kLanes, acc[r][v]);
}

// One work item: query tokens [first, last) of a chunk (positions context + first ...), KV head h.
//
// Scores are kept transposed, [key][row]: the key rows are read in place from the cache (only the queries
// are transposed, once per item), and the softmax's maxima and sums run across rows in vector lanes, with
// no horizontal reductions.
template <typename KV>
void attend_tile(const float* query, int64_t query_stride, const KV* k_head, const KV* v_head, const int64_t* table,
                 int64_t context, int64_t first, int64_t last, int64_t h, const Shape& s, float scale,
                 float* out) {
  const int64_t group = s.group, head_dim = s.head_dim;
  const int64_t rows = (last - first) * group;
  const int64_t row_vectors = (rows + kLanes - 1) / kLanes, stride = row_vectors * kLanes;
  // Each thread's scratch, kept from item to item (sized by the largest tile it has met).
  thread_local std::vector<float> q_t, acc, scores_t, running_max, denominator, correction;
  thread_local std::vector<BFloat16> q_pairs;
  q_t.resize(head_dim * stride);
  acc.assign(stride * head_dim, 0.0f);
  scores_t.resize(kKeysPerTile * stride);
  running_max.assign(stride, kNegativeInfinity);
  denominator.assign(stride, 0.0f);
  correction.resize(stride);
  const KV* keys[kKeysPerTile];
  const KV* values[kKeysPerTile];
  // Row m is query token first + m / group, query head h * group + m % group; scaled once here. The rows
  // are transposed 16 x 16 at a time in registers (one scalar store per element took 8% of the kernel);
  // rows past the tile's are zeros.
  for (int64_t m0 = 0; m0 < rows; m0 += kLanes) {
    const float* source[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t m = m0 + i;
      source[i] = m < rows ? query + (first + m / group) * query_stride + (h * group + m % group) * head_dim : nullptr;
    }
    for (int64_t d = 0; d < head_dim; d += kLanes) {
      f32x16 block[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) block[i] = source[i] != nullptr ? load16(source[i] + d) * scale : splat(0.0f);
      transpose16(block);
      for (int64_t i = 0; i < kLanes; ++i) store16(q_t.data() + (d + i) * stride + m0, block[i]);
    }
  }
  constexpr bool pairs = kBFloat16Dot && std::is_same_v<KV, BFloat16>;
  if constexpr (pairs) {  // see score_keys; once per item, against rows x keys x head_dim multiply-adds
    q_pairs.resize(head_dim * stride);
    for (int64_t p = 0; p < head_dim / 2; ++p)
      for (int64_t r = 0; r < stride; ++r)
        for (int64_t j = 0; j < 2; ++j) q_pairs[2 * (p * stride + r) + j] = to_bfloat16(q_t[(2 * p + j) * stride + r]);
  }
  const int64_t num_keys = context + last;  // the last query token sees keys 0 .. context + last - 1
  for (int64_t start = 0; start < num_keys; start += kKeysPerTile) {
    const int64_t count = std::min(kKeysPerTile, num_keys - start);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t key = start + t;
      const int64_t offset = table[key / s.block_size] * s.block_stride + (key % s.block_size) * head_dim;
      keys[t] = k_head + offset;
      values[t] = v_head + offset;
    }
    for (int64_t t = 0; t < count; t += kKeysPerPass) {
      const int64_t n = std::min(kKeysPerPass, count - t);
      float* target = scores_t.data() + t * stride;
      for (int64_t v = 0; v < row_vectors; v += kRowVectorsPerPass) {
        const int64_t width = std::min<int64_t>(kRowVectorsPerPass, row_vectors - v);
        const float* q = q_t.data() + v * kLanes;
        const BFloat16* qp = pairs ? q_pairs.data() + 2 * v * kLanes : nullptr;
        if (width == 4) score_keys<4>(keys + t, n, q, qp, stride, head_dim, target + v * kLanes, stride);
        else if (width == 3) score_keys<3>(keys + t, n, q, qp, stride, head_dim, target + v * kLanes, stride);
        else if (width == 2) score_keys<2>(keys + t, n, q, qp, stride, head_dim, target + v * kLanes, stride);
        else score_keys<1>(keys + t, n, q, qp, stride, head_dim, target + v * kLanes, stride);
      }
    }
    // Causal mask: key start + t is hidden from the rows of earlier tokens, a prefix of the rows.
    for (int64_t t = 0; t < count; ++t) {
      const int64_t hidden = std::clamp<int64_t>((start + t - context - first) * group, 0, rows);
      std::fill(scores_t.data() + t * stride, scores_t.data() + t * stride + hidden, kNegativeInfinity);
    }
    // Online softmax, 16 rows per vector: rescale what was accumulated when a row's maximum grows. Key 0
    // is in every row's first tile, so every maximum is finite from then on.
    for (int64_t v = 0; v < row_vectors; ++v) {
      const f32x16 old_max = load16(running_max.data() + v * kLanes);
      // Four maxima side by side, so that the MAXPS run in parallel and not as one chain of count latencies
      // (the maximum is exact: the order does not change it).
      f32x16 maxima[4] = {old_max, old_max, old_max, old_max};
      int64_t t = 0;
      for (; t + 4 <= count; t += 4)
        for (int64_t j = 0; j < 4; ++j)
          maxima[j] = maximum(load16(scores_t.data() + (t + j) * stride + v * kLanes), maxima[j]);
      for (; t < count; ++t) maxima[0] = maximum(load16(scores_t.data() + t * stride + v * kLanes), maxima[0]);
      const f32x16 new_max = maximum(maximum(maxima[0], maxima[1]), maximum(maxima[2], maxima[3]));
      f32x16 sum = splat(0.0f);
      for (int64_t t = 0; t < count; ++t) {
        float* row = scores_t.data() + t * stride + v * kLanes;
        const f32x16 p = exp16(load16(row) - new_max);
        store16(row, p);
        sum += p;
      }
      const f32x16 rescale = exp16(old_max - new_max);  // 0 on the first tile (old_max = -inf)
      store16(correction.data() + v * kLanes, rescale);
      store16(denominator.data() + v * kLanes, load16(denominator.data() + v * kLanes) * rescale + sum);
      store16(running_max.data() + v * kLanes, new_max);
    }
    for (int64_t m = 0; m < rows; m += kRowsPerPass) {
      const int64_t pass_rows = std::min(kRowsPerPass, rows - m);
      for (int64_t d = 0; d < head_dim; d += kValueVectors * kLanes)
        accumulate_values(scores_t.data() + m, stride, count, values, d, correction.data() + m, head_dim,
                          pass_rows, acc.data() + m * head_dim);
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    const float inverse = 1.0f / denominator[m];
    float* target = out + ((first + m / group) * s.num_q_heads + h * group + m % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) target[d] = acc[m * head_dim + d] * inverse;
  }
}

struct WorkItem {
  int64_t chunk, head, first, last;
};

// What every work item of a call shares.
struct Batch {
  const float* query;
  int64_t query_stride;  // elements from one query row to the next
  float* out;
  const int32_t* starts;
  const int32_t* contexts;
  const int64_t* tables;
  int64_t max_blocks;
  float scale;
};

template <typename KV>
void attend_items(const std::vector<WorkItem>& items, const Batch& b, const KV* k_ptr, const KV* v_ptr,
                  const Shape& shape) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t row_elements = shape.num_q_heads * shape.head_dim;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < num_items; ++i) {
    const WorkItem& item = items[i];
    const int64_t row0 = b.starts[item.chunk];
    attend_tile(b.query + row0 * b.query_stride, b.query_stride, k_ptr + item.head * shape.head_stride,
                v_ptr + item.head * shape.head_stride, b.tables + item.chunk * b.max_blocks, b.contexts[item.chunk],
                item.first, item.last, item.head, shape, b.scale, b.out + row0 * row_elements);
  }
}

#ifdef SPLITSERVE_AMX
// A bfloat16 cache in AMX tiles (cpu_amx_attention.h): first each (chunk, KV head)'s values transposed for the
// tiles, then the items (chunk, query head, up to 16 tokens), longest first.
void prefill_amx(const Batch& batch, int64_t num_chunks, int64_t num_kv_heads, const BFloat16* k_ptr,
                 const BFloat16* v_ptr, const Shape& shape) {
  const int64_t head_dim = shape.head_dim, words_per_step = head_dim / 16 * 256;
  std::vector<int64_t> offsets(num_chunks * num_kv_heads + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t length = batch.starts[c + 1] - batch.starts[c];
    const int64_t padded = length == 0 ? 0 : (batch.contexts[c] + length + 31) / 32 * 32;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      offsets[c * num_kv_heads + h + 1] = offsets[c * num_kv_heads + h] + padded / 32 * words_per_step;
  }
  std::unique_ptr<uint32_t[]> values(new uint32_t[std::max<int64_t>(1, offsets.back())]);
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t length = batch.starts[c + 1] - batch.starts[c];
      if (length == 0) continue;
      const int64_t keys = batch.contexts[c] + length;
      amx::prefill_values(v_ptr + h * shape.head_stride, batch.tables + c * batch.max_blocks, keys,
                          (keys + 31) / 32 * 32, head_dim, shape.block_size, shape.block_stride,
                          values.get() + offsets[c * num_kv_heads + h]);
    }
  std::vector<WorkItem> items;  // (chunk, query head, tokens first .. last)
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t first = 0; first < batch.starts[c + 1] - batch.starts[c]; first += 16)
      for (int64_t h = 0; h < shape.num_q_heads; ++h)
        items.push_back({c, h, first, std::min<int64_t>(first + 16, batch.starts[c + 1] - batch.starts[c])});
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return batch.contexts[a.chunk] + a.last > batch.contexts[b.chunk] + b.last;
  });
  const amx::TileConfig config = amx::prefill_tiles();
  const int64_t row_stride = shape.num_q_heads * head_dim;
#pragma omp parallel
  {
    _tile_loadconfig(&config);
    auto scratch = std::make_unique<amx::PrefillScratch>();
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) {
      const WorkItem& item = items[i];
      const int64_t kv_head = item.head / shape.group, row = batch.starts[item.chunk] + item.first;
      amx::prefill_item(batch.query + row * batch.query_stride + item.head * head_dim, batch.query_stride,
                        item.last - item.first,
                        batch.contexts[item.chunk] + item.first, k_ptr + kv_head * shape.head_stride,
                        batch.tables + item.chunk * batch.max_blocks, shape.block_size, shape.block_stride, head_dim,
                        values.get() + offsets[item.chunk * num_kv_heads + kv_head], batch.scale,
                        batch.out + row * row_stride + item.head * head_dim, row_stride, *scratch);
    }
    _tile_release();
  }
}
#endif

}  // namespace

bool amx_prefill_supported(int64_t head_dim, int64_t block_size) { return amx::prefill_supported(head_dim, block_size); }

at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor query_start_loc, at::Tensor context_lens,
                                   at::Tensor block_tables, double scale, at::Tensor out_arg) {
  check_query_rows(query, "paged_prefill_attention");
  TORCH_CHECK((key_cache.scalar_type() == at::kFloat || key_cache.scalar_type() == at::kBFloat16) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_prefill_attention: the cache must be float32 or bfloat16, keys and values alike");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kLong,
              "paged_prefill_attention: query_start_loc and context_lens int32, block_tables int64");
  TORCH_CHECK(query_start_loc.is_contiguous() && context_lens.is_contiguous() && block_tables.is_contiguous(),
              "paged_prefill_attention: query_start_loc, context_lens and block_tables must be contiguous");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides() &&
                  key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3),
              "paged_prefill_attention: each cache block's rows must be contiguous, keys and values alike");
  const int64_t num_rows = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0), num_blocks = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t num_chunks = context_lens.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(key_cache.size(3) == head_dim, "paged_prefill_attention: query and cache head sizes differ");
  TORCH_CHECK(head_dim % 64 == 0, "paged_prefill_attention: head_dim must be a multiple of 64");
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "paged_prefill_attention: q_heads must be a multiple of kv_heads");
  TORCH_CHECK(query_start_loc.size(0) == num_chunks + 1 && block_tables.size(0) == num_chunks,
              "paged_prefill_attention: one start per chunk plus the end, one block table per chunk");
  const int64_t group = num_q_heads / num_kv_heads;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* contexts = context_lens.data_ptr<int32_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(num_chunks == 0 || (starts[0] == 0 && starts[num_chunks] == num_rows),
              "paged_prefill_attention: the chunks must cover the query rows");
  // Checked here, not inside the parallel loop (an exception must not leave an OpenMP region).
  std::vector<WorkItem> items;
  const int64_t tokens_per_tile = std::max<int64_t>(1, kRowsPerTile / group);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t length = starts[c + 1] - starts[c], total = contexts[c] + length;
    TORCH_CHECK(length >= 0 && contexts[c] >= 0, "paged_prefill_attention: negative chunk or context length");
    TORCH_CHECK(total <= max_blocks * block_size, "paged_prefill_attention: context exceeds the block table");
    for (int64_t i = 0; i < (total + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[c * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention: block id out of range");
    }
    // Last tiles first: they see the most keys, so the dynamic schedule ends with the short ones.
    for (int64_t last = length; last > 0; last -= tokens_per_tile)
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({c, h, std::max<int64_t>(0, last - tokens_per_tile), last});
  }
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return contexts[a.chunk] + a.last > contexts[b.chunk] + b.last;
  });
  auto out = attention_output(out_arg, num_rows, num_q_heads, head_dim, query.options(), "paged_prefill_attention");
  const Shape shape{num_q_heads, group, head_dim, block_size, key_cache.stride(0), key_cache.stride(1)};
  const Batch batch{query.data_ptr<float>(), query.stride(0), out.data_ptr<float>(), starts, contexts, tables,
                    max_blocks, static_cast<float>(scale)};
#ifdef SPLITSERVE_AMX
  if (key_cache.scalar_type() == at::kBFloat16 && amx::prefill_supported(head_dim, block_size)) {
    prefill_amx(batch, num_chunks, num_kv_heads, reinterpret_cast<const BFloat16*>(key_cache.data_ptr()),
                reinterpret_cast<const BFloat16*>(value_cache.data_ptr()), shape);
    return out;
  }
#endif
  if (key_cache.scalar_type() == at::kBFloat16)
    attend_items(items, batch, reinterpret_cast<const BFloat16*>(key_cache.data_ptr()),
                 reinterpret_cast<const BFloat16*>(value_cache.data_ptr()), shape);
  else
    attend_items(items, batch, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), shape);
  return out;
}

}  // namespace splitserve
