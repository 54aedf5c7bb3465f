// verify_attention on CPU: T new queries per row against the row's cache, causal within the new
// tokens, GQA, per-row lengths, no mask tensor.
//
// Per query: scores s_j = scale * q . k_j for the keys it sees (j < cache_lens[b] - T + i + 1),
// p_j = exp(s_j - max s) (cpu_exp.h), out = sum_j p_j v_j / sum_j p_j, all in fp32 (bf16/fp16
// load exactly into fp32 and round once at the store; with AVX-512 they take the fp32 one-query
// kernels, the lane path being fp32 only). Two paths, by the queries that share a kv head (GQA group
// x new tokens): below 8, one task per (row, kv head, block of up to 8 tokens) walks the keys
// in blocks shared by the block's queries, scoring one query at a time (16 keys at once) and
// summing the values of the queries that see the same keys together (one chain per query and
// column); from 8 (fp32, AVX-512), tasks of 16 queries in the lanes of a register. Each query's
// arithmetic is in a fixed order set by its own keys, so its result does not depend on the
// batch, the queries beside it or the thread that ran it. Without AVX-512 the one-query path runs
// AVX2 (8-lane scores and value sums) where the CPU has it, the portable loops elsewhere; each
// instruction set sums in its own fixed order, so the bits are those of the machine's widest one.
//
// verify_attention_invariant: every query through the one-query-at-a-time path, whatever T and
// the GQA group (the lane path sums in another order). A query's bits then depend on its own q
// and keys alone: not on the batch, not on how many tokens came with it (decode, verify and
// prefill agree), so the deterministic mode's regular decoding is already what its verifier
// would compute. Decode (T = 1, groups below 8) costs what the regular kernel costs; it was
// the lane path's order first, which made SmolLM2's decode attention several times slower
// (3 of 16 lanes busy) and batch-8 deterministic decoding 0.73x plain.
//
// Why a kernel: for decode and verification (T <= 16, a few hundred keys) torch's SDPA spends
// most of its time outside the arithmetic, and the mask it needs for per-row lengths costs more
// ops per layer (SmolLM2 heads, 512 keys, T = 1: 31 us here against 90 us for the reference
// path, `python -m bench --routine verify_attention`, commit cc2c527).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_exp.h"
#include "exact_load.h"
#include "fixed_order_dot.h"
#include "op_checks.h"
#include "round_store.h"
#include "row_kernels.h"

