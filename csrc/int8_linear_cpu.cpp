// int8_linear on CPU: y ~= x @ w^T + b with x quantized to int8 per block of 32 inputs and w read
// as its 4- or 8-bit codes: integer dot products (AVX-512 VNNI), one float scale per block.
//
// This is NOT packed_linear's arithmetic: it is an approximation (x rounded to 8 bits per block,
// relative error ~1e-2 on a dot product) for the draft passes of self-speculative decoding, whose
// tokens the exact verify pass checks, so the output never depends on it. What it buys: a weight
// costs one byte op in a 4-wide integer dot, not a permute and a float fma, so a one-row pass is
// about three times cheaper than packed_linear's exact one over the same codes.
//
// Per block b of x row m: s = max|x| / 127, q = nearbyint(x / s) (int8, 0 where s = 0) and
// qsum = sum(q). With the weight w = scale * code + offset per block,
//   y[m, n] = sum over b, in increasing b, of fma(fma(float(dot(q, code)), scale, offset * qsum), s, y)
// (a float32 per output row, so every instruction set gives the same bits), plus the bias.
//
// Layout, uint8 [ceil(N / 16), K / 32, 384 | 640] (swiftkern/int8_weights.py builds it from
// packed_weights' layout): per group of 16 weight rows and block, float32 scale[16], float32
// offset[16], then the codes in 64-byte chunks, row r at bytes 4r..4r+3 of a chunk:
//   4-bit (4 chunks): chunk c holds packed bytes 4c..4c+3 (low nibble: input 4c + j, high: 16 + 4c + j);
//   8-bit (8 chunks): chunk c holds codes 4c..4c+3 plus 128 (unsigned).
// Rows past N in the last group have scale, offset and codes 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "linear_call.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace swiftkern {
namespace cpu {
namespace {

constexpr int kBlock = 32;
constexpr int kGroup = 16;                            // weight rows side by side (one int32 lane each)
constexpr int kHead = 2 * kGroup * 4;                 // scales and offsets of a group-block
constexpr int kGroupBlock4 = kHead + kGroup * 16;     // 384
constexpr int kGroupBlock8 = kHead + kGroup * 32;     // 640
constexpr int kTileRows = 4;                          // x rows sharing each unpacked chunk
#ifndef SWIFTKERN_INT8_PREFETCH
#define SWIFTKERN_INT8_PREFETCH 4096
#endif
constexpr int64_t kPrefetchBytes = SWIFTKERN_INT8_PREFETCH;

int layout_bits(int64_t bytes) { return bytes == kGroupBlock4 ? 4 : bytes == kGroupBlock8 ? 8 : 0; }

struct QuantizedX {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> s;     // [M, K / 32]
  std::vector<float> qsum;  // [M, K / 32], exact small integers
};

QuantizedX quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kBlock;
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float s = amax / 127.0f;
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        const float r = s > 0.0f ? std::nearbyint(xb[i] / s) : 0.0f;
        const int v = static_cast<int>(std::min(127.0f, std::max(-127.0f, r)));
        out.q[m * K + b * kBlock + i] = static_cast<int8_t>(v);
        sum += v;
      }
      out.s[m * blocks + b] = s;
      out.qsum[m * blocks + b] = static_cast<float>(sum);
    }
  return out;
}

// The 4-byte group j of weight row r's codes in a chunk, as unsigned values (4-bit: nibble half h)
template <int BITS>
inline int code_at(const uint8_t* chunk, int r, int j, int h) {
  const uint8_t byte = chunk[4 * r + j];
  if constexpr (BITS == 4) return h == 0 ? (byte & 0xF) : (byte >> 4);
  return byte;  // code + 128
}

