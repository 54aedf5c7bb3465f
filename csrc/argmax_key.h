// An order-preserving 64-bit key of an argmax candidate (value, index), for combining the argmaxes
// of a row's chunks with one unsigned max (an atomicMax on the GPU): the larger key is the
// candidate torch.argmax picks. High 32 bits: the value's order (any NaN above every number, so
// the first NaN wins; -0.0 as +0.0, which compare equal); low 32 bits: 2^32 - 1 - index, so equal
// values go to the lowest index. Every key is above 0 (-inf's order is 0x007fffff), so 0 stands
// for "no candidate yet". Indices must be below 2^32. Host and device code alike.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SWIFTKERN_HOST_DEVICE __host__ __device__
#else
#define SWIFTKERN_HOST_DEVICE
#endif

namespace swiftkern {

SWIFTKERN_HOST_DEVICE inline uint32_t float_order(float v) {
  if (v != v) return 0xffffffffu;
  if (v == 0.0f) v = 0.0f;  // -0.0 -> +0.0
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
#endif
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

SWIFTKERN_HOST_DEVICE inline uint64_t argmax_key(float value, int64_t index) {
  return (static_cast<uint64_t>(float_order(value)) << 32) | (0xffffffffu - static_cast<uint32_t>(index));
}

SWIFTKERN_HOST_DEVICE inline int64_t argmax_key_index(uint64_t key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key));
}

}  // namespace swiftkern
