// verify_attention on CPU: T new queries per row against the row's cache, causal within the new
// tokens, GQA, per-row lengths, no mask tensor.
//
// One task per (row, query head, new token): scores s_j = scale * q . k_j for the keys it sees
// (j < cache_lens[b] - T + i + 1), p_j = exp(s_j - max s) (cpu_exp.h), out = sum_j p_j v_j / sum_j p_j,
// all in fp32 (bf16/fp16 load and round once at the store). Each query is computed alone in a
// fixed order, so its result does not depend on the batch, T or the thread that ran it.
//
// Why a kernel: for decode and verification (T <= 16, a few hundred keys) torch's SDPA spends
// most of its time outside the arithmetic (44 us per SmolLM2 layer at T = 1, for ~30 K FMAs), and
// the mask it needs for per-row lengths costs more ops per layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_exp.h"
#include "op_checks.h"

namespace swiftkern {
namespace cpu {
namespace {

struct AttnShape {
  int64_t B, Hq, T, D, Hkv, S;
  int64_t q_b, q_h, q_t;  // strides of q (elements), D contiguous
  int64_t k_b, k_h, k_s;  // strides of k_cache (v_cache has the same)
  float scale;
};

// Scores of one query against keys [0, L): s[j] = scale * q . k_j, 16-lane fp32 partial sums.
template <class E>
void scores_portable(const E* q, const E* k, int64_t k_s, int64_t L, int64_t D, float scale, float* s) {
  for (int64_t j = 0; j < L; ++j) {
    const E* kj = k + j * k_s;
    float lane[16] = {};
    for (int64_t d = 0; d < D; ++d) lane[d % 16] += static_cast<float>(q[d]) * static_cast<float>(kj[d]);
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    s[j] = sum * scale;
  }
}

// out[d] = sum_j p[j] * v_j[d] / total, accumulated in fp32 in key order.
template <class E>
void weighted_values_portable(const float* p, const E* v, int64_t v_s, int64_t L, int64_t D, float inv_total,
                              float* acc, E* out) {
  std::fill(acc, acc + D, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    const E* vj = v + j * v_s;
    for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * static_cast<float>(vj[d]);
  }
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<E>(acc[d] * inv_total);
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void scores_avx512(const float* q, const float* k, int64_t k_s, int64_t L,
                                                      int64_t D, float scale, float* s) {
  for (int64_t j = 0; j < L; ++j) {
    const float* kj = k + j * k_s;
    __m512 acc = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kj + d), acc);
    if (d < D) {
      const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1u);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), _mm512_maskz_loadu_ps(m, kj + d), acc);
    }
    s[j] = _mm512_reduce_add_ps(acc) * scale;
  }
}

__attribute__((target("avx512f"))) void weighted_values_avx512(const float* p, const float* v, int64_t v_s,
                                                                int64_t L, int64_t D, float inv_total, float* out) {
  // D in chunks of 64 (4 registers): every key's row chunk is read once per query
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, D - d0);
    __mmask16 m[4];
    for (int c = 0; c < 4; ++c) {
      const int64_t n = std::clamp<int64_t>(width - 16 * c, 0, 16);
      m[c] = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
    }
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < L; ++j) {
      const float* vj = v + j * v_s + d0;
      const __m512 pj = _mm512_set1_ps(p[j]);
      a0 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[0], vj), a0);
      a1 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[1], vj + 16), a1);
      a2 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[2], vj + 32), a2);
      a3 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[3], vj + 48), a3);
    }
    const __m512 inv = _mm512_set1_ps(inv_total);
    _mm512_mask_storeu_ps(out + d0, m[0], _mm512_mul_ps(a0, inv));
    _mm512_mask_storeu_ps(out + d0 + 16, m[1], _mm512_mul_ps(a1, inv));
    _mm512_mask_storeu_ps(out + d0 + 32, m[2], _mm512_mul_ps(a2, inv));
    _mm512_mask_storeu_ps(out + d0 + 48, m[3], _mm512_mul_ps(a3, inv));
  }
}

