// greedy_accept on CPU: a torch-free kernel (raw pointers + sizes) and a thin ATen wrapper.
//
// Row b walks its verified positions j = 0, 1, ...: t = argmax(target_logits[b, j]); while
// j < num_draft[b] and draft_tokens[b, j] == t the draft is accepted. The first position that
// is not accepted gets t (the corrected token, or the bonus token after all drafts); the rest
// of the row is -1. Argmax as torch.argmax: computed in fp32, ties -> lowest index, the first
// NaN wins over everything, all -inf -> 0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "op_checks.h"

namespace swiftkern {
namespace cpu {

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Loaders: storage type -> fp32. The fp16 one is branch-free so the scan loop vectorizes.
struct LoadF32 {
  using T = float;
  static inline float load(float x) { return x; }
};
struct LoadBF16 {
  using T = uint16_t;
  static inline float load(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }
};
struct LoadF16 {
  using T = uint16_t;
  static inline float load(uint16_t h) {
    const uint32_t w = uint32_t(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;  // exponent+mantissa, sign shifted out
    // normal/inf/nan: move the fields into place and rescale the exponent bias (15 -> 127)
    const float normal = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    // subnormal: mantissa as the low bits of 0.5f's significand, minus 0.5f
    const float subnormal = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t mag = two_w < (1u << 27) ? f32_to_bits(subnormal) : f32_to_bits(normal);
    return bits_to_f32(sign | mag);
  }
};

constexpr int kLanes = 32;

// Index of the maximum of x[0:V] (V >= 1) with torch.argmax's tie and NaN rules, in two passes
// that both vectorize: the maximum (and whether any NaN occurs) in kLanes independent lanes,
// then the first index holding it (the second pass stops there; the row is in cache by then).
// Always inlined: each target clone below then compiles the scan for its own instruction set (a
// call would reach one out-of-line copy built for the baseline, SSE2, whatever the clone).
template <class L>
__attribute__((always_inline)) inline int64_t row_argmax(const typename L::T* __restrict x, int64_t V) {
  float best[kLanes];
  int32_t nan[kLanes];
  for (int l = 0; l < kLanes; ++l) { best[l] = -INFINITY; nan[l] = 0; }
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const float v = L::load(x[j + l]);
      nan[l] |= (v != v);
      best[l] = v > best[l] ? v : best[l];
    }
  }
  for (int l = 0; j < V; ++j, ++l) {
    const float v = L::load(x[j]);
    nan[l] |= (v != v);
    best[l] = v > best[l] ? v : best[l];
  }
  int32_t any_nan = 0;
  float m = -INFINITY;
  for (int l = 0; l < kLanes; ++l) {
    any_nan |= nan[l];
    m = best[l] > m ? best[l] : m;
  }
  if (any_nan) {  // the first NaN wins
    for (int64_t i = 0; i < V; ++i) {
      const float v = L::load(x[i]);
      if (v != v) return i;
    }
  }
  // the first index equal to the maximum (a row of -inf: index 0)
  j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    int32_t hit = 0;
#pragma omp simd reduction(| : hit)
    for (int l = 0; l < kLanes; ++l) hit |= (L::load(x[j + l]) == m);
    if (hit) break;
  }
  for (; j < V; ++j)
    if (L::load(x[j]) == m) return j;
  return 0;
}

// One compiled scan per dtype; on x86-64 GCC also AVX-512 and AVX2 clones picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SWIFTKERN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SWIFTKERN_CLONES
#endif

SWIFTKERN_CLONES int64_t argmax_f32(const float* x, int64_t V) { return row_argmax<LoadF32>(x, V); }
SWIFTKERN_CLONES int64_t argmax_bf16(const uint16_t* x, int64_t V) { return row_argmax<LoadBF16>(x, V); }
SWIFTKERN_CLONES int64_t argmax_f16(const uint16_t* x, int64_t V) { return row_argmax<LoadF16>(x, V); }

inline int64_t argmax(const float* x, int64_t V) { return argmax_f32(x, V); }
inline int64_t argmax(const uint16_t* x, int64_t V, bool is_bf16) {
  return is_bf16 ? argmax_bf16(x, V) : argmax_f16(x, V);
}

