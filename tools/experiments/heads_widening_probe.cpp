// Probe: ways to widen a 20-byte Q4_1 block's float16 scale and offset in the AVX-512 register
// tile (csrc/packed_linear_cpu.cpp's packed_tile_avx512: ROWS x rows by packed_tile_cols(ROWS)
// weight rows), standalone so each way is one template argument. Every exact way is checked
// against HEAD's bit for bit (random heads with subnormal scales and zero offsets); the probes
// marked "timing only" compute wrong weights. docs/speed.md (2026-12-03) has what it measured.
//
//   g++ -O3 -fopenmp -mf16c -DROWS=1 -o probe heads_widening_probe.cpp   # ROWS: x rows, 1 to 11
//   OMP_NUM_THREADS=1 ./probe 576 1536 1 400     # K, N, matrices, rounds: L2-hot
//   OMP_NUM_THREADS=2 ./probe 576 1536 120 20    # 66 MB of blocks: streamed from memory
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int kBytes = 20;  // float16 scale, float16 offset, 16 bytes of 4-bit codes
enum Way { kPerBlock, kInteger, kTwoBroadcasts, kChunkPermutes, kConstTable, kFloatHeads, kL1Weights, kWays };
const char* kNames[kWays] = {"per block: broadcast, cvtph2ps, 2 permutes (HEAD)",
                             "integer: shifts, mask, multiply by 2^112",
                             "two float16 broadcasts, two cvtph2ps",
                             "16 blocks: 5 loads, 3 permutes, 1 chunk ahead",
                             "constant table (timing only)",
                             "float32 heads, broadcast loads (timing only)", "weights loaded from L1 (timing only)"};

static inline uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

__attribute__((target("avx512f"))) static inline __m512 code_table(__m512 scale, __m512 offset) {
  return _mm512_fmadd_ps(scale, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), offset);
}

// float16 in the low / high half of each lane's dword -> float32, exact for every finite value
// (subnormals and zeros included: the shifted bits are the value times 2^-112)
__attribute__((target("avx512f"))) static inline __m512 half_bits_to_float(__m512i half_at_top) {
  const __m512i bits = _mm512_and_si512(_mm512_srai_epi32(half_at_top, 3), _mm512_set1_epi32(int(0x8FFFE000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p112f));
}

template <Way W>
__attribute__((target("avx512f"))) static inline __m512 block_table(const uint8_t* block, const float* head) {
  if constexpr (W == kPerBlock) {
    const __m512 pairs = _mm512_cvtph_ps(_mm256_set1_epi32(int(load_u32(block))));
    return code_table(_mm512_permute_ps(pairs, 0x00), _mm512_permute_ps(pairs, 0x55));
  } else if constexpr (W == kInteger) {
    const __m512i v = _mm512_set1_epi32(int(load_u32(block)));
    return code_table(half_bits_to_float(_mm512_slli_epi32(v, 16)), half_bits_to_float(v));
  } else if constexpr (W == kTwoBroadcasts) {
    uint16_t s, o;
    std::memcpy(&s, block, 2);
    std::memcpy(&o, block + 2, 2);
    return code_table(_mm512_cvtph_ps(_mm256_set1_epi16(short(s))), _mm512_cvtph_ps(_mm256_set1_epi16(short(o))));
  } else if constexpr (W == kChunkPermutes) {
    return code_table(_mm512_set1_ps(head[0]), _mm512_set1_ps(head[1]));
  } else if constexpr (W == kConstTable) {
    return code_table(_mm512_set1_ps(1.0f), _mm512_set1_ps(0.5f));
  } else {  // the 24-byte block read its float32 heads so (here: the block's first bytes as float32)
    float s, o;
    std::memcpy(&s, block, 4);
    std::memcpy(&o, block + 8, 4);
    return code_table(_mm512_set1_ps(s), _mm512_set1_ps(o));
  }
}

// heads[2i], heads[2i + 1] = block i's scale and offset (i < min(left, 16)): the dwords at 0, 5,
// 10, ... of 5 (masked) loads picked by three permutes, then two conversions
__attribute__((target("avx512f"))) static void widen_16_heads(const uint8_t* block, int64_t left, float* heads) {
  const int dwords = int(std::min<int64_t>(left, 16)) * 5;
  __m512i z[5];
  for (int q = 0; q < 5; ++q) {
    const int n = std::clamp(dwords - 16 * q, 0, 16);
    z[q] = _mm512_maskz_loadu_epi32(n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u), block + 64 * q);
  }
  const __m512i a = _mm512_permutex2var_epi32(z[0], _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0), z[1]);
  const __m512i b = _mm512_permutex2var_epi32(z[2], _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 3, 8, 13, 18, 23, 28, 0, 0, 0), z[3]);
  const __m512i c = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6, 11), z[4]);
  const __m512i pairs = _mm512_mask_blend_epi32(0xE000, _mm512_mask_blend_epi32(0x1F80, a, b), c);
  _mm512_store_ps(heads, _mm512_cvtph_ps(_mm512_castsi512_si256(pairs)));
  _mm512_store_ps(heads + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1)));
}

