// packed_linear on CPU: y = x @ w^T + b with w stored as the integer codes it was quantized to.
//
// A GGUF model dequantized to float32 (SmolLM2's Q4_1 layers and Q8_0 head) holds weights that
// are exactly w = scale * code + offset per block of 32 inputs, with a float16 scale and offset
// and a 4- or 8-bit code. swiftkern/packed_weights.py finds those codes (and checks that every
// weight comes back bit for bit); this kernel streams them at 0.625 / 1.06 bytes per weight (GGUF's
// Q4_1 and Q8_0 blocks) instead of 4, rebuilds each weight with one fma (exact: scale * code
// has at most 19 significant bits, so the fma rounds once, where the dequantizer's multiply-then-add did; with
// AVX-512 a 4-bit block makes its 16 possible weights so and permutes them by code, with AVX2
// each code is widened and converted first) and
// sums in skinny_linear's fixed order (fixed_order_dot.h). The output is therefore
// skinny_linear's on the float32 weight, bit for bit: a decode step reads a sixth of the bytes
// and computes the same logits.
//
// Packed layout: csrc/packed_layout.h (20 bytes a 4-bit block, 34 an 8-bit one).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fixed_order_dot.h"
#include "lane_panel_gemm.h"
#include "linear_call.h"
#include "op_checks.h"
#include "packed_layout.h"
#include "row_kernels.h"

