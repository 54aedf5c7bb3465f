// decoder_stack's path on raw rows: the op-by-op loop (decoder_stack_cpu.cpp) with the same
// kernels in the same order on the same values, so the same bits, but its inputs checked once a
// call and every intermediate in one buffer. Op by op, a SmolLM2 decode step made ~1500 ATen calls
// (an output allocated per op, views, checks): ~20 % of the main thread's time, while the other
// thread waited for it.
//
// Buffers of the model's element type E (float, bfloat16, float16), M = B * T rows: h [M, H] the
// residual stream (updated in place by the norms), x [M, H] the normed input of a sub-layer,
// q / k / v [B, T, heads * D] the projections, rq [B, Hq, T, D] the rotated queries, attn [B, T,
// Hq * D], gate / up / act [M, I], out [M, H] the last kept sub-layer's output (pending until the
// next norm adds it). The projections run in fp32 as skinny_linear does: for bf16 / fp16 their
// input upcast exactly into an fp32 scratch, their output + bias in fp32, then rounded once into
// the E buffer (for float32 the buffers are the scratch).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "decoder_stack.h"
#include "packed_layout.h"
#include "round_store.h"
#include "row_kernels.h"

namespace swiftkern {
namespace {

// A projection as this call runs it: packed codes or the weight of E, and its bias; x and y fp32
template <class E>
struct Projection {
  const E* w = nullptr;             // [N, K]; null: packed
  const uint8_t* packed = nullptr;  // [N, K/32, block_bytes] (float32 models only)
  int64_t block_bytes = 0;
  const E* bias = nullptr;  // [N] or null
  int64_t N = 0, K = 0;

  // y [M, N] = x [M, K] @ w^T + bias (the bias added in fp32, as LinearCall::finish adds it)
  void operator()(const float* x, int64_t M, float* y) const {
    if (packed)
      cpu::packed_linear_rows(x, M, K, packed, N, block_bytes, y);
    else
      cpu::skinny_linear_rows(x, M, K, w, N, y);
    add_bias(M, y);
  }
  cpu::TileSplit split(int64_t M) const {
    return packed ? cpu::packed_linear_split(M, K, N) : cpu::skinny_linear_split(M, K, N);
  }
  // the outputs of weight tiles [t0, t1) of split(M), without the bias
  void tiles(const float* x, int64_t M, float* y, int64_t t0, int64_t t1) const {
    if (packed)
      cpu::packed_linear_tiles(x, M, K, packed, N, block_bytes, y, t0, t1);
    else
      cpu::skinny_linear_tiles(x, M, K, w, N, y, t0, t1);
  }
  void add_bias(int64_t M, float* y) const {
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] += static_cast<float>(bias[n]);
  }
};

// The projections of one x [M, K] (a layer's q, k and v, or gate and up), each y [M, N] as its
// own call makes it, their weight tiles in one parallel region: one fork and join, not one a
// projection, and no thread idle at the end of the small k and v. SmolLM2 on an AVX-512 AMD EPYC
// (2 threads), alternating processes, grouped against one call each: `ar`'s 128 tokens 2.4-7.7 %
// faster in 5 of 6 pairs; a one-token forward 5.0 against 5.2 ms, 4 tokens 8.4 against 8.6 ms, in
// 5 of 5 pairs (docs/speed.md).
template <class E, size_t P>
void project_together(const std::array<std::pair<const Projection<E>*, float*>, P>& parts, const float* x, int64_t M) {
  std::array<int64_t, P + 1> first{};  // the parts' tiles laid end to end
  int64_t grain = 1;
  for (size_t i = 0; i < P; ++i) {
    const cpu::TileSplit split = parts[i].first->split(M);
    if (split.tiles == 0) {  // a part that runs whole: one call each
      for (auto [p, y] : parts) (*p)(x, M, y);
      return;
    }
    first[i + 1] = first[i] + split.tiles;
    grain = std::max(grain, split.grain);
  }
  at::parallel_for(0, first[P], grain, [&](int64_t t0, int64_t t1) {
    for (size_t i = 0; i < P; ++i) {
      const int64_t a = std::max(t0, first[i]), b = std::min(t1, first[i + 1]);
      if (a < b) parts[i].first->tiles(x, M, parts[i].second, a - first[i], b - first[i]);
    }
  });
  for (auto [p, y] : parts) p->add_bias(M, y);
}

// a contiguous CPU tensor of E with dim dims
template <class E>
bool is_e(const at::Tensor& t, int64_t dim) {
  return t.scalar_type() == c10::CppTypeToScalarType<E>::value && t.device().is_cpu() && t.dim() == dim &&
         t.is_contiguous();
}

// src [n] of E as fp32 (exact): src itself for float32, else its copy in scratch
template <class E>
const float* upcast(const E* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<E, float>) {
    return src;
  } else {
    static const cpu::Isa isa = cpu::pick_isa();
    cpu::widen_rows(isa, src, n, scratch);
    return scratch;
  }
}