namespace swiftkern {
namespace cpu {
namespace {

constexpr int64_t kTokenBlock = 8;     // new tokens a one-query-path task takes at most (they share key blocks)
constexpr int64_t kKeyBlock = 64;       // keys per block walked by all of a task's queries (32 KiB at D 128)
#if defined(__x86_64__)
// The AVX-512 scores read 16 key rows at a time, a column chunk of each row per step, which the
// hardware prefetchers do not follow: the rows kPrefetchKeys ahead are asked into L2 as the keys
// are scored (by a task's first query of a block; the others find them cached).
// verify_attention of SmolLM2's heads, one query, 2000 keys from memory, one thread: 315-369 ->
// 214-224 us; the values' rows, read whole in order, gained nothing from it, nor did the AVX2
// scores (4 rows at a time) (docs/speed.md).
constexpr int64_t kPrefetchKeys = 32;
template <class E>
inline void prefetch_key_rows(const E* k, int64_t k_s, int64_t rows, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(E));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(k + r * k_s) + c, _MM_HINT_T1);
}
// the AVX-512 lane path's (attend_lanes)
constexpr int64_t kMinLaneQueries = 8;  // fewer queries per kv head: one query at a time is faster
constexpr int64_t kSharedKvBytes = int64_t(1) << 19;  // a head's keys + values past this: read once per task
#endif


// Scores of one query against keys [0, L): s[j] = scale * q . k_j, 16-lane fp32 partial sums.
template <class E>
void scores_portable(const E* q, const E* k, int64_t k_s, int64_t L, int64_t D, float scale, float* s,
                     int64_t pf_keys) {
  (void)pf_keys;
  for (int64_t j = 0; j < L; ++j) {
    const E* kj = k + j * k_s;
    float lane[16] = {};
    for (int64_t d = 0; d < D; ++d) lane[d % 16] += static_cast<float>(q[d]) * static_cast<float>(kj[d]);
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    s[j] = sum * scale;
  }
}

// For queries u < nq: acc[u * acc_s + d] += sum_j p[u * p_s + j] * v_j[d] over keys [0, L), in
// key order (acc: fp32 rows of D).
template <class E>
void accumulate_values_portable(const float* p, int64_t p_s, int64_t nq, const E* v, int64_t v_s, int64_t L,
                                int64_t D, float* acc, int64_t acc_s) {
  for (int64_t u = 0; u < nq; ++u)
    for (int64_t j = 0; j < L; ++j) {
      const E* vj = v + j * v_s;
      for (int64_t d = 0; d < D; ++d) acc[u * acc_s + d] += p[u * p_s + j] * static_cast<float>(vj[d]);
    }
}

#if defined(__x86_64__)  // the vector bodies (AVX2, AVX-512) and the tail they share
// The softmax's keys [j, L) past a vector body: exp(s - mx) in place, each added to lane[j % 16]
// (j - 16 * (L / 16) = j % 16: the tail adds to lanes 0, 1, ...); then the 16 lanes summed in
// order -> the weights' total
float finish_softmax(float* s, int64_t j, int64_t L, float mx, float* lane) {
  for (; j < L; ++j) {
    s[j] -= mx;
    bi_exp_scalar(s + j, s + j, 1);
    lane[j % 16] += s[j];
  }
  float total = 0.0f;
  for (int l = 0; l < 16; ++l) total += lane[l];
  return total;
}

// q . k_j over D in 16-lane chunks: one fixed chain of FMAs (masked tail), reduced in a fixed order
template <class E>
__attribute__((target("avx512f"))) inline float dot_avx512(const E* q, const E* kj, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(load16(q + d), load16(kj + d), acc);
  if (d < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1u);
    acc = _mm512_fmadd_ps(load16_masked(q + d, m), load16_masked(kj + d, m), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// a[r] = the 16 lane sums of q . k_{r} for NK keys k_0.. (stride k_s) over D: NK independent
// chains of fma in increasing d (masked tail), the chains of dot_avx512
template <int NK, class E>
__attribute__((target("avx512f"))) inline void key_chains(const E* q, const E* k, int64_t k_s, int64_t D,
                                                          __m512* a) {
#pragma GCC unroll 16
  for (int r = 0; r < NK; ++r) a[r] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m512 qd = load16(q + d);
#pragma GCC unroll 16
    for (int r = 0; r < NK; ++r) a[r] = _mm512_fmadd_ps(qd, load16(k + r * k_s + d), a[r]);
  }
  if (d < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1u);
    const __m512 qd = load16_masked(q + d, m);
#pragma GCC unroll 16
    for (int r = 0; r < NK; ++r) a[r] = _mm512_fmadd_ps(qd, load16_masked(k + r * k_s + d, m), a[r]);
  }
}

// Sixteen keys at a time, then four, then one: each key's arithmetic that of dot_avx512 alone
// (the horizontal sums side by side make the same additions as _mm512_reduce_add_ps). Four
// chains of D / 16 FMAs waited on the FMA latency; sixteen keep both FMA ports busy, and their
// sums are one transposing tree and one vector multiply.
template <class E>
__attribute__((target("avx512f"))) void scores_avx512(const E* q, const E* k, int64_t k_s, int64_t L, int64_t D,
                                                      float scale, float* s, int64_t pf_keys) {
  int64_t j = 0;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (; j + 16 <= L; j += 16) {
    if (j + kPrefetchKeys + 16 <= pf_keys) prefetch_key_rows(k + (j + kPrefetchKeys) * k_s, k_s, 16, D);
    __m512 a[16];
    key_chains<16>(q, k + j * k_s, k_s, D, a);
    _mm512_storeu_ps(s + j, _mm512_mul_ps(halving_sum_16_avx512(a), vscale));
  }
  for (; j + 4 <= L; j += 4) {
    __m512 a[4];
    key_chains<4>(q, k + j * k_s, k_s, D, a);
    halving_sum_4_avx512(a, s + j);  // _mm512_reduce_add_ps's pairings, four side by side
    for (int r = 0; r < 4; ++r) s[j + r] *= scale;
  }
  for (; j < L; ++j) s[j] = dot_avx512(q, k + j * k_s, D) * scale;
}

// For Q queries: a[u * a_s + c * 16 ...] += sum_j p[u * p_s + j] * v_j[...] over R registers of
// columns (masks m; kWhole: every mask full, plain loads), in key order: Q * R independent chains,
// each value row loaded once for the Q queries
template <class E, int Q, int R, bool kWhole>
__attribute__((target("avx512f"))) inline void values_columns(const float* p, int64_t p_s, const E* v, int64_t v_s,
                                                              int64_t L, const __mmask16* m, float* a, int64_t a_s) {
  __m512 r[Q][R];
  for (int u = 0; u < Q; ++u)
    for (int c = 0; c < R; ++c) r[u][c] = _mm512_maskz_loadu_ps(m[c], a + u * a_s + 16 * c);
  for (int64_t j = 0; j < L; ++j) {
    const E* vj = v + j * v_s;
    __m512 vv[R];
    for (int c = 0; c < R; ++c) vv[c] = kWhole ? load16(vj + 16 * c) : load16_masked(vj + 16 * c, m[c]);
    for (int u = 0; u < Q; ++u) {
      const __m512 pj = _mm512_set1_ps(p[u * p_s + j]);
      for (int c = 0; c < R; ++c) r[u][c] = _mm512_fmadd_ps(pj, vv[c], r[u][c]);
    }
  }
  for (int u = 0; u < Q; ++u)
    for (int c = 0; c < R; ++c) _mm512_mask_storeu_ps(a + u * a_s + 16 * c, m[c], r[u][c]);
}

template <class E>
using ValuesColumnsFn = void (*)(const float*, int64_t, const E*, int64_t, int64_t, const __mmask16*, float*,
                                 int64_t);

// values_columns for q queries over one chunk of D: 8 registers (128 columns) for 1-2 queries, 4
// (64 columns) for 1-4; whole: every column of the chunk present
template <class E>
ValuesColumnsFn<E> values_columns_for(int registers, bool whole, int q) {
  static constexpr ValuesColumnsFn<E> wide[2][2] = {
      {values_columns<E, 1, 8, false>, values_columns<E, 2, 8, false>},
      {values_columns<E, 1, 8, true>, values_columns<E, 2, 8, true>}};
  static constexpr ValuesColumnsFn<E> narrow[2][4] = {
      {values_columns<E, 1, 4, false>, values_columns<E, 2, 4, false>, values_columns<E, 3, 4, false>,
       values_columns<E, 4, 4, false>},
      {values_columns<E, 1, 4, true>, values_columns<E, 2, 4, true>, values_columns<E, 3, 4, true>,
       values_columns<E, 4, 4, true>}};
  return registers == 8 ? wide[whole][q - 1] : narrow[whole][q - 1];
}

// accumulate_values_portable's sums: D in chunks of 128 columns (8 registers) for up to 2
// queries at once, a last chunk of up to 64 columns (4 registers) for up to 4; each element's
// sum is the same sequence whatever the chunking and grouping. One query's 4-8 chains waited on
// the FMA latency (4 cycles a key at D = 64); 2-4 queries share each value row's loads.
template <class E>
__attribute__((target("avx512f"))) void accumulate_values_avx512(const float* p, int64_t p_s, int64_t nq, const E* v,
                                                                  int64_t v_s, int64_t L, int64_t D, float* acc,
                                                                  int64_t acc_s) {
  for (int64_t d0 = 0; d0 < D;) {
    const int64_t width = D - d0 > 64 ? 128 : 64;
    __mmask16 m[8];
    for (int c = 0; c < 8; ++c) {
      const int64_t n = std::clamp<int64_t>(D - d0 - 16 * c, 0, 16);
      m[c] = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
    }
    const bool whole = D - d0 >= width;
    const int most = width == 128 ? 2 : 4;  // queries at once: Q * R + R + 1 of the 32 registers
    for (int64_t u = 0; u < nq; u += most) {
      const int q = static_cast<int>(std::min<int64_t>(most, nq - u));
      const float* pu = p + u * p_s;
      float* au = acc + u * acc_s + d0;
      values_columns_for<E>(static_cast<int>(width / 16), whole, q)(pu, p_s, v + d0, v_s, L, m, au, acc_s);
    }
    d0 += width;
  }
}

// AVX2 (8 lanes): each key's score is one chain of FMAs over D in chunks of 8 columns (the tail
// columns one FMA each into lanes 0, 1, ...), summed by halving (l + 4, l + 2, l + 1); four keys
// at a time keep four chains in flight, a key alone does the same arithmetic
__attribute__((target("avx2"))) inline float halving_sum_8(__m256 v) {
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

template <class E>
__attribute__((target("avx2,fma,f16c"))) inline float finish_key_avx2(__m256 acc, const E* q, const E* kj, int64_t d,
                                                                     int64_t D) {
  if (d < D) {
    alignas(32) float lane[8];
    _mm256_store_ps(lane, acc);
    for (int64_t t = d; t < D; ++t)
      lane[t - d] = std::fma(static_cast<float>(q[t]), static_cast<float>(kj[t]), lane[t - d]);
    acc = _mm256_load_ps(lane);
  }
  return halving_sum_8(acc);
}

template <class E>
__attribute__((target("avx2,fma,f16c"))) void scores_avx2(const E* q, const E* k, int64_t k_s, int64_t L, int64_t D,
                                                          float scale, float* s, int64_t pf_keys) {
  (void)pf_keys;  // no prefetch: 4 rows at a time, none gained (docs/speed.md)
  const int64_t whole = D / 8 * 8;
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t d = 0; d < whole; d += 8) {
      const __m256 qd = load8(q + d);
      for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(qd, load8(k + (j + r) * k_s + d), a[r]);
    }
    for (int r = 0; r < 4; ++r) s[j + r] = finish_key_avx2(a[r], q, k + (j + r) * k_s, whole, D) * scale;
  }
  for (; j < L; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < whole; d += 8) a = _mm256_fmadd_ps(load8(q + d), load8(k + j * k_s + d), a);
    s[j] = finish_key_avx2(a, q, k + j * k_s, whole, D) * scale;
  }
}

