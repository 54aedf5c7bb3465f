// The packed weight layout that swiftkern/packed_weights.py makes, csrc/pack_codes_cpu.cpp
// writes and csrc/packed_linear_cpu.cpp reads: uint8 [N, K / 32, block bytes], per block of 32
// inputs:
//   4-bit, 20 bytes (GGUF Q4_1's own block): float16 scale (bytes 0-1), float16 offset (2-3),
//     then byte 4 + i = code[i] | code[i + 16] << 4, unsigned;
//   8-bit, 34 bytes (GGUF Q8_0's own block): float16 scale (bytes 0-1), then byte 2 + i = code[i],
//     signed; the offset is +0.
// A weight is fma(scale, code, offset), which is what the dequantizer made (pack_codes checks it).
// The 8-bit block was 40 bytes (a float32 scale and a +0 offset): SmolLM2's Q8 head, which
// streams from memory once a step, is read in 15 % fewer bytes. The 4-bit block was 24 bytes (a
// float32 scale and offset): the layers, 80 MB a SmolLM2 step, are read in 17 % fewer bytes.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace swiftkern {
namespace cpu {

constexpr int kBlock = 32;           // inputs per scale
constexpr int kBlockBytes4 = 20;     // float16 scale and offset, 4-bit codes
constexpr int kBlockBytes8 = 34;     // float16 scale, 8-bit codes
template <int BITS>
constexpr int kBlockBytes = BITS == 4 ? kBlockBytes4 : kBlockBytes8;
template <int BITS>
constexpr int kCodesAt = BITS == 4 ? 4 : 2;  // the block's first code byte

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float half_at(const uint8_t* p) { return float(c10::Half(load_u16(p), c10::Half::from_bits())); }

// A block's scale and offset as float32 (exact: a float16 converts exactly)
template <int BITS>
inline float block_scale(const uint8_t* block) {
  return half_at(block);
}
template <int BITS>
inline float block_offset(const uint8_t* block) {
  if constexpr (BITS == 4) return half_at(block + 2);
  return 0.0f;
}

}  // namespace cpu
}  // namespace swiftkern