// Where a projection into dst (of E) writes its fp32 result: dst itself for float32, else scratch,
// rounded into dst by round_into
template <class E>
float* fp32_out(E* dst, float* scratch) {
  if constexpr (std::is_same_v<E, float>)
    return dst;
  else
    return scratch;
}

template <class E>
void round_into(const float* src, int64_t n, E* dst) {
  if constexpr (!std::is_same_v<E, float>) {
    static const cpu::Isa isa = cpu::pick_isa();
    cpu::round_rows(isa, src, n, dst);
  }
}

// The projection of slot `weight` [N, K] (bias slot `bias`), or nullopt where this path does not take it
template <class E>
std::optional<Projection<E>> projection(const StackShape& s, const LayerWeights& lw, Field weight, Field bias,
                                        int64_t rows, int64_t N, int64_t K) {
  Projection<E> p{};
  p.N = N;
  p.K = K;
  const at::Tensor* w = present(lw.w[weight]);
  if (!w || !is_e<E>(*w, 2) || w->size(0) != N || w->size(1) != K) return std::nullopt;
  switch (kernel_for(s, lw, weight, rows)) {
    case Kernel::kPacked: {
      if (!std::is_same_v<E, float>) return std::nullopt;
      const at::Tensor& pk = *lw.packed[weight];
      const int64_t bytes = pk.size(2);
      if (pk.scalar_type() != at::kByte || !pk.device().is_cpu() || pk.dim() != 3 || !pk.is_contiguous() ||
          pk.size(0) != N || pk.size(1) * 32 != K || (bytes != cpu::kBlockBytes4 && bytes != cpu::kBlockBytes8))
        return std::nullopt;
      p.packed = pk.data_ptr<uint8_t>();
      p.block_bytes = bytes;
      break;
    }
    case Kernel::kSkinny: p.w = w->data_ptr<E>(); break;
    default: return std::nullopt;
  }
  if (const at::Tensor* b = present(lw.w[bias])) {
    if (!is_e<E>(*b, 1) || b->size(0) != N) return std::nullopt;
    p.bias = b->data_ptr<E>();
  }
  return p;
}

// A kept layer's kernels and norm weights (each part filled where its sub-layer runs)
template <class E>
struct LayerPlan {
  const E *ln_attn = nullptr, *ln_mlp = nullptr;
  const E *q_norm = nullptr, *k_norm = nullptr;  // [D] each, Qwen3's per-head norms; null: none
  Projection<E> q, k, v, o, gate, up, down;
};

