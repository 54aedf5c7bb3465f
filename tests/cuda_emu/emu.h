// A CPU emulation of the CUDA runtime and of the device intrinsics the kernels in csrc/ use, so
// that tests run those kernels (and csrc/ops_cuda.cpp around them) without a GPU. The files
// cuda_runtime.h, cuda_runtime_api.h, cuda_bf16.h and cuda_fp16.h here stand in for CUDA's;
// build.py compiles csrc/*.cu as C++ against them after rewriting `kernel<<<grid, block, smem,
// stream>>>(args)` into `::emu::Launch(grid, block, smem, stream).kernel(&kernel)(args)` and
// `extern __shared__ T name[]` into a pointer to the launch's dynamic shared memory.
//
// How a launch runs (emu_runtime.cpp): blocks one after another; a block's threads as fibers
// (ucontext) on the calling thread, switched at __syncthreads and warp shuffles, in the schedule
// SWIFTKERN_EMULATED_SCHEDULE names (lockstep, or warps: one warp at a time, which exposes a
// missing __syncthreads). __shared__ is `static` (one block at a time, so a static is that
// block's shared memory), filled with 0xff bytes when a block starts using it. What it checks:
// the kernels' arithmetic, indexing, launch plans and barriers (a barrier some threads never
// reach is reported). What it does not: races between truly concurrent threads, the memory
// model, timing.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
typedef struct EmuStream* cudaStream_t;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaGetDevice(int* device);
// the SM count: SWIFTKERN_EMULATED_SMS (default 132, an H100's), read at each call
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);

namespace emu {

const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void* dynamic_shared();
// Fills [p, p + bytes) with garbage the first time it is called in a block (a static __shared__).
void fresh_shared(void* p, size_t bytes);
void sync_block();
// Every live lane of the caller's warp publishes `bits`, then gets lane `src`'s (its own when src
// is outside the warp).
uint64_t warp_exchange(uint64_t bits, int src);
[[noreturn]] void trap();

// One launch: checks the configuration as CUDA does, then runs body() as every thread of every block.
// device work the stream got so far: kernel launches and memsets (a CUDA graph's nodes)
struct StreamWork {
  long long kernels = 0, memsets = 0;
};
StreamWork& stream_work();

struct Launch {
  dim3 grid, block;
  size_t shared_bytes;
  Launch(dim3 grid_, dim3 block_, size_t shared_bytes_ = 0, cudaStream_t = nullptr)
      : grid(grid_), block(block_), shared_bytes(shared_bytes_) {}
  void run(void (*body)(void*), void* context) const;

  template <class... P>
  struct Bound {
    const Launch* launch;
    void (*fn)(P...);
    template <class... A>
    void operator()(A&&... args) const {
      struct Call {
        void (*fn)(P...);
        std::tuple<P...> args;
      } call{fn, std::tuple<P...>(std::forward<A>(args)...)};
      launch->run([](void* c) { auto* k = static_cast<Call*>(c); std::apply(k->fn, k->args); }, &call);
    }
  };
  template <class... P>
  Bound<P...> kernel(void (*fn)(P...)) const { return {this, fn}; }
};

template <class T>
T exchange_as(T v, int src) {
  static_assert(sizeof(T) <= 8, "warp shuffles of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_exchange(bits, src);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline int lane() { return static_cast<int>(thread_idx().x % 32); }

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())

inline void __syncthreads() { ::emu::sync_block(); }
inline int __syncthreads_and(int predicate) {
  static int all;  // this block's (one block runs at a time)
  ::emu::sync_block();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) all = 1;
  ::emu::sync_block();
  if (!predicate) all = 0;
  ::emu::sync_block();
  const int result = all;
  ::emu::sync_block();
  return result;
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) { return ::emu::exchange_as(v, ::emu::lane() ^ lane_mask); }
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned delta) {
  const int src = ::emu::lane() - static_cast<int>(delta);
  return ::emu::exchange_as(v, src >= 0 ? src : ::emu::lane());
}
[[noreturn]] inline void __trap() { ::emu::trap(); }

// fibers run one at a time, so these are atomic as written
inline int atomicMin(int* p, int v) { const int old = *p; if (v < old) *p = v; return old; }
inline int atomicMax(int* p, int v) { const int old = *p; if (v > old) *p = v; return old; }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  if (v > old) *p = v;
  return old;
}
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }
inline float atomicAdd(float* p, float v) { const float old = *p; *p += v; return old; }

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// the host compiler must not contract these into an fma (build.py passes -ffp-contract=off)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// bfloat16 / float16 storage, converted as CUDA does (round to nearest even; CUDA's NaN)
struct __nv_bfloat16 { uint16_t x; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  if (f != f) return {0x7fff};
  return {static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
struct __half { uint16_t x; };
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { _Float16 v; std::memcpy(&v, &h.x, 2); return static_cast<float>(v); }
inline __half __float2half_rn(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  __half h;
  std::memcpy(&h.x, &v, 2);
  if (f != f) h.x = 0x7fff;
  return h;
}
