// skinny_linear on CPU: y = x @ w^T + b with every output a fixed-order fp32 dot product.
//
// The order of one output y[m, n] is defined by K alone: 16 lanes, lane l accumulates
// fma(x[k], w[k], lane) for k = l, l + 16, l + 32, ... in increasing k; the lanes are then
// summed by halving (l + 8, l + 4, l + 2, l + 1). Nothing depends on M, N, the tile an output
// falls in, the thread that computes it or the instruction set (AVX-512, AVX2 and the portable
// loop produce the same bits), so a row's result is the same alone or in any batch: the op is
// batch-invariant by construction and serves both the decode/verify projections (few rows) and
// the deterministic verifier's bi_matmul (any number of rows).
//
// Speed: the output is computed in register tiles of up to 6 x rows by 4 weight rows (AVX-512;
// AVX2: avx2_tile_cols), so each weight vector loaded feeds up to 6 FMAs and a verify pass of up
// to 6 tokens is one sweep over the weight (with tiles of 4 x rows, 5 and 6 rows took a second,
// load-bound sweep: SmolLM2's projections at 5 / 6 rows 24.9 / 26.3 ms -> 23.6 / 24.8, one row
// 20.5; tiles of 7-8 x rows by 3 gained nothing at 8 rows and lost 30 % at 16), and the first x
// tile prefetches the weight tile two ahead, so the weight streams from memory while earlier
// tiles compute. On AVX2 (16 registers: tiles of up to 3 x rows by 2-4 weight rows) a call of
// more than 20 rows, a prefill or a deterministic verify pass, runs as lane panels instead
// (lane_panel_gemm.h): the same sums as a 6 x 16 GEMM tile, where the dot-product tiles ran at
// ~0.7x MKL's speed.
//
// bfloat16 / float16 (x and weight of one dtype): the weight is read in its own dtype and loaded
// into fp32 exactly (exact_load.h), x is upcast once, and each output is rounded once at the end:
// y = skinny_linear(x.float(), w.float(), b.float()).to(dtype), bit for bit. The bits still
// depend on nothing but the row, so a bf16 model's verify pass reproduces its decode steps
// (with torch's bf16 matmul, one row and k + 1 rows summed in different orders, and
// self-speculation's output drifted from plain decoding's), and it streams half the bytes of an
// fp32 weight (oneDNN's bf16 matmul at one row: 72 us for 1536 x 576 against 33 us here from fp32).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "exact_load.h"
#include "fixed_order_dot.h"
#include "lane_panel_gemm.h"
#include "linear_call.h"
#include "op_checks.h"
#include "row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <optional>
#include <string>
#include <vector>