// accumulate_values with one FMA a (query, key, column) in key order, as the AVX-512 kernel:
// per query, 64 columns (8 chains) at a time, then 8, then the tail columns one by one
template <class E, int R>
__attribute__((target("avx2,fma,f16c"))) inline void values_columns_avx2(const float* p, const E* v, int64_t v_s,
                                                                        int64_t L, float* a) {
  __m256 r[R];
  for (int c = 0; c < R; ++c) r[c] = _mm256_loadu_ps(a + 8 * c);
  for (int64_t j = 0; j < L; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int c = 0; c < R; ++c) r[c] = _mm256_fmadd_ps(pj, load8(v + j * v_s + 8 * c), r[c]);
  }
  for (int c = 0; c < R; ++c) _mm256_storeu_ps(a + 8 * c, r[c]);
}

template <class E>
__attribute__((target("avx2,fma,f16c"))) void accumulate_values_avx2(const float* p, int64_t p_s, int64_t nq,
                                                                    const E* v, int64_t v_s, int64_t L, int64_t D,
                                                                    float* acc, int64_t acc_s) {
  for (int64_t u = 0; u < nq; ++u) {
    const float* pu = p + u * p_s;
    float* au = acc + u * acc_s;
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) values_columns_avx2<E, 8>(pu, v + d, v_s, L, au + d);
    for (; d + 8 <= D; d += 8) values_columns_avx2<E, 1>(pu, v + d, v_s, L, au + d);
    for (; d < D; ++d)
      for (int64_t j = 0; j < L; ++j) au[d] = std::fma(pu[j], static_cast<float>(v[j * v_s + d]), au[d]);
  }
}

