// Linear layers of decode-sized batches on CPUs: out = x @ weight^T (+ bias) for a few to a
// couple of hundred rows, the weight streamed from memory once per call.
//
// At these sizes a projection is as much a read of its weight as arithmetic: SmolLM2's
// gate/up weight is 7 MB and a decode step of 64 rows does 32 FLOPs per weight byte. By the
// time a layer's GEMM runs, attention has swept its weights out of cache, and oneDNN's packed
// GEMM, tuned for weights it reuses, stalls on them (110-220 GFLOP/s against 300-350 with
// the weight in cache, on a 2-core Sapphire Rapids). Here the weight is kept as panels of
// 32 output columns, each a contiguous [in_features][32] block, walked in k-blocks of 16 KB
// (24 KB on Zen 5, 32 KB on Intel with AVX-512 and a 48 KB L1, whole panels on Zen 4) that
// every row tile uses before the next (each block read from memory once), while the weights
// two blocks ahead (32 KB ahead with whole panels) are fetched into L2 in a steady stream, so
// the memory reads overlap the arithmetic. benchmarks/cpu_gemm.py times both against each
// other with cold weights, as the engine meets them.
//
// Layouts (float32):
//   x       [rows, in_features], rows of in_features contiguous (any row stride)
//   panels  [num_panels, in_features, 32] contiguous: panel p holds output columns 32p .. 32p + 31
//           (pack_panels below builds it from an nn.Linear weight [out_features, in_features],
//           zero-padded past out_features)
//   bias    [out_features] or empty
// Returns [rows, out_features], contiguous.
//
// Each output is one dot product summed over in_features in order with fused multiply-adds,
// where oneDNN and MKL block the sum: results differ from F.linear by float32 rounding, and
// tests/integration/test_kernels.py bounds the difference. The plain-torch reference is
// torch.nn.functional.linear. With AVX-512 the micro-kernel holds 8 rows x 32 columns in 16
// registers; with AVX2 and FMA (no AVX-512), 6 rows x 16 columns in 12 of the 16 ymm registers,
// each panel in two halves, and tiles of 1 to 3 rows the whole 32 columns at once (a batch-1
// projection then reads its weight in memory order), summing in the same order (the two builds
// give the same results).
// With neither, small_gemm_supported() is false and the engine keeps oneDNN.

#include "cpu_tensor.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SPLITSERVE_SMALL_GEMM 1
#endif
#include <omp.h>