namespace swiftkern {
namespace cpu {

constexpr int kPackedTileRows = 11;     // x rows of a register tile: all of them, up to 11
constexpr int kPackedTileCols = 4;      // weight rows of a register tile, at most
// Whether a tile of MR x rows by NR weight rows keeps its MR * NR accumulators, a whole block's
// weights (2 * NR vectors), an x vector and a temporary in the 32 vector registers
constexpr bool whole_blocks_fit(int MR, int NR) { return MR * NR + 2 * NR + 2 <= 32; }

// Weight rows of the register tile for mr x rows (1 <= mr <= 11): all the x rows in one tile, so
// each weight is rebuilt once, and as many weight rows (up to 4) as fit: 4 up to 5 x rows, then 3
// up to 8, then 2 (the compiler spills nothing in those loops; 6 x 4, a block at a time by
// halves, spilled 20 times). SmolLM2's projections (one layer's weights over and over, from
// cache), alternating runs, ms at 5 / 6 / 7 / 8 rows: 4 weight rows up to 5 x rows, then 3:
// 6.7-7.0 / 9.5-9.8 / 10.6-11.0 / 11.7-11.9; 4 up to 4 rows, then 3: 8.2-9.4 / 9.0-10.2 /
// 9.9-11.4 / 11.1-13.0; 2 at 8 rows: 11.5-12.7
constexpr int packed_tile_cols(int mr) {
  int nr = kPackedTileCols;
  while (nr > 1 && !whole_blocks_fit(mr, nr)) --nr;
  return nr;
}
static_assert(packed_tile_cols(5) == 4 && packed_tile_cols(6) == 3 && packed_tile_cols(8) == 3 &&
              packed_tile_cols(9) == 2 && packed_tile_cols(11) == 2);

// AVX2 tiles (avx2_tile_cols, fixed_order_dot.h): the weights are rebuilt one vector at a time
// (a vector, its codes, the block's scale and offset beside the accumulators)
constexpr int kAvx2PackedTileRows = 6;  // x rows of an AVX2 register tile, at most (12 accumulators)
constexpr int avx2_packed_tile_cols(int mr) { return avx2_tile_cols(mr, kPackedTileCols); }

// Past this many x rows (more than one register tile holds) each weight tile is unpacked once
// into L1 rather than rebuilt for every tile of x rows. SmolLM2's projections when tiles were 6
// x rows, rebuilt per tile / unpacked: 8 rows 14.8 / 16.0 ms, 12 rows 19.8 / 18.0, 16 rows
// 26.0 / 22.3, 32 rows 50.4 / 39.2 (one row: 7.8). Tiles of 9-11 x rows by 2 weight rows against
// the unpacked path (whose cost barely moves from 9 to 12 rows): 9 rows 13.1 / 16.8-17.6 ms
// (a verify pass of 8 drafts), 10 14.8, 11 16.3 / ~17; 12 rows 17.4-18.0 / 16.7-16.9 and 13 (2
// weight rows, 32 registers) 18.4-18.8 / 18.5-19.4; 14-16 rows by 1 weight row 1.3-1.4x slower.
constexpr int64_t kUnpackAboveRows = 11;
static_assert(kUnpackAboveRows <= kPackedTileRows, "the register path takes all the x rows in one tile");
// AVX2 takes up to kPackedPanelAboveRows (16) x rows in register tiles, in near-equal groups of
// up to 6 rows against each weight tile while it is in L1 (so a weight is rebuilt once per
// group), and more rows as lane panels (lane_panel_gemm.h: each 16 weight rows packed lane-major
// once, straight from the codes, for all the x rows). One layer's 7 projections x 30 (2.6 MB of
// codes, from L3) on an AMD EPYC (2 threads, AVX2), alternating runs, register groups / panels,
// ms: 5 rows 17-20 / 23-31, 8 rows 24-29 / 32-39, 12 rows 30-45 / 36-47, 16 rows 40-59 / 44-67,
// 18 rows 52-65 / 48-66, 20 rows 58-73 / 52-66: the weight packing costs more than the rebuilds it
// saves until ~16 rows. Packing the panels from the codes instead of unpacking 16 rows to float32
// and transposing those (same bits), 21 / 24 / 32 / 64 rows: 43-55 / 49-57 / 60-81 / 102-133 ms
// against 67-79 / 67-82 / 84-98 / 132-156.
constexpr int64_t kPackedPanelAboveRows = 16;

// weight k of a block (0 <= k < 32), as the dequantizer made it
template <int BITS>
static inline float block_weight(const uint8_t* block, int k) {
  float code;
  if constexpr (BITS == 4) {
    const uint8_t byte = block[kCodesAt<BITS> + (k % 16)];
    code = static_cast<float>(k < 16 ? byte & 0xF : byte >> 4);
  } else {
    code = static_cast<float>(static_cast<int8_t>(block[kCodesAt<BITS> + k]));
  }
  return std::fma(block_scale<BITS>(block), code, block_offset<BITS>(block));
}

// One tile: x rows [0, MR) (stride K) against packed weight rows [0, NR) (stride row_bytes)
template <int BITS, int MR, int NR>
static void packed_tile_portable(const float* x, const uint8_t* w, int64_t row_bytes, float* y, int64_t K,
                                 int64_t N, const uint8_t* pf) {
  (void)pf;
  constexpr int block_bytes = kBlockBytes<BITS>;
  float lane[MR][NR][kLanes] = {};
  for (int64_t k = 0; k < K; ++k) {
    const int l = static_cast<int>(k % kLanes);
    for (int j = 0; j < NR; ++j) {
      const float wk = block_weight<BITS>(w + j * row_bytes + (k / kBlock) * block_bytes, static_cast<int>(k % kBlock));
      for (int i = 0; i < MR; ++i) lane[i][j][l] = std::fma(x[i * K + k], wk, lane[i][j][l]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = reduce_lanes(lane[i][j]);
}

#if defined(__x86_64__)
// The 16 weights a 4-bit block can hold, fma(scale, code, offset) for code 0..15 (scale and
// offset in every lane): each weight is then one permute of this table by its code (2 ops a half,
// not 4: widen, mask, convert, fma)
__attribute__((target("avx512f"))) static inline __m512 code_table_avx512(__m512 scale, __m512 offset) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(scale, codes, offset);
}

// A 4-bit block's table from its own float16 scale and offset, widened together (scale, offset in
// every pair of lanes), then spread: one conversion and two in-lane permutes a block and row
__attribute__((target("avx512f"))) static inline __m512 block_table_avx512(const uint8_t* block) {
  const __m512 pairs = _mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(load_u32(block))));
  return code_table_avx512(_mm512_permute_ps(pairs, 0x00), _mm512_permute_ps(pairs, 0x55));
}

// A 4-bit block's 32 weights, each its code's entry of `table`: lo = inputs 0-15, hi = 16-31 (a
// permute reads the low 4 bits of each index: byte & 0xF needs no mask)
__attribute__((target("avx512f"))) static inline void weights_by_code_avx512(const uint8_t* block, __m512 table,
                                                                            __m512& lo, __m512& hi) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kCodesAt<4>));
  const __m512i bytes = _mm512_cvtepu8_epi32(packed);
  lo = _mm512_permutexvar_ps(bytes, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

// The 32 weights of a block as the dequantizer made them: lo = inputs 0-15, hi = inputs 16-31
template <int BITS>
__attribute__((target("avx512f"))) static inline void block_weights_avx512(const uint8_t* block, __m512& lo,
                                                                         __m512& hi) {
  if constexpr (BITS == 4) {
    weights_by_code_avx512(block, block_table_avx512(block), lo, hi);
  } else {  // the float16 scale widened in every lane; the offset +0
    const __m512 scale = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(block))));
    const __m512 offset = _mm512_setzero_ps();
    const uint8_t* codes = block + kCodesAt<BITS>;
    const __m512i code_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i code_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
    lo = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(code_lo), offset);
    hi = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(code_hi), offset);
  }
}

// The tile loop widens 4-bit blocks' float16 scales and offsets this many blocks at a time
constexpr int64_t kHeadsAhead = 16;

