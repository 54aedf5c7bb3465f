// The torch-side wrappers of the CUDA kernels (csrc/ops_cuda.cpp), registered in bindings.cpp for
// CUDA tensors; tests/cuda_emu builds them with SWIFTKERN_CUDA_EMULATION, for CPU tensors.
#pragma once

#include <ATen/ATen.h>

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
