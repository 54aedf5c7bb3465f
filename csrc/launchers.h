// The torch-free CUDA launchers of swiftkern: raw pointers, sizes, strides (in elements) and a
// stream in; a cudaError_t out (the launch error, cudaSuccess when every kernel was queued).
// Implemented in csrc/<op>.cu; called by the torch-side wrappers in csrc/ops_cuda.cpp, which
// check shapes, dtypes and devices first. Index values inside tensors (num_draft, draft tokens,
// positions) are checked on the device: a bad one stops the kernel with a printed message.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace swiftkern {
namespace cuda {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// greedy_accept: draft [B, K] int64; logits [B, K+1, V] (V contiguous); num_draft [B] int32 in
// [0, K] -> out [B, K+1] int64 (contiguous), num_accepted [B] int32.
struct GreedyAcceptArgs {
  const int64_t* draft; int64_t draft_sb, draft_sk;
  const void* logits; DType logits_dtype; int64_t logits_sb, logits_sk;
  const int32_t* num_draft; int64_t num_draft_s;
  int64_t* out; int32_t* num_accepted;
  int64_t B, K, V;
  // scratch of greedy_keys_elems(B, K, V) uint64 argmax keys (each vocabulary chunk's best);
  // may be null when that is 0
  uint64_t* keys;
};
cudaError_t greedy_accept(const GreedyAcceptArgs& a, cudaStream_t stream);
int64_t greedy_keys_elems(int64_t B, int64_t K, int64_t V);
// Vocabulary chunks a position's argmax is split into: enough blocks for kGreedyBlocksPerSm per
// SM when there are few positions (B * (K+1)), each chunk at least kGreedyMinChunk elements; 1
// when the positions alone fill the GPU (one block a row streamed at 93 % of an H100's copy
// bandwidth at B = 256, K = 8, V = 128256, but 9 blocks at B = 1 left it at 3 %).
// On unless SWIFTKERN_CUDA_GREEDY_SPLIT=0 (read at each launch): on an H200 it took B = 1, K = 8
// from 12.8 / 24.1 us to 8.9 / 9.1 us (V = 49152 / 128256) and B = 8, V = 128256 from 25.0 to
// 15.0 us, and left B >= 64 unchanged (bench/results/greedy_accept-nvidia-h200.csv).
constexpr int64_t kGreedyBlocksPerSm = 2, kGreedyMinChunk = 8192;
int64_t greedy_vocab_chunks(int64_t positions, int64_t V, int sms);
bool greedy_vocab_split_enabled();

// rejection_sample: draft [B, K] int64; draft_probs [B, K, V] float32 or null (one-hot draft);
// target_probs [B, K+1, V] float32 (V contiguous); num_draft [B] int32; u_accept [B, K] and
// u_sample [B, K+1] float32 -> out [B, K+1] int64 (contiguous), num_accepted [B] int32.
struct RejectionSampleArgs {
  const int64_t* draft; int64_t draft_sb, draft_sk;
  const float* draft_probs; int64_t q_sb, q_sk;
  const float* target_probs; int64_t p_sb, p_sk;
  const int32_t* num_draft; int64_t num_draft_s;
  const float* u_accept; int64_t ua_sb, ua_sk;
  const float* u_sample; int64_t us_sb, us_sk;
  int64_t* out; int32_t* num_accepted;
  int64_t B, K, V;
};
cudaError_t rejection_sample(const RejectionSampleArgs& a, cudaStream_t stream);

// kv_compact on both caches [L, B, H, S, D] (D contiguous, same strides and element size):
// entry i < counts[b] of row b moves from src[b, i] to dst_start[b] + i in every layer and head;
// all sources are read before any destination is written. src [B, M] int64, dst_start [B]
// int64, counts [B] int32. `workspace` is needed only when kv_compact_workspace_bytes(a) > 0.
struct KvCompactArgs {
  void* k_cache; void* v_cache; int64_t elem_bytes;
  int64_t L, B, H, S, D;
  int64_t s_l, s_b, s_h, s_s;  // cache strides (elements); stride of D is 1
  const int64_t* src; int64_t src_sb, src_sm;
  const int64_t* dst_start; int64_t dst_s;
  const int32_t* counts; int64_t counts_s;
  int64_t M;
  void* workspace;
};
int64_t kv_compact_workspace_bytes(const KvCompactArgs& a);
cudaError_t kv_compact(const KvCompactArgs& a, cudaStream_t stream);

// fused_add_rms_norm over N rows of H: new_residual = residual + x (rounded to the dtype);
// normed = weight * dtype(new_residual * rsqrt(mean(new_residual^2) + eps)). Rows of x,
// residual, normed, new_residual at their row strides, H contiguous; weight [H] contiguous.
struct FusedAddRmsNormArgs {
  const void* x; int64_t x_s;
  const void* residual; int64_t r_s;
  const void* weight;
  void* normed; int64_t n_s;
  void* new_residual; int64_t nr_s;
  DType dtype; int64_t N, H; float eps;
};
cudaError_t fused_add_rms_norm(const FusedAddRmsNormArgs& a, cudaStream_t stream);

// rope_kv_append: q [B, Hq, T, D], k and v [B, Hkv, T, D], cos and sin [B, T, D], caches
// [B, Hkv, S, D], positions [B, T] int64 in [0, S), out [B, Hq, T, D]; D even and contiguous.
// out = rope(q); k_cache[b, h, positions[b, t]] = rope(k); v_cache[...] = v. One dtype for all.
struct Strides4 { int64_t b, h, t; };  // the D stride is 1
struct RopeKvAppendArgs {
  const void* q; Strides4 q_s;
  const void* k; Strides4 k_s;
  const void* v; Strides4 v_s;
  const void* cos; int64_t cos_sb, cos_st;
  const void* sin; int64_t sin_sb, sin_st;
  void* k_cache; Strides4 kc_s;
  void* v_cache; Strides4 vc_s;
  const int64_t* positions; int64_t pos_sb, pos_st;
  void* out; Strides4 out_s;
  DType dtype; int64_t B, Hq, Hkv, T, D, S;
};
cudaError_t rope_kv_append(const RopeKvAppendArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace swiftkern