// heads[2i], heads[2i + 1] = the scale and offset of block i of a row (i < min(16, left)), from
// its first block on: one gather of the 16 blocks' first dwords, two conversions (on the Intel
// Xeon, in the forward of a SmolLM2 token 5-7 % faster than four loads and two two-source
// permutes, interleaved runs; see gather_heads_pays for where it is slower)
__attribute__((target("avx512f"))) static inline void widen_heads_avx512(const uint8_t* block, int64_t left,
                                                                        float* heads) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(kBlockBytes4));
  const __mmask16 live = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
  const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, block, 1);
  _mm512_store_ps(heads, _mm512_cvtph_ps(_mm512_castsi512_si256(pairs)));
  _mm512_store_ps(heads + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1)));
}

// A 4-bit block's 32 weights from its widened scale and offset: lo = inputs 0-15, hi = 16-31
__attribute__((target("avx512f"))) static inline void block_weights_4bit_avx512(const uint8_t* block, float scale,
                                                                               float offset, __m512& lo, __m512& hi) {
  weights_by_code_avx512(block, code_table_avx512(_mm512_set1_ps(scale), _mm512_set1_ps(offset)), lo, hi);
}

// GATHER: a 4-bit block's scale and offset come from heads widened 16 blocks at a time by a
// gather (widen_heads_avx512), else from the block itself, widened by one conversion
// (block_table_avx512); the same bits either way
template <int BITS, int MR, int NR, bool GATHER>
__attribute__((target("avx512f"))) static void packed_tile_avx512(const float* x, const uint8_t* w,
                                                                  int64_t row_bytes, float* y, int64_t K, int64_t N,
                                                                  const uint8_t* pf) {
  static_assert(whole_blocks_fit(MR, NR), "a tile the registers cannot hold");
  constexpr int block_bytes = kBlockBytes<BITS>;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t blocks = K / kBlock;
  alignas(64) float heads[NR][2 * kHeadsAhead];  // 4-bit: [row][2 * block]: scale, offset
  for (int64_t b0 = 0; b0 < blocks; b0 += kHeadsAhead) {
    const int64_t b1 = std::min(blocks, b0 + kHeadsAhead);
    if constexpr (BITS == 4 && GATHER)  // the next 16 blocks' float16 scales and offsets of each row, at once
      for (int j = 0; j < NR; ++j) widen_heads_avx512(w + j * row_bytes + b0 * block_bytes, b1 - b0, heads[j]);
    for (int64_t b = b0; b < b1; ++b) {
      if (pf) {  // the tile ahead is NR contiguous rows: this block's share of it, a line or two
        const char* p = reinterpret_cast<const char*>(pf + b * NR * block_bytes);
        for (int c = 0; c < NR * block_bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
      }
      // per lane: input 32b + lane, then 32b + 16 + lane (increasing k)
      __m512 wv[2][NR];
      for (int j = 0; j < NR; ++j) {
        const uint8_t* block = w + j * row_bytes + b * block_bytes;
        if constexpr (BITS == 4 && GATHER)
          block_weights_4bit_avx512(block, heads[j][2 * (b - b0)], heads[j][2 * (b - b0) + 1], wv[0][j], wv[1][j]);
        else
          block_weights_avx512<BITS>(block, wv[0][j], wv[1][j]);
      }
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < MR; ++i) {
          const __m512 xv = _mm512_loadu_ps(x + i * K + b * kBlock + 16 * h);
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[h][j], acc[i][j]);
        }
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) {
      halving_sum_4_avx512(acc[i], y + i * N);
    } else {  // the four-wide sum on a padded copy: the same additions for the real accumulators
      __m512 four[4];
      float out[4];
      for (int j = 0; j < 4; ++j) four[j] = acc[i][std::min(j, NR - 1)];
      halving_sum_4_avx512(four, out);
      for (int j = 0; j < NR; ++j) y[i * N + j] = out[j];
    }
  }
}
template <int BITS>
__attribute__((target("avx512f"))) static void unpack_rows_avx512(const uint8_t* w, int64_t row_bytes, int rows,
                                                                  int64_t K, float* out, const uint8_t* pf) {
  constexpr int block_bytes = kBlockBytes<BITS>;
  for (int j = 0; j < rows; ++j)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + j * row_bytes + b * block_bytes), _MM_HINT_T0);
      __m512 lo, hi;
      block_weights_avx512<BITS>(w + j * row_bytes + b * block_bytes, lo, hi);
      _mm512_storeu_ps(out + j * K + b * kBlock, lo);
      _mm512_storeu_ps(out + j * K + b * kBlock + 16, hi);
    }
}

// The float16 value at p in every lane (widened by F16C, which pick_isa's AVX2 requires)
__attribute__((target("avx2,f16c"))) static inline __m256 half_lanes_avx2(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(p))));
}

