// rope_kv_append kernel: for each token (b, t), rotate every query and key head (rotate-half
// RoPE), write the rotated queries to `out` and the rotated keys and the values into the caches
// at positions[b, t]. A work item is kVec consecutive dimensions i of one head together with
// their partners i + D/2; 16-byte accesses when sizes and addresses allow.
//
// In fp32 the result is bit-identical to the reference: x1*c - x2*s and x2*c + x1*s with each
// product rounded (no fused multiply-add), as torch computes `x * cos + rotate_half(x) * sin`.
#pragma once

#include "cuda_common.cuh"

namespace swiftkern {
namespace cuda {

template <class Ty, int kVec>
__global__ void rope_kv_append_kernel(RopeKvAppendArgs a) {
  using S = typename Ty::Storage;
  using C = Chunk<S, kVec>;
  const int64_t b = blockIdx.x / a.T, t = blockIdx.x % a.T;
  const int64_t half = a.D / 2, per_head = half / kVec;
  const int64_t item = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t head = item / per_head, i = (item % per_head) * kVec;
  if (head >= a.Hq + 2 * a.Hkv) return;
  const int64_t pos = a.positions[b * a.pos_sb + t * a.pos_st];
  SWIFTKERN_DEVICE_REQUIRE(pos >= 0 && pos < a.S, "rope_kv_append: positions[%lld, %lld] = %lld is outside [0, S = %lld)\n",
                           static_cast<long long>(b), static_cast<long long>(t), static_cast<long long>(pos),
                           static_cast<long long>(a.S));
  if (head >= a.Hq + a.Hkv) {  // values: a plain copy into the cache
    const int64_t h = head - a.Hq - a.Hkv;
    const S* src = static_cast<const S*>(a.v) + b * a.v_s.b + h * a.v_s.h + t * a.v_s.t;
    S* dst = static_cast<S*>(a.v_cache) + b * a.vc_s.b + h * a.vc_s.h + pos * a.vc_s.t;
    *reinterpret_cast<C*>(dst + i) = *reinterpret_cast<const C*>(src + i);
    *reinterpret_cast<C*>(dst + i + half) = *reinterpret_cast<const C*>(src + i + half);
    return;
  }
  const S* src;
  S* dst;
  if (head < a.Hq) {
    src = static_cast<const S*>(a.q) + b * a.q_s.b + head * a.q_s.h + t * a.q_s.t;
    dst = static_cast<S*>(a.out) + b * a.out_s.b + head * a.out_s.h + t * a.out_s.t;
  } else {
    const int64_t h = head - a.Hq;
    src = static_cast<const S*>(a.k) + b * a.k_s.b + h * a.k_s.h + t * a.k_s.t;
    dst = static_cast<S*>(a.k_cache) + b * a.kc_s.b + h * a.kc_s.h + pos * a.kc_s.t;
  }
  const S* cos = static_cast<const S*>(a.cos) + b * a.cos_sb + t * a.cos_st;
  const S* sin = static_cast<const S*>(a.sin) + b * a.sin_sb + t * a.sin_st;
  const C x1 = *reinterpret_cast<const C*>(src + i), x2 = *reinterpret_cast<const C*>(src + i + half);
  const C c1 = *reinterpret_cast<const C*>(cos + i), c2 = *reinterpret_cast<const C*>(cos + i + half);
  const C s1 = *reinterpret_cast<const C*>(sin + i), s2 = *reinterpret_cast<const C*>(sin + i + half);
  C o1, o2;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float lo = Ty::load(x1.v[e]), hi = Ty::load(x2.v[e]);
    o1.v[e] = Ty::store(__fadd_rn(__fmul_rn(lo, Ty::load(c1.v[e])), -__fmul_rn(hi, Ty::load(s1.v[e]))));
    o2.v[e] = Ty::store(__fadd_rn(__fmul_rn(hi, Ty::load(c2.v[e])), __fmul_rn(lo, Ty::load(s2.v[e]))));
  }
  *reinterpret_cast<C*>(dst + i) = o1;
  *reinterpret_cast<C*>(dst + i + half) = o2;
}

}  // namespace cuda
}  // namespace swiftkern
