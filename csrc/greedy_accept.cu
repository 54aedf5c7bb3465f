// Launcher of greedy_accept (kernels in greedy_accept.cuh): the argmax kernel over every needed
// (row, position), split over the vocabulary when there are too few positions to fill the GPU,
// then the per-row walk, all on `stream`.
#include "greedy_accept.cuh"

namespace swiftkern {
namespace cuda {

namespace {

// The current device's SM count (looked up once per device)
int sm_count() {
  static int counts[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (counts[dev] == 0) cudaDeviceGetAttribute(&counts[dev], cudaDevAttrMultiProcessorCount, dev);
  return counts[dev];
}

// Vocabulary chunks per position: enough blocks for two per SM, each chunk at least
// `min_chunk` elements (4 vector loads per thread), and 1 (no split) when positions alone fill
// the GPU or V is short.
int64_t vocab_splits(int64_t positions, int64_t V, int64_t min_chunk) {
  const int64_t want = div_up<int64_t>(2 * sm_count(), positions);
  const int64_t most = V / min_chunk;
  return want < most ? (want > 1 ? want : 1) : (most > 1 ? most : 1);
}

}  // namespace

cudaError_t greedy_accept(const GreedyAcceptArgs& a, cudaStream_t stream) {
  if (a.B == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t positions = a.B * (a.K + 1);
  if (positions > 0x7fffffff) return cudaErrorInvalidConfiguration;
  bool keys = false;
  const cudaError_t err = dispatch_dtype(a.logits_dtype, [&](auto ty) {
    using Ty = decltype(ty);
    using S = typename Ty::Storage;
    const auto* logits = static_cast<const S*>(a.logits);
    const int64_t splits = vocab_splits(positions, a.V, int64_t(kThreads) * Pack<S>::kSize * 4);
    if (splits == 1) {
      greedy_argmax_kernel<Ty, kThreads><<<static_cast<unsigned>(positions), kThreads, 0, stream>>>(
          logits, a.logits_sb, a.logits_sk, a.num_draft, a.num_draft_s, a.out, a.K, a.V);
      return last_launch_error();
    }
    keys = true;
    const int64_t chunk = div_up(div_up(a.V, splits), int64_t(Pack<S>::kSize)) * Pack<S>::kSize;
    const cudaError_t zeroed = cudaMemsetAsync(a.out, 0, positions * sizeof(int64_t), stream);
    if (zeroed != cudaSuccess) return zeroed;
    const dim3 grid(static_cast<unsigned>(positions), static_cast<unsigned>(div_up(a.V, chunk)));
    greedy_argmax_split_kernel<Ty, kThreads><<<grid, kThreads, 0, stream>>>(
        logits, a.logits_sb, a.logits_sk, a.num_draft, a.num_draft_s, a.out, a.K, a.V, chunk);
    return last_launch_error();
  });
  if (err != cudaSuccess) return err;
  constexpr int kRows = 128;
  greedy_finalize_kernel<<<static_cast<unsigned>(div_up<int64_t>(a.B, kRows)), kRows, 0, stream>>>(
      a.draft, a.draft_sb, a.draft_sk, a.num_draft, a.num_draft_s, a.out, a.num_accepted, a.B, a.K, keys);
  return last_launch_error();
}

}  // namespace cuda
}  // namespace swiftkern
