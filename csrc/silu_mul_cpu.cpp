// silu_mul on CPU: silu(gate) * up = gate / (1 + exp(-gate)) * up, element by element.
//
// exp is cpu_exp.h's bi_exp and the rest single IEEE operations in that order (the arithmetic of
// batch_invariant.bi_silu_mul, same bits), so an element's result does not depend on where it
// sits (SIMD body or scalar tail, which thread): the op serves the regular decoder layers and
// the batch-invariant set alike. One pass instead of torch's two (silu, then the product).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <string>

#include "cpu_exp.h"
#include "cpu_isa.h"
#include "exact_load.h"
#include "op_checks.h"
#include "round_store.h"
#include "row_kernels.h"

namespace swiftkern {
namespace cpu {
namespace {

inline float silu_mul_one(float g, float u) { return g / (1.0f + bi_exp_one(-g)) * u; }

template <class T>
void silu_mul_scalar(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<T>(silu_mul_one(static_cast<float>(g[i]), static_cast<float>(u[i])));
}

#if defined(__x86_64__)
// bf16 / fp16 load exactly into fp32 (exact_load.h) and round at the store as the scalar loop
// does (round_store.h): the same bits in the body and the tail
template <class T>
__attribute__((target("avx512f"))) void silu_mul_avx512(const T* g, const T* u, T* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));  // -g, exactly
    const __m512 e = bi_exp_avx512_vec(neg);
    store16(y + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), load16(u + i)));
  }
  silu_mul_scalar(g + i, u + i, y + i, n - i);
}

template <class T>
__attribute__((target("avx2,fma,f16c"))) void silu_mul_avx2(const T* g, const T* u, T* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = load8(g + i);
    const __m256 e = bi_exp_avx2_vec(_mm256_xor_ps(gv, sign));  // exp(-g), -g exactly
    store8(y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), load8(u + i)));
  }
  silu_mul_scalar(g + i, u + i, y + i, n - i);
}
#endif

template <class T>
void silu_mul_range(const T* g, const T* u, T* y, int64_t n, Isa isa) {
#if defined(__x86_64__)
  if constexpr (kVectorElement<T>) {  // not double: the dispatch macro's, refused by checks::silu_mul
    if (isa == Isa::kAvx512) return silu_mul_avx512(g, u, y, n);
    if (isa == Isa::kAvx2) return silu_mul_avx2(g, u, y, n);
  }
#endif
  (void)isa;
  silu_mul_scalar(g, u, y, n);
}

}  // namespace

template <class T>
void silu_mul_rows(const T* gate, const T* up, T* y, int64_t n) {
  static const Isa isa = pick_isa();
  at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) { silu_mul_range<T>(gate + i0, up + i0, y + i0, i1 - i0, isa); });
}
#define INSTANTIATE(T) template void silu_mul_rows<T>(const T*, const T*, T*, int64_t);
SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE)
#undef INSTANTIATE

}  // namespace cpu

// gate, up: [...], one float dtype -> [...] contiguous, the same dtype
at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  checks::silu_mul(gate, up);
  checks::same_device("silu_mul", c10::DeviceType::CPU, {{"gate", &gate}, {"up", &up}});
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty(g.sizes(), g.options());
  const int64_t n = g.numel();
  if (n == 0) return y;
  static const cpu::Isa isa = cpu::pick_isa();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_mul_cpu", [&] {
    const scalar_t *gp = g.data_ptr<scalar_t>(), *up_ = u.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
      cpu::silu_mul_range<scalar_t>(gp + i0, up_ + i0, yp + i0, i1 - i0, isa);
    });
  });
  return y;
}

// silu_mul of gate, up (float32, bfloat16 or float16, one dtype) with a named instruction set
// ("avx512", "avx2", "portable"), one thread, for the test that each gives bi_silu_mul's bits
at::Tensor silu_mul_isa(const at::Tensor& gate, const at::Tensor& up, const std::string& isa) {
  TORCH_CHECK(gate.device().is_cpu() && checks::is_float_dtype(gate.scalar_type()) &&
                  up.scalar_type() == gate.scalar_type() && gate.sizes() == up.sizes(),
              "silu_mul_isa: gate and up must be CPU tensors of one shape and one float dtype");
  const cpu::Isa named = checks::named_isa("silu_mul_isa", isa);
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty(g.sizes(), g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_mul_isa", [&] {
    cpu::silu_mul_range<scalar_t>(g.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), g.numel(),
                                  named);
  });
  return y;
}

}  // namespace swiftkern