// y[0..4) = x . w[j] for 4 rows of K / 32 blocks, the accumulation order of the real tile
template <Way W, int MR, int NR>
__attribute__((target("avx512f"))) static void tile(const float* x, const uint8_t* w, int64_t row_bytes, float* y,
                                                   int64_t K, int64_t N) {
  __m512 acc[MR][NR];
  for (auto& r : acc) for (auto& a : r) a = _mm512_setzero_ps();
  const int64_t blocks = K / 32;
  alignas(64) float heads[2][NR][32];
  auto widen = [&](int64_t c0, int buf) {
    for (int j = 0; j < NR; ++j) widen_16_heads(w + j * row_bytes + c0 * kBytes, blocks - c0, heads[buf][j]);
  };
  if constexpr (W == kChunkPermutes) widen(0, 0);
  int buf = 0;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16, buf ^= 1) {
    const int64_t b1 = std::min(blocks, b0 + 16);
    if constexpr (W == kChunkPermutes)
      if (b1 < blocks) widen(b1, buf ^ 1);
    for (int64_t b = b0; b < b1; ++b) {
      __m512 wv[2][NR];
      for (int j = 0; j < NR; ++j) {
        const uint8_t* block = w + j * row_bytes + b * kBytes;
        if constexpr (W == kL1Weights) {  // no rebuild at all: the unpacked path's loads
          static thread_local float l1[NR][32] = {};
          wv[0][j] = _mm512_loadu_ps(l1[j] + (b & 1));
          wv[1][j] = _mm512_loadu_ps(l1[j] + 16 - (b & 1));
          continue;
        }
        const __m512 table = block_table<W>(block, &heads[buf][j][2 * (b - b0)]);
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
        wv[0][j] = _mm512_permutexvar_ps(codes, table);
        wv[1][j] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
      }
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < MR; ++i) {
          const __m512 xv = _mm512_loadu_ps(x + i * K + b * 32 + 16 * h);
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[h][j], acc[i][j]);
        }
    }
  }
  for (int i = 0; i < MR; ++i) for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#ifndef ROWS
#define ROWS 1
#endif
constexpr int kRows = ROWS, kCols = ROWS <= 5 ? 4 : ROWS <= 8 ? 3 : 2;  // as packed_tile_cols
static_assert(ROWS >= 1 && ROWS <= 11, "the register tiles take 1 to 11 x rows");
template <Way W>
static void linear(const float* x, const uint8_t* w, float* y, int64_t N, int64_t K) {
  const int64_t row_bytes = K / 32 * kBytes;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N - kCols + 1; n += kCols) tile<W, kRows, kCols>(x, w + n * row_bytes, row_bytes, y + n, K, N);
}

using LinearFn = void (*)(const float*, const uint8_t*, float*, int64_t, int64_t);
const LinearFn kLinear[kWays] = {linear<kPerBlock>, linear<kInteger>, linear<kTwoBroadcasts>,
                                 linear<kChunkPermutes>, linear<kConstTable>, linear<kFloatHeads>, linear<kL1Weights>};
const bool kExact[kWays] = {true, true, true, true, false, false, false};

int main(int argc, char** argv) {
  if (argc != 5) { std::fprintf(stderr, "usage: %s K N matrices rounds (K a multiple of 32)\n", argv[0]); return 2; }
  const int64_t K = std::atoll(argv[1]), N = std::atoll(argv[2]);
  const int matrices = std::atoi(argv[3]), rounds = std::atoi(argv[4]);
  const int64_t row_bytes = K / 32 * kBytes;
  std::srand(1);
  std::vector<std::vector<uint8_t>> w(matrices, std::vector<uint8_t>(N * row_bytes));
  for (auto& m : w)
    for (int64_t i = 0; i < N * K / 32; ++i) {
      uint8_t* block = &m[i * kBytes];
      float scale = (std::rand() % 1000 + 1) * 1e-5f * (std::rand() % 7 ? 1 : -1), offset = -(std::rand() % 1000) * 1e-4f;
      if (std::rand() % 50 == 0) offset = 0.0f;
      if (std::rand() % 80 == 0) scale = 3e-6f;  // a float16 subnormal
      const uint16_t s = _cvtss_sh(scale, 0), o = _cvtss_sh(offset, 0);
      std::memcpy(block, &s, 2);
      std::memcpy(block + 2, &o, 2);
      for (int c = 0; c < 16; ++c) block[4 + c] = uint8_t(std::rand());
    }
  std::vector<float> x(K * kRows), want(N * kRows), got(N * kRows);
  for (auto& v : x) v = (std::rand() % 2000 - 1000) * 1e-3f;
  kLinear[kPerBlock](x.data(), w[0].data(), want.data(), N, K);
  for (int v = 0; v < kWays; ++v) {
    kLinear[v](x.data(), w[0].data(), got.data(), N, K);
    if (kExact[v] && std::memcmp(got.data(), want.data(), N * kRows * 4)) std::printf("MISMATCH: %s\n", kNames[v]);
  }
  std::vector<double> best(kWays, 1e30), total(kWays, 0.0);
  for (int r = 0; r < rounds; ++r)
    for (int v = 0; v < kWays; ++v) {  // interleaved: the machine's drift hits every way alike
      const auto t0 = std::chrono::steady_clock::now();
      for (int m = 0; m < matrices; ++m) kLinear[v](x.data(), w[m].data(), got.data(), N, K);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      best[v] = std::min(best[v], ms);
      total[v] += ms;
    }
  for (int v = 0; v < kWays; ++v)
    std::printf("%-52s best %7.3f ms (%.3fx)  mean %7.3f ms (%.3fx)\n", kNames[v], best[v], best[v] / best[0],
                total[v] / rounds, total[v] / total[0]);
}
