// pack_codes on CPU: find the 4- or 8-bit codes a dequantized float32 weight was made of, in
// one pass over it, and lay them out as packed_linear reads them.
//
// The same answer as swiftkern/packed_weights.py's torch twin (`_pack_codes`), bit for bit: per
// block of 32 inputs, offset = the block's min (4-bit) or +0 (8-bit); the scale estimate
// (max - min) / 15 or max|w| / 127 rounded to float16; scales tried at that float16 and its
// neighbours 1, -1, 2, -2 steps away (bits as int16, wrapping), the first that rebuilds every
// weight exactly winning; code = clamp(round_half_even((w - offset) / s), lo, hi) (0 where s is
// not > 0), rebuilt as s * code + offset in two roundings (built with -ffp-contract=off, as
// torch computes it). No answer (nullopt) when a weight is not finite, a 4-bit offset is not a
// float16 value, fewer than half the blocks fit at the first scale (2 * fits < blocks: not
// this format), or some block fits at none. A block is independent of the others, so rows run
// in parallel; SmolLM2's 211 weights took ~1.45 s through torch (a dozen passes each).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "packed_layout.h"

namespace swiftkern {
namespace cpu {
namespace {

constexpr int kScaleSteps[] = {0, 1, -1, 2, -2};
constexpr int kNumSteps = sizeof(kScaleSteps) / sizeof(kScaleSteps[0]);

enum Status : int8_t { kFitsAtFirst = 0, kPending = 1, kFitsLater = 2, kNoFit = 3, kRefused = 4 };

struct Format {
  int bits, lo, hi, block_bytes;
};

Format format_of(int bits) {
  return bits == 4 ? Format{4, 0, 15, kBlockBytes4} : Format{8, -128, 127, kBlockBytes8};
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float half_value(uint16_t bits) { return float(c10::Half(bits, c10::Half::from_bits())); }

// clamp(nearbyint(x), lo, hi) in the default rounding mode, in loops the compiler vectorizes:
// below 2^22, adding and subtracting 1.5 * 2^23 rounds half to even (the sum's spacing is 1);
// from 2^22 up the rounded value clamps to lo or hi whatever it is; NaN stays NaN (no
// comparison holds), as torch.clamp keeps it. A zero code may come out +0 where nearbyint
// gives -0 (x in (-0.5, -0]): s * (+-0) + offset is the same float unless offset is a zero,
// and then (w - offset) is -0 only for w = -0, offset = +0, which no code rebuilds; the
// stored byte is 0 either way.
inline float clamped_code(float x, float lo, float hi) {
  constexpr float kRound = 12582912.0f, kExact = 4194304.0f;  // 1.5 * 2^23, 2^22
  const float r = std::fabs(x) < kExact ? (x + kRound) - kRound : x;
  return r < lo ? lo : (r > hi ? hi : r);
}

// Whether w[0..32) == s * code + offset for every weight, s the float16 `estimate` moved by
// `step`; on success scale and codes are written.
bool fits(const float* w, float offset, uint16_t estimate, int step, const Format& f, float* scale,
          float* codes) {
  const float s = half_value(uint16_t(estimate + step)), lo = float(f.lo), hi = float(f.hi);
  float c[kBlock];
  uint32_t differ = 0;
  for (int i = 0; i < kBlock; ++i) {
    c[i] = clamped_code(s > 0.0f ? (w[i] - offset) / s : 0.0f, lo, hi);
    const float back = s * c[i];
    differ |= bits_of(back + offset) ^ bits_of(w[i]);
  }
  if (differ) return false;
  *scale = s;
  std::memcpy(codes, c, sizeof c);
  return true;
}

// the block as packed_layout.h lays it out: the scale as the float16 it is, 4-bit the offset as the
// float16 it is too, then the codes (4-bit two a byte; 8-bit, the offset +0)
void write_block(uint8_t* out, float scale, float offset, const float* codes, const Format& f) {
  if (f.bits == 4) {
    const uint16_t halves[2] = {c10::Half(scale).x, c10::Half(offset).x};
    std::memcpy(out, halves, 4);
    uint8_t* body = out + kCodesAt<4>;
    for (int i = 0; i < kBlock / 2; ++i) body[i] = uint8_t(codes[i]) | uint8_t(uint8_t(codes[i + 16]) << 4);
  } else {
    const uint16_t half = c10::Half(scale).x;
    std::memcpy(out, &half, 2);
    uint8_t* body = out + kCodesAt<8>;
    for (int i = 0; i < kBlock; ++i) body[i] = uint8_t(int8_t(codes[i]));
  }
}

struct BlockStart {
  float offset;
  uint16_t estimate;  // float16 bits of the scale estimate
  bool usable;        // finite weights and (4-bit) a float16 offset
};

BlockStart start_block(const float* w, const Format& f) {
  float lo = w[0], hi = w[0], mag = 0.0f;
  bool finite = true;
  for (int i = 0; i < kBlock; ++i) {
    finite &= std::isfinite(w[i]);
    lo = w[i] < lo ? w[i] : lo;
    hi = w[i] > hi ? w[i] : hi;
    const float a = std::fabs(w[i]);
    mag = a > mag ? a : mag;
  }
  if (!finite) return {0.0f, 0, false};
  if (f.bits == 4) {
    const float estimate = (hi - lo) / float(f.hi);
    return {lo, c10::Half(estimate).x, float(c10::Half(lo)) == lo};
  }
  return {0.0f, c10::Half(mag / float(f.hi)).x, true};
}

// w: float32 [N, K] contiguous, K % 32 == 0; out: uint8 [N, K / 32, block_bytes]. Whether every
// block fits (out then holds the layout).
bool pack_codes_kernel(const float* w, int64_t N, int64_t K, int bits, uint8_t* out) {
  const Format f = format_of(bits);
  const int64_t per_row = K / kBlock, blocks = N * per_row;
  std::vector<int8_t> status(blocks);
  std::vector<BlockStart> starts(blocks);
  const int64_t grain = std::max<int64_t>(1, 4096 / per_row);
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    float scale, codes[kBlock];
    for (int64_t b = r0 * per_row; b < r1 * per_row; ++b) {
      const float* wb = w + b * kBlock;
      const BlockStart st = starts[b] = start_block(wb, f);
      if (!st.usable) {
        status[b] = kRefused;
      } else if (fits(wb, st.offset, st.estimate, kScaleSteps[0], f, &scale, codes)) {
        write_block(out + b * f.block_bytes, scale, st.offset, codes, f);
        status[b] = kFitsAtFirst;
      } else {
        status[b] = kPending;
      }
    }
  });
  int64_t at_first = 0, pending = 0;
  for (int8_t s : status) {
    if (s == kRefused) return false;
    at_first += s == kFitsAtFirst;
    pending += s == kPending;
  }
  if (2 * at_first < blocks) return false;  // not this format
  if (pending == 0) return true;
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    float scale, codes[kBlock];
    for (int64_t b = r0 * per_row; b < r1 * per_row; ++b) {
      if (status[b] != kPending) continue;
      status[b] = kNoFit;
      for (int k = 1; k < kNumSteps; ++k) {
        if (fits(w + b * kBlock, starts[b].offset, starts[b].estimate, kScaleSteps[k], f, &scale, codes)) {
          write_block(out + b * f.block_bytes, scale, starts[b].offset, codes, f);
          status[b] = kFitsLater;
          break;
        }
      }
    }
  });
  for (int8_t s : status)
    if (s == kNoFit) return false;
  return true;
}

}  // namespace
}  // namespace cpu

// weight: float32 [N, K] on the CPU, K a multiple of 32; bits 4 or 8 -> packed uint8
// [N, K / 32, 20 | 34] (the layout of csrc/packed_layout.h and swiftkern/packed_weights.py), or
// nullopt when the weight is not made of such codes.
std::optional<at::Tensor> pack_codes_cpu(const at::Tensor& weight, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_codes: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(weight.dim() == 2, "pack_codes: weight must be [N, K], got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "pack_codes: weight must be float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.device().is_cpu(), "pack_codes: weight must be on the CPU, got ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % cpu::kBlock == 0, "pack_codes: K = ", K, " is not a multiple of ", cpu::kBlock);
  const at::Tensor w = weight.contiguous();
  const int64_t block_bytes = cpu::format_of(int(bits)).block_bytes;
  at::Tensor out = at::empty({N, K / cpu::kBlock, block_bytes}, weight.options().dtype(at::kByte));
  if (w.numel() == 0) return out;
  if (!cpu::pack_codes_kernel(w.data_ptr<float>(), N, K, int(bits), out.data_ptr<uint8_t>())) return std::nullopt;
  return out;
}

}  // namespace swiftkern
