// bi_exp on CPU: exp(x) in float32 with the same bits for an element wherever it sits (the
// arithmetic is in cpu_exp.h; the kernel, its scalar tail and the torch twin agree bit for bit),
// bi_exp_sum: the fixed-order sum of those exps along a row (the verifier's softmax
// denominator), the same additions as reference.tree_sum, and bi_max_exp_sum: a row's max and
// the bi_exp_sum of the row minus it (the verifier's logprobs), in one call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_exp.h"
#include "cpu_isa.h"
#include "op_checks.h"

namespace swiftkern {

// x: float32 [...] -> float32 [...] (contiguous), exp(x) element by element
at::Tensor bi_exp_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "bi_exp_cpu: x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bi_exp: x must be float32, got ", x.scalar_type());
  static const cpu::ExpFn fn = cpu::pick_exp();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, xc.numel(), 32768, [&](int64_t i0, int64_t i1) { fn(xp + i0, yp + i0, i1 - i0); });
  return y;
}

// bi_exp with a named instruction set ("avx512", "avx2", "portable"), for the test that each
// gives the reference's bits
at::Tensor bi_exp_isa(const at::Tensor& x, const std::string& isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "bi_exp_isa: x must be float32 on the CPU");
  const cpu::ExpFn fn = cpu::exp_for(checks::named_isa("bi_exp_isa", isa));
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  fn(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel());
  return y;
}

namespace {

// buf: float32 [padded], padded a multiple of 64 (the exps, zero past the row) -> their sum in
// reference.tree_sum's order: halved by elementwise adds (i + half) while the length is even,
// then the rest added column by column. Each add is one IEEE add of the same two values as in
// the twin, so the bits agree. Overwrites buf.
float tree_sum_inplace(float* buf, int64_t padded) {
  int64_t len = padded;
  while (len % 2 == 0) {
    const int64_t half = len / 2;
    for (int64_t i = 0; i < half; ++i) buf[i] = buf[i] + buf[i + half];
    len = half;
  }
  float total = buf[0];
  for (int64_t j = 1; j < len; ++j) total = total + buf[j];
  return total;
}

// a single row's exps are made in chunks of this many elements, so it uses every thread
constexpr int64_t kExpChunk = 8192;
// the few-rows path keeps its scratch between calls up to this many floats
constexpr int64_t kKeptScratch = int64_t{1} << 20;

// x: float32 [n], n >= 1 -> the max over x, NaN where any element is NaN (as torch.amax)
inline float row_max_scalar(const float* x, int64_t n) {
  float m = x[0];
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    nan |= x[i] != x[i];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    m = _mm512_max_ps(m, v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float tail = i < n ? row_max_scalar(x + i, n - i) : -std::numeric_limits<float>::infinity();
  if (nan || tail != tail) return std::numeric_limits<float>::quiet_NaN();
  const float body = _mm512_reduce_max_ps(m);
  return body > tail ? body : tail;
}

__attribute__((target("avx2"))) float row_max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float tail = i < n ? row_max_scalar(x + i, n - i) : -std::numeric_limits<float>::infinity();
  if (_mm256_movemask_ps(nan) || tail != tail) return std::numeric_limits<float>::quiet_NaN();
  for (float lane : lanes) tail = lane > tail ? lane : tail;
  return tail;
}
#endif

using MaxFn = float (*)(const float* x, int64_t n);

// bi_exp_sum's shift: x - 0.0f is x, bit for bit (-0.0, infinities and NaN too)
float zero_shift(const float*, int64_t) { return 0.0f; }

MaxFn max_for(cpu::Isa isa) {
#if defined(__x86_64__)
  if (isa == cpu::Isa::kAvx512) return row_max_avx512;
  if (isa == cpu::Isa::kAvx2) return row_max_avx2;
#endif
  (void)isa;
  return row_max_scalar;
}

// one row: top = its max, buf[0, padded) = bi_exp(row - top) zero-padded, sum = their tree sum
void max_exp_sum_row(const float* x, int64_t V, int64_t padded, float* buf, float* top, float* sum, MaxFn max_fn,
                     cpu::ShiftedExpFn exp_fn) {
  *top = max_fn(x, V);
  exp_fn(x, *top, buf, V);
  std::fill(buf + V, buf + padded, 0.0f);
  *sum = tree_sum_inplace(buf, padded);
}

// x: float32 [..., V], V >= 1 -> (top, sum), each float32 [..., 1]: top = x.amax(-1) and sum =
// reference.bi_exp_sum(x - top), the softmax's shift and denominator (reference.bi_max_exp_sum)
// without the [..., V] difference; with_max = false: top = 0 and sum = bi_exp_sum(x). x - top is
// one IEEE subtraction per element, as torch's, so the bits agree. Rows are spread over the
// threads; fewer rows than threads (a decode step's logprob) have their exps made in chunks
// over every thread, then summed per row.
std::tuple<at::Tensor, at::Tensor> max_exp_sum(const at::Tensor& x, cpu::Isa isa, bool with_max = true) {
  const MaxFn max_fn = with_max ? max_for(isa) : zero_shift;
  const cpu::ShiftedExpFn exp_fn = cpu::shifted_exp_for(isa);
  const at::Tensor xc = x.contiguous();
  const int64_t V = xc.size(-1), rows = xc.numel() / V, padded = (V + 63) / 64 * 64;
  auto sizes = xc.sizes().vec();
  sizes.back() = 1;
  at::Tensor top = at::empty(sizes, xc.options()), sum = at::empty(sizes, xc.options());
  if (rows == 0) return {top, sum};
  const float* xp = xc.data_ptr<float>();
  float *tp = top.data_ptr<float>(), *sp = sum.data_ptr<float>();
  // the exps, zero-padded: padded floats a row, kept by the thread that uses them (a fresh
  // block of that size costs page faults on every call)
  thread_local std::vector<float> kept;
  if (rows >= at::get_num_threads()) {  // a row a thread at a time
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      if (static_cast<int64_t>(kept.size()) < padded) kept.resize(padded);
      for (int64_t r = r0; r < r1; ++r)
        max_exp_sum_row(xp + r * V, V, padded, kept.data(), tp + r, sp + r, max_fn, exp_fn);
    });
    return {top, sum};
  }
  at::Tensor fresh;
  float* bp;
  if (rows * padded <= kKeptScratch) {
    if (static_cast<int64_t>(kept.size()) < rows * padded) kept.resize(rows * padded);
    bp = kept.data();
  } else {  // a very long vocabulary: not kept
    fresh = at::empty({rows, padded}, xc.options());
    bp = fresh.data_ptr<float>();
  }
  const int64_t chunks = (V + kExpChunk - 1) / kExpChunk;
  for (int64_t r = 0; r < rows; ++r) tp[r] = max_fn(xp + r * V, V);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / chunks, lo = t % chunks * kExpChunk, n = std::min(kExpChunk, V - lo);
      exp_fn(xp + r * V + lo, tp[r], bp + r * padded + lo, n);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(bp + r * padded + V, bp + (r + 1) * padded, 0.0f);
    sp[r] = tree_sum_inplace(bp + r * padded, padded);
  }
  return {top, sum};
}

}  // namespace