namespace swiftkern {
namespace cpu {

constexpr int kMaxTileRows = 6;  // x rows per register tile, at most (24 accumulators)
constexpr int kTileCols = 4;     // weight rows per register tile
// x rows per block of a many-row call (L2-resident). 64 KiB made blocks of 6 rows at K = 1536,
// so a verify pass of 8-16 tokens swept SmolLM2's down projection 2-3 times from memory: its
// projections at 8 / 12 / 16 rows took 23.2 / 29.2 / 31.5 ms, 21.8 / 28.0 / 30.2 with 256 KiB.
constexpr int64_t kRowBlockBytes = 256 * 1024;
constexpr int64_t kPrefetchTiles = 2;  // weight tiles prefetched ahead of the one in use (measured best of 1, 2, 3, 6)

#if defined(__x86_64__)
// The weight tile ahead is asked into L2 (T1), not L1 (T0): SmolLM2's 210 projections at one row,
// random float32 / bf16 weights from memory, AMD EPYC Zen 4, 2 threads, alternating processes:
// float32 20.3-26.2 -> 14.6-16.2 ms (~20 -> ~27 GB/s; a plain sum reads 31 GB/s here), bf16
// 14.6-16.3 -> 10.3-10.9 ms; faster in every pair at 1, 4 and 8 rows with the AVX2 tiles too. An
// L1 prefetch holds one of the core's few L1 miss buffers until its line arrives; the L2 takes
// many more requests in flight. (The packed tiles, bound by their instructions, gained nothing.)
inline void prefetch_weight_line(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#endif

// One tile: rows x[0..MR) (stride K) against weight rows w[0..NR) (stride K, elements of W) -> y
// (stride N); pf: a weight tile to prefetch, or nullptr.
template <int MR, int NR, class W>
static void tile_portable(const float* x, const W* w, float* y, int64_t K, int64_t N, const W* pf) {
  (void)pf;
  float lane[MR][NR][kLanes] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int l = static_cast<int>(k % kLanes);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        lane[i][j][l] = std::fma(x[i * K + k], static_cast<float>(w[j * K + k]), lane[i][j][l]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = reduce_lanes(lane[i][j]);
}

#if defined(__x86_64__)
template <int MR, int NR, class W>
__attribute__((target("avx512f"))) static void tile_avx512(const float* x, const W* w, float* y, int64_t K,
                                                           int64_t N, const W* pf) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (pf)
      for (int j = 0; j < NR; ++j) prefetch_weight_line(pf + j * K + k);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load16(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {  // the tail: masked lanes keep their sums unchanged, as in the portable loop
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load16_masked(w + j * K + k, mask);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_mask3_fmadd_ps(xv, wv[j], acc[i][j], mask);
    }
  }
  if constexpr (NR == 4) {
    for (int i = 0; i < MR; ++i) halving_sum_4_avx512(acc[i], y + i * N);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) y[i * N + j] = halving_sum_avx512(acc[i][j]);
  }
}

// AVX2: lanes 0-7 and 8-15 of an output in two registers; tiles of at most 12 accumulators
// (avx2_tile_cols).
template <int MR, int NR, class W>
__attribute__((target("avx2,fma,f16c"))) static void tile_avx2(const float* x, const W* w, float* y, int64_t K,
                                                               int64_t N, const W* pf) {
  __m256 lo[MR][NR], hi[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (pf)
      for (int j = 0; j < NR; ++j) prefetch_weight_line(pf + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 x0 = _mm256_loadu_ps(x + i * K + k), x1 = _mm256_loadu_ps(x + i * K + k + 8);
      for (int j = 0; j < NR; ++j) {
        lo[i][j] = _mm256_fmadd_ps(x0, load8(w + j * K + k), lo[i][j]);
        hi[i][j] = _mm256_fmadd_ps(x1, load8(w + j * K + k + 8), hi[i][j]);
      }
    }
  }
  float lane[kLanes];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      if (k == K) {  // no tail: reduce in registers
        y[i * N + j] = halving_sum_8x2(lo[i][j], hi[i][j]);
        continue;
      }
      _mm256_storeu_ps(lane, lo[i][j]);
      _mm256_storeu_ps(lane + 8, hi[i][j]);
      for (int64_t t = k; t < K; ++t)
        lane[t - k] = std::fma(x[i * K + t], static_cast<float>(w[j * K + t]), lane[t - k]);
      y[i * N + j] = reduce_lanes(lane);
    }
}
#endif

// AVX2 tiles (avx2_tile_cols, fixed_order_dot.h: at most 12 accumulators beside the x and weight
// vectors): up to 3 x rows by 4 / 3 / 2 weight rows, a call's rows in near-equal groups.
// SmolLM2's 7 projections of a layer on a 2-core AMD EPYC (AVX2), one process alternating the
// tilings, medians of 15, ms at 2 / 4 / 8 / 12 / 16 / 20 rows:
// 2 x rows by 4 weight rows always (16 accumulators: spilled; the tiling until 2026-11-29)
// float32 0.37 / 0.55 / 0.93 / 1.64 / 2.04 / 2.43, bf16 0.37 / 0.82 / 1.23 / 1.53 / 2.42 / 2.85;
// these tiles 0.35 / 0.57 / 0.78 / 1.44 / 1.96 / 2.31 and 0.34 / 0.73 / 1.03 / 1.28 / 2.06 / 2.34;
// groups of up to 4 (4 x 1 tiles) 0.35 / 0.52 / 0.84 / 1.46 / 2.11 / 2.66 and 0.33 / 0.60 / 1.08 /
// 1.42 / 2.19 / 2.56 (x re-read from L2 for every weight row past ~12 rows).
constexpr int kAvx2MaxTileRows = 3;

template <class W>
using TileFn = void (*)(const float*, const W*, float*, int64_t, int64_t, const W*);

template <int MR, int NR, class W>
static TileFn<W> tile_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return tile_avx512<MR, NR, W>;
  if (isa == Isa::kAvx2) {
    if constexpr (MR <= kAvx2MaxTileRows && NR <= avx2_tile_cols(MR, kTileCols)) return tile_avx2<MR, NR, W>;
    return nullptr;  // more accumulators than AVX2's registers hold: fixed_order_linear never calls it
  }
#endif
  (void)isa;
  return tile_portable<MR, NR, W>;
}

template <int MR, class W>
static void fill_row(Isa isa, TileFn<W>* row) {
  row[0] = tile_for<MR, 1, W>(isa); row[1] = tile_for<MR, 2, W>(isa); row[2] = tile_for<MR, 3, W>(isa);
  row[3] = tile_for<MR, 4, W>(isa);
}

