// decoder_stack on CPU: every kept sub-layer of a LLaMA-family decoder in one call.
//
// The Python runner calls ~15 ops per layer per step (norms, 7 projections, RoPE + KV append,
// attention, SwiGLU, views); on a small model each call's Python and dispatcher overhead is a
// real share of a CPU decode step. This runs the same loop in C++, calling the same CPU
// kernels with the same arguments in the same order, so its results are the runner's bit for
// bit (tests/test_decoder_stack.py). Skip-aware: a skipped sub-layer costs nothing, and its
// residual add is fused into the next kept norm as in the runner.

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "decoder_stack.h"
#include "op_checks.h"

namespace swiftkern {

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps);
at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up);
at::Tensor rope_kv_append_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& positions);
at::Tensor verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, double scale);
at::Tensor verify_attention_invariant_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& cache_lens, double scale);

std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& hidden, const at::Tensor& pending,
                                            const at::Tensor& weight, double eps) {
  if (!pending.defined()) return {rms_norm_cpu(hidden, weight, eps), hidden};
  return fused_add_rms_norm_cpu(pending, hidden, weight, eps);
}

at::Tensor linear_by_rule(Kernel kernel, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const at::Tensor* packed) {
  switch (kernel) {
    case Kernel::kPacked: return packed_linear_cpu(x, *packed, bias);
    case Kernel::kSkinny: return skinny_linear_cpu(x, weight, bias);
    default: return at::linear(x, weight, bias);
  }
}

namespace {

// ops.linear's choice: the C++ fixed-order kernel up to skinny_max_rows rows (from the packed
// weight up to packed_max_rows, the same bits; float32 only), torch's matmul past
at::Tensor project(const StackShape& s, const at::Tensor& x, const LayerWeights& lw, Field weight, Field bias) {
  const Kernel kernel = kernel_for(s, lw, weight, x.numel() / x.size(-1));
  return linear_by_rule(kernel, x, *lw.w[weight], lw.w[bias], kernel == Kernel::kPacked ? &*lw.packed[weight] : nullptr);
}


// Qwen3's per-head norm: x [B, T, heads, D] normed over D (x itself where the model has none)
at::Tensor head_norm(const StackShape& s, const at::Tensor& x, const std::optional<at::Tensor>& weight) {
  const at::Tensor* w = present(weight);
  return w ? rms_norm_cpu(x, *w, s.eps) : x;
}

at::Tensor attention(const StackShape& s, const LayerWeights& w, const at::Tensor& x,
                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions, const at::Tensor& cache_lens) {
  const int64_t B = s.B, T = s.T, D = s.head_dim;
  at::Tensor q = head_norm(s, project(s, x, w, kQ, kQBias).view({B, T, s.num_heads, D}), w.w[kQNorm])
                     .transpose(1, 2);  // [B, Hq, T, D]
  at::Tensor k = head_norm(s, project(s, x, w, kK, kKBias).view({B, T, s.num_kv_heads, D}), w.w[kKNorm])
                     .transpose(1, 2);  // [B, Hkv, T, D]
  at::Tensor v = project(s, x, w, kV, kVBias).view({B, T, s.num_kv_heads, D}).transpose(1, 2);
  q = rope_kv_append_cpu(q, k, v, cos, sin, k_cache, v_cache, positions);
  if (s.max_len < k_cache.size(2)) {  // the keys in use only (ops.keys_in_use)
    k_cache = k_cache.slice(2, 0, s.max_len);
    v_cache = v_cache.slice(2, 0, s.max_len);
  }
  at::Tensor out = s.invariant ? verify_attention_invariant_cpu(q, k_cache, v_cache, cache_lens, s.scale)
                               : verify_attention_cpu(q, k_cache, v_cache, cache_lens, s.scale);  // [B, Hq, T, D]
  out = out.transpose(1, 2).reshape({B, T, s.num_heads * D});
  return project(s, out, w, kO, kOBias);
}

at::Tensor mlp(const StackShape& s, const LayerWeights& w, const at::Tensor& x) {
  const at::Tensor act = silu_mul_cpu(project(s, x, w, kGate, kGateBias), project(s, x, w, kUp, kUpBias));
  return project(s, act, w, kDown, kDownBias);
}

}  // namespace

// hidden: float32, bfloat16 or float16 [B, T, H] (the embeddings; the weights in the same dtype);
// weights: kFields per layer (_Layer's fields, None for
// an absent bias or head norm); skip: per layer, bit 0 = attention skipped, bit 1 = MLP skipped; k_cache,
// v_cache: [L, B, Hkv, S, D]; cos, sin: [B, T, D]; positions: int64 [B, T]; cache_lens: [B]
// the lengths after this chunk; max_len: keys in use; skinny_max_rows: ops.skinny_max_rows(dtype)
// (-1: the fixed-order kernel at any number of rows: the invariant set, bf16 / fp16); invariant: the
// one-query attention path; packed: empty, or per weight slot the packed weight
// (packed_weights.pack) or None; packed_max_rows: rows up to which a packed weight is read (-1: any);
// rows: on raw rows where it applies (decoder_stack_rows.cpp: float32, bf16, fp16; false: op by op, the same bits).
// -> (hidden, pending): the residual stream and the last kept
// sub-layer's output not yet added to it (undefined when no sub-layer ran).
std::tuple<at::Tensor, at::Tensor> decoder_stack_cpu(
    at::Tensor hidden, const std::vector<std::optional<at::Tensor>>& weights, const std::vector<int64_t>& skip,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& cache_lens, int64_t max_len, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t skinny_max_rows, bool invariant,
    const std::vector<std::optional<at::Tensor>>& packed, int64_t packed_max_rows, bool rows) {
  const int64_t L = static_cast<int64_t>(skip.size());
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 3 && checks::is_float_dtype(dtype),
              "decoder_stack: hidden must be float32, bfloat16 or float16 [B, T, H] on the CPU, got ", dtype, " ",
              hidden.sizes());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kFields, "decoder_stack: ", kFields,
              " weights per layer expected, got ", weights.size(), " for ", L, " layers");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes(),
              "decoder_stack: caches must be [L=", L, ", B, Hkv, S, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  TORCH_CHECK(packed.empty() || packed.size() == weights.size(), "decoder_stack: packed must be empty or have ",
              weights.size(), " slots, got ", packed.size());
  const StackShape s{hidden.size(0), hidden.size(1), num_heads, num_kv_heads, head_dim, max_len, skinny_max_rows,
                     packed_max_rows, eps, scale, invariant};
  if (rows)
    if (auto out = decoder_stack_rows(s, hidden, weights, skip, packed, k_cache, v_cache, cos, sin, positions,
                                      cache_lens))
      return *out;
  at::Tensor pending;  // undefined: nothing to add
  for (int64_t i = 0; i < L; ++i) {
    const LayerWeights w{weights.data() + i * kFields, packed.empty() ? nullptr : packed.data() + i * kFields};
    if (!(skip[i] & 1)) {
      auto [x, h] = add_norm(hidden, pending, *w.w[kLnAttn], s.eps);
      hidden = h;
      pending = attention(s, w, x, k_cache.select(0, i), v_cache.select(0, i), cos, sin, positions, cache_lens);
    }
    if (!(skip[i] & 2)) {
      auto [x, h] = add_norm(hidden, pending, *w.w[kLnMlp], s.eps);
      hidden = h;
      pending = mlp(s, w, x);
    }
  }
  return {hidden, pending};
}

}  // namespace swiftkern