namespace splitserve {

namespace {

constexpr int64_t kPanelColumns = 32;
constexpr int64_t kCacheLine = 64;

#ifdef __AVX512F__

constexpr int64_t kTileRows = 8;

// One k-block of ROWS rows x 32 columns: the sums start at zero (resume false) or at what out holds (resume
// true: the previous k-block's), add x[r][k] * panel[k][...] for the block's `steps` k in order, and are stored
// back to out, plus the bias after the last block (finish). Meanwhile `lines` cache lines from `prefetch` onwards
// are fetched into L2, spread evenly over the steps.
template <int ROWS>
void multiply_tile(const float* x, int64_t x_stride, const float* panel, int64_t steps, const float* bias,
                   int64_t columns, float* out, int64_t out_stride, const char* prefetch, int64_t lines, bool resume,
                   bool finish) {
  // The last panel may be partial: only its first `columns` columns exist in out and bias.
  const __mmask16 mask_low = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 mask_high = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  __m512 low[ROWS], high[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    low[r] = resume ? _mm512_maskz_loadu_ps(mask_low, out + r * out_stride) : _mm512_setzero_ps();
    high[r] = resume ? _mm512_maskz_loadu_ps(mask_high, out + r * out_stride + 16) : _mm512_setzero_ps();
  }
  int64_t owed = 0, issued = 0;
  for (int64_t k = 0; k < steps; ++k) {
    const __m512 w_low = _mm512_loadu_ps(panel + k * kPanelColumns);
    const __m512 w_high = _mm512_loadu_ps(panel + k * kPanelColumns + 16);
    for (owed += lines; owed >= steps; owed -= steps) _mm_prefetch(prefetch + issued++ * kCacheLine, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 value = _mm512_set1_ps(x[r * x_stride + k]);
      low[r] = _mm512_fmadd_ps(value, w_low, low[r]);
      high[r] = _mm512_fmadd_ps(value, w_high, high[r]);
    }
  }
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  if (finish && bias != nullptr) {
    bias_low = _mm512_maskz_loadu_ps(mask_low, bias);
    bias_high = _mm512_maskz_loadu_ps(mask_high, bias + 16);
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_mask_storeu_ps(out + r * out_stride, mask_low, finish ? _mm512_add_ps(low[r], bias_low) : low[r]);
    _mm512_mask_storeu_ps(out + r * out_stride + 16, mask_high, finish ? _mm512_add_ps(high[r], bias_high) : high[r]);
  }
}

using TileFunction = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                              const char*, int64_t, bool, bool);
constexpr TileFunction kTiles[kTileRows + 1] = {nullptr,          multiply_tile<1>, multiply_tile<2>,
                                                multiply_tile<3>, multiply_tile<4>, multiply_tile<5>,
                                                multiply_tile<6>, multiply_tile<7>, multiply_tile<8>};

#elif defined(SPLITSERVE_SMALL_GEMM)  // AVX2 and FMA

constexpr int64_t kTileRows = 6;

// As the AVX-512 multiply_tile, a panel's two halves of 16 columns one after the other (12 accumulators,
// 2 weight vectors and a broadcast fit the 16 ymm registers; 32 columns would not). The prefetches ride on the
// first half.
template <int ROWS>
void multiply_tile(const float* x, int64_t x_stride, const float* panel, int64_t steps, const float* bias,
                   int64_t columns, float* out, int64_t out_stride, const char* prefetch, int64_t lines, bool resume,
                   bool finish) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t half = 0; half < 2 && half * 16 < columns; ++half) {
    const float* weights = panel + half * 16;
    float* half_out = out + half * 16;
    // The last panel may be partial: only the columns that exist are loaded and stored.
    const int64_t present = std::min<int64_t>(16, columns - half * 16);
    const __m256i mask_low = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(present)), lane);
    const __m256i mask_high = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(present) - 8), lane);
    __m256 low[ROWS], high[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      low[r] = resume ? _mm256_maskload_ps(half_out + r * out_stride, mask_low) : _mm256_setzero_ps();
      high[r] = resume ? _mm256_maskload_ps(half_out + r * out_stride + 8, mask_high) : _mm256_setzero_ps();
    }
    int64_t owed = 0, issued = 0;
    for (int64_t k = 0; k < steps; ++k) {
      const __m256 w_low = _mm256_loadu_ps(weights + k * kPanelColumns);
      const __m256 w_high = _mm256_loadu_ps(weights + k * kPanelColumns + 8);
      if (half == 0) {
        for (owed += lines; owed >= steps; owed -= steps) _mm_prefetch(prefetch + issued++ * kCacheLine, _MM_HINT_T1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m256 value = _mm256_broadcast_ss(x + r * x_stride + k);
        low[r] = _mm256_fmadd_ps(value, w_low, low[r]);
        high[r] = _mm256_fmadd_ps(value, w_high, high[r]);
      }
    }
    __m256 bias_low = _mm256_setzero_ps(), bias_high = _mm256_setzero_ps();
    if (finish && bias != nullptr) {
      bias_low = _mm256_maskload_ps(bias + half * 16, mask_low);
      bias_high = _mm256_maskload_ps(bias + half * 16 + 8, mask_high);
    }
    for (int r = 0; r < ROWS; ++r) {
      _mm256_maskstore_ps(half_out + r * out_stride, mask_low, finish ? _mm256_add_ps(low[r], bias_low) : low[r]);
      _mm256_maskstore_ps(half_out + r * out_stride + 8, mask_high, finish ? _mm256_add_ps(high[r], bias_high) : high[r]);
    }
  }
}

