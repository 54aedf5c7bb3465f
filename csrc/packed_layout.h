// The packed weight layout that swiftkern/packed_weights.py makes, csrc/pack_codes_cpu.cpp
// writes and csrc/packed_linear_cpu.cpp reads: uint8 [N, K / 32, block bytes]; per block of 32
// inputs a float32 scale (bytes 0-3), a float32 offset (4-7), then the codes: 4-bit, byte 8 + i
// = code[i] | code[i + 16] << 4, unsigned; 8-bit, byte 8 + i = code[i], signed.
#pragma once

namespace swiftkern {
namespace cpu {

constexpr int kBlock = 32;                          // inputs per scale
constexpr int kHeaderBytes = 8;                     // scale, offset
constexpr int kBlockBytes4 = kHeaderBytes + 16;     // 4-bit codes
constexpr int kBlockBytes8 = kHeaderBytes + 32;     // 8-bit codes

}  // namespace cpu
}  // namespace swiftkern
