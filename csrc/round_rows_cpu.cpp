// round_rows_isa: round_store.h's rounding of fp32 into bfloat16 / float16 with a named
// instruction set, for the test that every set gives c10's scalar conversion bit for bit.

#include <ATen/ATen.h>

#include <string>

#include "op_checks.h"
#include "round_store.h"

namespace swiftkern {

// x: float32 [...] on the CPU; dtype: "bfloat16" or "float16" -> x rounded into dtype, one thread
at::Tensor round_rows_isa(const at::Tensor& x, const std::string& dtype, const std::string& isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "round_rows_isa: x must be float32 on the CPU");
  TORCH_CHECK(dtype == "bfloat16" || dtype == "float16", "round_rows_isa: dtype must be bfloat16 or float16, got ",
              dtype);
  const cpu::Isa named = checks::named_isa("round_rows_isa", isa);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options().dtype(dtype == "bfloat16" ? at::kBFloat16 : at::kHalf));
  if (dtype == "bfloat16")
    cpu::round_rows(named, xc.data_ptr<float>(), xc.numel(), y.data_ptr<c10::BFloat16>());
  else
    cpu::round_rows(named, xc.data_ptr<float>(), xc.numel(), y.data_ptr<c10::Half>());
  return y;
}

}  // namespace swiftkern