// One to three rows: the whole 32-column panel row in one pass, four sums a row (12 registers at 3 rows, the
// weights then partly taken from memory by the FMAs), so that the weights are read in memory order, 128 bytes a
// step, with four independent sums a row to cover the FMA latency. Same sums in the same order as multiply_tile.
// On a 2-core Zen 1 (which runs each ymm operation as two 128-bit halves), cpu_gemm.py against the two-halves
// tile in one process, cold weights, SmolLM2's four projections, outputs identical: 1.09-1.21x at 1 and 2 rows,
// 1.14-1.28x at 3. From 4 rows the 16 sums would not fit in the 16 registers, and the halves stay.
template <int ROWS>
void multiply_tile_whole(const float* x, int64_t x_stride, const float* panel, int64_t steps, const float* bias,
                         int64_t columns, float* out, int64_t out_stride, const char* prefetch, int64_t lines,
                         bool resume, bool finish) {
  // The column masks are made before the loop and again after it: kept across it, they took the registers of
  // the sums, which GCC 12 then stored to the stack on every step. The empty asm hides that the two are the same,
  // so that GCC does not keep the first.
  const auto column_masks = [columns](__m256i* mask) {
    int64_t present = columns;
    asm("" : "+r"(present));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < 4; ++j) mask[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(present) - 8 * j), lane);
  };
  __m256i mask[4];
  column_masks(mask);
  __m256 acc0[ROWS], acc1[ROWS], acc2[ROWS], acc3[ROWS];
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r) {
    const float* row_out = out + r * out_stride;
    acc0[r] = resume ? _mm256_maskload_ps(row_out, mask[0]) : _mm256_setzero_ps();
    acc1[r] = resume ? _mm256_maskload_ps(row_out + 8, mask[1]) : _mm256_setzero_ps();
    acc2[r] = resume ? _mm256_maskload_ps(row_out + 16, mask[2]) : _mm256_setzero_ps();
    acc3[r] = resume ? _mm256_maskload_ps(row_out + 24, mask[3]) : _mm256_setzero_ps();
  }
  int64_t owed = 0, issued = 0;
  for (int64_t k = 0; k < steps; ++k) {
    const float* weights = panel + k * kPanelColumns;
    for (owed += lines; owed >= steps; owed -= steps) _mm_prefetch(prefetch + issued++ * kCacheLine, _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(weights), w1 = _mm256_loadu_ps(weights + 8);
    const __m256 w2 = _mm256_loadu_ps(weights + 16), w3 = _mm256_loadu_ps(weights + 24);
#pragma GCC unroll 3
    for (int r = 0; r < ROWS; ++r) {
      const __m256 value = _mm256_broadcast_ss(x + r * x_stride + k);
      acc0[r] = _mm256_fmadd_ps(value, w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(value, w1, acc1[r]);
      acc2[r] = _mm256_fmadd_ps(value, w2, acc2[r]);
      acc3[r] = _mm256_fmadd_ps(value, w3, acc3[r]);
    }
  }
  column_masks(mask);
  const bool add_bias = finish && bias != nullptr;
  const __m256 b0 = add_bias ? _mm256_maskload_ps(bias, mask[0]) : _mm256_setzero_ps();
  const __m256 b1 = add_bias ? _mm256_maskload_ps(bias + 8, mask[1]) : _mm256_setzero_ps();
  const __m256 b2 = add_bias ? _mm256_maskload_ps(bias + 16, mask[2]) : _mm256_setzero_ps();
  const __m256 b3 = add_bias ? _mm256_maskload_ps(bias + 24, mask[3]) : _mm256_setzero_ps();
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r) {
    float* row_out = out + r * out_stride;
    _mm256_maskstore_ps(row_out, mask[0], finish ? _mm256_add_ps(acc0[r], b0) : acc0[r]);
    _mm256_maskstore_ps(row_out + 8, mask[1], finish ? _mm256_add_ps(acc1[r], b1) : acc1[r]);
    _mm256_maskstore_ps(row_out + 16, mask[2], finish ? _mm256_add_ps(acc2[r], b2) : acc2[r]);
    _mm256_maskstore_ps(row_out + 24, mask[3], finish ? _mm256_add_ps(acc3[r], b3) : acc3[r]);
  }
}

