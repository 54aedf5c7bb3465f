// rejection_sample on CPU: a torch-free kernel (raw pointers + strides) and a thin ATen wrapper.
//
// Row b: draft j (token x) is accepted while j < num_draft[b] and u_accept[b, j] * q(x) < p(x),
// compared in double (q = 1 for a one-hot draft, draft_probs undefined). At the first
// rejection j the token is drawn from max(0, p_j - q_j) (from p_j when that is all zero);
// after all drafts the bonus token is drawn from p_{num_draft[b]}. A draw from weights w is
// the smallest i with cdf[i] > u_sample[b, j] * cdf[V-1] (V-1 if none), where cdf is the
// left-to-right double running sum, exactly as torch's float64 cumsum on CPU, so the result
// matches reference.rejection_sample token for token. Nothing of size [B, K+1, V] is made:
// the first pass sums w and keeps the running sum at every kChunk-th element, the second
// rescans only the chunk where the running sum first passes the threshold. The first pass is
// one long chain of dependent adds, so a thread runs it for kGroup rows at once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace swiftkern {
namespace cpu {
namespace {  // internal linkage: other kernels' helpers share namespace cpu

constexpr int64_t kChunk = 1024;
constexpr int kGroup = 4;

// One inverse-CDF draw over w(i) = max(lo, p[i] - q[i] - [i == x]); q may be null and x -1.
// lo = 0 for a residual; lo = -inf passes p through unchanged (the bonus token, the fallback).
struct Draw {
  const float* p;
  const float* q;
  int64_t x;
  double lo, u;
  double weight(int64_t i) const {
    double v = q ? double(p[i]) - double(q[i]) : double(p[i]);
    if (i == x) v -= 1.0;
    return v < lo ? lo : v;
  }
  void fill(int64_t c0, int64_t n, double* __restrict w) const {  // w[i] = weight(c0 + i)
    const float* __restrict pc = p + c0;
    if (q) {
      const float* __restrict qc = q + c0;
      for (int64_t i = 0; i < n; ++i) w[i] = double(pc[i]) - double(qc[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) w[i] = double(pc[i]);
    }
    if (x >= c0 && x < c0 + n) w[x - c0] -= 1.0;
    for (int64_t i = 0; i < n; ++i) w[i] = w[i] < lo ? lo : w[i];
  }
};

// Pass 1 for n <= kGroup draws side by side (independent add chains): marks[g * M + c] is the
// left-to-right running sum of draw g before chunk c; marks[g * M + M - 1] its total.
void sum_group(const Draw* d, int n, int64_t V, double* marks, int64_t M) {
  alignas(64) double w[kGroup][kChunk] = {};
  double acc[kGroup] = {};
  int64_t c = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk, ++c) {
    const int64_t len = std::min(kChunk, V - c0);
    for (int g = 0; g < n; ++g) {
      marks[g * M + c] = acc[g];
      d[g].fill(c0, len, w[g]);
    }
    for (int64_t i = 0; i < len; ++i)
      for (int g = 0; g < kGroup; ++g) acc[g] += w[g][i];
  }
  for (int g = 0; g < n; ++g) marks[g * M + c] = acc[g];
}

// Pass 2: the smallest i with running sum > u * total (V - 1 if none), rescanning one chunk.
int64_t search(const Draw& d, int64_t V, const double* marks, int64_t M) {
  const double t = d.u * marks[M - 1];
  for (int64_t k = 0; k + 1 < M; ++k) {
    if (!(marks[k + 1] > t)) continue;
    double s = marks[k];  // continues pass 1's chain from the chunk start: the same sums
    const int64_t c1 = std::min(V, (k + 1) * kChunk);
    for (int64_t i = k * kChunk; i < c1; ++i)
      if ((s += d.weight(i)) > t) return i;
    return c1 - 1;  // unreachable: marks[k + 1] is the running sum at c1 - 1
  }
  return V - 1;
}

// Probability rows (the V axis) contiguous; draft_probs may be null (one-hot draft). out:
// contiguous [B, K+1]; num_accepted [B]. num_draft in [0, K]; drafts j < num_draft in [0, V).
void rejection_sample_kernel(const int64_t* draft, int64_t d_sb, int64_t d_sk,
                             const float* dprobs, int64_t q_sb, int64_t q_sk,
                             const float* tprobs, int64_t p_sb, int64_t p_sk,
                             const int32_t* num_draft, int64_t n_s,
                             const float* u_acc, int64_t ua_sb, int64_t ua_sk,
                             const float* u_smp, int64_t us_sb, int64_t us_sk,
                             int64_t* out, int32_t* num_accepted, int64_t B, int64_t K, int64_t V) {
  const int64_t M = (V + kChunk - 1) / kChunk + 1;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / V);  // a row costs ~V
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    std::vector<double> marks(kGroup * M);
    for (int64_t g0 = b0; g0 < b1; g0 += kGroup) {
      const int n = int(std::min<int64_t>(kGroup, b1 - g0));
      Draw d[kGroup];
      int64_t acc[kGroup];
      for (int g = 0; g < n; ++g) {  // acceptance, then what the row's token is drawn from
        const int64_t b = g0 + g, nd = num_draft[b * n_s];
        int64_t j = 0;
        for (; j < nd; ++j) {
          const int64_t x = draft[b * d_sb + j * d_sk];
          const double p = tprobs[b * p_sb + j * p_sk + x];
          const double q = dprobs ? double(dprobs[b * q_sb + j * q_sk + x]) : 1.0;
          if (!(double(u_acc[b * ua_sb + j * ua_sk]) * q < p)) break;
          out[b * (K + 1) + j] = x;
        }
        acc[g] = j;
        d[g] = {tprobs + b * p_sb + j * p_sk, nullptr, -1, -INFINITY, double(u_smp[b * us_sb + j * us_sk])};
        if (j < nd) {  // rejected: the residual max(0, p - q), q one-hot without draft_probs
          d[g].lo = 0.0;
          if (dprobs) d[g].q = dprobs + b * q_sb + j * q_sk;
          else d[g].x = draft[b * d_sb + j * d_sk];
        }
      }
      sum_group(d, n, V, marks.data(), M);
      for (int g = 0; g < n; ++g) {
        double* mk = marks.data() + g * M;
        if (d[g].lo == 0.0 && !(mk[M - 1] > 0.0)) {  // all-zero (or NaN) residual: draw from p
          d[g] = {d[g].p, nullptr, -1, -INFINITY, d[g].u};
          sum_group(&d[g], 1, V, mk, M);
        }
        int64_t* o = out + (g0 + g) * (K + 1);
        o[acc[g]] = search(d[g], V, mk, M);
        for (int64_t i = acc[g] + 1; i <= K; ++i) o[i] = -1;
        num_accepted[g0 + g] = int32_t(acc[g]);
      }
    }
  });
}

}  // namespace
}  // namespace cpu