// Groups [g0, g1) for x rows [0, M): the definition, one output at a time
template <int BITS>
void groups_portable(const QuantizedX& xq, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t g0,
                     int64_t g1) {
  const int64_t blocks = K / kBlock;
  constexpr int gb_bytes = BITS == 4 ? kGroupBlock4 : kGroupBlock8;
  for (int64_t g = g0; g < g1; ++g)
    for (int r = 0; r < kGroup && g * kGroup + r < N; ++r)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* gb = w + (g * blocks + b) * gb_bytes;
          float scale, offset;
          std::memcpy(&scale, gb + 4 * r, 4);
          std::memcpy(&offset, gb + kGroup * 4 + 4 * r, 4);
          const int8_t* q = xq.q.data() + m * K + b * kBlock;
          int dot = 0;
          if constexpr (BITS == 4) {
            for (int c = 0; c < 4; ++c)
              for (int j = 0; j < 4; ++j) {
                const uint8_t* chunk = gb + kHead + 64 * c;
                dot += code_at<4>(chunk, r, j, 0) * q[4 * c + j] + code_at<4>(chunk, r, j, 1) * q[16 + 4 * c + j];
              }
          } else {
            for (int c = 0; c < 8; ++c)
              for (int j = 0; j < 4; ++j) dot += code_at<8>(gb + kHead + 64 * c, r, j, 0) * q[4 * c + j];
            dot -= 128 * static_cast<int>(xq.qsum[m * blocks + b]);
          }
          const float t = std::fma(static_cast<float>(dot), scale, offset * xq.qsum[m * blocks + b]);
          acc = std::fma(t, xq.s[m * blocks + b], acc);
        }
        y[m * N + g * kGroup + r] = acc;
      }
}

#if defined(__x86_64__)
#define SWIFTKERN_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// Groups [g0, g1) for x rows [m0, m0 + MR): 16 weight rows in the lanes of one vector
template <int BITS, int MR>
SWIFTKERN_VNNI void groups_vnni(const QuantizedX& xq, const uint8_t* w, float* y, int64_t m0, int64_t K, int64_t N,
                                int64_t g0, int64_t g1) {
  const int64_t blocks = K / kBlock;
  constexpr int gb_bytes = BITS == 4 ? kGroupBlock4 : kGroupBlock8;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* gb = w + (g * blocks + b) * gb_bytes;
      // the weights a few KiB ahead (this thread's next ones: its range is contiguous); a
      // prefetch past the end is harmless
      const char* ahead = reinterpret_cast<const char*>(gb) + kPrefetchBytes;
      for (int c = 0; c < gb_bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
      __m512i dot[MR];
      if constexpr (BITS == 4) {
        for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(gb + kHead + 64 * c);
          const __m512i lo = _mm512_and_si512(v, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int i = 0; i < MR; ++i) {
            const int8_t* q = xq.q.data() + (m0 + i) * K + b * kBlock;
            int32_t qlo, qhi;
            std::memcpy(&qlo, q + 4 * c, 4);
            std::memcpy(&qhi, q + 16 + 4 * c, 4);
            dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(qlo));
            dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(qhi));
          }
        }
      } else {
        for (int i = 0; i < MR; ++i)
          dot[i] = _mm512_set1_epi32(-128 * static_cast<int>(xq.qsum[(m0 + i) * blocks + b]));
        for (int c = 0; c < 8; ++c) {
          const __m512i v = _mm512_loadu_si512(gb + kHead + 64 * c);
          for (int i = 0; i < MR; ++i) {
            int32_t q4;
            std::memcpy(&q4, xq.q.data() + (m0 + i) * K + b * kBlock + 4 * c, 4);
            dot[i] = _mm512_dpbusd_epi32(dot[i], v, _mm512_set1_epi32(q4));
          }
        }
      }
      const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(gb));
      const __m512 offset = _mm512_loadu_ps(reinterpret_cast<const float*>(gb + kGroup * 4));
      for (int i = 0; i < MR; ++i) {
        const int64_t xb = (m0 + i) * blocks + b;
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), scale,
                                         _mm512_mul_ps(offset, _mm512_set1_ps(xq.qsum[xb])));
        acc[i] = _mm512_fmadd_ps(t, _mm512_set1_ps(xq.s[xb]), acc[i]);
      }
    }
    const int64_t n = g * kGroup;
    const __mmask16 keep = N - n >= kGroup ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (N - n)) - 1);
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + n, keep, acc[i]);
  }
}

// quantize_rows' results, the same bits: the division and the conversion round to nearest even
// as nearbyint does, and |x / s| <= 127 needs no clamp
SWIFTKERN_VNNI QuantizedX quantize_rows_vnni(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  QuantizedX out{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kBlock;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float s = amax / 127.0f;
      __m512i qlo = _mm512_setzero_si512(), qhi = _mm512_setzero_si512();
      if (s > 0.0f) {
        const __m512 sv = _mm512_set1_ps(s);
        qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, sv));
        qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, sv));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + m * K + b * kBlock), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + m * K + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
      out.s[m * blocks + b] = s;
      out.qsum[m * blocks + b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
  return out;
}