// softmax_weights with bi_exp_avx2's exp (the same bits as the scalar exp) and its 16 lane sums
// in key order, lanes 0-7 and 8-15 in two registers
__attribute__((target("avx2"))) float softmax_weights_avx2(float* s, int64_t L) {
  float mx = s[0];
  for (int64_t j = 1; j < L; ++j) mx = std::max(mx, s[j]);
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= L; j += 16) {
    const __m256 p0 = bi_exp_avx2_vec(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    const __m256 p1 = bi_exp_avx2_vec(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
    _mm256_storeu_ps(s + j, p0);
    _mm256_storeu_ps(s + j + 8, p1);
    lo = _mm256_add_ps(lo, p0);
    hi = _mm256_add_ps(hi, p1);
  }
  alignas(32) float lane[16];
  _mm256_store_ps(lane, lo);
  _mm256_store_ps(lane + 8, hi);
  return finish_softmax(s, j, L, mx, lane);
}

// Up to 16 queries that share one kv head (GQA group x new tokens) in the 16 lanes of a
// register (a "lane block"): scores of 4 keys at a time against all lanes (q transposed once:
// qt[d][lane]), the softmax of all lanes at once, then the values for 4 queries at a time
// (each value row read once per 4 queries). ~5 cycles per (query, key) against ~12 for one
// query at a time, where every key needs a horizontal sum. Each phase takes a range of keys,
// so a task can walk one block of keys through all lane blocks of a head (keys read once).

// qt[d * 16 + l] = q[l][d] (0 for lanes past nq)
void lane_transpose(const float* const* q, int nq, int64_t D, float* qt) {
  for (int64_t d = 0; d < D; ++d)
    for (int l = 0; l < kLanes; ++l) qt[d * kLanes + l] = l < nq ? q[l][d] : 0.0f;
}

// sc[j * 16 + l] = scale * q_l . k_j for keys [0, n) (k: the block's first key)
__attribute__((target("avx512f"))) void lane_scores(const float* qt, const float* k, int64_t kv_s, int64_t n,
                                                    int64_t D, float scale, float* sc) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = k + j * kv_s, *k1 = k0 + kv_s, *k2 = k1 + kv_s, *k3 = k2 + kv_s;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qd = _mm512_loadu_ps(qt + d * kLanes);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(k0[d]), qd, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(k1[d]), qd, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(k2[d]), qd, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(k3[d]), qd, a3);
    }
    _mm512_storeu_ps(sc + j * kLanes, _mm512_mul_ps(a0, vscale));
    _mm512_storeu_ps(sc + (j + 1) * kLanes, _mm512_mul_ps(a1, vscale));
    _mm512_storeu_ps(sc + (j + 2) * kLanes, _mm512_mul_ps(a2, vscale));
    _mm512_storeu_ps(sc + (j + 3) * kLanes, _mm512_mul_ps(a3, vscale));
  }
  for (; j < n; ++j) {
    const float* kj = k + j * kv_s;
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) a = _mm512_fmadd_ps(_mm512_set1_ps(kj[d]), _mm512_loadu_ps(qt + d * kLanes), a);
    _mm512_storeu_ps(sc + j * kLanes, _mm512_mul_ps(a, vscale));
  }
}