// A block's scale and offset in every lane (an 8-bit block's offset +0)
template <int BITS>
__attribute__((target("avx2,f16c"))) static inline __m256 block_scale_avx2(const uint8_t* block) {
  return half_lanes_avx2(block);
}
template <int BITS>
__attribute__((target("avx2,f16c"))) static inline __m256 block_offset_avx2(const uint8_t* block) {
  if constexpr (BITS == 4) return half_lanes_avx2(block + 2);
  return _mm256_setzero_ps();
}

// Weight vector q of a block as the dequantizer made it: q = 0 inputs 0-7, 1 8-15 (lanes 0-7 and
// 8-15 of the first step), 2 16-23, 3 24-31 (the second); rebuilt one at a time by the tile loop
template <int BITS>
__attribute__((target("avx2,fma"))) static inline __m256 block_quarter_avx2(const uint8_t* block, __m256 scale,
                                                                          __m256 offset, int q) {
  __m256i codes;
  if constexpr (BITS == 4) {
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kCodesAt<BITS> + 8 * (q & 1))));
    codes = q < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(bytes, 4);
  } else {
    codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kCodesAt<BITS> + 8 * q)));
  }
  return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(codes), offset);
}

// AVX2: an output's lanes 0-7 and 8-15 in two accumulators (acc[i][j][0], [1]); per block, inputs
// 0-15 go to lanes 0-15 and then inputs 16-31, each lane in increasing k as fixed_order_dot.h says
template <int BITS, int MR, int NR>
__attribute__((target("avx2,fma,f16c"))) static void packed_tile_avx2(const float* x, const uint8_t* w,
                                                                     int64_t row_bytes, float* y, int64_t K, int64_t N,
                                                                     const uint8_t* pf) {
  constexpr int block_bytes = kBlockBytes<BITS>;
  __m256 acc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    if (pf) {
      const char* p = reinterpret_cast<const char*>(pf + b * NR * block_bytes);
      for (int c = 0; c < NR * block_bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
    }
    for (int j = 0; j < NR; ++j) {
      const uint8_t* block = w + j * row_bytes + b * block_bytes;
      const __m256 scale = block_scale_avx2<BITS>(block), offset = block_offset_avx2<BITS>(block);
      for (int q = 0; q < 4; ++q) {
        const __m256 wq = block_quarter_avx2<BITS>(block, scale, offset, q);
        for (int i = 0; i < MR; ++i)
          acc[i][j][q & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + b * kBlock + 8 * q), wq, acc[i][j][q & 1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = halving_sum_8x2(acc[i][j][0], acc[i][j][1]);
}

// The 16 x 16 bytes r[c][i] transposed: out[i][c] = r[c][i], in four rounds of interleaves
__attribute__((target("avx2"))) static inline void transpose_16x16_bytes(const __m128i* r, __m128i* out) {
  __m128i a[16], b[16], c[16];
  for (int p = 0; p < 8; ++p) {  // a[p], a[p + 8]: columns 0-7, 8-15 of rows 2p, 2p + 1, 2 bytes a column
    a[p] = _mm_unpacklo_epi8(r[2 * p], r[2 * p + 1]);
    a[p + 8] = _mm_unpackhi_epi8(r[2 * p], r[2 * p + 1]);
  }
  for (int h = 0; h < 2; ++h)  // b[4g + q]: columns 4g..4g + 3 of rows 4q..4q + 3, 4 bytes a column
    for (int q = 0; q < 4; ++q) {
      b[8 * h + q] = _mm_unpacklo_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
      b[8 * h + 4 + q] = _mm_unpackhi_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
    }
  for (int g = 0; g < 4; ++g)  // c[2p + o]: columns 2p, 2p + 1 of rows 8o..8o + 7, 8 bytes a column
    for (int o = 0; o < 2; ++o) {
      c[4 * g + o] = _mm_unpacklo_epi32(b[4 * g + 2 * o], b[4 * g + 2 * o + 1]);
      c[4 * g + 2 + o] = _mm_unpackhi_epi32(b[4 * g + 2 * o], b[4 * g + 2 * o + 1]);
    }
  for (int p = 0; p < 8; ++p) {
    out[2 * p] = _mm_unpacklo_epi64(c[2 * p], c[2 * p + 1]);
    out[2 * p + 1] = _mm_unpackhi_epi64(c[2 * p], c[2 * p + 1]);
  }
}

// codes [16 rows] (unsigned 4-bit or signed 8-bit) -> dst[0..16) = fma(scale, code, offset), rows
// 0-7 with s0 / o0, 8-15 with s1 / o1
template <int BITS>
__attribute__((target("avx2,fma"))) static inline void put_panel_codes(__m128i codes, __m256 s0, __m256 s1, __m256 o0,
                                                                      __m256 o1, float* dst) {
  const __m128i high = _mm_unpackhi_epi64(codes, codes);
  const __m256i c0 = BITS == 4 ? _mm256_cvtepu8_epi32(codes) : _mm256_cvtepi8_epi32(codes);
  const __m256i c1 = BITS == 4 ? _mm256_cvtepu8_epi32(high) : _mm256_cvtepi8_epi32(high);
  _mm256_storeu_ps(dst, _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(c0), o0));
  _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(c1), o1));
}

// A panel's weights lane-major straight from the codes: out[(l * J + j) * 16 + c] = weight (c,
// l + 16j) of packed rows w [nr <= 16] (stride row_bytes), zeros for c >= nr, J = K / 16. Per
// block the 16 rows' code bytes are transposed (lane l's code of every row in one vector), and
// each weight is rebuilt as fma(scale, code, offset) eight rows at a time: the dequantizer's bits.
template <int BITS>
__attribute__((target("avx2,fma,f16c"))) static void pack_packed_panel_avx2(const uint8_t* w, int64_t row_bytes, int nr,
                                                                      int64_t K, float* out) {
  constexpr int block_bytes = kBlockBytes<BITS>;
  const int64_t J = K / kLanes;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    // the 16 rows scales and offsets, 8 rows a vector (rows past nr: 0, so their weights are 0):
    // the float16 values widened; 8-bit offsets +0
    const uint8_t* head = w + b * block_bytes;
    alignas(16) uint16_t scales[kPanelCols] = {}, offsets[kPanelCols] = {};
    for (int c = 0; c < nr; ++c) {
      scales[c] = load_u16(head + c * row_bytes);
      if constexpr (BITS == 4) offsets[c] = load_u16(head + c * row_bytes + 2);
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales + 8)));
    const __m256 o0 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(offsets)));
    const __m256 o1 = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(offsets + 8)));
    // 4-bit: byte i holds inputs i (low nibble, step 2b) and i + 16 (step 2b + 1); 8-bit: bytes 0-15
    // are step 2b, bytes 16-31 step 2b + 1
    for (int half = 0; half < (BITS == 4 ? 1 : 2); ++half) {
      __m128i r[kPanelCols], t[kLanes];
      for (int c = 0; c < kPanelCols; ++c)
        r[c] = c < nr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * row_bytes + b * block_bytes +
                                                                         kCodesAt<BITS> + 16 * half))
                      : _mm_setzero_si128();
      transpose_16x16_bytes(r, t);
      for (int l = 0; l < kLanes; ++l) {
        if constexpr (BITS == 4) {
          const __m128i low4 = _mm_set1_epi8(0xF);
          put_panel_codes<BITS>(_mm_and_si128(t[l], low4), s0, s1, o0, o1, out + (l * J + 2 * b) * kPanelCols);
          put_panel_codes<BITS>(_mm_and_si128(_mm_srli_epi16(t[l], 4), low4), s0, s1, o0, o1,
                                out + (l * J + 2 * b + 1) * kPanelCols);
        } else {
          put_panel_codes<BITS>(t[l], s0, s1, o0, o1, out + (l * J + 2 * b + half) * kPanelCols);
        }
      }
    }
  }
}
#endif