// Up to 16 queries that share one kv head (GQA group x new tokens), in the 16 lanes of a
// register: q[l] (D floats), lim[l] keys seen (0 for unused lanes), out[l] (D floats).
// Scores of 4 keys at a time against all lanes (q transposed once: qt[d][lane]), the softmax
// of all lanes at once, then the values for 4 queries at a time (each value row read once per
// 4 queries). ~5 cycles per (query, key) against ~12 for one query at a time, where every key
// needs a horizontal sum.
__attribute__((target("avx512f"))) void attend_lanes_avx512(const float* const* q, const int64_t* lim, int nq,
                                                            const float* k, const float* v, int64_t kv_s,
                                                            int64_t D, float scale, float* const* out, float* qt,
                                                            float* sc) {
  int64_t L = 0;
  for (int l = 0; l < nq; ++l) L = std::max(L, lim[l]);
  for (int64_t d = 0; d < D; ++d)
    for (int l = 0; l < 16; ++l) qt[d * 16 + l] = l < nq ? q[l][d] : 0.0f;
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {
    const float *k0 = k + j * kv_s, *k1 = k0 + kv_s, *k2 = k1 + kv_s, *k3 = k2 + kv_s;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qd = _mm512_loadu_ps(qt + d * 16);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(k0[d]), qd, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(k1[d]), qd, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(k2[d]), qd, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(k3[d]), qd, a3);
    }
    _mm512_storeu_ps(sc + j * 16, _mm512_mul_ps(a0, vscale));
    _mm512_storeu_ps(sc + (j + 1) * 16, _mm512_mul_ps(a1, vscale));
    _mm512_storeu_ps(sc + (j + 2) * 16, _mm512_mul_ps(a2, vscale));
    _mm512_storeu_ps(sc + (j + 3) * 16, _mm512_mul_ps(a3, vscale));
  }
  for (; j < L; ++j) {
    const float* kj = k + j * kv_s;
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) a = _mm512_fmadd_ps(_mm512_set1_ps(kj[d]), _mm512_loadu_ps(qt + d * 16), a);
    _mm512_storeu_ps(sc + j * 16, _mm512_mul_ps(a, vscale));
  }
  // softmax per lane over the keys it sees; unseen keys get weight 0
  alignas(64) int32_t lim32[16];
  for (int l = 0; l < 16; ++l) lim32[l] = l < nq ? static_cast<int32_t>(lim[l]) : 0;
  const __m512i vlim = _mm512_load_si512(lim32);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (j = 0; j < L; ++j) {
    const __mmask16 seen = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(static_cast<int32_t>(j)));
    mx = _mm512_mask_max_ps(mx, seen, mx, _mm512_loadu_ps(sc + j * 16));
  }
  __m512 total = _mm512_setzero_ps();
  for (j = 0; j < L; ++j) {
    const __mmask16 seen = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32(static_cast<int32_t>(j)));
    const __m512 p = _mm512_maskz_mov_ps(seen, bi_exp_avx512_vec(_mm512_sub_ps(_mm512_loadu_ps(sc + j * 16), mx)));
    total = _mm512_add_ps(total, p);
    _mm512_storeu_ps(sc + j * 16, p);
  }
  alignas(64) float tot[16];
  _mm512_store_ps(tot, total);
  // values: 4 queries x 64 columns of D in 16 registers
  for (int q0 = 0; q0 < nq; q0 += 4) {
    int64_t Lq = 0;
    for (int r = q0; r < std::min(nq, q0 + 4); ++r) Lq = std::max(Lq, lim[r]);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __mmask16 m[4];
      for (int c = 0; c < 4; ++c) {
        const int64_t n = std::clamp<int64_t>(D - d0 - 16 * c, 0, 16);
        m[c] = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
      }
      __m512 acc[4][4];
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
      for (j = 0; j < Lq; ++j) {
        const float* vj = v + j * kv_s + d0;
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = _mm512_maskz_loadu_ps(m[c], vj + 16 * c);
        const float* pj = sc + j * 16 + q0;
        for (int r = 0; r < 4; ++r) {
          const __m512 pr = _mm512_set1_ps(pj[r]);  // lanes past nq hold weight 0
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
        }
      }
      for (int r = 0; r < 4 && q0 + r < nq; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / tot[q0 + r]);
        for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out[q0 + r] + d0 + 16 * c, m[c], _mm512_mul_ps(acc[r][c], inv));
      }
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

// The query heads of one kv head and the new tokens, flattened: u = g * T + i (query head
// hkv * group + g, token i); lanes of 16 of them per task on the AVX-512 fp32 path.
constexpr int kLanes = 16;
constexpr int64_t kMinLaneQueries = 8;  // fewer queries per kv head: one query at a time is faster