template <int BITS>
SWIFTKERN_VNNI void groups_vnni_rows(const QuantizedX& xq, const uint8_t* w, float* y, int64_t M, int64_t K,
                                     int64_t N, int64_t g0, int64_t g1) {
  for (int64_t m = 0; m < M; m += kTileRows) {
    switch (std::min<int64_t>(kTileRows, M - m)) {
      case 1: groups_vnni<BITS, 1>(xq, w, y, m, K, N, g0, g1); break;
      case 2: groups_vnni<BITS, 2>(xq, w, y, m, K, N, g0, g1); break;
      case 3: groups_vnni<BITS, 3>(xq, w, y, m, K, N, g0, g1); break;
      default: groups_vnni<BITS, 4>(xq, w, y, m, K, N, g0, g1); break;
    }
  }
}
#undef SWIFTKERN_VNNI
#endif

bool vnni_supported() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

at::Tensor int8_linear_with(bool vnni, const at::Tensor& x, const at::Tensor& weights,
                            const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && weights.device().is_cpu(), "int8_linear: tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 3 && layout_bits(weights.size(2)) != 0,
              "int8_linear: weights must be uint8 [ceil(N/16), K/32, 384 or 640] (swiftkern.int8_weights), got ",
              weights.scalar_type(), " ", weights.sizes());
  const int64_t groups = weights.size(0), K = weights.size(1) * kBlock;
  TORCH_CHECK(N > (groups - 1) * kGroup && N <= groups * kGroup, "int8_linear: N = ", N, " does not fit ", groups,
              " groups of 16 rows");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "int8_linear: x [..., K] must match weights [G, K/32, bytes]: got ",
              x.sizes(), " and ", weights.sizes());
  LinearCall call = linear_call("int8_linear", x, N, bias);
  if (call.trivial(K)) return call.y;
  const at::Tensor xc = x.contiguous(), wc = weights.contiguous();
#if defined(__x86_64__)
  const QuantizedX xq = vnni ? quantize_rows_vnni(xc.data_ptr<float>(), call.M, K)
                             : quantize_rows(xc.data_ptr<float>(), call.M, K);
#else
  const QuantizedX xq = quantize_rows(xc.data_ptr<float>(), call.M, K);
#endif
  const int bits = layout_bits(wc.size(2));
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* yp = call.y.data_ptr<float>();
  const int64_t M = call.M;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kGroup * K));  // ~ K * 16 * 1024 weights a task
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
#if defined(__x86_64__)
    if (vnni) {
      if (bits == 4) groups_vnni_rows<4>(xq, wp, yp, M, K, N, g0, g1);
      else groups_vnni_rows<8>(xq, wp, yp, M, K, N, g0, g1);
      return;
    }
#endif
    if (bits == 4) groups_portable<4>(xq, wp, yp, M, K, N, g0, g1);
    else groups_portable<8>(xq, wp, yp, M, K, N, g0, g1);
  });
  return call.finish();
}

}  // namespace
}  // namespace cpu

// x: float32 [..., K]; weights: uint8 [ceil(N/16), K/32, 384 | 640] (int8_weights layout); bias:
// float32 [N] or None; n: the number of weight rows -> float32 [..., N], the int8 approximation
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& weights, const std::optional<at::Tensor>& bias,
                           int64_t n) {
  return cpu::int8_linear_with(cpu::vnni_supported(), x, weights, bias, n);
}

// The same with a named instruction set ("vnni" or "portable"), for the test that both give the same bits
at::Tensor int8_linear_isa(const at::Tensor& x, const at::Tensor& weights, int64_t n, const std::string& isa) {
  TORCH_CHECK(isa == "vnni" || isa == "portable", "int8_linear_isa: unknown instruction set '", isa,
              "' (vnni, portable)");
  TORCH_CHECK(isa == "portable" || cpu::vnni_supported(), "int8_linear_isa: this CPU cannot run ", isa);
  return cpu::int8_linear_with(isa == "vnni", x, weights, std::nullopt, n);
}

// Whether int8_linear has its VNNI kernel here (elsewhere the portable loop is slower than the
// exact kernels, and drafts keep exact arithmetic)
bool int8_linear_fast() { return cpu::vnni_supported(); }

}  // namespace swiftkern
