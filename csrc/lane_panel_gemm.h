// The fixed-order matmul of fixed_order_dot.h as a GEMM: many x rows (a prefill) on AVX2.
//
// fixed_order_dot.h sums lane l of an output over k = l, l + 16, ... in increasing k. Reorder k
// lane by lane (all of lane 0's k, then lane 1's, ...) and each lane becomes an ordinary
// contiguous piece of the reduction: a GEMM over that piece, started from zero, is exactly the
// lane's chain of fmas. So x is packed lane-major ([row tile][lane][step][up to 6 rows, padded to
// 8]), each panel of 16 weight rows too ([lane][step][16 outputs]; packed_linear_cpu.cpp builds it
// straight from 4- or 8-bit codes), and a register tile of up to 6 x rows by 16 (at 6 rows 12
// accumulators, 2 weight loads and 6 broadcasts for 12 fmas a step: the classic AVX2 GEMM kernel)
// runs every lane's piece; the 16 lane sums of an output are then added by halving, vectorized
// across the 16 outputs of the panel. Every output keeps skinny_linear's bits; only the loads change.
//
// The dot-product tiles (skinny_linear_cpu.cpp) keep an output's 16 lanes in two registers, so
// AVX2 holds at most 2 x rows by 4 weight rows: 12 loads for 16 fmas, and the x block streamed
// from L2 per 4 weight rows. SmolLM2's 7 projections of a layer on a 2-core AMD EPYC (AVX2), ms
// at 64 / 130 / 512 rows: dot-product tiles 5.2-7.6 / 10.8-13.5 / 45-52, these panels 4.7-5.1
// (65 rows) / 7.2-9.0 / 31-33, MKL's sgemm 3.7-5.8 / 6.8-10.0 / 22-28 (alternating runs; this
// machine is noisy). The accumulators are named variables: as an array, GCC stored each one to
// the stack after every fma, and the panels ran 1.4x slower.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "exact_load.h"
#include "fixed_order_dot.h"

namespace swiftkern {
namespace cpu {

constexpr int kPanelRows = 6;               // x rows of a register tile
constexpr int kPanelCols = 16;              // weight rows (outputs) of a panel
// x rows past which AVX2 runs the panels: SmolLM2's 210 projections (30 layers, from memory), ms,
// float32 weights, dot-product tiles / panels: 20 rows 53-57 / 55-61, 24 rows 63-76 / 55-59, 28
// rows 71-74 / 63-69; with x tiles of 1-6 rows (one layer's projections x 30, from L3) 9 rows
// 33-35 / 48-56, 20 rows 65-74 / 70-88 (packed weights past 16 rows: packed_linear_cpu.cpp)
constexpr int64_t kPanelAboveRows = 20;

// Whether a call of M x rows with isa's kernels goes through the panels, past above_rows (AVX2
// only: AVX-512's dot-product tiles hold 6 x rows by 4 weight rows and keep up with MKL there)
inline bool panels_take(Isa isa, int64_t M, int64_t above_rows = kPanelAboveRows) {
  return isa == Isa::kAvx2 && M > above_rows;
}

// Steps of lane l over K inputs: k = l, l + 16, ... < K
inline int lane_steps(int64_t K, int l) { return l < K ? static_cast<int>((K - l + kLanes - 1) / kLanes) : 0; }

// x [M, K] packed lane-major in tiles of at most 6 rows: at(t, l)[j * 8 + i] = x[first_row(t) + i,
// l + 16j] for i < rows_of(t) (J = ceil(K / 16) steps a lane; the slots past a tile's rows, up to
// 8, zeros and unread, so that 8 x 8 transposes in registers write whole vectors), packed in tasks
// of tiles. The tiles are as equal as can be: 8 rows are two tiles of 4, not 6 + 2 (a 2-row tile
// has 4 accumulators, too few chains to keep the fma units busy), 26 are 5 + 5 + 5 + 5 + 6.
constexpr int kPackedRowStride = 8;
struct LanePackedX {
  int64_t M, K, J, tiles;
  std::unique_ptr<float[]> data;  // [tiles][16][J][8]

