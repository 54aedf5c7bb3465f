// skinny_linear on CPU: y = x @ w^T + b for a few rows of x (decode, verification, drafts).
//
// With M <= 16 rows the product is a pass over the weight: each thread streams a contiguous
// slice of w's rows once and dots every x row against the row it holds in L1. Every output
// element is one fixed-order fp32 dot product, whatever M is, so a row's result does not
// depend on the other rows (batch-invariant). The dot is 32-lane SIMD (AVX2/FMA, picked
// when the CPU has it, a portable loop with the same summation order otherwise).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <optional>

namespace swiftkern {
namespace cpu {

// One fp32 dot product in a fixed order: 32 partial sums (k mod 32), summed pairwise, then
// the K % 32 tail. Both variants below follow exactly this order, so they agree bit for bit.
constexpr int kLanes = 32;

static inline float reduce_lanes(const float* lane) {
  float s8[8];
  for (int l = 0; l < 8; ++l) s8[l] = (lane[l] + lane[l + 8]) + (lane[l + 16] + lane[l + 24]);
  return ((s8[0] + s8[4]) + (s8[1] + s8[5])) + ((s8[2] + s8[6]) + (s8[3] + s8[7]));
}

static float dot_portable(const float* __restrict x, const float* __restrict w, int64_t K) {
  float lane[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(x[k + l], w[k + l], lane[l]);
  float acc = reduce_lanes(lane);
  for (; k < K; ++k) acc = std::fma(x[k], w[k], acc);
  return acc;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma")))
static float dot_avx2(const float* __restrict x, const float* __restrict w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // lanes 0-7, 8-15, 16-23, 24-31
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
  }
  float lane[kLanes];
  _mm256_storeu_ps(lane, a0);
  _mm256_storeu_ps(lane + 8, a1);
  _mm256_storeu_ps(lane + 16, a2);
  _mm256_storeu_ps(lane + 24, a3);
  float acc = reduce_lanes(lane);
  for (; k < K; ++k) acc = std::fma(x[k], w[k], acc);
  return acc;
}
#endif

using DotFn = float (*)(const float*, const float*, int64_t);

static DotFn pick_dot() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return dot_avx2;
#endif
  return dot_portable;
}

static void skinny_linear_rows(const float* __restrict x, const float* __restrict w,
                               const float* __restrict bias, float* __restrict y,
                               int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  static const DotFn dot = pick_dot();
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wr = w + n * K;  // streamed from memory once, then read from L1 for m > 0
    for (int64_t m = 0; m < M; ++m) {
      const float acc = dot(x + m * K, wr, K);
      y[m * N + n] = bias ? acc + bias[n] : acc;
    }
  }
}

}  // namespace cpu

// x: float32 [..., K] (at most 16 rows in all); weight: float32 [N, K]; bias: float32 [N] or None
// -> float32 [..., N]
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear_cpu: tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "skinny_linear: x and weight must be float32, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "skinny_linear: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
              "skinny_linear: x [..., K] must match weight [N, K]: got ", x.sizes(), " and ", weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  int64_t M = 1;  // rows: every dimension of x but the last
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  TORCH_CHECK(M <= 16, "skinny_linear: at most 16 rows (use a matmul for more), got ", M);
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N,
                "skinny_linear: bias must be float32 [N=", N, "], got ", bias->sizes());
    bias_c = bias->contiguous();
    b = bias_c.data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) {  // an empty reduction: every dot product is 0
    return b ? y.copy_(bias_c.expand_as(y)) : y.zero_();
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));  // ~128 KiB of weight a task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    cpu::skinny_linear_rows(xp, wp, b, yp, M, K, N, n0, n1);
  });
  return y;
}

}  // namespace swiftkern