// lane_scores for two lane blocks at once (qa, qb -> sa, sb): each key element broadcast once
// feeds both, 6 loads per 8 FMAs instead of 5 per 4.
__attribute__((target("avx512f"))) void lane_scores2(const float* qa, const float* qb, const float* k, int64_t kv_s,
                                                     int64_t n, int64_t D, float scale, float* sa, float* sb) {
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = k + j * kv_s, *k1 = k0 + kv_s, *k2 = k1 + kv_s, *k3 = k2 + kv_s;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qad = _mm512_loadu_ps(qa + d * kLanes), qbd = _mm512_loadu_ps(qb + d * kLanes);
      const __m512 x0 = _mm512_set1_ps(k0[d]), x1 = _mm512_set1_ps(k1[d]);
      const __m512 x2 = _mm512_set1_ps(k2[d]), x3 = _mm512_set1_ps(k3[d]);
      a0 = _mm512_fmadd_ps(x0, qad, a0); b0 = _mm512_fmadd_ps(x0, qbd, b0);
      a1 = _mm512_fmadd_ps(x1, qad, a1); b1 = _mm512_fmadd_ps(x1, qbd, b1);
      a2 = _mm512_fmadd_ps(x2, qad, a2); b2 = _mm512_fmadd_ps(x2, qbd, b2);
      a3 = _mm512_fmadd_ps(x3, qad, a3); b3 = _mm512_fmadd_ps(x3, qbd, b3);
    }
    const __m512 av[4] = {a0, a1, a2, a3}, bv[4] = {b0, b1, b2, b3};
    for (int r = 0; r < 4; ++r) {
      _mm512_storeu_ps(sa + (j + r) * kLanes, _mm512_mul_ps(av[r], vscale));
      _mm512_storeu_ps(sb + (j + r) * kLanes, _mm512_mul_ps(bv[r], vscale));
    }
  }
  if (j < n) {  // the last keys: the one-block kernel, same per-lane arithmetic
    lane_scores(qa, k + j * kv_s, kv_s, n - j, D, scale, sa + j * kLanes);
    lane_scores(qb, k + j * kv_s, kv_s, n - j, D, scale, sb + j * kLanes);
  }
}

// In place over keys [0, L): sc -> exp(sc - max) where lane l sees key j (j < lim[l]), else 0;
// tot[l] = the sum of lane l's weights.
__attribute__((target("avx512f"))) void lane_softmax(float* sc, const int64_t* lim, int nq, int64_t L, float* tot) {
  alignas(64) int32_t lim32[kLanes];
  for (int l = 0; l < kLanes; ++l) lim32[l] = l < nq ? static_cast<int32_t>(lim[l]) : 0;
  const __m512i vlim = _mm512_load_si512(lim32);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < L; ++j) {
    const __mmask16 seen = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(static_cast<int32_t>(j)));
    mx = _mm512_mask_max_ps(mx, seen, mx, _mm512_loadu_ps(sc + j * kLanes));
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const __mmask16 seen = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(static_cast<int32_t>(j)));
    const __m512 p =
        _mm512_maskz_mov_ps(seen, bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(sc + j * kLanes), mx)));
    total = _mm512_add_ps(total, p);
    _mm512_storeu_ps(sc + j * kLanes, p);
  }
  _mm512_storeu_ps(tot, total);
}

// acc[l * D + d] += sum_j p[j * 16 + l] * v_j[d] for keys [0, n) and lanes l < nq: 4 lanes x 64
// columns of D in 16 registers, each value row loaded once per 4 lanes. acc holds 16 lanes x D,
// so lanes past nq are read and written with empty masks (no access): every loop over the 4 x 4
// accumulators has a constant trip count and they stay in registers (a loop to nr made GCC keep
// them in memory, storing all 16 at every key: 2.3x the time of the scores).
__attribute__((target("avx512f"))) void lane_values(const float* p, const float* v, int64_t kv_s, int64_t n,
                                                    int64_t D, int nq, float* acc) {
  for (int q0 = 0; q0 < nq; q0 += 4) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __mmask16 m[4], rows[4][4];  // m: the columns of D in each register; rows: m for lanes < nq only
      for (int c = 0; c < 4; ++c) {
        const int64_t w = std::clamp<int64_t>(D - d0 - 16 * c, 0, 16);
        m[c] = static_cast<__mmask16>(w == 16 ? 0xFFFFu : (1u << w) - 1u);
        for (int r = 0; r < 4; ++r) rows[r][c] = q0 + r < nq ? m[c] : static_cast<__mmask16>(0);
      }
      __m512 a[4][4];
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_maskz_loadu_ps(rows[r][c], acc + (q0 + r) * D + d0 + 16 * c);
      const bool whole = D - d0 >= 64;  // plain loads: the masks stay out of the key loop
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + j * kv_s + d0;
        __m512 vv[4];
        for (int c = 0; c < 4; ++c)
          vv[c] = whole ? _mm512_loadu_ps(vj + 16 * c) : _mm512_maskz_loadu_ps(m[c], vj + 16 * c);
        const float* pj = p + j * kLanes + q0;
        for (int r = 0; r < 4; ++r) {
          const __m512 pr = _mm512_set1_ps(pj[r]);  // lanes past nq hold weight 0
          for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(pr, vv[c], a[r][c]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(acc + (q0 + r) * D + d0 + 16 * c, rows[r][c], a[r][c]);
    }
  }
}
#endif

// exp(s - max) in place over [0, L) -> the sum of the weights
float softmax_weights(float* s, int64_t L, ExpFn exp_fn) {
  float mx = s[0];
  for (int64_t j = 1; j < L; ++j) mx = std::max(mx, s[j]);
  for (int64_t j = 0; j < L; ++j) s[j] -= mx;
  exp_fn(s, s, L);
  float lane[16] = {};
  for (int64_t j = 0; j < L; ++j) lane[j % 16] += s[j];
  float total = 0.0f;
  for (int l = 0; l < 16; ++l) total += lane[l];
  return total;
}