using TileFunction = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                              const char*, int64_t, bool, bool);
constexpr TileFunction kTiles[kTileRows + 1] = {nullptr,          multiply_tile_whole<1>, multiply_tile_whole<2>, multiply_tile_whole<3>,
                                                multiply_tile<4>, multiply_tile<5>, multiply_tile<6>};

#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SPLITSERVE_SMALL_GEMM_BFLOAT16 1

// bfloat16 x and weight, float32 sums: the weight as panels of 32 output columns, each k-pair of a panel one
// 128-byte row [32 columns][2] (dims 2j and 2j + 1 of every column side by side), so that VDPBF16PS multiplies a
// broadcast pair of x by 16 columns' pairs and adds both products to 16 float32 sums. ROWS rows x 32 columns in
// 2 x ROWS registers, a whole panel's depth in one call (at most 8 rows: one row tile, nothing to reuse); the
// weights ahead fetched into L2 as in the float32 tiles.
template <int ROWS>
void multiply_tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs, const float* bias,
                        int64_t columns, uint16_t* out, int64_t out_stride, const char* prefetch, int64_t lines) {
  const __mmask16 mask_low = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 mask_high = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  __m512 low[ROWS], high[ROWS];
  for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm512_setzero_ps();
  int64_t owed = 0, issued = 0;
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh w_low = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kPanelColumns);
    const __m512bh w_high = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kPanelColumns + 32);
    for (owed += lines; owed >= pairs; owed -= pairs) _mm_prefetch(prefetch + issued++ * kCacheLine, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * j, sizeof(pair));
      const __m512bh value = (__m512bh)_mm512_set1_epi32(pair);
      low[r] = _mm512_dpbf16_ps(low[r], value, w_low);
      high[r] = _mm512_dpbf16_ps(high[r], value, w_high);
    }
  }
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias_low = _mm512_maskz_loadu_ps(mask_low, bias);
    bias_high = _mm512_maskz_loadu_ps(mask_high, bias + 16);
  }
  for (int r = 0; r < ROWS; ++r) {  // rounded to bfloat16 once, as oneDNN rounds its float32 sums
    _mm256_mask_storeu_epi16(out + r * out_stride, mask_low, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(low[r], bias_low)));
    _mm256_mask_storeu_epi16(out + r * out_stride + 16, mask_high,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(high[r], bias_high)));
  }
}

using TileFunctionBFloat16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, int64_t,
                                      uint16_t*, int64_t, const char*, int64_t);
constexpr int64_t kTileRowsBFloat16 = 8;
constexpr TileFunctionBFloat16 kTilesBFloat16[kTileRowsBFloat16 + 1] = {
    nullptr, multiply_tile_bf16<1>, multiply_tile_bf16<2>, multiply_tile_bf16<3>, multiply_tile_bf16<4>,
    multiply_tile_bf16<5>, multiply_tile_bf16<6>, multiply_tile_bf16<7>, multiply_tile_bf16<8>};

#endif

