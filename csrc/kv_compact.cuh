// kv_compact kernels: entries are copied as raw bytes in the widest unit (16, 8, 4, 2 or 1 bytes)
// that the row size, base pointers and strides allow, so every dtype works the same way.
//
// Sources may overlap destinations, so all reads of a slice finish before its writes. The usual
// case (a verification's K+1 entries: at most kRegisterUnits units a thread) is
// kv_compact_registers_kernel: one block per (layer, row, head) holds both caches' kept entries
// in registers across one barrier. Larger slices take kv_compact_kernel, one block per (cache,
// layer, row, head): through shared memory (kStaged) when M entries fit, else through a global
// workspace with a gather kernel then a scatter kernel (stream order separates them).
#pragma once

#include "cuda_common.cuh"

namespace swiftkern {
namespace cuda {

enum KvCompactMode : int { kStaged = 0, kGather = 1, kScatter = 2 };

constexpr int kRegisterUnits = 4;  // copy units a thread holds per cache in kv_compact_registers_kernel

// Entry i, unit c of the units e = threadIdx.x, threadIdx.x + blockDim.x, ... of a slice whose
// entries are row_units units long, stepped without a division per unit.
struct UnitCursor {
  int i, c, di, dc, row_units;
  __device__ __forceinline__ UnitCursor(int row_units_)
      : i(static_cast<int>(threadIdx.x) / row_units_), c(static_cast<int>(threadIdx.x) % row_units_),
        di(static_cast<int>(blockDim.x) / row_units_), dc(static_cast<int>(blockDim.x) % row_units_),
        row_units(row_units_) {}
  __device__ __forceinline__ void next() {
    i += di;
    c += dc;
    if (c >= row_units) { c -= row_units; ++i; }
  }
};

// Block blockIdx.x's (layer, row, head) slice (h fastest), its row's count of kept entries and
// their destination start.
struct CompactSlice {
  int64_t l, b, h, n, start;
  __device__ __forceinline__ explicit CompactSlice(const KvCompactArgs& a) {
    const int64_t slice = blockIdx.x;
    h = slice % a.H;
    b = (slice / a.H) % a.B;
    l = slice / (a.H * a.B);
    n = a.counts[b * a.counts_s];
    start = a.dst_start[b * a.dst_s];
  }
  __device__ __forceinline__ void require_in_cache(const KvCompactArgs& a) const {
    // a row that moves nothing may name any start (the reference and the CPU kernel skip it)
    SWIFTKERN_DEVICE_REQUIRE(n >= 0 && n <= a.M && (n == 0 || (start >= 0 && start + n <= a.S)),
                             "kv_compact: row %lld moves counts = %lld entries to [%lld, %lld), outside the "
                             "cache (S = %lld) or more than M = %lld\n",
                             static_cast<long long>(b), static_cast<long long>(n), static_cast<long long>(start),
                             static_cast<long long>(start + n), static_cast<long long>(a.S),
                             static_cast<long long>(a.M));
  }
  // the slice's first byte in a cache
  __device__ __forceinline__ char* base(void* cache, const KvCompactArgs& a) const {
    return static_cast<char*>(cache) + (l * a.s_l + b * a.s_b + h * a.s_h) * a.elem_bytes;
  }
};

// grid: L * B * H blocks; block (l, b, h) moves the kept entries of both caches. Needs
// counts[b] * row_units <= kRegisterUnits * blockDim.x (the launcher checks M * row_units).
template <class U>
__global__ void kv_compact_registers_kernel(KvCompactArgs a, int row_units) {
  const CompactSlice sl(a);
  sl.require_in_cache(a);
  const int64_t n = sl.n, start = sl.start, b = sl.b;
  if (n == 0) return;
  U* k = reinterpret_cast<U*>(sl.base(a.k_cache, a));
  U* v = reinterpret_cast<U*>(sl.base(a.v_cache, a));
  const int64_t pos_units = a.s_s * a.elem_bytes / static_cast<int64_t>(sizeof(U));
  U k_units[kRegisterUnits], v_units[kRegisterUnits];
  UnitCursor at(row_units);
#pragma unroll
  for (int r = 0; r < kRegisterUnits; ++r, at.next()) {
    if (at.i >= n) break;
    const int64_t src = a.src[b * a.src_sb + at.i * a.src_sm];
    SWIFTKERN_DEVICE_REQUIRE(src >= 0 && src < a.S, "kv_compact: src_positions[%lld, %lld] = %lld is outside [0, S = %lld)\n",
                             static_cast<long long>(b), static_cast<long long>(at.i), static_cast<long long>(src),
                             static_cast<long long>(a.S));
    k_units[r] = k[src * pos_units + at.c];
    v_units[r] = v[src * pos_units + at.c];
  }
  __syncthreads();  // every source read before any destination is written
  UnitCursor to(row_units);
#pragma unroll
  for (int r = 0; r < kRegisterUnits; ++r, to.next()) {
    if (to.i >= n) break;
    k[(start + to.i) * pos_units + to.c] = k_units[r];
    v[(start + to.i) * pos_units + to.c] = v_units[r];
  }
}

template <class U, int kMode>
__global__ void kv_compact_kernel(KvCompactArgs a, int64_t row_units) {
  extern __shared__ __align__(16) unsigned char kv_smem[];
  const CompactSlice sl(a);
  if (kMode != kScatter) sl.require_in_cache(a);
  const int64_t n = sl.n, start = sl.start, b = sl.b, slice = blockIdx.x;
  if (n == 0) return;
  const int64_t eb = a.elem_bytes;
  U* base = reinterpret_cast<U*>(sl.base(blockIdx.y == 0 ? a.k_cache : a.v_cache, a));
  const int64_t pos_units = a.s_s * eb / static_cast<int64_t>(sizeof(U));
  U* buf = kMode == kStaged
               ? reinterpret_cast<U*>(kv_smem)
               : static_cast<U*>(a.workspace) + ((blockIdx.y * gridDim.x + slice) * a.M) * row_units;
  const int64_t total = n * row_units;
  if (kMode != kScatter) {
    for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
      const int64_t i = e / row_units, c = e - i * row_units;
      const int64_t src = a.src[b * a.src_sb + i * a.src_sm];
      SWIFTKERN_DEVICE_REQUIRE(src >= 0 && src < a.S, "kv_compact: src_positions[%lld, %lld] = %lld is outside [0, S = %lld)\n",
                               static_cast<long long>(b), static_cast<long long>(i), static_cast<long long>(src),
                               static_cast<long long>(a.S));
      buf[e] = base[src * pos_units + c];
    }
  }
  if (kMode == kStaged) __syncthreads();
  if (kMode != kGather) {
    for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
      const int64_t i = e / row_units, c = e - i * row_units;
      base[(start + i) * pos_units + c] = buf[e];
    }
  }
}

}  // namespace cuda
}  // namespace swiftkern