#if defined(__x86_64__)
// softmax_weights in one vector pass after the max: the same max, bi_exp_avx512's exp (vector
// for whole chunks of 16, scalar for the tail) and the same 16 lane sums in key order
__attribute__((target("avx512f"))) float softmax_weights_avx512(float* s, int64_t L) {
  __m512 vmx = _mm512_set1_ps(s[0]);
  int64_t j = 0;
  for (; j + 16 <= L; j += 16) vmx = _mm512_max_ps(_mm512_loadu_ps(s + j), vmx);
  float mx = _mm512_reduce_max_ps(vmx);
  for (; j < L; ++j) mx = std::max(mx, s[j]);
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 sums = _mm512_setzero_ps();
  for (j = 0; j + 16 <= L; j += 16) {
    const __m512 p = bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    _mm512_storeu_ps(s + j, p);
    sums = _mm512_add_ps(sums, p);
  }
  alignas(64) float lane[16];
  _mm512_store_ps(lane, sums);
  return finish_softmax(s, j, L, mx, lane);
}

// The query heads of one kv head and the new tokens, flattened: u = g * T + i (query head
// hkv * group + g, token i), in lane blocks of 16.
void attend_lanes(const AttnShape& sh, const float* q, const float* k, const float* v, const int64_t* lens,
                  float* out) {
  const int64_t group = sh.Hq / sh.Hkv, queries = group * sh.T;  // queries per (row, kv head)
  const int64_t blocks = (queries + kLanes - 1) / kLanes;  // lane blocks of one (row, kv head)
  // a head's keys and values past kSharedKvBytes, and heads enough to keep every thread busy:
  // one task walks them once through all its lane blocks (else each block would stream them
  // again); otherwise a task per lane block (parallelism)
  const bool shared = 2 * sh.S * sh.D * static_cast<int64_t>(sizeof(float)) > kSharedKvBytes &&
                      sh.B * sh.Hkv >= 2 * at::get_num_threads();
  // otherwise pairs of lane blocks when there are tasks enough (scored together: lane_scores2)
  const bool pairs = blocks >= 2 && sh.B * sh.Hkv * ((blocks + 1) / 2) >= 2 * at::get_num_threads();
  const int64_t per_task = shared ? blocks : pairs ? 2 : 1;
  const int64_t per_head = (blocks + per_task - 1) / per_task;  // tasks per (row, kv head)
  const int64_t tasks = sh.B * sh.Hkv * per_head;
  const int64_t work = std::max<int64_t>(1, per_task * kLanes * sh.S * sh.D);
  at::parallel_for(0, tasks, std::max<int64_t>(1, (int64_t(1) << 16) / work), [&](int64_t t0, int64_t t1) {
    const size_t cap = static_cast<size_t>(per_task);
    std::vector<float> qt(cap * sh.D * kLanes), sc(cap * sh.S * kLanes), acc(cap * kLanes * sh.D);
    std::vector<float> totals(cap * kLanes);  // the softmax sum of every lane
    std::vector<int64_t> lim(cap * kLanes);
    std::vector<int> nq(cap);
    std::vector<float*> outs(cap * kLanes);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t first = (task % per_head) * per_task;
      const int64_t hkv = (task / per_head) % sh.Hkv, b = task / (per_head * sh.Hkv);
      const size_t nb = static_cast<size_t>(std::min(per_task, blocks - first));  // lane blocks of this task
      int64_t L = 0;
      for (size_t x = 0; x < nb; ++x) {
        const float* qs[kLanes];
        const int64_t blk = first + static_cast<int64_t>(x);
        nq[x] = 0;
        for (int64_t u = blk * kLanes; u < std::min(queries, (blk + 1) * kLanes); ++u, ++nq[x]) {
          const int64_t h = hkv * group + u / sh.T, i = u % sh.T;
          qs[nq[x]] = q + b * sh.q_b + h * sh.q_h + i * sh.q_t;
          outs[x * kLanes + nq[x]] = out + b * sh.o_b + h * sh.o_h + i * sh.o_t;
          lim[x * kLanes + nq[x]] = lens[b] - sh.T + i + 1;
          L = std::max(L, lim[x * kLanes + nq[x]]);
        }
        lane_transpose(qs, nq[x], sh.D, qt.data() + x * sh.D * kLanes);
      }
      const float* kh = k + b * sh.k_b + hkv * sh.k_h;
      const float* vh = v + b * sh.k_b + hkv * sh.k_h;
      for (int64_t j0 = 0; j0 < L; j0 += kKeyBlock) {  // each key block once, through every lane block
        const int64_t n = std::min(kKeyBlock, L - j0);
        size_t x = 0;
        for (; x + 2 <= nb; x += 2)
          lane_scores2(qt.data() + x * sh.D * kLanes, qt.data() + (x + 1) * sh.D * kLanes, kh + j0 * sh.k_s, sh.k_s,
                       n, sh.D, sh.scale, sc.data() + (x * sh.S + j0) * kLanes,
                       sc.data() + ((x + 1) * sh.S + j0) * kLanes);
        if (x < nb)
          lane_scores(qt.data() + x * sh.D * kLanes, kh + j0 * sh.k_s, sh.k_s, n, sh.D, sh.scale,
                      sc.data() + (x * sh.S + j0) * kLanes);
      }
      for (size_t x = 0; x < nb; ++x)
        lane_softmax(sc.data() + x * sh.S * kLanes, lim.data() + x * kLanes, nq[x], L, totals.data() + x * kLanes);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j0 = 0; j0 < L; j0 += kKeyBlock)
        for (size_t x = 0; x < nb; ++x)
          lane_values(sc.data() + (x * sh.S + j0) * kLanes, vh + j0 * sh.k_s, sh.k_s, std::min(kKeyBlock, L - j0),
                      sh.D, nq[x], acc.data() + x * kLanes * sh.D);
      for (size_t x = 0; x < nb; ++x)
        for (int l = 0; l < nq[x]; ++l) {
          const float inv = 1.0f / totals[x * kLanes + l];
          const float* a = acc.data() + (x * kLanes + l) * sh.D;
          float* o = outs[x * kLanes + l];
          for (int64_t d = 0; d < sh.D; ++d) o[d] = a[d] * inv;
        }
    }
  });
}
#endif