// The panel loop both small GEMMs share. Each thread takes a contiguous run of panels, so that its weight reads
// are one sequential stream, and walks each panel in k-blocks of block_steps steps (a step is one 128-byte row of
// a panel: 32 floats, or one pair of 32 bfloat16 columns): every row tile of up to max_rows rows runs over a block
// before the next block starts, so the block is read from memory once and from L1 by the other tiles, and the sums
// go on where the last block left them (each output still one sum in k order, so the blocks change no result).
// While a block runs, the line `ahead` bytes further in the thread's stream is fetched into L2, the fetches spread
// evenly over the block's tiles and steps: a steady stream at the pace of the arithmetic. tile(rows, x, panel,
// steps, bias, columns, out, prefetch, lines, resume, finish) runs one row tile over one block.
//
// The float32 block is 16 KB of weights (128 steps), with a tile's x well inside a 32 KB L1, and the stream is
// fetched two blocks ahead. Measured otherwise (cpu_gemm.py --block-steps, SmolLM2's four projections, 30 cold
// weights each, alternating in one process):
//  - AMD with a 48 KB L1 (Zen 5): 24 KB blocks (192 steps) ran at 1.02-1.10x 128 steps' GFLOP/s at 32, 64 and
//    192 rows, 0.96-0.98x at 16 (medians of 9); 64 steps 0.86-0.96x, whole panels 0.86-1.10x.
//  - AMD with AVX-512 and a 32 KB L1 (Zen 4): whole panels, still fetched 32 KB ahead, ran at 1.03-1.20x at 64
//    and 192 rows and 1.00-1.06x at 8 and 16 (but 0.92x for the 576-deep up projection at 16 rows), medians of
//    7; fetched two whole panels ahead instead (144 KB for the 576-deep projections, 384 KB for the 1536-deep
//    down projection), they lost 15-21% there at 8 and 16 rows. So Zen 4 walks whole panels.
//  - Intel with AVX-512 and a 48 KB L1 (a 2-core Xeon of family 6 model 167, AMX): 32 KB blocks (256 steps) against
//    128 read 0.98-1.09x in cpu_gemm.py (medians of 7) and ran the offline workload 1.012x faster (4 alternating
//    pairs in one process, each pair faster; 384 steps the same as 256, whole panels 0.80-0.96x in cpu_gemm.py).
// set_small_gemm_block_steps changes the block for the process (0: whole panels), so that benchmarks/cpu_gemm.py
// times them in one run.
int64_t default_block_steps() {
  if (amd_with_l1d_of_at_least(48 * 1024)) return 192;
#ifdef __AVX512F__
  if (amd_cpu()) return 0;  // this build runs AVX-512: Zen 4 (Zen 3 has none, Zen 5 has the 48 KB L1)
  if (l1d_of_at_least(48 * 1024)) return 256;  // Intel (or another vendor) with AVX-512 and a 48 KB L1
#endif
  return 128;
}
constexpr int64_t kAheadBlocks = 2;
constexpr int64_t kWholePanelAheadSteps = 128;  // with whole panels, fetched as far ahead as two 16 KB blocks
std::atomic<int64_t> g_block_steps{default_block_steps()};

template <typename T, typename Tile>
void run_panels(const T* x_ptr, int64_t x_stride, int64_t rows, const T* panel_ptr, int64_t num_panels, int64_t steps,
                int64_t block_steps, int64_t ahead, const float* bias_ptr, T* out_ptr, int64_t out_features,
                int64_t max_rows, const Tile& tile) {
  constexpr int64_t step_elements = 128 / static_cast<int64_t>(sizeof(T));
  const int64_t panel_elements = steps * step_elements;
  const int64_t num_tiles = (rows + max_rows - 1) / max_rows;
  block_steps = std::min(block_steps, steps);
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t first = num_panels * thread / threads, last = num_panels * (thread + 1) / threads;
    const char* stream = reinterpret_cast<const char*>(panel_ptr + first * panel_elements);
    const char* stream_end = reinterpret_cast<const char*>(panel_ptr + last * panel_elements);
    // The first blocks have no block before them to fetch them.
    for (const char* line = stream; line < std::min(stream + ahead, stream_end); line += kCacheLine)
      __builtin_prefetch(line, 0, 2);  // prefetcht1: into L2
    for (int64_t p = first; p < last; ++p) {
      const T* panel = panel_ptr + p * panel_elements;
      const int64_t columns = std::min(kPanelColumns, out_features - p * kPanelColumns);
      for (int64_t k = 0; k < steps; k += block_steps) {
        const int64_t block = std::min(block_steps, steps - k);
        const char* fetch = reinterpret_cast<const char*>(panel + k * step_elements) + ahead;
        const int64_t fetch_lines = fetch >= stream_end ? 0 : std::min<int64_t>(block * 128, stream_end - fetch) / kCacheLine;
        const int64_t lines_per_tile = (fetch_lines + num_tiles - 1) / num_tiles;
        for (int64_t t = 0; t < num_tiles; ++t) {
          const int64_t row = t * max_rows, tile_rows = std::min(max_rows, rows - row);
          const int64_t line = std::min(fetch_lines, t * lines_per_tile);
          tile(tile_rows, x_ptr + row * x_stride + k * (step_elements / kPanelColumns), panel + k * step_elements,
               block, bias_ptr == nullptr ? nullptr : bias_ptr + p * kPanelColumns, columns,
               out_ptr + row * out_features + p * kPanelColumns, fetch + line * kCacheLine,
               std::min(fetch_lines, line + lines_per_tile) - line, k > 0, k + block == steps);
        }
      }
    }
  }
}