// Strides are in elements; logits rows (the V axis) are contiguous. Outputs are contiguous:
// out_tokens [B, K+1], num_accepted [B]. num_draft values must already be in [0, K].
template <typename T>
void greedy_accept_kernel(const int64_t* draft, int64_t d_sb, int64_t d_sk,
                          const T* logits, int64_t l_sb, int64_t l_sk,
                          const int32_t* num_draft, int64_t n_s,
                          int64_t* out, int32_t* num_accepted,
                          int64_t B, int64_t K, int64_t V, bool is_bf16, int num_threads) {
  auto arg = [&](int64_t b, int64_t j) -> int64_t {
    const T* row = logits + b * l_sb + j * l_sk;
    if constexpr (std::is_same<T, float>::value) return argmax(row, V);
    else return argmax(row, V, is_bf16);
  };
  auto finish_row = [&](int64_t b, int64_t a, int64_t t) {
    int64_t* o = out + b * (K + 1);
    for (int64_t j = 0; j < a; ++j) o[j] = draft[b * d_sb + j * d_sk];
    o[a] = t;
    for (int64_t j = a + 1; j <= K; ++j) o[j] = -1;
    num_accepted[b] = int32_t(a);
  };
  const int64_t work = B * (K + 1) * V;
  const bool par = num_threads > 1 && work >= (1 << 17);  // a parallel region costs ~a 512 KiB scan

  if (B >= num_threads || !par) {
    // rows in parallel; each row stops scanning at its first rejection
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (par)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nd = num_draft[b * n_s];
      int64_t a = 0, t = arg(b, 0);
      while (a < nd && draft[b * d_sb + a * d_sk] == t) t = arg(b, ++a);
      finish_row(b, a, t);
    }
    return;
  }
  // few rows, many threads: all argmaxes a row may need, in parallel over rows x positions
  std::vector<int64_t> target(B * (K + 1), -1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t i = 0; i < B * (K + 1); ++i) {
    const int64_t b = i / (K + 1), j = i % (K + 1);
    if (j <= num_draft[b * n_s]) target[i] = arg(b, j);
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nd = num_draft[b * n_s];
    const int64_t* t = target.data() + b * (K + 1);
    int64_t a = 0;
    while (a < nd && draft[b * d_sb + a * d_sk] == t[a]) ++a;
    finish_row(b, a, t[a]);
  }
}

}  // namespace cpu

// draft_tokens: int64 [B, K]; target_logits: float32|bfloat16|float16 [B, K+1, V];
// num_draft: int32 [B] in [0, K] -> (out_tokens int64 [B, K+1], num_accepted int32 [B])
std::tuple<at::Tensor, at::Tensor> greedy_accept_cpu(const at::Tensor& draft_tokens,
                                                     const at::Tensor& target_logits,
                                                     const at::Tensor& num_draft) {
  TORCH_CHECK(draft_tokens.dim() == 2, "greedy_accept: draft_tokens must be [B, K], got shape ",
              draft_tokens.sizes());
  TORCH_CHECK(target_logits.dim() == 3, "greedy_accept: target_logits must be [B, K+1, V], got shape ",
              target_logits.sizes());
  TORCH_CHECK(num_draft.dim() == 1, "greedy_accept: num_draft must be [B], got shape ", num_draft.sizes());
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1), V = target_logits.size(2);
  TORCH_CHECK(target_logits.size(0) == B && target_logits.size(1) == K + 1,
              "greedy_accept: target_logits must be [B, K+1, V] = [", B, ", ", K + 1,
              ", V] to match draft_tokens ", draft_tokens.sizes(), ", got ", target_logits.sizes());
  TORCH_CHECK(num_draft.size(0) == B, "greedy_accept: num_draft must have B = ", B,
              " entries, got ", num_draft.size(0));
  TORCH_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max(),
              "greedy_accept: vocabulary size V must be in [1, 2^31), got ", V);
  TORCH_CHECK(draft_tokens.device().is_cpu() && target_logits.device().is_cpu() && num_draft.device().is_cpu(),
              "greedy_accept (CPU kernel): all inputs must be on the CPU, got draft_tokens on ",
              draft_tokens.device(), ", target_logits on ", target_logits.device(), ", num_draft on ",
              num_draft.device());
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong, "greedy_accept: draft_tokens must be int64, got ",
              draft_tokens.scalar_type());
  TORCH_CHECK(num_draft.scalar_type() == at::kInt, "greedy_accept: num_draft must be int32, got ",
              num_draft.scalar_type());
  const auto dt = target_logits.scalar_type();
  TORCH_CHECK(checks::is_float_dtype(dt),
              "greedy_accept: target_logits must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(target_logits.stride(2) == 1 || V == 1 || target_logits.numel() == 0,
              "greedy_accept: target_logits must be contiguous along V (stride(2) == 1), got strides ",
              target_logits.strides(), "; call .contiguous() first");

  const int32_t* nd = num_draft.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = nd[b * num_draft.stride(0)];
    TORCH_CHECK(n >= 0 && n <= K, "greedy_accept: num_draft[", b, "] = ", n, " is outside [0, K = ", K, "]");
  }
  auto out = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, num_draft.options());
  if (B == 0) return {out, num_accepted};

  const int threads = at::get_num_threads();
  const int64_t* draft = draft_tokens.data_ptr<int64_t>();
  const int64_t d_sb = draft_tokens.stride(0), d_sk = draft_tokens.stride(1);
  const int64_t l_sb = target_logits.stride(0), l_sk = target_logits.stride(1), n_s = num_draft.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  int32_t* na = num_accepted.data_ptr<int32_t>();
  if (dt == at::kFloat) {
    cpu::greedy_accept_kernel<float>(draft, d_sb, d_sk, target_logits.data_ptr<float>(), l_sb, l_sk,
                                     nd, n_s, o, na, B, K, V, false, threads);
  } else {
    const auto* x = static_cast<const uint16_t*>(target_logits.data_ptr());
    cpu::greedy_accept_kernel<uint16_t>(draft, d_sb, d_sk, x, l_sb, l_sk, nd, n_s, o, na, B, K, V,
                                        dt == at::kBFloat16, threads);
  }
  return {out, num_accepted};
}

}  // namespace swiftkern