template <class E>
void attend(const AttnShape& sh, const E* q, const E* k, const E* v, const int64_t* lens, E* out, Isa isa,
            bool invariant) {
  static const ExpFn exp_fn = pick_exp();
  const int64_t group = sh.Hq / sh.Hkv;
#if defined(__x86_64__)
  const bool avx512 = isa == Isa::kAvx512;
  if constexpr (std::is_same_v<E, float>) {
    if (avx512 && !invariant && group * sh.T >= kMinLaneQueries) return attend_lanes(sh, q, k, v, lens, out);
  }
#endif
  // one task per (row, kv head, block of new tokens): the block's queries (tokens x the group)
  // walk the keys in blocks of kKeyBlock, each read from memory once for all of them (a prefill
  // streamed every key from L3 once per token). Each query's arithmetic is the same whatever
  // block it is in: its scores key by key, its softmax and its value sums in key order.
  using ScoresFn = void (*)(const E*, const E*, int64_t, int64_t, int64_t, float, float*, int64_t);
  using ValuesFn = void (*)(const float*, int64_t, int64_t, const E*, int64_t, int64_t, int64_t, float*, int64_t);
  ScoresFn scores_fn = scores_portable<E>;
  ValuesFn values_fn = accumulate_values_portable<E>;
  auto weights_fn = [](float* s, int64_t L) { return softmax_weights(s, L, exp_fn); };
  float (*softmax_fn)(float*, int64_t) = weights_fn;
#if defined(__x86_64__)
  if (avx512) {
    scores_fn = scores_avx512<E>;
    values_fn = accumulate_values_avx512<E>;
    softmax_fn = softmax_weights_avx512;
  } else if (isa == Isa::kAvx2) {
    scores_fn = scores_avx2<E>;
    values_fn = accumulate_values_avx2<E>;
    softmax_fn = softmax_weights_avx2;
  }
#endif
  // tokens a task takes: 4 tasks a thread first (decode and short passes keep one token a task),
  // then up to kTokenBlock
  const int64_t spread = sh.B * sh.Hkv * sh.T / (4 * static_cast<int64_t>(at::get_num_threads()));
  const int64_t per_task = std::clamp<int64_t>(spread, 1, std::min(kTokenBlock, sh.T));
  const int64_t blocks = (sh.T + per_task - 1) / per_task;  // token blocks of a (row, kv head)
  const int64_t tasks = sh.B * sh.Hkv * blocks;
  const int64_t queries = per_task * group;  // of a task, at most
  const int64_t work = std::max<int64_t>(1, queries * sh.S * sh.D);  // FMAs of one task, at most
  at::parallel_for(0, tasks, std::max<int64_t>(1, (int64_t(1) << 16) / work), [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(static_cast<size_t>(queries * sh.S)), acc(static_cast<size_t>(queries * sh.D));
    std::vector<float> total(static_cast<size_t>(queries));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t blk = task % blocks, hkv = (task / blocks) % sh.Hkv, b = task / (blocks * sh.Hkv);
      const int64_t i0 = blk * per_task, nt = std::min(per_task, sh.T - i0);
      const int64_t first = lens[b] - sh.T + i0 + 1;  // keys token i0 sees (>= 1: lens[b] >= T); i0 + t: first + t
      const E* kb = k + b * sh.k_b + hkv * sh.k_h;
      const E* vb = v + b * sh.k_b + hkv * sh.k_h;
      auto query = [&](int64_t t, int64_t g) {  // token i0 + t of query head hkv * group + g
        return q + b * sh.q_b + (hkv * group + g) * sh.q_h + (i0 + t) * sh.q_t;
      };
      // f(t0, t1, j0, n): tokens i0 + [t0, t1) each see keys [j0, j0 + n) of the key block at j0;
      // block by block, the tokens that see a whole block in one run
      auto each_key_block = [&](auto&& f) {
        for (int64_t j0 = 0; j0 < first + nt - 1; j0 += kKeyBlock) {
          const int64_t whole = std::clamp<int64_t>(j0 + kKeyBlock - first, 0, nt);  // from it: all kKeyBlock keys
          for (int64_t t = std::max<int64_t>(0, j0 - first + 1); t < whole; ++t) f(t, t + 1, j0, first + t - j0);
          if (whole < nt) f(whole, nt, j0, kKeyBlock);
        }
      };
      each_key_block([&](int64_t t0, int64_t t1, int64_t j0, int64_t n) {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t g = 0; g < group; ++g)  // the first query prefetches (up to the keys the task sees)
            scores_fn(query(t, g), kb + j0 * sh.k_s, sh.k_s, n, sh.D, sh.scale,
                      scores.data() + (t * group + g) * sh.S + j0, t == t0 && g == 0 ? first + nt - 1 - j0 : 0);
      });
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < group; ++g)
          total[t * group + g] = softmax_fn(scores.data() + (t * group + g) * sh.S, first + t);
      std::fill(acc.begin(), acc.end(), 0.0f);
      each_key_block([&](int64_t t0, int64_t t1, int64_t j0, int64_t n) {  // the queries of tokens [t0, t1) at once
        values_fn(scores.data() + t0 * group * sh.S + j0, sh.S, (t1 - t0) * group, vb + j0 * sh.k_s, sh.k_s, n,
                  sh.D, acc.data() + t0 * group * sh.D, sh.D);
      });
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < group; ++g) {
          E* o = out + b * sh.o_b + (hkv * group + g) * sh.o_h + (i0 + t) * sh.o_t;
          const float inv = 1.0f / total[t * group + g];
          float* a = acc.data() + (t * group + g) * sh.D;
          for (int64_t d = 0; d < sh.D; ++d) a[d] = a[d] * inv;
          round_rows(isa, a, sh.D, o);  // bf16 / fp16: c10's rounding, in vectors
        }
    }
  });
}

}  // namespace