  LanePackedX(const float* x, int64_t M_, int64_t K_);
  const float* at(int64_t t, int l) const { return data.get() + (t * kLanes + l) * J * kPackedRowStride; }
  int64_t first_row(int64_t t) const { return t * M / tiles; }
  int rows_of(int64_t t) const { return static_cast<int>(first_row(t + 1) - first_row(t)); }
};

// Per-thread buffers of one panel: its weights lane-major and the 16 lane sums of a tile
struct PanelScratch {
  std::vector<float> w;     // [16 lanes][J][16 outputs]
  float sums[kLanes][kPanelRows][kPanelCols];
  explicit PanelScratch(int64_t J) : w(kLanes * J * kPanelCols) {}
};

#if defined(__x86_64__)
// sums[0..MR)[0..16) of one lane: a[j * 8 + i] (x) times w[j * 16 + c] over `steps` steps, from zero
template <int MR>
__attribute__((target("avx2,fma"))) static inline void panel_lane_avx2(const float* a, const float* w, int steps,
                                                                      float (*sums)[kPanelCols]) {
  static_assert(1 <= MR && MR <= kPanelRows, "a tile of 1 to 6 x rows");
  // named accumulators: in an array GCC kept them on the stack, one store per fma
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int j = 0; j < steps; ++j, a += kPackedRowStride, w += kPanelCols) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#define SWIFTKERN_PANEL_ROW(i)                     \
  if constexpr (i < MR) {                          \
    const __m256 xv = _mm256_broadcast_ss(a + i);  \
    c##i##0 = _mm256_fmadd_ps(xv, w0, c##i##0);    \
    c##i##1 = _mm256_fmadd_ps(xv, w1, c##i##1);    \
  }
    SWIFTKERN_PANEL_ROW(0) SWIFTKERN_PANEL_ROW(1) SWIFTKERN_PANEL_ROW(2)
    SWIFTKERN_PANEL_ROW(3) SWIFTKERN_PANEL_ROW(4) SWIFTKERN_PANEL_ROW(5)
#undef SWIFTKERN_PANEL_ROW
  }
#define SWIFTKERN_PANEL_STORE(i)        \
  if constexpr (i < MR) {               \
    _mm256_storeu_ps(sums[i], c##i##0);     \
    _mm256_storeu_ps(sums[i] + 8, c##i##1); \
  }
  SWIFTKERN_PANEL_STORE(0) SWIFTKERN_PANEL_STORE(1) SWIFTKERN_PANEL_STORE(2)
  SWIFTKERN_PANEL_STORE(3) SWIFTKERN_PANEL_STORE(4) SWIFTKERN_PANEL_STORE(5)
#undef SWIFTKERN_PANEL_STORE
}

using PanelLaneFn = void (*)(const float*, const float*, int, float (*)[kPanelCols]);
// panel_lane_avx2<mr> at [mr - 1]
static constexpr PanelLaneFn kPanelLanes[kPanelRows] = {panel_lane_avx2<1>, panel_lane_avx2<2>, panel_lane_avx2<3>,
                                                       panel_lane_avx2<4>, panel_lane_avx2<5>, panel_lane_avx2<6>};

// y[i * N + c] (i < mr, c < nr) = the halving sum (l + 8, + 4, + 2, + 1) of sums[l][i][c],
// eight outputs to a register
__attribute__((target("avx2"))) static inline void panel_halving_sums_avx2(const float (*sums)[kPanelRows][kPanelCols],
                                                                         float* y, int64_t N, int mr, int nr) {
  for (int i = 0; i < mr; ++i) {
    alignas(32) float row[kPanelCols];
    for (int h = 0; h < kPanelCols; h += 8) {
      __m256 v[kLanes];
      for (int l = 0; l < kLanes; ++l) v[l] = _mm256_loadu_ps(sums[l][i] + h);
      for (int width = kLanes / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) v[l] = _mm256_add_ps(v[l], v[l + width]);
      _mm256_store_ps(row + h, v[0]);
    }
    std::copy(row, row + nr, y + i * N);
  }
}

// Transposes the 8 x 8 floats r[0..8) in registers: r[q][i] <- r[i][q]
__attribute__((target("avx2"))) static inline void transpose_8x8_avx2(__m256* r) {
  __m256 t[8], u[8];
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
  }
  for (int p = 0; p < 2; ++p) {
    u[4 * p] = _mm256_shuffle_ps(t[4 * p], t[4 * p + 2], 0x44);
    u[4 * p + 1] = _mm256_shuffle_ps(t[4 * p], t[4 * p + 2], 0xEE);
    u[4 * p + 2] = _mm256_shuffle_ps(t[4 * p + 1], t[4 * p + 3], 0x44);
    u[4 * p + 3] = _mm256_shuffle_ps(t[4 * p + 1], t[4 * p + 3], 0xEE);
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2f128_ps(u[q], u[q + 4], 0x20);
    r[q + 4] = _mm256_permute2f128_ps(u[q], u[q + 4], 0x31);
  }
}

// Tile t of x (rows [6t, 6t + rows)) lane-major into out [16][J][8]
__attribute__((target("avx2"))) static inline void pack_x_tile_avx2(const float* src, int rows, int64_t K, int64_t J,
                                                                   float* out) {
  const int64_t whole = K / kLanes;
  for (int64_t j = 0; j < whole; ++j)
    for (int lb = 0; lb < kLanes; lb += 8) {  // lanes lb..lb + 8 of step j: an 8 x 8 transpose
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = i < rows ? _mm256_loadu_ps(src + i * K + j * kLanes + lb) : _mm256_setzero_ps();
      transpose_8x8_avx2(r);
      for (int q = 0; q < 8; ++q) _mm256_storeu_ps(out + ((lb + q) * J + j) * kPackedRowStride, r[q]);
    }
  for (int l = 0; whole < J && l < K - whole * kLanes; ++l)  // the K % 16 tail
    for (int i = 0; i < kPackedRowStride; ++i)
      out[(l * J + whole) * kPackedRowStride + i] = i < rows ? src[i * K + whole * kLanes + l] : 0.f;
}

inline LanePackedX::LanePackedX(const float* x, int64_t M_, int64_t K_)
    : M(M_), K(K_), J((K_ + kLanes - 1) / kLanes), tiles((M_ + kPanelRows - 1) / kPanelRows),
      data(new float[tiles * kLanes * J * kPackedRowStride]) {
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      pack_x_tile_avx2(x + first_row(t) * K, rows_of(t), K, J, data.get() + t * kLanes * J * kPackedRowStride);
  });
}

