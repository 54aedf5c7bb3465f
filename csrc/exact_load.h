// Loads of float32, bfloat16 or float16 elements into fp32 registers, exactly: bf16 by moving its
// bits into the high half of each lane, fp16 by vcvtph2ps. A kernel that loads its operands
// through these computes on bf16 / fp16 data with the fp32 kernel's arithmetic, so its result is
// the fp32 kernel's on the upcast inputs (the attention's cache, the projections' weights).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace swiftkern {
namespace cpu {

#if defined(__x86_64__)
// 16 elements of E from p as fp32
template <class E>
__attribute__((target("avx512f"))) inline __m512 load16(const E* p) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<E, c10::BFloat16>)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    else
      return _mm512_cvtph_ps(raw);
  }
}

// The elements of p under a prefix mask m (the first popcount(m)), zeros past them
template <class E>
__attribute__((target("avx512f"))) inline __m512 load16_masked(const E* p, __mmask16 m) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {  // a copy of the elements in reach (16-bit masked loads would need AVX512BW)
    alignas(32) E part[16] = {};
    for (int i = 0; i < 16 && (m >> i & 1u); ++i) part[i] = p[i];
    return load16(part);
  }
}

// 8 elements of E from p as fp32 (AVX2; fp16 needs F16C, which every AVX2 CPU has)
template <class E>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const E* p) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<E, c10::BFloat16>)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    else
      return _mm256_cvtph_ps(raw);
  }
}
#endif

}  // namespace cpu
}  // namespace swiftkern
