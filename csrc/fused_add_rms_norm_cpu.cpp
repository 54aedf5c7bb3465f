// fused_add_rms_norm and rms_norm on CPU: rows in parallel, one pass over each row's inputs.
//
// rms_norm is the same with no residual (s = x, nothing stored but normed). Each row's
// arithmetic is fixed by H alone, so a row's bits do not depend on the other rows.
//
// Per row: s = dtype(residual + x) is stored as the new residual and kept in fp32; the sum of
// s^2 runs in 16 fp32 lanes (a vectorizable loop; torch sums in another order, so results agree
// with the reference to fp32 rounding of the mean); normed = weight * dtype(s * rsqrt(mean + eps)),
// the reference's (HF LlamaRMSNorm's) order of roundings.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "op_checks.h"
#include "row_kernels.h"

namespace swiftkern {
namespace cpu {
namespace {

constexpr int kSumLanes = 16;

// r, new_res: null for rms_norm
template <class T>
void fused_add_rms_norm_rows(const T* x, int64_t x_s, const T* r, int64_t r_s, const T* w, T* normed,
                             T* new_res, int64_t N, int64_t H, float eps) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / H);  // ~32K elements a task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> s(H);
    for (int64_t n = n0; n < n1; ++n) {
      const T* xr = x + n * x_s;
      if (r == nullptr) {
        for (int64_t h = 0; h < H; ++h) s[h] = static_cast<float>(xr[h]);
      } else {
        const T* rr = r + n * r_s;
        T* res = new_res + n * H;
        for (int64_t h = 0; h < H; ++h) {
          res[h] = static_cast<T>(static_cast<float>(rr[h]) + static_cast<float>(xr[h]));
          s[h] = static_cast<float>(res[h]);
        }
      }
      float lanes[kSumLanes] = {};
      int64_t h = 0;
      for (; h + kSumLanes <= H; h += kSumLanes)
        for (int l = 0; l < kSumLanes; ++l) lanes[l] += s[h + l] * s[h + l];
      for (int l = 0; h < H; ++h, ++l) lanes[l] += s[h] * s[h];
      float sum = 0.0f;
      for (int l = 0; l < kSumLanes; ++l) sum += lanes[l];
      const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
      T* out = normed + n * H;
      for (int64_t k = 0; k < H; ++k)
        out[k] = static_cast<T>(static_cast<float>(w[k]) * static_cast<float>(static_cast<T>(s[k] * rstd)));
    }
  });
}

}  // namespace

template <class T>
void add_rms_norm_rows(const T* x, int64_t x_s, const T* residual, int64_t r_s, const T* w, T* normed, T* new_res,
                       int64_t N, int64_t H, float eps) {
  fused_add_rms_norm_rows<T>(x, x_s, residual, r_s, w, normed, new_res, N, H, eps);
}
#define INSTANTIATE(T)                                                                                            \
  template void add_rms_norm_rows<T>(const T*, int64_t, const T*, int64_t, const T*, T*, T*, int64_t, int64_t, \
                                     float);
SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE)
#undef INSTANTIATE

}  // namespace cpu

// x, residual: [..., H]; weight: [H]; one float dtype -> (normed [..., H], new_residual [..., H])
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(x, residual, weight);
  checks::same_device("fused_add_rms_norm", c10::DeviceType::CPU,
                      {{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  const int64_t H = x.size(-1);
  auto normed = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  auto new_residual = at::empty_like(normed);
  if (x.numel() == 0) return {normed, new_residual};
  const at::Tensor xs = unit_stride_rows(x), rs = unit_stride_rows(residual), ws = weight.contiguous();
  const int64_t N = xs.size(0);
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      cpu::fused_add_rms_norm_rows<float>(xs.data_ptr<float>(), xs.stride(0), rs.data_ptr<float>(), rs.stride(0),
                                          ws.data_ptr<float>(), normed.data_ptr<float>(),
                                          new_residual.data_ptr<float>(), N, H, e);
      break;
    case at::kBFloat16:
      cpu::fused_add_rms_norm_rows<c10::BFloat16>(
          xs.data_ptr<c10::BFloat16>(), xs.stride(0), rs.data_ptr<c10::BFloat16>(), rs.stride(0),
          ws.data_ptr<c10::BFloat16>(), normed.data_ptr<c10::BFloat16>(), new_residual.data_ptr<c10::BFloat16>(),
          N, H, e);
      break;
    default:
      cpu::fused_add_rms_norm_rows<c10::Half>(xs.data_ptr<c10::Half>(), xs.stride(0), rs.data_ptr<c10::Half>(),
                                              rs.stride(0), ws.data_ptr<c10::Half>(), normed.data_ptr<c10::Half>(),
                                              new_residual.data_ptr<c10::Half>(), N, H, e);
  }
  return {normed, new_residual};
}

// x: [..., H]; weight: [H]; one float dtype -> normed [..., H]
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(x, x, weight, "rms_norm");
  checks::same_device("rms_norm", c10::DeviceType::CPU, {{"x", &x}, {"weight", &weight}});
  const int64_t H = x.size(-1);
  auto normed = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return normed;
  const at::Tensor xs = unit_stride_rows(x), ws = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    cpu::fused_add_rms_norm_rows<scalar_t>(xs.data_ptr<scalar_t>(), xs.stride(0), nullptr, 0,
                                           ws.data_ptr<scalar_t>(), normed.data_ptr<scalar_t>(), nullptr,
                                           xs.size(0), H, static_cast<float>(eps));
  });
  return normed;
}

}  // namespace swiftkern