// The tiles of one instruction set for weights of type W
template <class W>
struct TileTable {
  TileFn<W> fn[kMaxTileRows][kTileCols];  // [MR - 1][NR - 1]
  int max_rows;                           // x rows per tile this ISA takes at once
  int cols[kMaxTileRows];                 // [MR - 1]: weight rows a tile of MR x rows takes
  bool equal_groups;                      // a block's x rows in near-equal tiles (else max_rows and the rest)
  explicit TileTable(Isa isa)
      : max_rows(isa == Isa::kAvx2 ? kAvx2MaxTileRows : isa == Isa::kAvx512 ? kMaxTileRows : 4),
        equal_groups(isa == Isa::kAvx2) {
    fill_row<1, W>(isa, fn[0]); fill_row<2, W>(isa, fn[1]); fill_row<3, W>(isa, fn[2]);
    fill_row<4, W>(isa, fn[3]); fill_row<5, W>(isa, fn[4]); fill_row<6, W>(isa, fn[5]);
    for (int mr = 1; mr <= kMaxTileRows; ++mr)
      cols[mr - 1] = isa == Isa::kAvx2 ? avx2_tile_cols(mr, kTileCols) : kTileCols;
  }
};

// x rows per block of an M-row call: ~kRowBlockBytes of x, a whole number of tiles of up to
// max_rows rows
static int64_t row_block(int max_rows, int64_t M, int64_t K) {
  const int64_t mr_max = std::min<int64_t>(max_rows, M);
  return std::max<int64_t>(mr_max, (kRowBlockBytes / (K * 4)) / mr_max * mr_max);
}

// Outputs y[:, n_begin:n_end): one weight tile (4 rows) at a time, every x tile against it,
// so each weight row comes from memory once and is then read from L1 (x, a few rows, stays in
// L1/L2); the weight is walked in order, which the hardware prefetcher streams. Past
// kRowBlock rows (a prefill) the x rows go in blocks that stay in L2 while the weight range is
// swept once per block: without blocks every weight tile streamed all of x from L3 or memory
// (a SmolLM2 prefill of 8 x 164 tokens ran at ~130 GFLOP/s against MKL's ~310). A block
// changes which outputs are computed together, never the order of one output's sum.
template <class W>
static void fixed_order_linear(const TileTable<W>& table, const float* x, const W* w, float* y, int64_t M,
                               int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t block = row_block(table.max_rows, M, K);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    // AVX2: the block's rows in near-equal groups of at most max_rows (4 rows: 2 + 2, not 3 + 1,
    // whose one-row tile would take the weight tile again for little work), the weight tile as
    // wide as the largest group's; other ISAs: groups of max_rows and the rest
    const int64_t groups = (m1 - m0 + table.max_rows - 1) / table.max_rows;
    const int group = table.equal_groups ? static_cast<int>((m1 - m0 + groups - 1) / groups)
                                         : static_cast<int>(std::min<int64_t>(table.max_rows, m1 - m0));
    const int nr_max = table.cols[group - 1];
    for (int64_t n = n_begin; n < n_end; n += nr_max) {
      const int nr = static_cast<int>(std::min<int64_t>(nr_max, n_end - n));
      for (int64_t m = m0; m < m1; m += group) {
        const int mr = static_cast<int>(std::min<int64_t>(group, m1 - m));
        // the first x tile asks for the weight tile kPrefetchTiles ahead, so it arrives while
        // this one is used; past the end of this task's range nothing is prefetched
        const int64_t ahead = n + kPrefetchTiles * nr_max;
        const W* pf = (m == m0 && ahead + nr_max <= n_end) ? w + ahead * K : nullptr;
        table.fn[mr - 1][nr - 1](x + m * K, w + n * K, y + m * N + n, K, N, pf);
      }
    }
  }
}

template <class W>
static const TileTable<W>& table_for(Isa isa) {
  static const TileTable<W> avx512(Isa::kAvx512), avx2(Isa::kAvx2), portable(Isa::kPortable);
  return isa == Isa::kAvx512 ? avx512 : isa == Isa::kAvx2 ? avx2 : portable;
}

// y[:, n_begin:n_end) (row stride N) from float32 weight rows w_rows [n_end - n_begin, K], with
// the tiles of `isa`: packed_linear_cpu.cpp runs it on weight tiles it has unpacked into L1
void fixed_order_rows(Isa isa, const float* x, const float* w_rows, float* y, int64_t M, int64_t K, int64_t N,
                      int64_t n_begin, int64_t n_end) {
  fixed_order_linear(table_for<float>(isa), x, w_rows, y + n_begin, M, K, N, 0, n_end - n_begin);
}

int64_t fixed_order_row_block(Isa isa, int64_t M, int64_t K) {
  return row_block(table_for<float>(isa).max_rows, M, K);
}

}  // namespace cpu

// Weight tiles (kTileCols weight rows each) of a task: ~128 KiB of float32 weight
static int64_t skinny_grain(int64_t K) { return std::max<int64_t>(1, 32768 / (cpu::kTileCols * K)); }

