// fused_add_rms_norm and rms_norm on CPU: rows in parallel, each row read once into fp32.
//
// rms_norm is the same with no residual (s = x, nothing stored but normed). Each row's
// arithmetic is fixed by H alone, so a row's bits do not depend on the other rows.
//
// Per row: s = dtype(residual + x) is stored as the new residual and kept in fp32; the sum of
// s^2 runs in 16 fp32 lanes (a vectorizable loop; torch sums in another order, so results agree
// with the reference to fp32 rounding of the mean); normed = weight * dtype(s * rsqrt(mean + eps)),
// the reference's (HF LlamaRMSNorm's) order of roundings. Two passes a row, the second over its
// fp32 copy; AVX-512 / AVX2 bodies load exactly and round as c10 does (exact_load.h,
// round_store.h), so they give the scalar loop's bits: element by element, c10's conversions
// made an fp16 norm of 576 ~2.7 us dearer than the float32 one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_isa.h"
#include "op_checks.h"
#include "round_store.h"
#include "row_kernels.h"

namespace swiftkern {
namespace cpu {
namespace {

constexpr int kSumLanes = 16;

// Pass 1 of a row from element h on: s[h] = float(dtype(r + x)) (r null: float(x)), stored
// rounded into res, and s^2 added into lanes[h % 16] in element order
template <class T>
void add_square_scalar(const T* x, const T* r, T* res, float* s, float* lanes, int64_t h, int64_t H) {
  for (; h < H; ++h) {
    float v = static_cast<float>(x[h]);
    if (r != nullptr) {
      res[h] = static_cast<T>(static_cast<float>(r[h]) + v);
      v = static_cast<float>(res[h]);
    }
    s[h] = v;
    lanes[h % kSumLanes] += v * v;
  }
}

// Pass 2 from element h on: out = dtype(w * dtype(s * rstd)), HF LlamaRMSNorm's roundings
template <class T>
void scale_scalar(const float* s, float rstd, const T* w, T* out, int64_t h, int64_t H) {
  for (; h < H; ++h) out[h] = static_cast<T>(static_cast<float>(w[h]) * static_cast<float>(static_cast<T>(s[h] * rstd)));
}

#if defined(__x86_64__)
// The same passes on whole 16s (one accumulator is the 16 lanes), loads exact and stores
// rounded as the scalar loop's casts (exact_load.h, round_store.h); the scalar loop ends the row
template <class T>
__attribute__((target("avx512f"))) void add_square_avx512(const T* x, const T* r, T* res, float* s, float* lanes,
                                                          int64_t H) {
  __m512 acc = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h + kSumLanes <= H; h += kSumLanes) {
    __m512 v = load16(x + h);
    if (r != nullptr) {
      store16(res + h, _mm512_add_ps(load16(r + h), v));
      v = load16(res + h);
    }
    _mm512_storeu_ps(s + h, v);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  _mm512_storeu_ps(lanes, acc);
  add_square_scalar(x, r, res, s, lanes, h, H);
}

template <class T>
__attribute__((target("avx512f"))) void scale_avx512(const float* s, float rstd, const T* w, T* out, int64_t H) {
  const __m512 k = _mm512_set1_ps(rstd);
  int64_t h = 0;
  for (; h + 16 <= H; h += 16) {
    store16(out + h, _mm512_mul_ps(_mm512_loadu_ps(s + h), k));
    store16(out + h, _mm512_mul_ps(load16(w + h), load16(out + h)));
  }
  scale_scalar(s, rstd, w, out, h, H);
}

template <class T>
__attribute__((target("avx2,f16c"))) __m256 add8(const T* x, const T* r, T* res, float* s, int64_t h) {
  __m256 v = load8(x + h);
  if (r != nullptr) {
    store8(res + h, _mm256_add_ps(load8(r + h), v));
    v = load8(res + h);
  }
  _mm256_storeu_ps(s + h, v);
  return v;
}

// lanes 0-7 and 8-15 in two accumulators
template <class T>
__attribute__((target("avx2,f16c"))) void add_square_avx2(const T* x, const T* r, T* res, float* s, float* lanes,
                                                          int64_t H) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t h = 0;
  for (; h + kSumLanes <= H; h += kSumLanes) {
    const __m256 a = add8(x, r, res, s, h), b = add8(x, r, res, s, h + 8);
    lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
  }
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
  add_square_scalar(x, r, res, s, lanes, h, H);
}

template <class T>
__attribute__((target("avx2,f16c"))) void scale_avx2(const float* s, float rstd, const T* w, T* out, int64_t H) {
  const __m256 k = _mm256_set1_ps(rstd);
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) {
    store8(out + h, _mm256_mul_ps(_mm256_loadu_ps(s + h), k));
    store8(out + h, _mm256_mul_ps(load8(w + h), load8(out + h)));
  }
  scale_scalar(s, rstd, w, out, h, H);
}
#endif

template <class T>
void add_square(Isa isa, const T* x, const T* r, T* res, float* s, float* lanes, int64_t H) {
#if defined(__x86_64__)
  if constexpr (kVectorElement<T>) {  // not double: the dispatch macro's, refused by the checks
    if (isa == Isa::kAvx512) return add_square_avx512(x, r, res, s, lanes, H);
    if (isa == Isa::kAvx2) return add_square_avx2(x, r, res, s, lanes, H);
  }
#endif
  (void)isa;
  add_square_scalar(x, r, res, s, lanes, 0, H);
}

template <class T>
void scale(Isa isa, const float* s, float rstd, const T* w, T* out, int64_t H) {
#if defined(__x86_64__)
  if constexpr (kVectorElement<T>) {
    if (isa == Isa::kAvx512) return scale_avx512(s, rstd, w, out, H);
    if (isa == Isa::kAvx2) return scale_avx2(s, rstd, w, out, H);
  }
#endif
  (void)isa;
  scale_scalar(s, rstd, w, out, 0, H);
}

// One row with the vectors of isa; s: H floats of scratch. The row is read whole (pass 1) before
// normed is written, so normed may be x and res may be r (the decoder stack's in-place norms).
template <class T>
void norm_row(const T* x, const T* r, const T* w, T* normed, T* res, int64_t H, float eps, float* s, Isa isa) {
  float lanes[kSumLanes] = {};
  add_square(isa, x, r, res, s, lanes, H);
  float sum = 0.0f;
  for (int l = 0; l < kSumLanes; ++l) sum += lanes[l];
  scale(isa, s, 1.0f / std::sqrt(sum / static_cast<float>(H) + eps), w, normed, H);
}

// r, new_res: null for rms_norm
template <class T>
void fused_add_rms_norm_rows(const T* x, int64_t x_s, const T* r, int64_t r_s, const T* w, T* normed,
                             T* new_res, int64_t N, int64_t H, float eps, Isa isa) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / H);  // ~32K elements a task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> s(H);
    for (int64_t n = n0; n < n1; ++n)
      norm_row<T>(x + n * x_s, r ? r + n * r_s : nullptr, w, normed + n * H, r ? new_res + n * H : nullptr, H, eps,
                  s.data(), isa);
  });
}

}  // namespace

