// Launcher of rejection_sample (kernel in rejection_sample.cuh): one block per row on `stream`.
#include "rejection_sample.cuh"

namespace swiftkern {
namespace cuda {

cudaError_t rejection_sample(const RejectionSampleArgs& a, cudaStream_t stream) {
  if (a.B == 0) return cudaSuccess;
  if (a.B > 0x7fffffff || a.K >= 0x7fffffff) return cudaErrorInvalidConfiguration;
  constexpr int kThreads = kRejectionThreads;
  // each thread's contiguous segment of the vocabulary, a multiple of 4 for float4 loads
  const int64_t seg = div_up<int64_t>(div_up<int64_t>(a.V, kThreads), 4) * 4;
  rejection_sample_kernel<kThreads><<<static_cast<unsigned>(a.B), kThreads, 0, stream>>>(
      a.draft, a.draft_sb, a.draft_sk, a.draft_probs, a.q_sb, a.q_sk, a.target_probs, a.p_sb, a.p_sk,
      a.num_draft, a.num_draft_s, a.u_accept, a.ua_sb, a.ua_sk, a.u_sample, a.us_sb, a.us_sk, a.out,
      a.num_accepted, a.K, a.V, seg);
  return last_launch_error();
}

}  // namespace cuda
}  // namespace swiftkern
