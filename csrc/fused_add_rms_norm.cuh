// fused_add_rms_norm kernel: one block per row. Each thread keeps its slice of the new residual
// in registers (in storage form) between the sum of squares and the scaling, so a row is read and written once;
// loads and stores are 16 bytes wide when the row size and addresses allow (kVec elements).
// kIters = 0 is for rows longer than the registers hold (any H): the scaling reads the new residual
// back from the thread's own writes (in L2 by then) instead of keeping it.
//
// Numerics as the reference (HF LlamaRMSNorm after `residual + x`): the sum is rounded to the
// dtype and stored; its fp32 squares are summed; normed = weight * dtype(s * rsqrt(mean + eps)).
#pragma once

#include "cuda_common.cuh"

namespace swiftkern {
namespace cuda {

// the new residual dtype(residual + x), its fp32 squares added to sum_sq in element order
template <class Ty, int kVec>
__device__ __forceinline__ Chunk<typename Ty::Storage, kVec> added(const Chunk<typename Ty::Storage, kVec>& xc,
                                                                  const Chunk<typename Ty::Storage, kVec>& rc,
                                                                  float& sum_sq) {
  Chunk<typename Ty::Storage, kVec> s;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    s.v[e] = Ty::store(Ty::load(rc.v[e]) + Ty::load(xc.v[e]));
    const float v = Ty::load(s.v[e]);
    sum_sq += v * v;
  }
  return s;
}

// normed = weight * dtype(sum * rstd), element by element
template <class Ty, int kVec>
__device__ __forceinline__ Chunk<typename Ty::Storage, kVec> scaled(const Chunk<typename Ty::Storage, kVec>& sum,
                                                                   const Chunk<typename Ty::Storage, kVec>& wc,
                                                                   float rstd) {
  Chunk<typename Ty::Storage, kVec> out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) out.v[e] = Ty::store(Ty::load(wc.v[e]) * Ty::load(Ty::store(Ty::load(sum.v[e]) * rstd)));
  return out;
}

template <class Ty, int kVec, int kIters>
__global__ void __launch_bounds__(1024) fused_add_rms_norm_kernel(FusedAddRmsNormArgs a) {
  using S = typename Ty::Storage;
  using C = Chunk<S, kVec>;
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const C* x = reinterpret_cast<const C*>(static_cast<const S*>(a.x) + row * a.x_s);
  const C* r = reinterpret_cast<const C*>(static_cast<const S*>(a.residual) + row * a.r_s);
  const C* w = static_cast<const C*>(a.weight);
  C* normed = reinterpret_cast<C*>(static_cast<S*>(a.normed) + row * a.n_s);
  C* new_res = reinterpret_cast<C*>(static_cast<S*>(a.new_residual) + row * a.nr_s);
  const int64_t chunks = a.H / kVec;

  float sum_sq = 0.0f;
  if constexpr (kIters == 0) {
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) new_res[c] = added<Ty, kVec>(x[c], r[c], sum_sq);
    sum_sq = block_reduce<1024>(sum_sq, [](float p, float q) { return p + q; }, scratch);
    const float rstd = 1.0f / sqrtf(sum_sq / static_cast<float>(a.H) + a.eps);
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) normed[c] = scaled<Ty, kVec>(new_res[c], w[c], rstd);
  } else {
    C sum[kIters];  // the rounded new residual, kept in storage form (fewer registers)
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t c = static_cast<int64_t>(it) * blockDim.x + threadIdx.x;
      if (c < chunks) new_res[c] = sum[it] = added<Ty, kVec>(x[c], r[c], sum_sq);
    }
    sum_sq = block_reduce<1024>(sum_sq, [](float p, float q) { return p + q; }, scratch);
    const float rstd = 1.0f / sqrtf(sum_sq / static_cast<float>(a.H) + a.eps);
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t c = static_cast<int64_t>(it) * blockDim.x + threadIdx.x;
      if (c < chunks) normed[c] = scaled<Ty, kVec>(sum[it], w[c], rstd);
    }
  }
}

}  // namespace cuda
}  // namespace swiftkern
