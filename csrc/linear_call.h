// The shared set-up of the CPU matmul ops (skinny_linear, packed_linear): the number of rows,
// the checked bias and the output, y [..., N] for x [..., K].
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace swiftkern {

struct LinearCall {
  at::Tensor y;     // float32 [..., N], uninitialized
  at::Tensor bias;  // float32 [N] contiguous, or undefined
  int64_t M;        // rows: every dimension of x but the last

  // Nothing to compute (no rows, no outputs, or K = 0: every dot product is 0, plus the bias)?
  // Then y is final.
  bool trivial(int64_t K) {
    if (M == 0 || y.size(-1) == 0) return true;
    if (K != 0) return false;
    if (bias.defined()) y.copy_(bias.expand_as(y)); else y.zero_();
    return true;
  }

  // y with the bias added, once the dot products are in it
  at::Tensor finish() { return bias.defined() ? y.add_(bias) : y; }
};

inline LinearCall linear_call(const char* op, const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias) {
  LinearCall c{at::Tensor(), at::Tensor(), 1};
  for (int64_t d = 0; d + 1 < x.dim(); ++d) c.M *= x.size(d);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N, op,
                ": bias must be float32 [N=", N, "], got ", bias->sizes());
    c.bias = bias->contiguous();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  c.y = at::empty(sizes, x.options());
  return c;
}

}  // namespace swiftkern
