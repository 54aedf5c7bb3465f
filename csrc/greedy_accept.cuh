// greedy_accept kernels: blocks over (verified position, vocabulary chunk) compute the row's
// argmax (fp32, torch.argmax's rules), then one thread per row walks its drafts. No [B, K+1, V]
// temporary: the target token of position j goes straight into out[b, j], which the walk turns
// into the final row (accepted drafts equal their targets, so only the tail changes to -1). With
// one chunk a row (many rows) out[b, j] gets the index; with several (few rows: the vocabulary
// split so the GPU fills up) each chunk's best goes into a scratch of argmax_keys, one a
// (position, chunk), and the walk's block reduces a row's keys to indices first (no zeroed
// buffer, so no third launch).
//
// Argmax rules (as torch.argmax): the first NaN wins over everything; otherwise the largest
// value, ties to the lowest index; a row of -inf gives 0.
#pragma once

#include "argmax_key.h"
#include "cuda_common.cuh"

namespace swiftkern {
namespace cuda {

struct ArgBest {
  float value;
  int64_t index;  // -1: nothing seen yet
};

// Visit element i after every element this thread saw before (indices increase).
__device__ __forceinline__ void visit(ArgBest& best, float v, int64_t i) {
  if (best.index < 0 || v > best.value || (v != v && best.value == best.value)) best = {v, i};
}

// Is a preferred over b (any order of indices)?
__device__ __forceinline__ bool better(const ArgBest& a, const ArgBest& b) {
  if (b.index < 0) return a.index >= 0;
  if (a.index < 0) return false;
  const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
  if (a_nan || b_nan) return a_nan && (!b_nan || a.index < b.index);
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ __forceinline__ ArgBest shfl_xor(const ArgBest& a, int o) {
  return {__shfl_xor_sync(0xffffffffu, a.value, o),
          static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(a.index), o))};
}

template <int kThreads>
__device__ __forceinline__ ArgBest block_argmax(ArgBest v) {
  __shared__ float s_value[kThreads / 32];
  __shared__ int64_t s_index[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const ArgBest other = shfl_xor(v, o);
    if (better(other, v)) v = other;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) { s_value[warp] = v.value; s_index[warp] = v.index; }
  __syncthreads();
  ArgBest best = {s_value[0], s_index[0]};
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) {
    const ArgBest other = {s_value[w], s_index[w]};
    if (better(other, best)) best = other;
  }
  return best;
}

// The argmax of row[0:V] over the block. 16-byte loads for the aligned middle of the row; each
// thread visits its elements in increasing index order (head, vectors, tail).
template <class Ty, int kThreads>
__device__ __forceinline__ ArgBest row_argmax(const typename Ty::Storage* row, int64_t V) {
  using S = typename Ty::Storage;
  constexpr int kVec = Pack<S>::kSize;
  const int64_t misalign = (reinterpret_cast<uintptr_t>(row) % 16) / sizeof(S);
  const int64_t head = misalign ? (V < kVec - misalign ? V : kVec - misalign) : 0;
  const int64_t num_vecs = (V - head) / kVec;
  const int64_t tail = head + num_vecs * kVec;
  const Pack<S>* vecs = reinterpret_cast<const Pack<S>*>(row + head);
  ArgBest best = {0.0f, -1};
  if (threadIdx.x < head) visit(best, Ty::load(row[threadIdx.x]), threadIdx.x);
  for (int64_t p = threadIdx.x; p < num_vecs; p += kThreads) {
    const Pack<S> pk = vecs[p];
#pragma unroll
    for (int e = 0; e < kVec; ++e) visit(best, Ty::load(pk.v[e]), head + p * kVec + e);
  }
  const int64_t i = tail + threadIdx.x;
  if (i < V) visit(best, Ty::load(row[i]), i);
  return block_argmax<kThreads>(best);
}

