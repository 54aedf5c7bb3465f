// CPU ops that other CPU files call directly (besides bindings.cpp, which registers them).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace swiftkern {

// greedy_accept_cpu.cpp: draft_tokens int64 [B, K]; target_logits [B, K+1, V]; num_draft int32 [B]
// -> (out_tokens int64 [B, K+1], num_accepted int32 [B])
std::tuple<at::Tensor, at::Tensor> greedy_accept_cpu(const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                                                     const at::Tensor& num_draft);

// bi_exp_cpu.cpp: x float32 [..., V] -> (top, sum of exp(x - top)), float32 [..., 1] each, fixed order
std::tuple<at::Tensor, at::Tensor> bi_max_exp_sum_cpu(const at::Tensor& x);

// greedy_verify_cpu.cpp (documented there)
std::tuple<at::Tensor, at::Tensor, std::vector<std::vector<int64_t>>, std::vector<int64_t>, std::optional<at::Tensor>>
greedy_verify_cpu(const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                  const std::vector<int64_t>& num_draft, bool logprobs);

}  // namespace swiftkern
