// The CUDA ops of csrc/ops_cuda.cpp (built with SWIFTKERN_CUDA_EMULATION: CPU tensors, kernels run
// by emu_runtime.cpp) as a Python module with the names and arguments of torch.ops.swiftkern.
#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace swiftkern {
std::tuple<at::Tensor, at::Tensor> greedy_accept_cuda(const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                                                      const at::Tensor& num_draft);
std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(const at::Tensor& draft_tokens,
                                                         const std::optional<at::Tensor>& draft_probs,
                                                         const at::Tensor& target_probs, const at::Tensor& num_draft,
                                                         const at::Tensor& u_accept, const at::Tensor& u_sample);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps);
at::Tensor rope_kv_append_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                               const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                               const at::Tensor& positions);
void kv_compact_cuda(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& src_positions,
                     const at::Tensor& dst_start, const at::Tensor& counts);
}  // namespace swiftkern

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "swiftkern's CUDA ops on CPU tensors, their kernels run by a CPU emulation of CUDA (tests only)";
  m.def("greedy_accept", &swiftkern::greedy_accept_cuda);
  m.def("rejection_sample", &swiftkern::rejection_sample_cuda);
  m.def("fused_add_rms_norm", &swiftkern::fused_add_rms_norm_cuda);
  m.def("rope_kv_append", &swiftkern::rope_kv_append_cuda);
  m.def("kv_compact", &swiftkern::kv_compact_cuda);
}