// y [M, N] = x [M, K] @ w [N, K]^T with the tiles of isa for weights of type W, in tasks of
// whole weight tiles
template <class W>
static void fixed_order_matmul(cpu::Isa isa, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
#if defined(__x86_64__)
  if (cpu::panels_take(isa, M)) {  // a prefill on AVX2: lane panels of 16 weight rows (lane_panel_gemm.h)
    const int64_t J = (K + cpu::kLanes - 1) / cpu::kLanes;
    cpu::for_panels(x, y, M, K, N, [&](int64_t n, int nr, float* out) { cpu::pack_panel_weights_avx2(w + n * K, nr, K, J, out); });
    return;
  }
#endif
  const cpu::TileTable<W>& table = cpu::table_for<W>(isa);
  constexpr int nr = cpu::kTileCols;
  const int64_t tiles = (N + nr - 1) / nr;
  at::parallel_for(0, tiles, skinny_grain(K), [&](int64_t t0, int64_t t1) {
    cpu::fixed_order_linear(table, x, w, y, M, K, N, t0 * nr, std::min(N, t1 * nr));
  });
}

template <class W>
void cpu::skinny_linear_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y) {
  static const Isa isa = pick_isa();
  fixed_order_matmul(isa, x, w, y, M, K, N);
}

cpu::TileSplit cpu::skinny_linear_split(int64_t M, int64_t K, int64_t N) {
  if (panels_take(pick_isa(), M)) return {0, 0};
  return {(N + kTileCols - 1) / kTileCols, skinny_grain(K)};
}

template <class W>
void cpu::skinny_linear_tiles(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t t0,
                              int64_t t1) {
  static const Isa isa = pick_isa();
  fixed_order_linear(table_for<W>(isa), x, w, y, M, K, N, t0 * kTileCols, std::min(N, t1 * kTileCols));
}

namespace cpu {
#define INSTANTIATE(W)                                                                                  \
  template void skinny_linear_rows<W>(const float*, int64_t, int64_t, const W*, int64_t, float*);    \
  template void skinny_linear_tiles<W>(const float*, int64_t, int64_t, const W*, int64_t, float*, int64_t, \
                                       int64_t);
SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE)
#undef INSTANTIATE
}  // namespace cpu

static at::Tensor skinny_linear_with(cpu::Isa isa, const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear_cpu: tensors must be on the CPU");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(checks::is_float_dtype(dtype) && weight.scalar_type() == dtype,
              "skinny_linear: x and weight must be float32, bfloat16 or float16, one dtype, got ", dtype, " and ",
              weight.scalar_type(), " (convert one to the other's dtype)");
  TORCH_CHECK(weight.dim() == 2, "skinny_linear: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
              "skinny_linear: x [..., K] must match weight [N, K]: got ", x.sizes(), " and ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  LinearCall call = linear_call("skinny_linear", x, N, bias);
  if (call.trivial(K)) return call.finish();
  const at::Tensor xc = x.to(at::kFloat).contiguous(), wc = weight.contiguous();  // x: [M, K] fp32, exact
  const float* xp = xc.data_ptr<float>();
  float* yp = call.y.data_ptr<float>();
  if (dtype == at::kFloat)
    fixed_order_matmul(isa, xp, wc.data_ptr<float>(), yp, call.M, K, N);
  else if (dtype == at::kBFloat16)
    fixed_order_matmul(isa, xp, wc.data_ptr<at::BFloat16>(), yp, call.M, K, N);
  else
    fixed_order_matmul(isa, xp, wc.data_ptr<at::Half>(), yp, call.M, K, N);
  return call.finish();
}

// x: [..., K] and weight: [N, K], both float32, bfloat16 or float16; bias: [N] of the same dtype
// or None -> [..., N] of that dtype, each element a fixed-order fp32 dot product (+ bias),
// rounded once; the widest ISA the CPU has
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias) {
  static const cpu::Isa isa = cpu::pick_isa();
  return skinny_linear_with(isa, x, weight, bias);
}

// The same with a named instruction set ("avx512", "avx2", "portable"), for the test that all
// of them give the same bits; isas: the ones this CPU runs, widest first.
at::Tensor skinny_linear_isa(const at::Tensor& x, const at::Tensor& weight, const std::string& isa) {
  return skinny_linear_with(checks::named_isa("skinny_linear_isa", isa), x, weight, std::nullopt);
}

std::vector<std::string> skinny_linear_isas() {
  std::vector<std::string> out;
  for (cpu::Isa i : cpu::kIsas)
    if (cpu::isa_supported(i)) out.push_back(cpu::isa_name(i));
  return out;
}

}  // namespace swiftkern
