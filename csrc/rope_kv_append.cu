// Launcher of rope_kv_append (kernel in rope_kv_append.cuh): 16-byte or scalar accesses, one
// block row per token, on `stream`.
#include "rope_kv_append.cuh"

namespace swiftkern {
namespace cuda {
namespace {

constexpr int kThreads = 128;

bool strides_aligned(const Strides4& s, int64_t elem) { return ((s.b | s.h | s.t) * elem) % 16 == 0; }

template <class Ty, int kVec>
cudaError_t launch(const RopeKvAppendArgs& a, cudaStream_t stream) {
  const int64_t items = (a.Hq + 2 * a.Hkv) * (a.D / 2 / kVec);
  if (items == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.B * a.T), static_cast<unsigned>(div_up<int64_t>(items, kThreads)));
  rope_kv_append_kernel<Ty, kVec><<<grid, kThreads, 0, stream>>>(a);
  return last_launch_error();
}

}  // namespace

cudaError_t rope_kv_append(const RopeKvAppendArgs& a, cudaStream_t stream) {
  if (a.B * a.T == 0 || a.D == 0) return cudaSuccess;
  if (a.D % 2 != 0 || a.B * a.T > 0x7fffffff) return cudaErrorInvalidValue;
  return dispatch_dtype(a.dtype, [&](auto ty) {
    using Ty = decltype(ty);
    constexpr int kVec = Pack<typename Ty::Storage>::kSize;
    const int64_t e = sizeof(typename Ty::Storage);
    const bool vec = (a.D / 2) % kVec == 0 && strides_aligned(a.q_s, e) && strides_aligned(a.k_s, e) &&
                     strides_aligned(a.v_s, e) && strides_aligned(a.kc_s, e) && strides_aligned(a.vc_s, e) &&
                     strides_aligned(a.out_s, e) && ((a.cos_sb | a.cos_st | a.sin_sb | a.sin_st) * e) % 16 == 0 &&
                     aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.cos) && aligned16(a.sin) &&
                     aligned16(a.k_cache) && aligned16(a.v_cache) && aligned16(a.out);
    return vec ? launch<Ty, kVec>(a, stream) : launch<Ty, 1>(a, stream);
  });
}

}  // namespace cuda
}  // namespace swiftkern