template <class T>
void add_rms_norm_rows(const T* x, int64_t x_s, const T* residual, int64_t r_s, const T* w, T* normed, T* new_res,
                       int64_t N, int64_t H, float eps) {
  static const Isa isa = pick_isa();
  fused_add_rms_norm_rows<T>(x, x_s, residual, r_s, w, normed, new_res, N, H, eps, isa);
}
#define INSTANTIATE(T)                                                                                            \
  template void add_rms_norm_rows<T>(const T*, int64_t, const T*, int64_t, const T*, T*, T*, int64_t, int64_t, \
                                     float);
SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE)
#undef INSTANTIATE

}  // namespace cpu

namespace {

// The ops' body once checked: normed, and with a residual (else null) new_residual (else undefined)
std::tuple<at::Tensor, at::Tensor> norm_op(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                                           double eps, cpu::Isa isa) {
  auto normed = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor new_residual = residual ? at::empty_like(normed) : at::Tensor();
  if (x.numel() == 0) return {normed, new_residual};
  const at::Tensor xs = unit_stride_rows(x), ws = weight.contiguous();
  const at::Tensor rs = residual ? unit_stride_rows(*residual) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    cpu::fused_add_rms_norm_rows<scalar_t>(
        xs.data_ptr<scalar_t>(), xs.stride(0), residual ? rs.data_ptr<scalar_t>() : nullptr,
        residual ? rs.stride(0) : 0, ws.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(),
        residual ? new_residual.data_ptr<scalar_t>() : nullptr, xs.size(0), x.size(-1), static_cast<float>(eps), isa);
  });
  return {normed, new_residual};
}

}  // namespace

// x, residual: [..., H]; weight: [H]; one float dtype -> (normed [..., H], new_residual [..., H])
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(x, residual, weight);
  checks::same_device("fused_add_rms_norm", c10::DeviceType::CPU,
                      {{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  static const cpu::Isa isa = cpu::pick_isa();
  return norm_op(x, &residual, weight, eps, isa);
}

// x: [..., H]; weight: [H]; one float dtype -> normed [..., H]
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(x, x, weight, "rms_norm");
  checks::same_device("rms_norm", c10::DeviceType::CPU, {{"x", &x}, {"weight", &weight}});
  static const cpu::Isa isa = cpu::pick_isa();
  return std::get<0>(norm_op(x, nullptr, weight, eps, isa));
}

// fused_add_rms_norm (residual given) or rms_norm (residual None: new_residual None) with a named
// instruction set ("avx512", "avx2", "portable"), for the test that each gives the same bits
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_isa(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                          const at::Tensor& weight, double eps, const std::string& isa) {
  const char* name = "fused_add_rms_norm_isa";
  checks::fused_add_rms_norm(x, residual ? *residual : x, weight, name);
  checks::same_device(name, c10::DeviceType::CPU, {{"x", &x}, {"weight", &weight}});
  TORCH_CHECK(!residual || residual->device().is_cpu(), name, ": residual must be on the CPU");
  return norm_op(x, residual ? &*residual : nullptr, weight, eps, checks::named_isa(name, isa));
}

}  // namespace swiftkern