// The checks both small GEMMs make of out_features against the panels and of the bias (float32 [out_features] or
// empty); returns whether there is a bias.
bool check_output(int64_t num_panels, const at::Tensor& bias, int64_t out_features, const char* name) {
  TORCH_CHECK(out_features > (num_panels - 1) * kPanelColumns && out_features <= num_panels * kPanelColumns, name,
              ": out_features does not match the panels");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.dim() == 1 && bias.size(0) == out_features && bias.is_contiguous() &&
                            bias.scalar_type() == at::kFloat), name, ": bias must be float32 [out_features]");
  return has_bias;
}

}  // namespace

bool small_gemm_supported() {
#ifdef SPLITSERVE_SMALL_GEMM
  return true;
#else
  return false;
#endif
}

int64_t set_small_gemm_block_steps(int64_t steps) {
  TORCH_CHECK(steps >= -1, "set_small_gemm_block_steps: steps must be positive, 0 (whole panels) or -1 (this CPU's "
              "default), not ", steps);
  return g_block_steps.exchange(steps == -1 ? default_block_steps() : steps);
}

int64_t default_small_gemm_block_steps() { return default_block_steps(); }

// The most rows the engine sends to small_gemm; above it oneDNN's packed GEMM is ahead. With the weight cold, as
// in the engine (benchmarks/cpu_gemm.py, SmolLM2's four projections):
//  - AVX-512 (8 x 32 tiles): ahead from 1 row (1.4-2.3x) to 192 (0.97-1.22x) and even at 256, on a 2-core
//    Sapphire Rapids.
//  - AVX2 and FMA (6 x 16 tiles, a 2-core Zen 3 VM, medians of 7): the four together took 0.79x oneDNN's time at
//    48 rows, 0.89x at 64, 1.02x at 96, 1.21x at 128, 1.25x at 160 and 1.31x at 192, where oneDNN's AVX2 kernel
//    runs at 70-108 GFLOP/s against the small GEMM's 60-76 (the gate/up projection, 576 x 3072, crosses first:
//    0.95x oneDNN's speed at 64 rows, 0.67x at 128 and 192).
int64_t small_gemm_max_rows() {
#ifdef __AVX512F__
  return 192;
#elif defined(SPLITSERVE_SMALL_GEMM)
  return 96;
#else
  return 0;
#endif
}

at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels: a float32 [out, in] weight");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t num_panels = (out_features + kPanelColumns - 1) / kPanelColumns;
  auto padded = at::zeros({num_panels * kPanelColumns, in_features}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  // [panels, 32, in] -> [panels, in, 32]
  return padded.view({num_panels, kPanelColumns, in_features}).transpose(1, 2).contiguous();
}

at::Tensor small_gemm(at::Tensor x, at::Tensor panels, at::Tensor bias, int64_t out_features) {
  TORCH_CHECK(small_gemm_supported(), "small_gemm: built without AVX-512 or AVX2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "small_gemm: x must be float32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kPanelColumns, "small_gemm: panels must be contiguous float32 [panels, in, 32]");
  const int64_t rows = x.size(0), in_features = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == in_features, "small_gemm: x has ", in_features, " features, the weight ",
              panels.size(1));
  const bool has_bias = check_output(num_panels, bias, out_features, "small_gemm");
  auto out = at::empty({rows, out_features}, x.options());
