// top_p_cut on CPU: where HF's top-p rule cuts each row, from the row sorted ascending and the
// softmax of that sorted row (swiftkern/top_p.py). The cumulative sum is torch's CPU cumsum of
// float32 to the bit: each term widened to double, added in order, the running sum rounded to
// float32; a position is removed where that sum is <= float32(1 - top_p), the last one never.
// The count m of removed positions is the answer where they are exactly the first m sorted
// positions and the m-th sorted value is below the (m+1)-th (no tie split by the cut); else -1,
// and the caller takes the sort.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace swiftkern {

namespace {

// sorted, probs: float32 [V], V >= 1 -> m, or -1 where the cut is not a tie-free prefix
int64_t row_cut(const float* sorted, const float* probs, int64_t V, float threshold) {
  double running = 0.0;
  int64_t removed = 0, first_kept = V - 1;  // the last position is always kept
  for (int64_t i = 0; i + 1 < V; ++i) {
    running += static_cast<double>(probs[i]);
    if (static_cast<float>(running) <= threshold) {
      ++removed;
    } else if (first_kept == V - 1) {
      first_kept = i;
    }
  }
  if (first_kept != removed) return -1;  // not a prefix (a NaN or negative term)
  if (removed > 0 && !(sorted[removed - 1] < sorted[removed])) return -1;  // a tie split by the cut
  return removed;
}

}  // namespace

// sorted_values, probs: float32 [N, V], V >= 1, CPU -> int64 [N]
at::Tensor top_p_cut_cpu(const at::Tensor& sorted_values, const at::Tensor& probs, double top_p) {
  TORCH_CHECK(sorted_values.device().is_cpu() && probs.device().is_cpu(),
              "top_p_cut (CPU kernel): sorted_values and probs must be on the CPU");
  TORCH_CHECK(sorted_values.scalar_type() == at::kFloat && probs.scalar_type() == at::kFloat,
              "top_p_cut: sorted_values and probs must be float32, got ", sorted_values.scalar_type(), " and ",
              probs.scalar_type());
  TORCH_CHECK(sorted_values.dim() == 2 && sorted_values.sizes() == probs.sizes() && sorted_values.size(1) >= 1,
              "top_p_cut: sorted_values and probs must be one shape [N, V] with V >= 1, got ",
              sorted_values.sizes(), " and ", probs.sizes());
  const at::Tensor s = sorted_values.contiguous(), p = probs.contiguous();
  const int64_t N = s.size(0), V = s.size(1);
  at::Tensor out = at::empty({N}, s.options().dtype(at::kLong));
  const float threshold = static_cast<float>(1.0 - top_p);
  const float* sp = s.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_cut(sp + r * V, pp + r * V, V, threshold);
  });
  return out;
}

}  // namespace swiftkern