// draft_tokens: int64 [B, K]; draft_probs: float32 [B, K, V] or undefined (one-hot draft);
// target_probs: float32 [B, K+1, V]; num_draft: int32 [B] in [0, K]; u_accept: float32 [B, K];
// u_sample: float32 [B, K+1] -> (out_tokens int64 [B, K+1] padded with -1, num_accepted int32 [B])
std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& draft_tokens,
                                                        const std::optional<at::Tensor>& draft_probs,
                                                        const at::Tensor& target_probs,
                                                        const at::Tensor& num_draft,
                                                        const at::Tensor& u_accept,
                                                        const at::Tensor& u_sample) {
  const bool has_q = draft_probs.has_value() && draft_probs->defined();
  TORCH_CHECK(draft_tokens.dim() == 2, "rejection_sample: draft_tokens must be [B, K], got shape ",
              draft_tokens.sizes());
  TORCH_CHECK(target_probs.dim() == 3, "rejection_sample: target_probs must be [B, K+1, V], got shape ",
              target_probs.sizes());
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1), V = target_probs.size(2);
  TORCH_CHECK(target_probs.size(0) == B && target_probs.size(1) == K + 1,
              "rejection_sample: target_probs must be [B, K+1, V] = [", B, ", ", K + 1,
              ", V] to match draft_tokens ", draft_tokens.sizes(), ", got ", target_probs.sizes());
  TORCH_CHECK(V > 0, "rejection_sample: target_probs has an empty vocabulary axis (V = 0)");
  if (has_q)
    TORCH_CHECK(draft_probs->dim() == 3 && draft_probs->size(0) == B && draft_probs->size(1) == K &&
                    draft_probs->size(2) == V,
                "rejection_sample: draft_probs must be [B, K, V] = [", B, ", ", K, ", ", V, "], got ",
                draft_probs->sizes());
  TORCH_CHECK(num_draft.dim() == 1 && num_draft.size(0) == B, "rejection_sample: num_draft must be [B] = [",
              B, "], got ", num_draft.sizes());
  TORCH_CHECK(u_accept.dim() == 2 && u_accept.size(0) == B && u_accept.size(1) == K,
              "rejection_sample: u_accept must be [B, K] = [", B, ", ", K, "], got ", u_accept.sizes());
  TORCH_CHECK(u_sample.dim() == 2 && u_sample.size(0) == B && u_sample.size(1) == K + 1,
              "rejection_sample: u_sample must be [B, K+1] = [", B, ", ", K + 1, "], got ", u_sample.sizes());
  for (const at::Tensor* t : {&draft_tokens, &target_probs, &num_draft, &u_accept, &u_sample})
    TORCH_CHECK(t->device().is_cpu(), "rejection_sample (CPU kernel): all inputs must be on the CPU, got one on ",
                t->device());
  if (has_q) TORCH_CHECK(draft_probs->device().is_cpu(), "rejection_sample (CPU kernel): draft_probs is on ",
                         draft_probs->device(), ", not the CPU");
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong, "rejection_sample: draft_tokens must be int64, got ",
              draft_tokens.scalar_type());
  TORCH_CHECK(num_draft.scalar_type() == at::kInt, "rejection_sample: num_draft must be int32, got ",
              num_draft.scalar_type());
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat && (!has_q || draft_probs->scalar_type() == at::kFloat),
              "rejection_sample (CPU kernel): target_probs and draft_probs must be float32, got ",
              target_probs.scalar_type(), has_q ? " and " : "", has_q ? c10::toString(draft_probs->scalar_type()) : "",
              " (ops.rejection_sample converts bfloat16/float16 to float32 first)");
  TORCH_CHECK(u_accept.scalar_type() == at::kFloat && u_sample.scalar_type() == at::kFloat,
              "rejection_sample: u_accept and u_sample must be float32, got ", u_accept.scalar_type(), " and ",
              u_sample.scalar_type());
  TORCH_CHECK(target_probs.stride(2) == 1 || V == 1 || target_probs.numel() == 0,
              "rejection_sample: target_probs must be contiguous along V (stride(2) == 1), got strides ",
              target_probs.strides(), "; call .contiguous() first");
  if (has_q)
    TORCH_CHECK(draft_probs->stride(2) == 1 || V == 1 || draft_probs->numel() == 0,
                "rejection_sample: draft_probs must be contiguous along V (stride(2) == 1), got strides ",
                draft_probs->strides(), "; call .contiguous() first");

  const int32_t* nd = num_draft.data_ptr<int32_t>();
  const int64_t* draft = draft_tokens.data_ptr<int64_t>();
  const int64_t n_s = num_draft.stride(0), d_sb = draft_tokens.stride(0), d_sk = draft_tokens.stride(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = nd[b * n_s];
    TORCH_CHECK(n >= 0 && n <= K, "rejection_sample: num_draft[", b, "] = ", n, " is outside [0, K = ", K, "]");
    for (int64_t j = 0; j < n; ++j) {
      const int64_t x = draft[b * d_sb + j * d_sk];
      TORCH_CHECK(x >= 0 && x < V, "rejection_sample: draft_tokens[", b, ", ", j, "] = ", x,
                  " is outside the vocabulary [0, V = ", V, ")");
    }
  }
  auto out = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, num_draft.options());
  if (B == 0) return {out, num_accepted};

  const float* q = has_q ? draft_probs->data_ptr<float>() : nullptr;
  cpu::rejection_sample_kernel(draft, d_sb, d_sk, q, has_q ? draft_probs->stride(0) : 0,
                               has_q ? draft_probs->stride(1) : 0, target_probs.data_ptr<float>(),
                               target_probs.stride(0), target_probs.stride(1), nd, n_s,
                               u_accept.data_ptr<float>(), u_accept.stride(0), u_accept.stride(1),
                               u_sample.data_ptr<float>(), u_sample.stride(0), u_sample.stride(1),
                               out.data_ptr<int64_t>(), num_accepted.data_ptr<int32_t>(), B, K, V);
  return {out, num_accepted};
}

}  // namespace swiftkern