using PackedTileFn = void (*)(const float*, const uint8_t*, int64_t, float*, int64_t, int64_t, const uint8_t*);

// One instruction set's register tiles for BITS-bit codes: fn[mr - 1][nr - 1] for mr x rows by
// nr weight rows, cols[mr - 1] the weight rows a tile of mr x rows takes, and max_rows the x rows
// past which the weight tiles are unpacked into L1 instead (packed_linear_range)
struct PackedTiles {
  PackedTileFn fn[kPackedTileRows][kPackedTileCols];  // [MR - 1][NR - 1]
  int cols[kPackedTileRows];
  int64_t tile_rows;  // x rows of one register tile, at most
  int64_t max_rows;   // x rows up to which the register tiles take the call (in groups of tile_rows)

  template <int BITS, int MR, int NR>
  static PackedTileFn pick(Isa isa, bool gather_heads) {
    (void)isa;
    (void)gather_heads;
#if defined(__x86_64__)
    if constexpr (MR <= kAvx2PackedTileRows && NR <= avx2_packed_tile_cols(MR))
      if (isa == Isa::kAvx2) return packed_tile_avx2<BITS, MR, NR>;
#endif
    if constexpr (NR > packed_tile_cols(MR)) {
      return nullptr;  // wider than the registers hold: never called
    } else {
#if defined(__x86_64__)
      if (isa == Isa::kAvx512)
        return gather_heads ? packed_tile_avx512<BITS, MR, NR, BITS == 4> : packed_tile_avx512<BITS, MR, NR, false>;
#endif
      return packed_tile_portable<BITS, MR, NR>;
    }
  }

