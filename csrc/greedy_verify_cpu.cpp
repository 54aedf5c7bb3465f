// greedy_verify on CPU: a speculative step's tail in one call (swiftkern/verify_step.py).
//
// After a verify forward the step accepted its drafts (greedy_accept), converted the counts,
// gathered each row's next pending token, read the rows back to the host and, in mode
// deterministic, computed each kept token's logprob: ~8 torch ops, each run with its code evicted
// by the weights the forward had just streamed (~0.3-0.4 ms a step on SmolLM2, an AMD EPYC with 2
// threads). Here they are the same kernels called from C++, so the results are their bits
// (tests/test_greedy_verify.py).

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "cpu_ops.h"

namespace swiftkern {

// draft_tokens int64 [B, K]; target_logits [B, K+1, V] (float32 / bf16 / fp16, contiguous along V);
// num_draft: B host ints in [0, K]; logprobs: also each row's out tokens' log-probabilities.
// -> (out_tokens int64 [B, K+1] and, as a list, num_accepted: greedy_accept's; pending int64 [B]:
//     out_tokens[b, num_accepted[b]]; out_tokens' rows as lists; with logprobs float32 [B, K+1]:
//     bi_token_logprob's bits at out_tokens[b, :num_accepted[b] + 1], NaN past them, else None)
std::tuple<at::Tensor, at::Tensor, std::vector<std::vector<int64_t>>, std::vector<int64_t>, std::optional<at::Tensor>>
greedy_verify_cpu(const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                  const std::vector<int64_t>& num_draft, bool logprobs) {
  const int64_t B = draft_tokens.dim() == 2 ? draft_tokens.size(0) : -1;
  TORCH_CHECK(static_cast<int64_t>(num_draft.size()) == B, "greedy_verify: num_draft must have one entry per row of "
              "draft_tokens [B, K], got ", num_draft.size(), " for shape ", draft_tokens.sizes());
  at::Tensor nd = at::empty({B}, at::kInt);
  int32_t* n = nd.mutable_data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(num_draft[b] >= 0 && num_draft[b] <= draft_tokens.size(1), "greedy_verify: num_draft[", b, "] = ",
                num_draft[b], " is outside [0, K = ", draft_tokens.size(1), "]");
    n[b] = static_cast<int32_t>(num_draft[b]);
  }
  auto [out, accepted] = greedy_accept_cpu(draft_tokens, target_logits, nd);
  const int64_t K1 = out.size(1);
  at::Tensor pending = at::empty({B}, out.options());
  int64_t* p = pending.mutable_data_ptr<int64_t>();
  const int64_t* o = out.const_data_ptr<int64_t>();
  const int32_t* a = accepted.const_data_ptr<int32_t>();
  std::vector<std::vector<int64_t>> rows(B);
  std::vector<int64_t> num_accepted(B);
  for (int64_t b = 0; b < B; ++b) {
    rows[b].assign(o + b * K1, o + (b + 1) * K1);
    num_accepted[b] = a[b];
    p[b] = o[b * K1 + a[b]];
  }
  std::optional<at::Tensor> lps;
  if (logprobs) {
    // bi_token_logprob (swiftkern/batch_invariant.py): (z[t] - top) - log(sum), z the logits in
    // float32, (top, sum) from bi_max_exp_sum; the subtractions and the log are torch's ops (their
    // bits, a NaN's payload included), the rest plain copies: each op dispatched here ran cold too
    lps = at::empty({B, K1}, target_logits.options().dtype(at::kFloat));
    float* l = lps->mutable_data_ptr<float>();
    std::fill(l, l + B * K1, std::numeric_limits<float>::quiet_NaN());
    const int64_t V = target_logits.size(2);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t kept = a[b] + 1;
      const at::Tensor z = target_logits[b].narrow(0, 0, kept).to(at::kFloat).contiguous();  // [kept, V]
      const auto [top, total] = bi_max_exp_sum_cpu(z);                                        // [kept, 1] each
      at::Tensor picked = at::empty({kept, 1}, z.options());                                 // z[j, t_j]
      const float* zp = z.const_data_ptr<float>();
      float* pp = picked.mutable_data_ptr<float>();
      for (int64_t j = 0; j < kept; ++j) pp[j] = zp[j * V + o[b * K1 + j]];
      const at::Tensor lp = (picked - top) - at::log(total);  // [kept, 1]
      std::copy_n(lp.const_data_ptr<float>(), kept, l + b * K1);
    }
  }
  return {out, pending, rows, num_accepted, lps};
}

}  // namespace swiftkern
