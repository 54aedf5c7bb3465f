// Launcher of fused_add_rms_norm (kernel in fused_add_rms_norm.cuh): picks 16-byte or scalar
// access, the block size and the registers per thread from H, on `stream`.
#include "fused_add_rms_norm.cuh"

namespace swiftkern {
namespace cuda {
namespace {

constexpr int64_t kMaxHidden = 32768;  // 1024 threads x 32 scalar registers (or 8 16-byte chunks)

template <class Ty, int kVec, int kIters>
cudaError_t launch(const FusedAddRmsNormArgs& a, int threads, cudaStream_t stream) {
  fused_add_rms_norm_kernel<Ty, kVec, kIters><<<static_cast<unsigned>(a.N), threads, 0, stream>>>(a);
  return last_launch_error();
}

// kIters: the smallest power of two with threads * kIters * kVec >= H.
template <class Ty, int kVec>
cudaError_t launch_iters(const FusedAddRmsNormArgs& a, cudaStream_t stream) {
  const int64_t chunks = a.H / kVec;
  const int threads = static_cast<int>(chunks >= 1024 ? 1024 : div_up<int64_t>(chunks, 32) * 32);
  const int64_t iters = div_up<int64_t>(chunks, threads);
  if (iters <= 1) return launch<Ty, kVec, 1>(a, threads, stream);
  if (iters <= 2) return launch<Ty, kVec, 2>(a, threads, stream);
  if (iters <= 4) return launch<Ty, kVec, 4>(a, threads, stream);
  if (iters <= 8) return launch<Ty, kVec, 8>(a, threads, stream);
  if (kVec == 1 && iters <= 16) return launch<Ty, 1, 16>(a, threads, stream);
  if (kVec == 1 && iters <= 32) return launch<Ty, 1, 32>(a, threads, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

int64_t fused_add_rms_norm_max_hidden(DType) { return kMaxHidden; }

cudaError_t fused_add_rms_norm(const FusedAddRmsNormArgs& a, cudaStream_t stream) {
  if (a.N == 0) return cudaSuccess;
  if (a.H < 1 || a.H > kMaxHidden || a.N > 0x7fffffff) return cudaErrorInvalidValue;
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