  template <int BITS, int MR>
  void fill(Isa isa, bool g) {
    fn[MR - 1][0] = pick<BITS, MR, 1>(isa, g); fn[MR - 1][1] = pick<BITS, MR, 2>(isa, g);
    fn[MR - 1][2] = pick<BITS, MR, 3>(isa, g); fn[MR - 1][3] = pick<BITS, MR, 4>(isa, g);
    cols[MR - 1] = isa == Isa::kAvx2 ? avx2_packed_tile_cols(MR) : packed_tile_cols(MR);
  }

  template <int BITS>
  static PackedTiles make(Isa isa, bool g) {
    PackedTiles t{};
    t.fill<BITS, 1>(isa, g); t.fill<BITS, 2>(isa, g); t.fill<BITS, 3>(isa, g); t.fill<BITS, 4>(isa, g);
    t.fill<BITS, 5>(isa, g); t.fill<BITS, 6>(isa, g); t.fill<BITS, 7>(isa, g); t.fill<BITS, 8>(isa, g);
    t.fill<BITS, 9>(isa, g); t.fill<BITS, 10>(isa, g); t.fill<BITS, 11>(isa, g);
    t.tile_rows = isa == Isa::kAvx2 ? kAvx2PackedTileRows : kPackedTileRows;
    t.max_rows = isa == Isa::kAvx2 ? kPackedPanelAboveRows : kUnpackAboveRows;
    return t;
  }
};

// skinny_linear_cpu.cpp: its tiles over float32 weight rows, and the x rows per L2-resident block
void fixed_order_rows(Isa isa, const float* x, const float* w_rows, float* y, int64_t M, int64_t K, int64_t N,
                      int64_t n_begin, int64_t n_end);
int64_t fixed_order_row_block(Isa isa, int64_t M, int64_t K);

// Weight rows [0, rows) of a packed range (stride row_bytes) -> float32 out [rows, K], exactly; pf:
// the same rows a few tiles ahead, prefetched (or null). AVX2 never comes here: its calls of more
// rows than the register tiles take go to the lane panels (pack_packed_panel_avx2).
template <int BITS>
static void unpack_rows(Isa isa, const uint8_t* w, int64_t row_bytes, int rows, int64_t K, float* out,
                        const uint8_t* pf) {
  constexpr int block_bytes = kBlockBytes<BITS>;
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return unpack_rows_avx512<BITS>(w, row_bytes, rows, K, out, pf);
#endif
  (void)isa;
  (void)pf;
  for (int j = 0; j < rows; ++j)
    for (int64_t k = 0; k < K; ++k)
      out[j * K + k] = block_weight<BITS>(w + j * row_bytes + (k / kBlock) * block_bytes, static_cast<int>(k % kBlock));
}

// Outputs y[:, n_begin:n_end). Up to kUnpackAboveRows x rows: one register tile of all the x rows
// per packed weight tile, each weight rebuilt once. More rows: the x rows go in skinny_linear's
// L2-resident blocks, and for each block every weight tile is unpacked into an L1 buffer and
// skinny_linear's tiles read it (a weight is rebuilt once per block of ~100 rows). With one
// unpack per tile for all the rows, a prefill streamed all of x from L3 for every 4 weight rows:
// SmolLM2's deterministic prefill of 2000 tokens spent ~3.8 of its 5.4 s in the matmul tiles.
// Either way every output is the same fixed-order sum. (On AVX2 a call of more rows than
// max_rows = kPackedPanelAboveRows takes the lane panels and never reaches here.)
template <int BITS>
static void packed_linear_range(const PackedTiles& tiles, Isa isa, const float* x, const uint8_t* w,
                                int64_t row_bytes, float* y, int64_t M, int64_t K, int64_t N, int64_t n_begin,
                                int64_t n_end) {
  // SmolLM2's projections at one row, 0 / 2 / 4 / 8 / 16 tiles ahead: 12.1 / 7.8 / 7.9 / 8.3 / 8.5 ms
  // (into L2 instead of L1: 7.5 / 7.3 / 7.9 / 7.7 at 2 / 4 / 8 / 16, within the noise)
  constexpr int64_t prefetch_tiles = 2;
  if (M > tiles.max_rows) {
    std::vector<float> unpacked(kPackedTileCols * K);  // [4, K]: 9-24 KiB at K = 576-1536
    const int64_t block = fixed_order_row_block(isa, M, K);
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0);
      for (int64_t n = n_begin; n < n_end; n += kPackedTileCols) {
        const int nr = static_cast<int>(std::min<int64_t>(kPackedTileCols, n_end - n));
        const int64_t ahead = n + prefetch_tiles * kPackedTileCols;
        const uint8_t* pf = ahead + kPackedTileCols <= n_end ? w + ahead * row_bytes : nullptr;
        unpack_rows<BITS>(isa, w + n * row_bytes, row_bytes, nr, K, unpacked.data(), pf);
        fixed_order_rows(isa, x + m0 * K, unpacked.data(), y + m0 * N, rows, K, N, n, n + nr);
      }
    }
    return;
  }
  // the x rows in near-equal groups of at most tile_rows (one group on AVX-512), every group
  // against a weight tile while it is in L1; the tile as wide as the largest group's
  const int64_t groups = (M + tiles.tile_rows - 1) / tiles.tile_rows;
  const int group = static_cast<int>((M + groups - 1) / groups);
  const int cols = tiles.cols[group - 1];
  for (int64_t n = n_begin; n < n_end; n += cols) {
    const int nr = static_cast<int>(std::min<int64_t>(cols, n_end - n));
    const int64_t ahead = n + prefetch_tiles * cols;
    const uint8_t* pf = ahead + cols <= n_end ? w + ahead * row_bytes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += group) {
      const int mr = static_cast<int>(std::min<int64_t>(group, M - m0));
      tiles.fn[mr - 1][nr - 1](x + m0 * K, w + n * row_bytes, row_bytes, y + m0 * N + n, K, N, m0 == 0 ? pf : nullptr);
    }
  }
}

