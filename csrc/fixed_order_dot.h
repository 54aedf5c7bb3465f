// The fixed-order dot product shared by the CPU matmul kernels (skinny_linear_cpu.cpp, on float32
// weights, and packed_linear_cpu.cpp, on weights stored as integer codes): 16 lanes, lane l
// accumulates fma(x[k], w[k], lane) for k = l, l + 16, ... in increasing k, then the lanes are
// summed by halving (l + 8, l + 4, l + 2, l + 1). Every kernel that follows it gives an output the
// same bits, whatever the instruction set, tile or thread.
#pragma once

#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

namespace swiftkern {
namespace cpu {

constexpr int kLanes = 16;

// AVX2 has 16 vector registers of 8 lanes and an output's 16 lanes take two accumulators, so a
// register tile of mr x rows by nr weight rows fits when 2 * mr * nr + 4 <= 16 (4 registers for
// the vectors the tile loads or builds beside the accumulators) -> the most weight rows, up to
// max_cols, a tile of mr x rows takes: with max_cols 4, 4 at one x row, 3 at two, 2 at three, then 1
constexpr int avx2_tile_cols(int mr, int max_cols) {
  int nr = max_cols;
  while (nr > 1 && 2 * mr * nr + 4 > 16) --nr;
  return nr;
}
static_assert(avx2_tile_cols(1, 4) == 4 && avx2_tile_cols(2, 4) == 3 && avx2_tile_cols(3, 4) == 2 &&
              avx2_tile_cols(4, 4) == 1 && avx2_tile_cols(6, 4) == 1);

static inline float reduce_lanes(float* lane) {
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] = lane[l] + lane[l + width];
  return lane[0];
}

#if defined(__x86_64__)
// reduce_lanes in registers: the same additions in the same order (l + 8, l + 4, l + 2, l + 1)
__attribute__((target("avx2"))) static inline float halving_sum_8x2(__m256 lo, __m256 hi) {
  const __m256 h8 = _mm256_add_ps(lo, hi);                                             // l + (l + 8)
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));  // + 4
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));                             // + 2
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));                     // + 1
}

__attribute__((target("avx512f,avx2"))) static inline float halving_sum_avx512(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return halving_sum_8x2(_mm512_castps512_ps256(v), hi);
}

// reduce_lanes of four accumulators at once, stored as y[0..4): the same additions in the same
// order (l + 8, l + 4, l + 2, l + 1), done on the four side by side after 128-bit shuffles
// rather than one horizontal sum each (3.5 instead of ~7 vector ops per output). SmolLM2's
// projections, six alternating runs of two builds: 128 rows 171.7 -> 164.8 ms, 32 rows ~4 %
// faster, 1-16 rows (bound by the weight stream) unchanged within the noise
__attribute__((target("avx512f"))) static inline void halving_sum_4_avx512(const __m512* a, float* y) {
  // +8: [a0 lanes 0-7 + 8-15 | a1 ...] and [a2 | a3]
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
  // +4: one 128-bit quarter per accumulator, lanes 0-3 + 4-7
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  // +2, then +1, within each quarter
  const __m512 t = _mm512_add_ps(r, _mm512_shuffle_ps(r, r, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u = _mm512_add_ps(t, _mm512_shuffle_ps(t, t, _MM_SHUFFLE(1, 1, 1, 1)));
  const __m512 lane0 = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u);
  _mm_storeu_ps(y, _mm512_castps512_ps128(lane0));
}

// reduce_lanes of sixteen accumulators at once -> lane i: a[i]'s sum, the same additions in the
// same order (l + 8, l + 4, l + 2, l + 1) as a transposing tree: 30 shuffles and 15 adds for 16
// sums, against 36 shuffles, 12 adds and the scalar stores of four halving_sum_4_avx512.
__attribute__((target("avx512f"))) static inline __m512 halving_sum_16_avx512(const __m512* a) {
  // the tree leaves sum b[n] in lane 4 * (n % 4) + n / 4, so b[n] = a[4 * (n % 4) + n / 4]
  // puts a[i]'s sum in lane i
  __m512 s[8], r[4], t[2];
  for (int p = 0; p < 8; ++p) {  // +8: [b(2p) lanes 0-7 + 8-15 | b(2p + 1) ...]
    const __m512 x = a[4 * ((2 * p) % 4) + (2 * p) / 4], y = a[4 * ((2 * p + 1) % 4) + (2 * p + 1) / 4];
    s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int p = 0; p < 4; ++p)  // +4: one quarter per accumulator, lanes 0-3 + 4-7
    r[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // +2 within each quarter: [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
    t[p] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * p], r[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * p], r[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // +1: [x, y, x', y'] per quarter
  return _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif

}  // namespace cpu
}  // namespace swiftkern