// x: float32 [..., V], V >= 1 -> float32 [..., 1]: per row, reference.tree_sum(bi_exp(row)),
// the exps zero-padded to a multiple of 64 (max_exp_sum's sums with no shift); rows are independent.
// x: float32 rows [..., V], V >= 1, on the CPU, else an error naming ``where`` (the entry point)
// and ``op``
void check_rows(const at::Tensor& x, const char* where, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), where, ": x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must be [..., V] with V >= 1, got ", x.sizes());
}

at::Tensor bi_exp_sum_cpu(const at::Tensor& x) {
  check_rows(x, "bi_exp_sum_cpu", "bi_exp_sum");
  static const cpu::Isa isa = cpu::pick_isa();
  return std::get<1>(max_exp_sum(x, isa, /*with_max=*/false));
}

std::tuple<at::Tensor, at::Tensor> bi_max_exp_sum_cpu(const at::Tensor& x) {
  check_rows(x, "bi_max_exp_sum_cpu", "bi_max_exp_sum");
  static const cpu::Isa isa = cpu::pick_isa();
  return max_exp_sum(x, isa);
}

// bi_max_exp_sum with a named instruction set, for the test that each gives the reference's bits
std::tuple<at::Tensor, at::Tensor> bi_max_exp_sum_isa(const at::Tensor& x, const std::string& isa) {
  check_rows(x, "bi_max_exp_sum_isa", "bi_max_exp_sum");
  return max_exp_sum(x, checks::named_isa("bi_max_exp_sum_isa", isa));
}

}  // namespace swiftkern
