// fp32 values rounded into the model's element type (float, bfloat16, float16) as c10's scalar
// conversion rounds them, 16 or 8 at a time, and rows widened and narrowed with them: the
// counterpart of exact_load.h. A kernel that stores through these gives the bits of its scalar
// loop (static_cast<E>) in its vector body, so an element's result does not depend on where it
// sits. bf16: round to nearest even on the bits (c10's round_to_nearest_even); fp16: F16C's
// vcvtps2ph in round-to-nearest-even, IEEE like c10's software conversion (subnormal results and
// overflow to infinity included). A vector holding a NaN is stored by the scalar conversion
// (c10 makes every bf16 NaN 0x7FC0 and every fp16 NaN sign | 0x7E00, where the instructions keep
// the payload).
//
// Why: a bf16 SmolLM2 decode step converted its projections' fp32 outputs element by element
// and ran silu_mul's scalar loop (the vector bodies were float32 only): silu_mul of 1536 bf16
// elements took 18 us against 6 us in float32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "exact_load.h"

namespace swiftkern {
namespace cpu {

#if defined(__x86_64__)
// The 16 values of v into p[0..16) as static_cast<E> makes each
template <class E>
__attribute__((target("avx512f"))) inline void store16(E* p, __m512 v) {
  if constexpr (std::is_same_v<E, float>) {
    _mm512_storeu_ps(p, v);
  } else {
    if (__builtin_expect(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0, 0)) {
      alignas(64) float lane[16];
      _mm512_store_ps(lane, v);
      for (int i = 0; i < 16; ++i) p[i] = static_cast<E>(lane[i]);
      return;
    }
    __m256i out;
    if constexpr (std::is_same_v<E, c10::BFloat16>) {
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
      out = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16));
    } else {
      out = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
  }
}

// The 8 values of v into p[0..8) as static_cast<E> makes each
template <class E>
__attribute__((target("avx2,f16c"))) inline void store8(E* p, __m256 v) {
  if constexpr (std::is_same_v<E, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0, 0)) {
      alignas(32) float lane[8];
      _mm256_store_ps(lane, v);
      for (int i = 0; i < 8; ++i) p[i] = static_cast<E>(lane[i]);
      return;
    }
    __m128i out;
    if constexpr (std::is_same_v<E, c10::BFloat16>) {
      const __m256i bits = _mm256_castps_si256(v);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
      const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);  // [0, 0xFFFF]: packs unsaturated
      out = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    } else {
      out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
  }
}

// The whole vectors of [0, n): how many elements they hold (the scalar loop takes the rest). The
// index is a local: taken by reference, GCC stored and reloaded it around every vector store
// (which may alias it); timed, that cost nothing measurable on a Zen 4, but the loop is tighter.
template <class E>
__attribute__((target("avx512f"))) inline int64_t round_rows_avx512(const float* src, int64_t n, E* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(dst + i, _mm512_loadu_ps(src + i));
  return i;
}
template <class E>
__attribute__((target("avx2,f16c"))) inline int64_t round_rows_avx2(const float* src, int64_t n, E* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
  return i;
}
template <class E>
__attribute__((target("avx512f"))) inline int64_t widen_rows_avx512(const E* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
  return i;
}
template <class E>
__attribute__((target("avx2,f16c"))) inline int64_t widen_rows_avx2(const E* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  return i;
}
#endif

// The element types the vectors load and store (the dispatch macros' double is not one of them)
template <class E>
constexpr bool kVectorElement =
    std::is_same_v<E, float> || std::is_same_v<E, c10::BFloat16> || std::is_same_v<E, c10::Half>;

// dst[i] = static_cast<E>(src[i]), i < n, with the vectors of isa
template <class E>
inline void round_rows(Isa isa, const float* src, int64_t n, E* dst) {
  int64_t i = 0;
#if defined(__x86_64__)
  if constexpr (kVectorElement<E>) {
    if (isa == Isa::kAvx512) i = round_rows_avx512(src, n, dst);
    if (isa == Isa::kAvx2) i = round_rows_avx2(src, n, dst);
  }
#endif
  (void)isa;
  for (; i < n; ++i) dst[i] = static_cast<E>(src[i]);
}

// dst[i] = static_cast<float>(src[i]) (exact), i < n, with the vectors of isa
template <class E>
inline void widen_rows(Isa isa, const E* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__x86_64__)
  if constexpr (kVectorElement<E>) {
    if (isa == Isa::kAvx512) i = widen_rows_avx512(src, n, dst);
    if (isa == Isa::kAvx2) i = widen_rows_avx2(src, n, dst);
  }
#endif
  (void)isa;
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace cpu
}  // namespace swiftkern
