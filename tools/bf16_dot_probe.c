// Can the invariant bf16 matmul use the CPU's bf16 dot-product instructions? Two probes:
//
// 1. throughput: VDPBF16PS (AVX512-BF16: 2 bf16 products a lane) against VFMADD231PS (1 float32
//    product a lane), 12 independent chains each, in instructions a second;
// 2. order: AMX's TDPBF16PS on a 16 x 32 by 32 x 16 tile, every output compared bit for bit with
//    fma chains over k (even element first, odd first), with each pair summed exactly before one
//    rounding, and with the exact sum rounded once. The fixed-order dot product of
//    csrc/fixed_order_dot.h is a chain of fmas; an instruction that matches none of these orders
//    cannot reproduce it, whatever the packing.
//
// Build and run (Linux, x86-64, a CPU with AVX512-BF16 and AMX-BF16):
//   gcc -O2 tools/bf16_dot_probe.c -o /tmp/bf16_dot_probe -lm && /tmp/bf16_dot_probe
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS12(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define DECL(i) __m512 a##i = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);

// fn(n): 12 independent chains of `step` (a##i: the chain's register), n steps each, on x and y
#define CHAIN_TIMER(fn, isa, T, x0, y0, step)             \
  __attribute__((target(isa))) static float fn(long n) {   \
    CHAINS12(DECL)                                            \
    T x = x0, y = y0;                                         \
    for (long i = 0; i < n; i++) {                            \
      CHAINS12(step)                                          \
      __asm__ volatile("" : "+v"(x), "+v"(y));                \
    }                                                         \
    __m512 s = _mm512_setzero_ps();                           \
    CHAINS12(SUM)                                             \
    return _mm512_reduce_add_ps(s);                           \
  }
#define DP_STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
#define FMA_STEP(i) a##i = _mm512_fmadd_ps(x, y, a##i);
CHAIN_TIMER(dp_chains, "avx512f,avx512bf16", __m512bh, (__m512bh)_mm512_set1_epi16(0x3f80),
            (__m512bh)_mm512_set1_epi16(0x3000), DP_STEP)
CHAIN_TIMER(fma_chains, "avx512f", __m512, _mm512_set1_ps(1.f), _mm512_set1_ps(1e-6f), FMA_STEP)

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static uint16_t to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }
static float from_bf16(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint32_t state = 12345;
static uint32_t next(void) { state ^= state << 13; state ^= state >> 17; state ^= state << 5; return state; }
// a bf16 value in about [-3.3, 3.3] * 2^[-spread, spread]
static float random_bf16(int spread) {
  const float v = ((int)(next() % 2000) - 1000) / 300.f * ldexpf(1.f, (int)(next() % (2 * spread + 1)) - spread);
  return from_bf16(to_bf16(v));
}

// C [16][16] += A [16][32] (bf16) @ B, B in AMX's pair layout: B[k / 2][2n + k % 2] = w[k][n]
__attribute__((target("amx-tile,amx-bf16"))) static void amx_tile(const uint16_t* A, const uint16_t* B, float* C) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 3; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  _tile_loadd(0, C, 64);
  _tile_loadd(1, A, 64);
  _tile_loadd(2, B, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, C, 64);
  _tile_release();
}

static int differ(float a, float b) { return memcmp(&a, &b, 4) != 0; }

static void order_probe(int spread) {
  long mismatch[4] = {0}, total = 0;
  for (int it = 0; it < 2000; it++) {
    float x[16][32], w[32][16], c0[16][16], C[16][16];
    uint16_t A[16][32], B[16][32];
    for (int m = 0; m < 16; m++)
      for (int k = 0; k < 32; k++) x[m][k] = random_bf16(spread), A[m][k] = to_bf16(x[m][k]);
    for (int k = 0; k < 32; k++)
      for (int n = 0; n < 16; n++) w[k][n] = random_bf16(spread), B[k / 2][2 * n + k % 2] = to_bf16(w[k][n]);
    for (int m = 0; m < 16; m++)
      for (int n = 0; n < 16; n++) c0[m][n] = C[m][n] = (it % 2) ? random_bf16(spread) * 8 : 0.f;
    amx_tile(&A[0][0], &B[0][0], &C[0][0]);
    for (int m = 0; m < 16; m++)
      for (int n = 0; n < 16; n++) {
        float even = c0[m][n], odd = c0[m][n], pair = c0[m][n];
        double exact = c0[m][n];
        for (int k = 0; k < 32; k += 2) {
          const double p0 = (double)x[m][k] * w[k][n], p1 = (double)x[m][k + 1] * w[k + 1][n];
          even = fmaf(x[m][k + 1], w[k + 1][n], fmaf(x[m][k], w[k][n], even));
          odd = fmaf(x[m][k], w[k][n], fmaf(x[m][k + 1], w[k + 1][n], odd));
          pair = (float)((double)pair + (p0 + p1));
          exact += p0 + p1;
        }
        total++;
        mismatch[0] += differ(C[m][n], even);
        mismatch[1] += differ(C[m][n], odd);
        mismatch[2] += differ(C[m][n], pair);
        mismatch[3] += differ(C[m][n], (float)exact);
      }
  }
  printf("AMX TDPBF16PS, exponent spread %2d: %ld outputs; differ from fma chain even-first %ld, odd-first %ld, "
         "pair-rounded %ld, exact-rounded %ld\n",
         spread, total, mismatch[0], mismatch[1], mismatch[2], mismatch[3]);
}

int main(void) {
  const long n = 50000000;
  for (int r = 0; r < 3; r++) {
    double t = now();
    volatile float sink = fma_chains(n);
    const double t_fma = now() - t;
    t = now();
    sink = dp_chains(n);
    const double t_dp = now() - t;
    (void)sink;
    printf("one thread: VFMADD231PS zmm %.2f G/s (16 products each), VDPBF16PS zmm %.2f G/s (32 products each)\n",
           12 * n / t_fma / 1e9, 12 * n / t_dp / 1e9);
  }
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
    printf("AMX: the kernel refused the tile state; no order probe\n");
    return 0;
  }
  for (int spread = 0; spread <= 20; spread += 10) order_probe(spread);
  return 0;
}
