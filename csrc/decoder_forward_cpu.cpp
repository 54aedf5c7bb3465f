// decoder_forward on CPU: a whole forward, through the LM head, in one call from Python.
//
// After decoder_stack has streamed the weights through the caches, every small op the runner
// calls next runs with its code and data evicted: on SmolLM2 (an AMD EPYC, 2 threads) the ~10 ops
// around the stack of a one-token forward (the token check, positions, the new lengths, the
// embedding, the RoPE rows, the cache advance, the final norm) took ~0.6 ms of a ~7 ms step,
// where each takes a few microseconds warm. Here they are plain loops and copies around the same
// decoder_stack_cpu and norm kernels, so the result is the op-by-op runner's bit for bit
// (tests/test_decoder_forward.py).

#include <ATen/ATen.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "decoder_stack.h"

namespace swiftkern {

namespace {

// Rows ids[i] of table [N, W] -> [count, W] (a copy: the values themselves); every id checked
at::Tensor gather_rows(const at::Tensor& table, const int64_t* ids, int64_t count, const char* what) {
  const int64_t N = table.size(0), W = table.size(1);
  at::Tensor out = at::empty({count, W}, table.options());
  const int64_t row_bytes = W * static_cast<int64_t>(table.element_size());
  const char* src = static_cast<const char*>(table.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < N, "decoder_forward: ", what, " ", ids[i], " at ", i, " is outside [0, ", N,
                ")");
    std::memcpy(dst + i * row_bytes, src + ids[i] * row_bytes, row_bytes);
  }
  return out;
}

}  // namespace

// tokens: int64 [B, T]; embed: [V, H] (the model dtype); cos, sin: the RoPE rows, either tables
// [P, D] read at the positions (rope_table) or [B, T, D] as they are; positions: int64 [B, T], or
// undefined: cache_lens[b] + t; cache_lens: int64 [B] contiguous, the lengths before this chunk,
// advanced by T in place once the stack has run; final_norm: [H]; head_weight [V, H], head_bias
// [V] or None, head_packed (its codes, or None): the LM head, through the stack's rule for a
// projection (its bits; None: no head); the rest as decoder_stack_cpu's. Every token id and table
// position is checked before anything is written.
// -> the logits [B, T, V], or without a head the final-normed hidden [B, T, H].
at::Tensor decoder_forward_cpu(
    const at::Tensor& tokens, const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin, bool rope_table,
    const std::optional<at::Tensor>& positions_in, at::Tensor cache_lens, const at::Tensor& final_norm,
    const std::vector<std::optional<at::Tensor>>& weights, const std::vector<int64_t>& skip, const at::Tensor& k_cache,
    const at::Tensor& v_cache, int64_t max_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, double scale, int64_t skinny_max_rows, bool invariant,
    const std::vector<std::optional<at::Tensor>>& packed, int64_t packed_max_rows,
    const std::optional<at::Tensor>& head_weight, const std::optional<at::Tensor>& head_bias,
    const std::optional<at::Tensor>& head_packed) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.dim() == 2 &&
                  (tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt),
              "decoder_forward: tokens must be int64 or int32 [B, T] on the CPU, got ", tokens.scalar_type(), " ",
              tokens.sizes());
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && final_norm.size(0) == embed.size(1),
              "decoder_forward: embed must be a contiguous [V, H] and final_norm [H], got ", embed.sizes(), " and ",
              final_norm.sizes());
  const int64_t B = tokens.size(0), T = tokens.size(1), H = embed.size(1);
  TORCH_CHECK(cache_lens.scalar_type() == at::kLong && cache_lens.is_contiguous() && cache_lens.numel() == B,
              "decoder_forward: cache_lens must be a contiguous int64 [B=", B, "], got ", cache_lens.scalar_type(),
              " ", cache_lens.sizes());
  const at::Tensor ids = tokens.to(at::kLong).contiguous();
  const at::Tensor hidden = gather_rows(embed, ids.const_data_ptr<int64_t>(), B * T, "token id").view({B, T, H});

  int64_t* lens = cache_lens.mutable_data_ptr<int64_t>();
  at::Tensor positions;
  if (positions_in.has_value() && positions_in->defined()) {
    positions = *positions_in;
  } else {
    positions = at::empty({B, T}, tokens.options());
    int64_t* p = positions.mutable_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) p[b * T + t] = lens[b] + t;
  }
  at::Tensor new_lens = at::empty({B}, cache_lens.options());
  int64_t* after = new_lens.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) after[b] = lens[b] + T;

  at::Tensor row_cos = cos, row_sin = sin;
  if (rope_table) {
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous(),
                "decoder_forward: rope tables must be contiguous [P, D], got ", cos.sizes(), " and ", sin.sizes());
    const at::Tensor pos = positions.contiguous();
    const int64_t D = cos.size(1);
    row_cos = gather_rows(cos, pos.const_data_ptr<int64_t>(), B * T, "position").view({B, T, D});
    row_sin = gather_rows(sin, pos.const_data_ptr<int64_t>(), B * T, "position").view({B, T, D});
  }

  const auto [h, pending] = decoder_stack_cpu(hidden, weights, skip, k_cache, v_cache, row_cos, row_sin, positions,
                                        new_lens, max_len, num_heads, num_kv_heads, head_dim, eps, scale,
                                        skinny_max_rows, invariant, packed, packed_max_rows, true);
  for (int64_t b = 0; b < B; ++b) lens[b] += T;  // the cache's device side advanced, in place

  const at::Tensor normed = std::get<0>(add_norm(h, pending, final_norm, eps));
  const at::Tensor* head = present(head_weight);
  if (head == nullptr) return normed;
  // the LM head: its Python and dispatch, after the cold small ops above, ran cold as well
  const at::Tensor* codes = present(head_packed);
  const bool same_dtype = head->scalar_type() == normed.scalar_type();
  const Kernel kernel = same_dtype ? kernel_for_rows(skinny_max_rows, packed_max_rows, codes != nullptr, B * T)
                                   : Kernel::kTorch;
  return linear_by_rule(kernel, normed, *head, head_bias, codes);
}

}  // namespace swiftkern
