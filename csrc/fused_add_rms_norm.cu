// Launcher of fused_add_rms_norm (kernel in fused_add_rms_norm.cuh): picks 16-byte or scalar
// access, the block size and the registers per thread from H, on `stream`.
#include "fused_add_rms_norm.cuh"

namespace swiftkern {
namespace cuda {
namespace {

template <class Ty, int kVec, int kIters>
cudaError_t launch(const FusedAddRmsNormArgs& a, int threads, cudaStream_t stream) {
  fused_add_rms_norm_kernel<Ty, kVec, kIters><<<static_cast<unsigned>(a.N), threads, 0, stream>>>(a);
  return last_launch_error();
}

// kIters: the smallest power of two with threads * kIters * kVec >= H while a thread's slice fits
// in its registers (ptxas -v on sm_80 and sm_90a: 8 16-byte chunks of 16-bit values or 32 scalars
// spill, 8 chunks of fp32 values and 16 scalars do not; .ci/nvcc_check.sh fails on a spill);
// past that, kIters = 0 reads the new residual back.
template <class Ty, int kVec>
cudaError_t launch_iters(const FusedAddRmsNormArgs& a, cudaStream_t stream) {
  const int64_t chunks = a.H / kVec;
  const int threads = static_cast<int>(chunks >= 1024 ? 1024 : div_up<int64_t>(chunks, 32) * 32);
  const int64_t iters = div_up<int64_t>(chunks, threads);
  if (iters <= 1) return launch<Ty, kVec, 1>(a, threads, stream);
  if (iters <= 2) return launch<Ty, kVec, 2>(a, threads, stream);
  if (iters <= 4) return launch<Ty, kVec, 4>(a, threads, stream);
  if constexpr (kVec != 8) {
    if (iters <= 8) return launch<Ty, kVec, 8>(a, threads, stream);
  }
  if constexpr (kVec == 1) {
    if (iters <= 16) return launch<Ty, 1, 16>(a, threads, stream);
  }
  return launch<Ty, kVec, 0>(a, threads, stream);
}

}  // namespace

cudaError_t fused_add_rms_norm(const FusedAddRmsNormArgs& a, cudaStream_t stream) {
  if (a.N == 0) return cudaSuccess;
  if (a.H < 1 || a.N > 0x7fffffff) return cudaErrorInvalidValue;
  return dispatch_dtype(a.dtype, [&](auto ty) {
    using Ty = decltype(ty);
    constexpr int kVec = Pack<typename Ty::Storage>::kSize;
    const int64_t row_bytes_mod = (a.x_s | a.r_s | a.n_s | a.nr_s) * static_cast<int64_t>(sizeof(typename Ty::Storage));
    const bool vec = a.H % kVec == 0 && row_bytes_mod % 16 == 0 && aligned16(a.x) && aligned16(a.residual) &&
                     aligned16(a.weight) && aligned16(a.normed) && aligned16(a.new_residual);
    return vec ? launch_iters<Ty, kVec>(a, stream) : launch_iters<Ty, 1>(a, stream);
  });
}

}  // namespace cuda
}  // namespace swiftkern
