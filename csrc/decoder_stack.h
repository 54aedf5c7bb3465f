// What the two ways of running decoder_stack share: a layer's weight slots, the call's shape,
// and the rule that picks each projection's kernel (decoder_stack_cpu.cpp: op by op on tensors,
// any dtype; decoder_stack_rows.cpp: on raw rows in one buffer, float32 / bf16 / fp16, where it applies).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace swiftkern {

// One layer's weights, in the order of swiftkern.model._Layer's fields.
// kQNorm, kKNorm: Qwen3's per-head RMSNorm weights [D] of the queries and keys before RoPE (None: none).
enum Field { kLnAttn, kQ, kK, kV, kQBias, kKBias, kVBias, kO, kOBias, kLnMlp, kGate, kUp, kDown, kGateBias,
             kUpBias, kDownBias, kQNorm, kKNorm, kFields };

struct StackShape {
  int64_t B, T, num_heads, num_kv_heads, head_dim, max_len, skinny_max_rows;  // skinny_max_rows < 0: any
  int64_t packed_max_rows;  // < 0: any
  double eps, scale;
  bool invariant;
};

// One layer's weights: float32 (kFields, _Layer's fields) and packed (the same slots; undefined where
// a weight is not packed, or no packed list was given)
struct LayerWeights {
  const std::optional<at::Tensor>* w;
  const std::optional<at::Tensor>* packed;  // nullptr: none
};

inline const at::Tensor* present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &t.value() : nullptr;
}

// ops.linear's choice for a projection of `rows` rows: the packed weight where there is one and
// rows <= packed_max_rows, else the C++ fixed-order kernel up to skinny_max_rows rows, else torch
enum class Kernel { kPacked, kSkinny, kTorch };
inline Kernel kernel_for_rows(int64_t skinny_max_rows, int64_t packed_max_rows, bool packed, int64_t rows) {
  if (packed && (packed_max_rows < 0 || rows <= packed_max_rows)) return Kernel::kPacked;
  return skinny_max_rows < 0 || rows <= skinny_max_rows ? Kernel::kSkinny : Kernel::kTorch;
}
inline Kernel kernel_for(const StackShape& s, const LayerWeights& lw, Field weight, int64_t rows) {
  return kernel_for_rows(s.skinny_max_rows, s.packed_max_rows, lw.packed && present(lw.packed[weight]), rows);
}

// x [..., K] @ weight [N, K].T + bias by the kernel the rule picks (packed: the weight's codes,
// or undefined); decoder_stack_cpu.cpp, and the LM head of decoder_forward_cpu.cpp
at::Tensor linear_by_rule(Kernel kernel, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const at::Tensor* packed);

// (rms_norm(hidden + pending), hidden + pending), the sum fused into the norm's pass; pending
// undefined: nothing to add (decoder_stack_cpu.cpp: before each kept sub-layer, and the final norm)
std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& hidden, const at::Tensor& pending,
                                            const at::Tensor& weight, double eps);

// The whole stack (decoder_stack_cpu.cpp; its arguments documented there) and a forward up to the LM
// head around it in one call (decoder_forward_cpu.cpp), both bound in bindings.cpp.
std::tuple<at::Tensor, at::Tensor> decoder_stack_cpu(
    at::Tensor hidden, const std::vector<std::optional<at::Tensor>>& weights, const std::vector<int64_t>& skip,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& positions, const at::Tensor& cache_lens, int64_t max_len, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t skinny_max_rows, bool invariant,
    const std::vector<std::optional<at::Tensor>>& packed, int64_t packed_max_rows, bool rows);
at::Tensor decoder_forward_cpu(
    const at::Tensor& tokens, const at::Tensor& embed, const at::Tensor& cos, const at::Tensor& sin, bool rope_table,
    const std::optional<at::Tensor>& positions_in, at::Tensor cache_lens, const at::Tensor& final_norm,
    const std::vector<std::optional<at::Tensor>>& weights, const std::vector<int64_t>& skip, const at::Tensor& k_cache,
    const at::Tensor& v_cache, int64_t max_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double eps, double scale, int64_t skinny_max_rows, bool invariant,
    const std::vector<std::optional<at::Tensor>>& packed, int64_t packed_max_rows,
    const std::optional<at::Tensor>& head_weight, const std::optional<at::Tensor>& head_bias,
    const std::optional<at::Tensor>& head_packed);

// decoder_stack's path on raw rows (decoder_stack_rows.cpp; float32, bf16 or fp16): its (hidden,
// pending), or nullopt where it does not apply (another dtype, a projection for torch's matmul, a
// layout or value it does not take), and the op-by-op path runs (and says what is wrong, if
// anything is). bf16 / fp16 on raw rows against op by op: a SmolLM2 one-token forward 6-11 %
// faster (docs/speed.md).
std::optional<std::tuple<at::Tensor, at::Tensor>> decoder_stack_rows(
    const StackShape& s, const at::Tensor& hidden, const std::vector<std::optional<at::Tensor>>& weights,
    const std::vector<int64_t>& skip, const std::vector<std::optional<at::Tensor>>& packed, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
    const at::Tensor& cache_lens);

}  // namespace swiftkern
