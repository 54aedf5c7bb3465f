// The shared set-up of the CPU matmul ops (skinny_linear, packed_linear): the number of rows,
// the checked bias and the output, y [..., N] for x [..., K], computed in fp32 and rounded to x's dtype.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace swiftkern {

struct LinearCall {
  at::Tensor y;         // float32 [..., N], uninitialized
  at::Tensor bias;      // float32 [N] contiguous (upcast exactly), or undefined
  int64_t M;            // rows: every dimension of x but the last
  at::ScalarType dtype; // x's: the result's, rounded to once at the end

  // Nothing to compute (no rows, no outputs, or K = 0: every dot product is 0)? Then y is set
  // and finish() gives the result.
  bool trivial(int64_t K) {
    if (M == 0 || y.size(-1) == 0) return true;
    if (K != 0) return false;
    y.zero_();
    return true;
  }

  // The result, once the dot products are in y: + bias in fp32, then one rounding to dtype
  at::Tensor finish() {
    if (bias.defined()) y.add_(bias);
    return dtype == at::kFloat ? y : y.to(dtype);
  }
};

// torch's name of a floating dtype the matmul ops take
inline const char* float_dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : "another dtype";
}

inline LinearCall linear_call(const char* op, const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias) {
  LinearCall c{at::Tensor(), at::Tensor(), 1, x.scalar_type()};
  for (int64_t d = 0; d + 1 < x.dim(); ++d) c.M *= x.size(d);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == c.dtype && bias->dim() == 1 && bias->size(0) == N, op, ": bias must be ",
                float_dtype_name(c.dtype), " [N=", N, "] like x, got ", bias->scalar_type(), " ", bias->sizes());
    c.bias = bias->to(at::kFloat).contiguous();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  c.y = at::empty(sizes, x.options().dtype(at::kFloat));
  return c;
}

}  // namespace swiftkern
