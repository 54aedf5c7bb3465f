// rejection_sample kernel: one block per row, the same tokens as the CPU kernel and the reference.
//
// Acceptance: every draft j < num_draft[b] is tested in parallel (u_accept * q(x) < p(x) in
// float64, as the CPU kernel), and the first rejection ends the accepted prefix.
//
// The draw: the CPU kernel returns the smallest i whose left-to-right float64 running sum S_i
// of the weights w exceeds t = u * S_{V-1}. A serial chain over V is slow on a GPU, so the block
// first sums in parallel: each thread sums a contiguous segment, a block scan gives every
// segment's offset, and the thread whose segment crosses u * total walks it to the crossing i*.
// Those sums P differ from S by rounding only; for non-negative finite weights both are within
// V * 2^-53 (relative) of the exact sums, so if P_{i*} and P_{i*-1} clear u * total by a margin
// of 16 (V + 2) 2^-53 (relative) the serial chain would stop at i* as well. Otherwise (weights
// negative or not finite, or u * total within the margin of a running sum: about V * 1e-15 of
// draws) the block runs the serial chain exactly as the CPU kernel does, chunk by chunk.
#pragma once

#include "cuda_common.cuh"

namespace swiftkern {
namespace cuda {

constexpr int kRejectionThreads = 512;
constexpr int64_t kSerialChunk = 1024;  // rejection_sample_cpu.cpp's kChunk: same chunked search

// What a token is drawn from: w(i) = max(lo, p[i] - q[i] - [i == x]) (q may be null, x -1);
// lo = 0 for a residual, -inf for p itself (the bonus token, or an all-zero residual).
struct Draw {
  const float* p;
  const float* q;
  int64_t x;
  double lo, u;
};

__device__ __forceinline__ double weight_of(const Draw& d, int64_t i, float p, float q) {
  double v = d.q ? static_cast<double>(p) - static_cast<double>(q) : static_cast<double>(p);
  if (i == d.x) v -= 1.0;
  return v < d.lo ? d.lo : v;
}

__device__ __forceinline__ double weight_at(const Draw& d, int64_t i) {
  return weight_of(d, i, d.p[i], d.q ? d.q[i] : 0.0f);
}

// Left-to-right sum of w over [i0, i1) and whether every w was finite and >= 0. With kVec the
// rows are 16-byte aligned and i0 is a multiple of 4.
template <bool kVec>
__device__ __forceinline__ double segment_sum(const Draw& d, int64_t i0, int64_t i1, bool* ok) {
  double s = 0.0;
  bool good = true;
  int64_t i = i0;
  if (kVec) {
    for (; i + 4 <= i1; i += 4) {
      const float4 p4 = *reinterpret_cast<const float4*>(d.p + i);
      const float4 q4 = d.q ? *reinterpret_cast<const float4*>(d.q + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      const double w0 = weight_of(d, i, p4.x, q4.x), w1 = weight_of(d, i + 1, p4.y, q4.y);
      const double w2 = weight_of(d, i + 2, p4.z, q4.z), w3 = weight_of(d, i + 3, p4.w, q4.w);
      good &= (w0 >= 0.0 && w0 <= 1e300) & (w1 >= 0.0 && w1 <= 1e300) & (w2 >= 0.0 && w2 <= 1e300) &
              (w3 >= 0.0 && w3 <= 1e300);
      s += w0; s += w1; s += w2; s += w3;
    }
  }
  for (; i < i1; ++i) {
    const double w = weight_at(d, i);
    good &= (w >= 0.0 && w <= 1e300);
    s += w;
  }
  *ok = good;
  return s;
}

struct RejectionShared {
  double scratch[32];
  int iscratch[32];
  double chunk[kSerialChunk];
  double value;
  int64_t index;
  int first_reject;
};

// The fast draw: the token, -1 when it cannot be decided this way, or -2 when the weights are
// fine but all zero (the caller then draws from p). Called by the whole block.
template <int kThreads, bool kVec>
__device__ int64_t parallel_draw(const Draw& d, int64_t V, int64_t seg, bool empty_is_special,
                                 RejectionShared& sh) {
  const int64_t i0 = threadIdx.x * seg, i1 = i0 + seg < V ? i0 + seg : V;
  bool ok = true;
  const double mine = i0 < V ? segment_sum<kVec>(d, i0, i1, &ok) : 0.0;
  double total;
  const double before = block_exclusive_sum<kThreads>(mine, sh.scratch, &total);
  if (!__syncthreads_and(ok) || !(total <= 1e300)) return -1;
  if (empty_is_special && !(total > 0.0)) return -2;
  const double t = d.u * total;
  const bool crosses = i0 < V && before + mine > t;
  const int first = block_reduce<kThreads>(crosses ? static_cast<int>(threadIdx.x) : kThreads,
                                           [](int a, int b) { return a < b ? a : b; }, sh.iscratch);
  if (first == kThreads) return -1;
  if (threadIdx.x == first) {
    const double margin = 16.0 * (static_cast<double>(V) + 2.0) * 0x1p-53;
    double local = 0.0, below = before;
    int64_t found = -1;
    for (int64_t i = i0; i < i1; ++i) {
      local += weight_at(d, i);
      const double at = before + local;
      if (at > t) {
        if (at > t * (1.0 + margin) && below <= t * (1.0 - margin)) found = i;
        break;
      }
      below = at;
    }
    sh.index = found;
  }
  __syncthreads();
  const int64_t index = sh.index;
  __syncthreads();
  return index;
}

// Sum of w left to right from 0 (one thread adds; the block stages chunks in shared memory).
template <int kThreads>
__device__ double serial_total(const Draw& d, int64_t V, RejectionShared& sh) {
  double s = 0.0;
  for (int64_t c0 = 0; c0 < V; c0 += kSerialChunk) {
    const int64_t n = V - c0 < kSerialChunk ? V - c0 : kSerialChunk;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) sh.chunk[i] = weight_at(d, c0 + i);
    __syncthreads();
    if (threadIdx.x == 0)
      for (int64_t i = 0; i < n; ++i) s += sh.chunk[i];
    __syncthreads();
  }
  if (threadIdx.x == 0) sh.value = s;
  __syncthreads();
  s = sh.value;
  __syncthreads();
  return s;
}

// The CPU kernel's search: the first chunk whose closing running sum exceeds t, then the first
// element of that chunk whose running sum does; V - 1 if none.
template <int kThreads>
__device__ int64_t serial_search(const Draw& d, int64_t V, double t, RejectionShared& sh) {
  double s = 0.0;
  if (threadIdx.x == 0) sh.index = -1;
  for (int64_t c0 = 0; c0 < V; c0 += kSerialChunk) {
    const int64_t n = V - c0 < kSerialChunk ? V - c0 : kSerialChunk;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) sh.chunk[i] = weight_at(d, c0 + i);
    __syncthreads();
    if (threadIdx.x == 0) {
      const double start = s;
      for (int64_t i = 0; i < n; ++i) s += sh.chunk[i];
      if (s > t) {
        double r = start;
        for (int64_t i = 0; i < n; ++i)
          if ((r += sh.chunk[i]) > t) { sh.index = c0 + i; break; }
      }
    }
    __syncthreads();
    if (sh.index >= 0) break;
  }
  const int64_t index = sh.index;
  __syncthreads();
  return index >= 0 ? index : V - 1;
}

// The token drawn from `d` (a residual when `residual`: an all-zero one falls back to p).
template <int kThreads>
__device__ int64_t draw_token(Draw d, bool residual, int64_t V, int64_t seg, bool vec, RejectionShared& sh) {
  int64_t token = vec ? parallel_draw<kThreads, true>(d, V, seg, residual, sh)
                      : parallel_draw<kThreads, false>(d, V, seg, residual, sh);
  if (token == -2) {  // all-zero residual: draw from p
    d = {d.p, nullptr, -1, -INFINITY, d.u};
    residual = false;
    token = vec ? parallel_draw<kThreads, true>(d, V, seg, false, sh)
                : parallel_draw<kThreads, false>(d, V, seg, false, sh);
  }
  if (token >= 0) return token;
  double total = serial_total<kThreads>(d, V, sh);
  if (residual && !(total > 0.0)) {
    d = {d.p, nullptr, -1, -INFINITY, d.u};
    total = serial_total<kThreads>(d, V, sh);
  }
  return serial_search<kThreads>(d, V, d.u * total, sh);
}

// grid: B blocks of kThreads; block b writes out[b, :] and num_accepted[b].
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
rejection_sample_kernel(const int64_t* __restrict__ draft, int64_t d_sb, int64_t d_sk,
                        const float* __restrict__ q_probs, int64_t q_sb, int64_t q_sk,
                        const float* __restrict__ p_probs, int64_t p_sb, int64_t p_sk,
                        const int32_t* __restrict__ num_draft, int64_t n_s,
                        const float* __restrict__ u_acc, int64_t ua_sb, int64_t ua_sk,
                        const float* __restrict__ u_smp, int64_t us_sb, int64_t us_sk,
                        int64_t* __restrict__ out, int32_t* __restrict__ num_accepted,
                        int64_t K, int64_t V, int64_t seg) {
  __shared__ RejectionShared sh;
  const int64_t b = blockIdx.x;
  const int32_t nd = num_draft[b * n_s];
  SWIFTKERN_DEVICE_REQUIRE(nd >= 0 && nd <= K, "rejection_sample: num_draft[%lld] = %d is outside [0, K = %lld]\n",
                           static_cast<long long>(b), nd, static_cast<long long>(K));
  if (threadIdx.x == 0) sh.first_reject = nd;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < nd; j += kThreads) {
    const int64_t x = draft[b * d_sb + j * d_sk];
    SWIFTKERN_DEVICE_REQUIRE(x >= 0 && x < V, "rejection_sample: draft_tokens[%lld, %lld] = %lld is outside [0, V = %lld)\n",
                             static_cast<long long>(b), static_cast<long long>(j), static_cast<long long>(x),
                             static_cast<long long>(V));
    const double p = p_probs[b * p_sb + j * p_sk + x];
    const double q = q_probs ? static_cast<double>(q_probs[b * q_sb + j * q_sk + x]) : 1.0;
    if (!(static_cast<double>(u_acc[b * ua_sb + j * ua_sk]) * q < p)) atomicMin(&sh.first_reject, static_cast<int>(j));
  }
  __syncthreads();
  const int64_t a = sh.first_reject;
  const bool residual = a < nd;
  Draw d = {p_probs + b * p_sb + a * p_sk, nullptr, -1, -INFINITY, static_cast<double>(u_smp[b * us_sb + a * us_sk])};
  if (residual) {
    d.lo = 0.0;
    if (q_probs) d.q = q_probs + b * q_sb + a * q_sk;
    else d.x = draft[b * d_sb + a * d_sk];
  }
  const bool vec = seg % 4 == 0 && reinterpret_cast<uintptr_t>(d.p) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(q_probs ? q_probs + b * q_sb + a * q_sk : d.p) % 16 == 0;
  const int64_t token = draw_token<kThreads>(d, residual, V, seg, vec, sh);
  for (int64_t j = threadIdx.x; j <= K; j += kThreads)
    out[b * (K + 1) + j] = j < a ? draft[b * d_sb + j * d_sk] : (j == a ? token : -1);
  if (threadIdx.x == 0) num_accepted[b] = static_cast<int32_t>(a);
}

}  // namespace cuda
}  // namespace swiftkern