template <class E>
std::optional<std::tuple<at::Tensor, at::Tensor>> stack_rows(
    const StackShape& s, const at::Tensor& hidden, const std::vector<std::optional<at::Tensor>>& weights,
    const std::vector<int64_t>& skip, const std::vector<std::optional<at::Tensor>>& packed, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
    const at::Tensor& cache_lens) {
  constexpr at::ScalarType dtype = c10::CppTypeToScalarType<E>::value;
  const int64_t L = static_cast<int64_t>(skip.size());
  const int64_t B = s.B, T = s.T, M = B * T, D = s.head_dim, Hq = s.num_heads, Hkv = s.num_kv_heads;
  if (M == 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || Hq % Hkv || D % 2) return std::nullopt;
  const at::Tensor h_in = hidden.contiguous();
  const int64_t H = h_in.size(2);
  // the caches, the rotary tables and the positions as the op-by-op path reads them
  if (k_cache.scalar_type() != dtype || v_cache.scalar_type() != dtype || k_cache.size(1) != B ||
      k_cache.size(2) != Hkv || k_cache.size(4) != D || k_cache.stride(4) != 1 || v_cache.stride(4) != 1 ||
      k_cache.strides() != v_cache.strides())
    return std::nullopt;
  const int64_t S = k_cache.size(3), keys = std::min(s.max_len, S);
  for (const at::Tensor* t : {&cos, &sin})
    if (t->scalar_type() != dtype || t->dim() != 3 || (t->size(0) != 1 && t->size(0) != B) ||
        t->size(1) != T || t->size(2) != D || t->stride(2) != 1)
      return std::nullopt;
  if (positions.scalar_type() != at::kLong || positions.dim() != 2 || positions.size(0) != B ||
      positions.size(1) != T || cache_lens.scalar_type() != at::kLong || cache_lens.dim() != 1 ||
      cache_lens.size(0) != B || !cache_lens.is_contiguous())
    return std::nullopt;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* lens = cache_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] < T || lens[b] > keys) return std::nullopt;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos[b * positions.stride(0) + t * positions.stride(1)];
      if (p < 0 || p >= S) return std::nullopt;
    }
  }
  // every kept sub-layer's kernels
  int64_t I = 0;
  std::vector<LayerPlan<E>> plans(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    const LayerWeights lw{weights.data() + i * kFields, packed.empty() ? nullptr : packed.data() + i * kFields};
    LayerPlan<E>& plan = plans[static_cast<size_t>(i)];
    for (auto [kept, norm, slot] : {std::tuple{!(skip[i] & 1), &plan.ln_attn, kLnAttn},
                                    std::tuple{!(skip[i] & 2), &plan.ln_mlp, kLnMlp}}) {
      if (!kept) continue;
      const at::Tensor* w = present(lw.w[slot]);
      if (!w || !is_e<E>(*w, 1) || w->size(0) != H) return std::nullopt;
      *norm = w->data_ptr<E>();
    }
    auto take = [&](Projection<E>& p, Field weight, Field bias, int64_t N, int64_t K) {
      auto made = projection<E>(s, lw, weight, bias, M, N, K);
      if (made) p = *made;
      return made.has_value();
    };
    if (plan.ln_attn && !(take(plan.q, kQ, kQBias, Hq * D, H) && take(plan.k, kK, kKBias, Hkv * D, H) &&
                          take(plan.v, kV, kVBias, Hkv * D, H) && take(plan.o, kO, kOBias, H, Hq * D)))
      return std::nullopt;
    if (plan.ln_attn)
      for (auto [slot, norm] : {std::pair{kQNorm, &plan.q_norm}, std::pair{kKNorm, &plan.k_norm}})
        if (const at::Tensor* w = present(lw.w[slot])) {
          if (!is_e<E>(*w, 1) || w->size(0) != D) return std::nullopt;
          *norm = w->data_ptr<E>();
        }
    if (plan.ln_mlp) {
      const at::Tensor* gate = present(lw.w[kGate]);
      if (!gate || gate->dim() != 2 || (I != 0 && gate->size(0) != I)) return std::nullopt;
      I = gate->size(0);
      if (!(take(plan.gate, kGate, kGateBias, I, H) && take(plan.up, kUp, kUpBias, I, H) &&
            take(plan.down, kDown, kDownBias, H, I)))
        return std::nullopt;
    }
  }
  // one buffer for every intermediate; for bf16 / fp16 an fp32 scratch for the projections' inputs
  // (xf: the widest) and outputs (yf: q, k and v, or gate and up, side by side)
  const int64_t nq = M * Hq * D, nkv = M * Hkv * D;
  at::Tensor buffer = at::empty({M * (3 * H + 3 * Hq * D + 2 * Hkv * D + 3 * I)}, h_in.options());
  const int64_t x_width = std::max({H, Hq * D, I}), y_width = std::max({Hq * D + 2 * Hkv * D, 2 * I, H});
  std::vector<float> scratch(std::is_same_v<E, float> ? 0 : static_cast<size_t>(M * (x_width + y_width)));
  float *xf = scratch.data(), *yf = xf + M * x_width;
  E* h = buffer.data_ptr<E>();
  E *x = h + M * H, *out = x + M * H, *q = out + M * H, *k = q + nq, *v = k + nkv, *rq = v + nkv;
  E *attn = rq + nq, *gate = attn + nq, *up = gate + M * I, *act = up + M * I;
  std::memcpy(h, h_in.data_ptr<E>(), M * H * sizeof(E));
  bool pending = false;  // out holds a sub-layer's output not yet added to h
  auto add_norm = [&](const E* w) {  // x = rms_norm(h + out) * w, h += out (or x = rms_norm(h) * w)
    cpu::add_rms_norm_rows(pending ? out : h, H, pending ? h : nullptr, H, w, x, pending ? h : nullptr, M, H,
                           static_cast<float>(s.eps));
  };
  const cpu::HeadStrides q_rows{T * Hq * D, D, Hq * D}, kv_rows{T * Hkv * D, D, Hkv * D};
  const cpu::HeadStrides heads_first{Hq * T * D, T * D, D};
  const cpu::HeadStrides cache{k_cache.stride(1), k_cache.stride(2), k_cache.stride(3)};
  cpu::RopeArgsOf<E> rope{B, Hq, Hkv, T, D, q, k, v, q_rows, kv_rows, kv_rows, cos.data_ptr<E>(), sin.data_ptr<E>(),
                     cos.size(0) == 1 ? 0 : cos.stride(0), cos.stride(1), sin.size(0) == 1 ? 0 : sin.stride(0),
                     sin.stride(1), nullptr, nullptr, rq, cache, cache, heads_first, pos, positions.stride(0),
                     positions.stride(1)};
  const cpu::AttnShape shape{B, Hq, T, D, Hkv, keys, heads_first.b, heads_first.h, heads_first.t,
                             cache.b, cache.h, cache.t, q_rows.b, q_rows.h, q_rows.t, static_cast<float>(s.scale)};
  E *kc = k_cache.data_ptr<E>(), *vc = v_cache.data_ptr<E>();
  // a projection of x_in [M, K] (E) into y [M, N] (E): fp32 in and out as skinny_linear runs it
  auto project = [&](const Projection<E>& p, const E* x_in, E* y) {
    float* yp = fp32_out(y, yf);
    p(upcast(x_in, M * p.K, xf), M, yp);
    round_into(yp, M * p.N, y);
  };
  for (int64_t i = 0; i < L; ++i) {
    const LayerPlan<E>& plan = plans[static_cast<size_t>(i)];
    if (plan.ln_attn) {
      add_norm(plan.ln_attn);
      float *qf = fp32_out(q, yf), *kf = fp32_out(k, yf + nq), *vf = fp32_out(v, yf + nq + nkv);
      project_together<E, 3>({{{&plan.q, qf}, {&plan.k, kf}, {&plan.v, vf}}}, upcast(x, M * H, xf), M);
      round_into(qf, nq, q);
      round_into(kf, nkv, k);
      round_into(vf, nkv, v);
      if (plan.q_norm)  // in place, one row per token and head (each row read before it is written)
        cpu::add_rms_norm_rows<E>(q, D, nullptr, D, plan.q_norm, q, nullptr, M * Hq, D, static_cast<float>(s.eps));
      if (plan.k_norm)
        cpu::add_rms_norm_rows<E>(k, D, nullptr, D, plan.k_norm, k, nullptr, M * Hkv, D, static_cast<float>(s.eps));
      rope.k_cache = kc + i * k_cache.stride(0);
      rope.v_cache = vc + i * v_cache.stride(0);
      cpu::rope_kv_append_rows(rope);
      cpu::attend_rows(shape, rq, rope.k_cache, rope.v_cache, lens, attn, s.invariant);
      project(plan.o, attn, out);
      pending = true;
    }
    if (plan.ln_mlp) {
      add_norm(plan.ln_mlp);
      float *gf = fp32_out(gate, yf), *uf = fp32_out(up, yf + M * I);
      project_together<E, 2>({{{&plan.gate, gf}, {&plan.up, uf}}}, upcast(x, M * H, xf), M);
      round_into(gf, M * I, gate);
      round_into(uf, M * I, up);
      cpu::silu_mul_rows(gate, up, act, M * I);
      project(plan.down, act, out);
      pending = true;
    }
  }
  at::Tensor hidden_out = buffer.narrow(0, 0, M * H).view({B, T, H});
  at::Tensor pending_out = pending ? buffer.narrow(0, 2 * M * H, M * H).view({B, T, H}) : at::Tensor();
  return std::make_tuple(hidden_out, pending_out);
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> decoder_stack_rows(
    const StackShape& s, const at::Tensor& hidden, const std::vector<std::optional<at::Tensor>>& weights,
    const std::vector<int64_t>& skip, const std::vector<std::optional<at::Tensor>>& packed, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
    const at::Tensor& cache_lens) {
  switch (hidden.scalar_type()) {
    case at::kFloat:
      return stack_rows<float>(s, hidden, weights, skip, packed, k_cache, v_cache, cos, sin, positions, cache_lens);
    case at::kBFloat16:
      return stack_rows<c10::BFloat16>(s, hidden, weights, skip, packed, k_cache, v_cache, cos, sin, positions,
                                       cache_lens);
    case at::kHalf:
      return stack_rows<c10::Half>(s, hidden, weights, skip, packed, k_cache, v_cache, cos, sin, positions,
                                   cache_lens);
    default: return std::nullopt;
  }
}

}  // namespace swiftkern
