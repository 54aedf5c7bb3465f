// Launcher of kv_compact (kernels in kv_compact.cuh): picks the copy unit and the register, the
// staged or the workspace path, on `stream`.
#include "kv_compact.cuh"

namespace swiftkern {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxStagedBytes = 48 * 1024;  // the default dynamic shared memory limit

int64_t row_bytes(const KvCompactArgs& a) { return a.D * a.elem_bytes; }

// The widest copy unit that divides the row size, both base addresses and every stride in bytes.
int copy_unit(const KvCompactArgs& a) {
  const uint64_t bits = static_cast<uint64_t>(row_bytes(a)) | reinterpret_cast<uintptr_t>(a.k_cache) |
                        reinterpret_cast<uintptr_t>(a.v_cache) | static_cast<uint64_t>(a.s_l * a.elem_bytes) |
                        static_cast<uint64_t>(a.s_b * a.elem_bytes) | static_cast<uint64_t>(a.s_h * a.elem_bytes) |
                        static_cast<uint64_t>(a.s_s * a.elem_bytes);
  for (int u = 16; u > 1; u /= 2)
    if (bits % u == 0) return u;
  return 1;
}

template <class U>
cudaError_t launch(const KvCompactArgs& a, cudaStream_t stream) {
  const int64_t units = row_bytes(a) / static_cast<int64_t>(sizeof(U));
  if (a.M * units <= kRegisterUnits * kThreads) {
    kv_compact_registers_kernel<U><<<static_cast<unsigned>(a.L * a.B * a.H), kThreads, 0, stream>>>(
        a, static_cast<int>(units));
    return last_launch_error();
  }
  const dim3 grid(static_cast<unsigned>(a.L * a.B * a.H), 2);
  const int64_t staged = a.M * row_bytes(a);
  if (staged <= kMaxStagedBytes) {
    kv_compact_kernel<U, kStaged><<<grid, kThreads, static_cast<size_t>(staged), stream>>>(a, units);
    return last_launch_error();
  }
  if (a.workspace == nullptr) return cudaErrorInvalidValue;
  kv_compact_kernel<U, kGather><<<grid, kThreads, 0, stream>>>(a, units);
  const cudaError_t err = last_launch_error();
  if (err != cudaSuccess) return err;
  kv_compact_kernel<U, kScatter><<<grid, kThreads, 0, stream>>>(a, units);
  return last_launch_error();
}

}  // namespace

int64_t kv_compact_workspace_bytes(const KvCompactArgs& a) {
  const int64_t staged = a.M * row_bytes(a);
  return staged <= kMaxStagedBytes ? 0 : 2 * a.L * a.B * a.H * staged;
}

cudaError_t kv_compact(const KvCompactArgs& a, cudaStream_t stream) {
  if (a.L * a.B * a.H == 0 || a.M == 0 || a.D == 0) return cudaSuccess;
  if (a.L * a.B * a.H > 0x7fffffff) return cudaErrorInvalidConfiguration;
  switch (copy_unit(a)) {
    case 16: return launch<uint4>(a, stream);
    case 8: return launch<uint2>(a, stream);
    case 4: return launch<uint32_t>(a, stream);
    case 2: return launch<uint16_t>(a, stream);
    default: return launch<uint8_t>(a, stream);
  }
}

}  // namespace cuda
}  // namespace swiftkern
