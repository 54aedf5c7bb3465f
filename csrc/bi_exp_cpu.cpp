// bi_exp on CPU: exp(x) in float32 with the same bits for an element wherever it sits (the
// arithmetic is in cpu_exp.h; the kernel, its scalar tail and the torch twin agree bit for bit),
// and bi_exp_sum: the fixed-order sum of those exps along a row (the verifier's softmax
// denominator), the same additions as reference.tree_sum.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "cpu_exp.h"
#include "op_checks.h"

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

// bi_exp with a named instruction set ("avx512", "avx2", "portable"), for the test that each
// gives the reference's bits
at::Tensor bi_exp_isa(const at::Tensor& x, const std::string& isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "bi_exp_isa: x must be float32 on the CPU");
  const cpu::ExpFn fn = cpu::exp_for(checks::named_isa("bi_exp_isa", isa));
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  fn(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel());
  return y;
}

// x: float32 [..., V], V >= 1 -> float32 [..., 1]: per row, reference.tree_sum(bi_exp(row)):
// the exps zero-padded to a multiple of 64, halved by elementwise adds (i + half) while the
// length is even, then the rest added column by column. Each add is one IEEE add of the same
// two values as in the twin, so the bits agree; rows are independent.
at::Tensor bi_exp_sum_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "bi_exp_sum_cpu: x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bi_exp_sum: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "bi_exp_sum: x must be [..., V] with V >= 1, got ", x.sizes());
  static const cpu::ExpFn fn = cpu::pick_exp();
  const at::Tensor xc = x.contiguous();
  const int64_t V = xc.size(-1), rows = xc.numel() / V, padded = (V + 63) / 64 * 64;
  auto sizes = xc.sizes().vec();
  sizes.back() = 1;
  at::Tensor out = at::empty(sizes, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(padded);
    for (int64_t r = r0; r < r1; ++r) {
      fn(xp + r * V, buf.data(), V);
      std::fill(buf.begin() + V, buf.end(), 0.0f);
      int64_t len = padded;
      while (len % 2 == 0) {
        const int64_t half = len / 2;
        for (int64_t i = 0; i < half; ++i) buf[i] = buf[i] + buf[i + half];
        len = half;
      }
      float total = buf[0];
      for (int64_t j = 1; j < len; ++j) total = total + buf[j];
      op[r] = total;
    }
  });
  return out;
}

}  // namespace swiftkern