static int packed_bits(int64_t block_bytes) {
  return block_bytes == kBlockBytes4 ? 4 : block_bytes == kBlockBytes8 ? 8 : 0;
}

// Bytes of a packed weight row of K inputs with bits-bit codes (4 or 8)
static int64_t packed_row_bytes(int64_t K, int bits) {
  return K / kBlock * (bits == 4 ? kBlockBytes4 : kBlockBytes8);
}

// Weight tiles of a call (kPackedTileCols weight rows each) in a parallel region's tasks: ~K * 4 *
// 8192 weights a task, as skinny_linear's
static int64_t packed_grain(int64_t K) { return std::max<int64_t>(1, 32768 / (kPackedTileCols * K)); }

// The kernels a call runs: an instruction set and, with AVX-512, whether the register tiles
// gather their 4-bit blocks' heads (packed_tile_avx512's GATHER)
struct PackedIsa {
  Isa isa;
  bool gather_heads;
};

// Whether the AVX-512 register tiles gather 16 blocks' float16 heads at once (Intel) rather than
// convert each block's own (elsewhere). SmolLM2's 210 4-bit layer projections (66 MB, from DRAM)
// on an AMD EPYC (Zen 4, 2 threads), in one process, interleaved, ten rounds: per block 0.88x /
// 0.85x / 0.91x the gather's time at 1 / 4 / 8 x rows (a gather is slow there; heads widened 16
// at a time by loads and permutes or by scalar conversions, 0.91-0.98x, were slower than per
// block too). On the Intel Xeon the gather was 5-7 % faster than loads and permutes; per block was
// not timed there.
static bool gather_heads_pays() {
#if defined(__x86_64__)
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

// The kernels this CPU runs best
static PackedIsa packed_isa_here() {
  const Isa isa = pick_isa();
  return {isa, isa == Isa::kAvx512 && gather_heads_pays()};
}

// The register tiles for BITS-bit codes with the kernels k, made once (as skinny_linear's table_for)
template <int BITS>
static const PackedTiles& packed_tiles_for(PackedIsa k) {
  static const PackedTiles avx512 = PackedTiles::make<BITS>(Isa::kAvx512, false),
                           avx512_gather = PackedTiles::make<BITS>(Isa::kAvx512, true),
                           avx2 = PackedTiles::make<BITS>(Isa::kAvx2, false),
                           portable = PackedTiles::make<BITS>(Isa::kPortable, false);
  if (k.isa == Isa::kAvx512) return k.gather_heads ? avx512_gather : avx512;
  return k.isa == Isa::kAvx2 ? avx2 : portable;
}

// Outputs of weight tiles [t0, t1) of y [M, N] = x [M, K] @ w^T with k's register or unpacking
// tiles, w packed with bits-bit codes (4 or 8)
static void packed_tile_range_with_isa(PackedIsa k, const float* x, int64_t M, int64_t K, const uint8_t* w,
                                       int64_t N, int bits, float* y, int64_t t0, int64_t t1) {
  const int64_t row_bytes = packed_row_bytes(K, bits);
  const PackedTiles& tiles = bits == 4 ? packed_tiles_for<4>(k) : packed_tiles_for<8>(k);
  const auto range = bits == 4 ? packed_linear_range<4> : packed_linear_range<8>;
  range(tiles, k.isa, x, w, row_bytes, y, M, K, N, t0 * kPackedTileCols, std::min(N, t1 * kPackedTileCols));
}

// y [M, N] = x [M, K] @ w^T with k's kernels, w packed with bits-bit codes (4 or 8), K > 0
static void packed_linear_with_isa(PackedIsa k, const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N,
                                   int bits, float* yp) {
  const Isa isa = k.isa;
#if defined(__x86_64__)
  if (panels_take(isa, M, kPackedPanelAboveRows)) {
    // each panel of 16 weight rows packed lane-major straight from its codes
    const int64_t row_bytes = packed_row_bytes(K, bits);
    const auto pack = bits == 4 ? pack_packed_panel_avx2<4> : pack_packed_panel_avx2<8>;
    for_panels(xp, yp, M, K, N, [&](int64_t n, int nr, float* out) { pack(wp + n * row_bytes, row_bytes, nr, K, out); });
    return;
  }
#endif
  const int64_t tiles_n = (N + kPackedTileCols - 1) / kPackedTileCols;
  at::parallel_for(0, tiles_n, packed_grain(K), [&](int64_t t0, int64_t t1) {
    packed_tile_range_with_isa(k, xp, M, K, wp, N, bits, yp, t0, t1);
  });
}

void packed_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t block_bytes,
                        float* y) {
  packed_linear_with_isa(packed_isa_here(), x, M, K, w, N, packed_bits(block_bytes), y);
}