// Weight rows w [nr, K] (stride K, elements of W, loaded exactly as fp32) -> out[(l * J + j) * 16 + c]
// = w[c, l + 16j], zeros for c >= nr: 8 x 8 blocks transposed in registers, the K % 16 tail by element
template <class W>
__attribute__((target("avx2,f16c"))) static void pack_panel_weights_avx2(const W* w, int nr, int64_t K, int64_t J,
                                                                       float* out) {
  const int64_t whole = K / kLanes;
  for (int cb = 0; cb < kPanelCols; cb += 8)
    for (int64_t j = 0; j < whole; ++j)
      for (int lb = 0; lb < kLanes; lb += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i)
          r[i] = cb + i < nr ? load8(w + (cb + i) * K + j * kLanes + lb) : _mm256_setzero_ps();
        transpose_8x8_avx2(r);
        for (int q = 0; q < 8; ++q) _mm256_storeu_ps(out + ((lb + q) * J + j) * kPanelCols + cb, r[q]);
      }
  for (int l = 0; whole < J && l < K - whole * kLanes; ++l)
    for (int c = 0; c < kPanelCols; ++c)
      out[(l * J + whole) * kPanelCols + c] = c < nr ? static_cast<float>(w[c * K + whole * kLanes + l]) : 0.f;
}

// Outputs y[:, 0:nr) (row stride N; nr <= 16) of x (packed) against the panel's weights already
// lane-major in s.w
static inline void panel_tiles_avx2(const LanePackedX& x, PanelScratch& s, int nr, float* y, int64_t N) {
  for (int64_t t = 0; t < x.tiles; ++t) {
    const int mr = x.rows_of(t);
    const PanelLaneFn lane_fn = kPanelLanes[mr - 1];
    for (int l = 0; l < kLanes; ++l) lane_fn(x.at(t, l), s.w.data() + l * x.J * kPanelCols, lane_steps(x.K, l), s.sums[l]);
    panel_halving_sums_avx2(s.sums, y + x.first_row(t) * N, N, mr, nr);
  }
}

// y [M, N] (row stride N) for x [M, K]: x packed once, then the panels of 16 outputs in parallel
// tasks, each panel's weights put lane-major by pack_panel(n, nr, out [16][J][16]) (weight rows
// [n, n + nr); pack_panel_weights_avx2's layout) and run over every x tile. x is not cut into
// L2-sized blocks: with each panel's weights packed once a block, SmolLM2's projections (6
// layers, packed weights) at 130 / 512 / 2000 rows took 38-39 / 142-161 / 585-587 ms in one
// block, 40-55 / 150-203 / 615-775 in blocks of 256 KiB-1 MiB of packed x (x streams from L3
// well enough)
template <class PackPanel>
void for_panels(const float* x, float* y, int64_t M, int64_t K, int64_t N, const PackPanel& pack_panel) {
  const LanePackedX packed(x, M, K);
  at::parallel_for(0, (N + kPanelCols - 1) / kPanelCols, 1, [&](int64_t p0, int64_t p1) {
    PanelScratch scratch(packed.J);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanelCols;
      const int nr = static_cast<int>(std::min<int64_t>(kPanelCols, N - n));
      pack_panel(n, nr, scratch.w.data());
      panel_tiles_avx2(packed, scratch, nr, y + n, N);
    }
  });
}

#endif

}  // namespace cpu
}  // namespace swiftkern
