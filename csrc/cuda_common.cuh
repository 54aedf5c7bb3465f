// Shared device helpers of the torch-free CUDA kernels: storage types, 16-byte packs, block
// reductions and scans, and the device-side input check.
//
// Storage is raw: float32 as float, bfloat16 and float16 as uint16_t bits, so launchers take
// plain pointers and nothing depends on torch's half types or on the __CUDA_NO_*_CONVERSIONS__
// flags torch's build sets. Every kernel loads to fp32, computes in fp32 (fp64 where stated),
// and stores in the storage type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "launchers.h"

namespace swiftkern {
namespace cuda {

// A violated input contract (an index outside its range) stops the kernel with a message rather
// than reading or writing outside a tensor; the host sees cudaErrorLaunchFailure at the next sync.
// The message is printed by a call that never returns, out of line: printf inline made the
// kernel keep its live values across the call (kv_compact's register kernel for 16-byte units,
// sm_90a: 76 registers with printf inline, 56 with this call, the same as with no check).
template <class... Args>
[[noreturn]] __device__ __noinline__ void device_fail(const char* format, Args... args) {
  printf(format, args...);
  __trap();
}

#define SWIFTKERN_DEVICE_REQUIRE(cond, ...)                                   \
  do {                                                                        \
    if (!(cond)) ::swiftkern::cuda::device_fail("swiftkern: " __VA_ARGS__); \
  } while (0)

struct F32 {
  using Storage = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float f) { return f; }
};
struct BF16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
  static __device__ __forceinline__ uint16_t store(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
struct F16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ uint16_t store(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

// Calls f(Ty{}) with the storage-type tag of dt (Ty::Storage is the element type).
template <class F>
inline cudaError_t dispatch_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::kFloat32: return f(F32{});
    case DType::kBFloat16: return f(BF16{});
    case DType::kFloat16: return f(F16{});
  }
  return cudaErrorInvalidValue;
}

// N storage elements loaded and stored as one access (N * sizeof(S) is 16 bytes, or N is 1).
template <class S, int N>
struct alignas(sizeof(S) * N) Chunk {
  static constexpr int kSize = N;
  S v[N];
};

// 16 bytes of storage elements, loaded and stored as one vector instruction.
template <class S>
using Pack = Chunk<S, static_cast<int>(16 / sizeof(S))>;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Ceiling division for launch sizes.
template <class T>
inline T div_up(T a, T b) { return (a + b - 1) / b; }

// The launch error of the last kernel (a bad configuration), cleared so it is reported once.
inline cudaError_t last_launch_error() { return cudaGetLastError(); }

// The current device's SM count, asked of the driver once per device (0 if it cannot say).
inline int current_device_sms() {
  constexpr int kDevices = 64;
  static int cached[kDevices] = {};  // a race writes the same value
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < kDevices && cached[device] > 0) return cached[device];
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) sms = 0;
  if (device < kDevices) cached[device] = sms;
  return sms;
}

// ---------------------------------------------------------------- reductions over a block
// Block sizes are multiples of 32, at most 1024. `scratch` is __shared__ storage of at least 32
// values; the functions synchronize the block and may be called back to back.

template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The reduction of v over the block (blockDim.x threads, at most kThreads), returned to every
// thread.
template <int kThreads, class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* scratch) {
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_reduce(v, op);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w)
    if (w < warps) v = op(v, scratch[w]);
  return v;
}

// Exclusive prefix sum of v over the block (exactly kThreads threads) in thread order; *total
// gets the block's sum.
template <int kThreads>
__device__ __forceinline__ double block_exclusive_sum(double v, double* scratch, double* total) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  double before = 0.0, all = 0.0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = all;
    all += scratch[w];
  }
  *total = all;
  const double prev = __shfl_up_sync(0xffffffffu, incl, 1);  // every lane takes part
  return lane == 0 ? before : before + prev;
}

}  // namespace cuda
}  // namespace swiftkern