TileSplit packed_linear_split(int64_t M, int64_t K, int64_t N) {
  if (panels_take(pick_isa(), M, kPackedPanelAboveRows)) return {0, 0};
  return {(N + kPackedTileCols - 1) / kPackedTileCols, packed_grain(K)};
}

void packed_linear_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t block_bytes,
                         float* y, int64_t t0, int64_t t1) {
  packed_tile_range_with_isa(packed_isa_here(), x, M, K, w, N, packed_bits(block_bytes), y, t0, t1);
}

}  // namespace cpu

static at::Tensor packed_linear_with(cpu::PackedIsa kernels, const at::Tensor& x, const at::Tensor& packed,
                                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && cpu::packed_bits(packed.size(2)) != 0,
              "packed_linear: packed must be uint8 [N, K/32, 20 or 34] (swiftkern.packed_weights.pack), got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t N = packed.size(0), K = packed.size(1) * cpu::kBlock;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "packed_linear: x [..., K] must match packed [N, K/32, bytes]: got ",
              x.sizes(), " and ", packed.sizes());
  LinearCall call = linear_call("packed_linear", x, N, bias);
  TORCH_CHECK(packed.size(1) * packed.size(2) * cpu::kPanelCols < (int64_t{1} << 31),
              "packed_linear: rows of ", packed.size(1) * packed.size(2), " bytes are too long (the panels address 16 rows "
              "with 32-bit offsets: K must stay under ~", (int64_t{1} << 31) / cpu::kPanelCols / cpu::kBlockBytes8 * cpu::kBlock, ")");
  if (call.trivial(K)) return call.finish();
  const at::Tensor xc = x.contiguous(), pc = packed.contiguous();
  cpu::packed_linear_with_isa(kernels, xc.data_ptr<float>(), call.M, K, pc.data_ptr<uint8_t>(), N,
                              cpu::packed_bits(pc.size(2)), call.y.data_ptr<float>());
  return call.finish();
}

// x: float32 [..., K]; packed: uint8 [N, K/32, 20 | 34] (4- | 8-bit codes); bias: float32 [N] or
// None -> float32 [..., N], skinny_linear(x, the unpacked weight, bias) bit for bit
at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return packed_linear_with(cpu::packed_isa_here(), x, packed, bias);
}

// The same with named kernels, for the test that each gives skinny_linear's bits: an instruction
// set ("avx512": heads converted per block, "avx2" or "portable") or "avx512-gather"
at::Tensor packed_linear_isa(const at::Tensor& x, const at::Tensor& packed, const std::string& isa) {
  const bool gather = isa == "avx512-gather";
  const cpu::Isa named = checks::named_isa("packed_linear_isa", gather ? "avx512" : isa);
  return packed_linear_with({named, gather}, x, packed, std::nullopt);
}

// The names packed_linear_isa takes that this CPU runs, widest first
std::vector<std::string> packed_linear_isas() {
  std::vector<std::string> names;
  for (cpu::Isa isa : cpu::kIsas)
    if (cpu::isa_supported(isa)) {
      if (isa == cpu::Isa::kAvx512) names.push_back("avx512-gather");
      names.push_back(cpu::isa_name(isa));
    }
  return names;
}

// The name (as packed_linear_isas gives it) of the kernels packed_linear runs on this CPU
std::string packed_linear_here() {
  const cpu::PackedIsa k = cpu::packed_isa_here();
  return k.gather_heads ? "avx512-gather" : cpu::isa_name(k.isa);
}

// Whether packed_linear beats skinny_linear here: it has an AVX-512 or AVX2 kernel (elsewhere the
// portable loop is slower than the float32 kernel, and the runner keeps the float32 weights)
bool packed_linear_fast() { return cpu::pick_isa() != cpu::Isa::kPortable; }

}  // namespace swiftkern
