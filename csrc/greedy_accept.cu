// Launcher of greedy_accept (kernels in greedy_accept.cuh): the argmax kernel over every needed
// (row, position) and vocabulary chunk, then the per-row walk, all on `stream`: two launches.
#include <cstdlib>
#include <cstring>

#include "greedy_accept.cuh"

namespace swiftkern {
namespace cuda {

bool greedy_vocab_split_enabled() {
  const char* v = std::getenv("SWIFTKERN_CUDA_GREEDY_SPLIT");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

int64_t greedy_vocab_chunks(int64_t positions, int64_t V, int sms) {
  const int64_t want = div_up<int64_t>(kGreedyBlocksPerSm * static_cast<int64_t>(sms), positions);
  const int64_t most = V / kGreedyMinChunk;
  const int64_t chunks = want < most ? want : most;
  return chunks > 1 ? chunks : 1;
}

namespace {

constexpr int kThreads = 256;

// Vocabulary chunks of a launch and their length (a multiple of 8 elements, so a chunk starts as
// 16-byte aligned as its row; none empty).
void plan_chunks(int64_t positions, int64_t V, int64_t* chunks, int64_t* chunk) {
  const int64_t want = greedy_vocab_split_enabled() ? greedy_vocab_chunks(positions, V, current_device_sms()) : 1;
  *chunk = div_up<int64_t>(div_up<int64_t>(V, want), 8) * 8;
  *chunks = div_up<int64_t>(V, *chunk);
}

}  // namespace

int64_t greedy_keys_elems(int64_t B, int64_t K, int64_t V) {
  int64_t chunks = 1, chunk = V;
  if (B > 0 && V > 0) plan_chunks(B * (K + 1), V, &chunks, &chunk);
  return chunks > 1 ? B * (K + 1) * chunks : 0;
}

cudaError_t greedy_accept(const GreedyAcceptArgs& a, cudaStream_t stream) {
  if (a.B == 0) return cudaSuccess;
  const int64_t positions = a.B * (a.K + 1);
  if (positions > 0x7fffffff || a.V > 0xffffffffLL) return cudaErrorInvalidConfiguration;
  int64_t chunks = 1, chunk = a.V;
  plan_chunks(positions, a.V, &chunks, &chunk);
  if (chunks > 1 && a.keys == nullptr) return cudaErrorInvalidValue;
  // two launches either way: the argmax (each chunk's best key into a.keys when split, no
  // zeroing needed), then the walk (keyed: a block a row reduces the chunks first)
  const dim3 grid(static_cast<unsigned>(positions), static_cast<unsigned>(chunks));
  const cudaError_t err = dispatch_dtype(a.logits_dtype, [&](auto ty) {
    using Ty = decltype(ty);
    greedy_argmax_kernel<Ty, kThreads><<<grid, kThreads, 0, stream>>>(
        static_cast<const typename Ty::Storage*>(a.logits), a.logits_sb, a.logits_sk, a.num_draft,
        a.num_draft_s, a.out, a.keys, a.K, a.V, chunk);
    return last_launch_error();
  });
  if (err != cudaSuccess) return err;
  if (chunks > 1) {
    greedy_finalize_keyed_kernel<kThreads><<<static_cast<unsigned>(a.B), kThreads, 0, stream>>>(
        a.draft, a.draft_sb, a.draft_sk, a.num_draft, a.num_draft_s, a.keys, a.out, a.num_accepted, a.K, chunks);
    return last_launch_error();
  }
  constexpr int kRows = 128;
  greedy_finalize_kernel<<<static_cast<unsigned>(div_up<int64_t>(a.B, kRows)), kRows, 0, stream>>>(
      a.draft, a.draft_sb, a.draft_sk, a.num_draft, a.num_draft_s, a.out, a.num_accepted, a.B, a.K);
  return last_launch_error();
}

}  // namespace cuda
}  // namespace swiftkern
