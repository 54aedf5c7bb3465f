// bi_exp on CPU: exp(x) in float32 with the same bits for an element wherever it sits (the
// arithmetic is in cpu_exp.h; the kernel, its scalar tail and the torch twin agree bit for bit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_exp.h"

namespace swiftkern {

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