// grid: (B * (K+1), chunks) blocks; block (b, j) = blockIdx.x / (K+1), % (K+1) reads
// logits[b, j, c * chunk : (c+1) * chunk] for c = blockIdx.y. Positions past num_draft[b] are
// never needed and are skipped.
template <class Ty, int kThreads>
__global__ void __launch_bounds__(kThreads)
greedy_argmax_kernel(const typename Ty::Storage* __restrict__ logits, int64_t l_sb, int64_t l_sk,
                     const int32_t* __restrict__ num_draft, int64_t n_s, int64_t* __restrict__ out,
                     uint64_t* __restrict__ keys, int64_t K, int64_t V, int64_t chunk) {
  const int64_t b = blockIdx.x / (K + 1), j = blockIdx.x % (K + 1);
  const int32_t nd = num_draft[b * n_s];
  SWIFTKERN_DEVICE_REQUIRE(nd >= 0 && nd <= K, "greedy_accept: num_draft[%lld] = %d is outside [0, K = %lld]\n",
                           static_cast<long long>(b), nd, static_cast<long long>(K));
  if (j > nd) return;
  const int64_t start = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t n = V - start < chunk ? V - start : chunk;
  const ArgBest best = row_argmax<Ty, kThreads>(logits + b * l_sb + j * l_sk + start, n);
  if (threadIdx.x != 0) return;
  if (gridDim.y == 1) out[b * (K + 1) + j] = best.index;
  else keys[static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y] = argmax_key(best.value, start + best.index);
}

// Row b's walk: out[b, 0..num_draft[b]] hold its targets; keep the drafts that match (they equal
// their targets), the target at the first mismatch, then -1.
__device__ __forceinline__ void walk_row(const int64_t* __restrict__ draft, int64_t d_sb, int64_t d_sk, int64_t b,
                                         int64_t nd, int64_t K, int64_t* __restrict__ o,
                                         int32_t* __restrict__ num_accepted) {
  int64_t a = 0;
  while (a < nd && draft[b * d_sb + a * d_sk] == o[a]) ++a;
  for (int64_t i = a + 1; i <= K; ++i) o[i] = -1;
  num_accepted[b] = static_cast<int32_t>(a);
}

// One block a row: each warp takes positions 0..num_draft[b] in turn and reduces their chunks'
// keys (the largest key is the argmax) into out[b, j], then thread 0 walks the row.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
greedy_finalize_keyed_kernel(const int64_t* __restrict__ draft, int64_t d_sb, int64_t d_sk,
                             const int32_t* __restrict__ num_draft, int64_t n_s, const uint64_t* __restrict__ keys,
                             int64_t* __restrict__ out, int32_t* __restrict__ num_accepted, int64_t K, int64_t chunks) {
  const int64_t b = blockIdx.x;
  const int64_t nd = num_draft[b * n_s];
  int64_t* o = out + b * (K + 1);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t j = warp; j <= nd; j += kThreads / 32) {
    const uint64_t* row = keys + (b * (K + 1) + j) * chunks;
    unsigned long long best = 0;
    for (int64_t c = lane; c < chunks; c += 32) best = row[c] > best ? row[c] : best;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, off);
      best = other > best ? other : best;
    }
    if (lane == 0) o[j] = argmax_key_index(best);
  }
  __syncthreads();
  if (threadIdx.x == 0) walk_row(draft, d_sb, d_sk, b, nd, K, o, num_accepted);
}

// One thread per row (one chunk a position: out[b, :] holds the target indices already).
__global__ void greedy_finalize_kernel(const int64_t* __restrict__ draft, int64_t d_sb, int64_t d_sk,
                                       const int32_t* __restrict__ num_draft, int64_t n_s,
                                       int64_t* __restrict__ out, int32_t* __restrict__ num_accepted,
                                       int64_t B, int64_t K) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= B) return;
  walk_row(draft, d_sb, d_sk, b, num_draft[b * n_s], K, out + b * (K + 1), num_accepted);
}

}  // namespace cuda
}  // namespace swiftkern
