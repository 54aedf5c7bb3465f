// exp(x) in float32 with the same bits for an element wherever it sits, on any x86 ISA: the
// arithmetic of reference.bi_exp, operation for operation (each one exactly rounded IEEE
// float32, no fused multiply-add: setup.py compiles with -ffp-contract=off):
//   t = clamp(x, -87, 88); n = round_half_even(t * log2 e); r = (t - n * ln2_hi) - n * ln2_lo;
//   p = Horner over the degree-7 Taylor coefficients of exp (p = p * r + c);
//   exp = p * 2^n (2^n from its exponent bits); 0 where x < -87; NaN where x is NaN.
// Used by bi_exp and bi_max_exp_sum (the deterministic verifier's softmax) and the CPU attention kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"

namespace swiftkern {
namespace cpu {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2Hi = 0.693145751953125f;
inline constexpr float kLn2Lo = 1.4286068203094172e-06f;
inline constexpr float kLow = -87.0f, kHigh = 88.0f;
inline constexpr float kTaylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline float bi_exp_one(float x) {
  if (x != x) return x;  // NaN stays NaN, as torch.clamp keeps it (fmax would clamp it to kLow)
  const float t = std::fmin(std::fmax(x, kLow), kHigh);
  const float n = std::nearbyint(t * kLog2e);  // default rounding: half to even, as torch.round
  const float r = (t - n * kLn2Hi) - n * kLn2Lo;
  float p = kTaylor[0];
  for (int i = 1; i < 8; ++i) p = p * r + kTaylor[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < kLow ? 0.0f : p * scale;
}

inline void bi_exp_scalar(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bi_exp_one(x[i]);
}

#if defined(__x86_64__)
// 16 lanes of bi_exp_one, same bits
__attribute__((target("avx512f"))) inline __m512 bi_exp_avx512_vec(__m512 v) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kLow), _CMP_LT_OQ);
  // max / min return their second operand where one is NaN: v there, so NaN stays NaN (the reference's clamp)
  const __m512 t = _mm512_min_ps(_mm512_set1_ps(kHigh), _mm512_max_ps(_mm512_set1_ps(kLow), v));
  const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(t, _mm512_mul_ps(nf, _mm512_set1_ps(kLn2Hi))),
                                 _mm512_mul_ps(nf, _mm512_set1_ps(kLn2Lo)));
  __m512 p = _mm512_set1_ps(kTaylor[0]);
  for (int c = 1; c < 8; ++c) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kTaylor[c]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nf), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mask_mov_ps(out, tiny, _mm512_setzero_ps());
}

__attribute__((target("avx512f"))) inline void bi_exp_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, bi_exp_avx512_vec(_mm512_loadu_ps(x + i)));
  bi_exp_scalar(x + i, y + i, n - i);
}

// 8 lanes of bi_exp_one, same bits (the operations of bi_exp_avx512_vec)
__attribute__((target("avx2"))) inline __m256 bi_exp_avx2_vec(__m256 v) {
  const __m256 tiny = _mm256_cmp_ps(v, _mm256_set1_ps(kLow), _CMP_LT_OQ);
  const __m256 t = _mm256_min_ps(_mm256_set1_ps(kHigh), _mm256_max_ps(_mm256_set1_ps(kLow), v));
  const __m256 nf = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(t, _mm256_mul_ps(nf, _mm256_set1_ps(kLn2Hi))),
                                 _mm256_mul_ps(nf, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kTaylor[0]);
  for (int c = 1; c < 8; ++c) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kTaylor[c]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

__attribute__((target("avx2"))) inline void bi_exp_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, bi_exp_avx2_vec(_mm256_loadu_ps(x + i)));
  bi_exp_scalar(x + i, y + i, n - i);
}

// y = bi_exp(x - shift): the subtraction is one IEEE operation per element, as torch's x - shift
__attribute__((target("avx512f"))) inline void bi_exp_shifted_avx512(const float* x, float shift, float* y,
                                                                      int64_t n) {
  const __m512 s = _mm512_set1_ps(shift);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {  // four independent vectors a round: the polynomial's chains overlap
    const __m512 a = bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
    const __m512 b = bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), s));
    const __m512 c = bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(x + i + 32), s));
    const __m512 d = bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(x + i + 48), s));
    _mm512_storeu_ps(y + i, a);
    _mm512_storeu_ps(y + i + 16, b);
    _mm512_storeu_ps(y + i + 32, c);
    _mm512_storeu_ps(y + i + 48, d);
  }
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(x + i), s)));
  for (; i < n; ++i) y[i] = bi_exp_one(x[i] - shift);
}

__attribute__((target("avx2"))) inline void bi_exp_shifted_avx2(const float* x, float shift, float* y, int64_t n) {
  const __m256 s = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, bi_exp_avx2_vec(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  for (; i < n; ++i) y[i] = bi_exp_one(x[i] - shift);
}
#endif

inline void bi_exp_shifted_scalar(const float* x, float shift, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bi_exp_one(x[i] - shift);
}

using ExpFn = void (*)(const float* x, float* y, int64_t n);  // y[i] = exp(x[i]), i < n

// isa's implementation (all give the same bits)
inline ExpFn exp_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return bi_exp_avx512;
  if (isa == Isa::kAvx2) return bi_exp_avx2;
#endif
  (void)isa;
  return bi_exp_scalar;
}

// the widest implementation this CPU runs
inline ExpFn pick_exp() { return exp_for(pick_isa()); }

using ShiftedExpFn = void (*)(const float* x, float shift, float* y, int64_t n);  // y[i] = exp(x[i] - shift)

inline ShiftedExpFn shifted_exp_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return bi_exp_shifted_avx512;
  if (isa == Isa::kAvx2) return bi_exp_shifted_avx2;
#endif
  (void)isa;
  return bi_exp_shifted_scalar;
}

}  // namespace cpu
}  // namespace swiftkern