template <class E>
void attend_rows(const AttnShape& sh, const E* q, const E* k, const E* v, const int64_t* lens, E* out, bool invariant) {
  static const Isa isa = pick_isa();
  attend<E>(sh, q, k, v, lens, out, isa, invariant);
}
#define INSTANTIATE(E) \
  template void attend_rows<E>(const AttnShape&, const E*, const E*, const E*, const int64_t*, E*, bool);
SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE)
#undef INSTANTIATE

}  // namespace cpu

namespace {
// q [B, Hq, T, D]; k_cache, v_cache [B, Hkv, S, D] (D contiguous, one layout; S: the keys in
// use); cache_lens int64 [B] in [T, S]; one float dtype -> [B, Hq, T, D] contiguous, q's dtype
// isa: the widest paths the CPU has (pick_isa), or one named by a test
at::Tensor attention_entry(const char* name, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& cache_lens, double scale, bool invariant,
                           cpu::Isa isa = cpu::pick_isa()) {
  checks::same_device(name, c10::DeviceType::CPU,
                      {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"cache_lens", &cache_lens}});
  checks::verify_attention(q, k_cache, v_cache, cache_lens);
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor lens = cache_lens.contiguous();
  const int64_t Hq = q.size(1), T = q.size(2), D = q.size(3);
  cpu::AttnShape sh{q.size(0), Hq, T, D, k_cache.size(1), k_cache.size(2),
                    qc.stride(0), qc.stride(1), qc.stride(2),
                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                    Hq * T * D, T * D, D,  // out: contiguous
                    static_cast<float>(scale)};
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < sh.B; ++b)
    TORCH_CHECK(lp[b] >= sh.T && lp[b] <= sh.S, name, ": cache_lens[", b, "] = ", lp[b],
                " must be in [T = ", sh.T, ", S = ", sh.S, "]: each row holds its T new tokens in the keys given");
  at::Tensor out = at::empty({sh.B, sh.Hq, sh.T, sh.D}, q.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "verify_attention_cpu", [&] {
    const scalar_t *qp = qc.data_ptr<scalar_t>(), *kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    cpu::attend<scalar_t>(sh, qp, kp, vp, lp, op, isa, invariant);
  });
  return out;
}
}  // namespace

at::Tensor verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, double scale) {
  return attention_entry("verify_attention", q, k_cache, v_cache, cache_lens, scale, false);
}

// verify_attention (invariant: its invariant variant) on a named instruction set: avx512, avx2 or
// portable, so the tests run the narrower paths on an AVX-512 CPU too
at::Tensor verify_attention_isa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, double scale, const std::string& isa, bool invariant) {
  return attention_entry(invariant ? "verify_attention_invariant" : "verify_attention", q, k_cache, v_cache, cache_lens,
                         scale, invariant, checks::named_isa("verify_attention_isa", isa));
}

// The same contract; each query through the one-query path: its bits independent of T and the batch
at::Tensor verify_attention_invariant_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& cache_lens, double scale) {
  return attention_entry("verify_attention_invariant", q, k_cache, v_cache, cache_lens, scale, true);
}

}  // namespace swiftkern
