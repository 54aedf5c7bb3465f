// bi_exp on CPU: exp(x) in float32 with the same bits for an element wherever it sits.
//
// The arithmetic is that of reference.bi_exp, operation for operation (each one exactly rounded
// IEEE float32, no fused multiply-add: setup.py compiles with -ffp-contract=off), so the kernel,
// its scalar tail and the torch twin agree bit for bit:
//   t = clamp(x, -87, 88); n = round_half_even(t * log2 e); r = (t - n * ln2_hi) - n * ln2_lo;
//   p = Horner over the degree-7 Taylor coefficients of exp (p = p * r + c);
//   exp = p * 2^n (2^n from its exponent bits); 0 where x < -87.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace swiftkern {
namespace cpu {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2Hi = 0.693145751953125f;
constexpr float kLn2Lo = 1.4286068203094172e-06f;
constexpr float kLow = -87.0f, kHigh = 88.0f;
constexpr float kTaylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

static inline float bi_exp_one(float x) {
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

static void bi_exp_scalar(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bi_exp_one(x[i]);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void bi_exp_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kLow), _CMP_LT_OQ);
    const __m512 t = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
    const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLog2e)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(t, _mm512_mul_ps(nf, _mm512_set1_ps(kLn2Hi))),
                                   _mm512_mul_ps(nf, _mm512_set1_ps(kLn2Lo)));
    __m512 p = _mm512_set1_ps(kTaylor[0]);
    for (int c = 1; c < 8; ++c) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kTaylor[c]));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nf), _mm512_set1_epi32(127)), 23);
    const __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    _mm512_storeu_ps(y + i, _mm512_mask_mov_ps(out, tiny, _mm512_setzero_ps()));
  }
  bi_exp_scalar(x + i, y + i, n - i);
}
#endif

using ExpFn = void (*)(const float*, float*, int64_t);

static ExpFn pick_exp() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return bi_exp_avx512;
#endif
  return bi_exp_scalar;
}

}  // namespace cpu

// x: float32 [...] -> float32 [...] (contiguous), exp(x) element by element
at::Tensor bi_exp_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "bi_exp_cpu: x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bi_exp: x must be float32, got ", x.scalar_type());
  static const cpu::ExpFn fn = cpu::pick_exp();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, xc.numel(), 32768, [&](int64_t i0, int64_t i1) { fn(xp + i0, yp + i0, i1 - i0); });
  return y;
}

}  // namespace swiftkern
