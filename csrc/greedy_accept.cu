// Launcher of greedy_accept (kernels in greedy_accept.cuh): the argmax kernel over every needed
// (row, position), then the per-row walk, both on `stream`.
#include "greedy_accept.cuh"

namespace swiftkern {
namespace cuda {

cudaError_t greedy_accept(const GreedyAcceptArgs& a, cudaStream_t stream) {
  if (a.B == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = a.B * (a.K + 1);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const cudaError_t err = dispatch_dtype(a.logits_dtype, [&](auto ty) {
    using Ty = decltype(ty);
    greedy_argmax_kernel<Ty, kThreads><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const typename Ty::Storage*>(a.logits), a.logits_sb, a.logits_sk, a.num_draft,
        a.num_draft_s, a.out, a.K, a.V);
    return last_launch_error();
  });
  if (err != cudaSuccess) return err;
  constexpr int kRows = 128;
  greedy_finalize_kernel<<<static_cast<unsigned>(div_up<int64_t>(a.B, kRows)), kRows, 0, stream>>>(
      a.draft, a.draft_sb, a.draft_sk, a.num_draft, a.num_draft_s, a.out, a.num_accepted, a.B, a.K);
  return last_launch_error();
}

}  // namespace cuda
}  // namespace swiftkern