#ifdef SPLITSERVE_SMALL_GEMM
  if (rows == 0) return out;
  const int64_t x_stride = x.stride(0);
  const int64_t block_steps = g_block_steps.load(std::memory_order_relaxed);
  const int64_t ahead_steps = std::min(in_features, block_steps == 0 ? kWholePanelAheadSteps : block_steps);
  run_panels(x.data_ptr<float>(), x_stride, rows, panels.data_ptr<float>(), num_panels, in_features,
             block_steps == 0 ? in_features : block_steps, kAheadBlocks * ahead_steps * 128,
             has_bias ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), out_features, kTileRows,
             [&](int64_t tile_rows, const float* x_tile, const float* panel, int64_t steps, const float* bias_tile,
                 int64_t columns, float* out_tile, const char* prefetch, int64_t lines, bool resume, bool finish) {
               kTiles[tile_rows](x_tile, x_stride, panel, steps, bias_tile, columns, out_tile, out_features, prefetch,
                                 lines, resume, finish);
             });
#endif
  return out;
}

}  // namespace splitserve

namespace splitserve {

bool small_gemm_bfloat16_supported() {
#ifdef SPLITSERVE_SMALL_GEMM_BFLOAT16
  return true;
#else
  return false;
#endif
}

// An nn.Linear weight [out, in] (bfloat16, in even) as [panels, in / 2, 64]: panel p, pair j holds, for each of
// the columns 32p .. 32p + 31 in turn, its dims 2j and 2j + 1 (zero past out_features).
at::Tensor pack_panels_bfloat16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0,
              "pack_panels_bfloat16: a bfloat16 [out, in] weight with an even number of input features");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t num_panels = (out_features + kPanelColumns - 1) / kPanelColumns;
  auto padded = at::zeros({num_panels * kPanelColumns, in_features}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  // [panels, 32, in / 2, 2] -> [panels, in / 2, 32, 2]
  return padded.view({num_panels, kPanelColumns, in_features / 2, 2}).transpose(1, 2).contiguous()
      .view({num_panels, in_features / 2, 2 * kPanelColumns});
}

// out = x @ weight^T (+ bias): x [rows, in] bfloat16 (rows contiguous), panels from pack_panels_bfloat16, bias
// float32 [out] or empty. Sums in float32 (pairs of products added in VDPBF16PS order), each output rounded to
// bfloat16 once. Returns [rows, out_features] bfloat16.
at::Tensor small_gemm_bfloat16(at::Tensor x, at::Tensor panels, at::Tensor bias, int64_t out_features) {
  TORCH_CHECK(small_gemm_bfloat16_supported(), "small_gemm_bfloat16: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "small_gemm_bfloat16: x must be bfloat16 [rows, in_features] with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.size(2) == 2 * kPanelColumns, "small_gemm_bfloat16: panels must be contiguous [panels, in / 2, 64]");
  const int64_t rows = x.size(0), in_features = x.size(1), num_panels = panels.size(0), pairs = panels.size(1);
  TORCH_CHECK(in_features == 2 * pairs, "small_gemm_bfloat16: x has ", in_features, " features, the weight ", 2 * pairs);
  TORCH_CHECK(x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "small_gemm_bfloat16: x's rows must start on 4-byte boundaries");
  const bool has_bias = check_output(num_panels, bias, out_features, "small_gemm_bfloat16");
  auto out = at::empty({rows, out_features}, x.options());
#ifdef SPLITSERVE_SMALL_GEMM_BFLOAT16
  if (rows == 0) return out;
  const int64_t x_stride = x.stride(0);
  run_panels(reinterpret_cast<const uint16_t*>(x.data_ptr()), x_stride, rows,
             reinterpret_cast<const uint16_t*>(panels.data_ptr()), num_panels, pairs, pairs, kAheadBlocks * pairs * 128,
             has_bias ? bias.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()), out_features,
             kTileRowsBFloat16,
             [&](int64_t tile_rows, const uint16_t* x_tile, const uint16_t* panel, int64_t steps, const float* bias_tile,
                 int64_t columns, uint16_t* out_tile, const char* prefetch, int64_t lines, bool, bool) {
               // One block of the whole depth (block_steps = pairs): every call starts and finishes its sums.
               kTilesBFloat16[tile_rows](x_tile, x_stride, panel, steps, bias_tile, columns, out_tile, out_features,
                                         prefetch, lines);
             });
#endif
  return out;
}

}  // namespace splitserve