#if defined(__x86_64__)
void attend_lanes(const AttnShape& sh, const float* q, const float* k, const float* v, const int64_t* lens,
                  float* out) {
  const int64_t group = sh.Hq / sh.Hkv, per_head = group * sh.T;
  const int64_t blocks = (per_head + kLanes - 1) / kLanes;
  const int64_t tasks = sh.B * sh.Hkv * blocks;
  const int64_t work = std::max<int64_t>(1, kLanes * sh.S * sh.D);
  at::parallel_for(0, tasks, std::max<int64_t>(1, (int64_t(1) << 16) / work), [&](int64_t t0, int64_t t1) {
    std::vector<float> qt(static_cast<size_t>(sh.D * kLanes)), sc(static_cast<size_t>(sh.S * kLanes));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t blk = task % blocks, hkv = (task / blocks) % sh.Hkv, b = task / (blocks * sh.Hkv);
      const float* qs[kLanes];
      float* outs[kLanes];
      int64_t lim[kLanes];
      int nq = 0;
      for (int64_t u = blk * kLanes; u < std::min(per_head, (blk + 1) * kLanes); ++u, ++nq) {
        const int64_t h = hkv * group + u / sh.T, i = u % sh.T;
        qs[nq] = q + b * sh.q_b + h * sh.q_h + i * sh.q_t;
        outs[nq] = out + ((b * sh.Hq + h) * sh.T + i) * sh.D;
        lim[nq] = lens[b] - sh.T + i + 1;
      }
      const int64_t kv_off = b * sh.k_b + hkv * sh.k_h;
      attend_lanes_avx512(qs, lim, nq, k + kv_off, v + kv_off, sh.k_s, sh.D, sh.scale, outs, qt.data(), sc.data());
    }
  });
}
#endif

template <class E>
void attend(const AttnShape& sh, const E* q, const E* k, const E* v, const int64_t* lens, E* out, bool avx512) {
  static const ExpFn exp_fn = pick_exp();
  const int64_t group = sh.Hq / sh.Hkv;
#if defined(__x86_64__)
  if constexpr (std::is_same_v<E, float>) {
    if (avx512 && group * sh.T >= kMinLaneQueries) return attend_lanes(sh, q, k, v, lens, out);
  }
#endif
  const int64_t tasks = sh.B * sh.Hq * sh.T;
  const int64_t work = std::max<int64_t>(1, sh.S * sh.D);  // FMAs of one query, at most
  at::parallel_for(0, tasks, std::max<int64_t>(1, (int64_t(1) << 16) / work), [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(static_cast<size_t>(sh.S)), acc(static_cast<size_t>(sh.D));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t i = task % sh.T, h = (task / sh.T) % sh.Hq, b = task / (sh.T * sh.Hq);
      const int64_t L = lens[b] - sh.T + i + 1;  // keys this query sees (>= 1: lens[b] >= T)
      const E* qp = q + b * sh.q_b + h * sh.q_h + i * sh.q_t;
      const int64_t kv_off = b * sh.k_b + (h / group) * sh.k_h;
      E* op = out + ((b * sh.Hq + h) * sh.T + i) * sh.D;
#if defined(__x86_64__)
      if constexpr (std::is_same_v<E, float>) {
        if (avx512) {
          scores_avx512(qp, k + kv_off, sh.k_s, L, sh.D, sh.scale, scores.data());
          const float total = softmax_weights(scores.data(), L, exp_fn);
          weighted_values_avx512(scores.data(), v + kv_off, sh.k_s, L, sh.D, 1.0f / total, op);
          continue;
        }
      }
#endif
      scores_portable(qp, k + kv_off, sh.k_s, L, sh.D, sh.scale, scores.data());
      const float total = softmax_weights(scores.data(), L, exp_fn);
      weighted_values_portable(scores.data(), v + kv_off, sh.k_s, L, sh.D, 1.0f / total, acc.data(), op);
    }
  });
}

bool cpu_has_avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

}  // namespace
}  // namespace cpu

// q [B, Hq, T, D]; k_cache, v_cache [B, Hkv, S, D] (D contiguous, one layout; S: the keys in
// use); cache_lens int64 [B] in [T, S]; one float dtype -> [B, Hq, T, D] contiguous, q's dtype
at::Tensor verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, double scale) {
  checks::same_device("verify_attention", c10::DeviceType::CPU,
                      {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"cache_lens", &cache_lens}});
  checks::verify_attention(q, k_cache, v_cache, cache_lens);
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor lens = cache_lens.contiguous();
  cpu::AttnShape sh{q.size(0), q.size(1), q.size(2), q.size(3), k_cache.size(1), k_cache.size(2),
                    qc.stride(0), qc.stride(1), qc.stride(2),
                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale)};
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < sh.B; ++b)
    TORCH_CHECK(lp[b] >= sh.T && lp[b] <= sh.S, "verify_attention: cache_lens[", b, "] = ", lp[b],
                " must be in [T = ", sh.T, ", S = ", sh.S, "]: each row holds its T new tokens in the keys given");
  at::Tensor out = at::empty({sh.B, sh.Hq, sh.T, sh.D}, q.options());
  if (out.numel() == 0) return out;
  static const bool avx512 = cpu::cpu_has_avx512();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "verify_attention_cpu", [&] {
    cpu::attend<scalar_t>(sh, qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          lp, out.data_ptr<scalar_t>(), avx512);
  });
  return out;
}

}  // namespace swiftkern
