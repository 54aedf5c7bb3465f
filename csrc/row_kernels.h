// The CPU kernels on raw rows: what each op (packed_linear, skinny_linear, the norms,
// rope_kv_append, verify_attention, silu_mul) runs once its tensors are checked, allocated and
// laid out. The ops call these, and so does decoder_stack's row path, which checks its
// inputs once a call and keeps every intermediate in one buffer: a SmolLM2 decode step ran
// ~1500 ATen calls (allocations, views, checks), ~20 % of its time on the main thread while the
// other thread waited. Same functions, same arithmetic: the same bits either way.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace swiftkern {
namespace cpu {

// y [M, N] = x [M, K] @ w^T, w packed uint8 [N, K/32, block_bytes] (24: 4-bit codes, 34: 8-bit; packed_layout.h)
void packed_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t block_bytes,
                        float* y);

// y [M, N] = x [M, K] @ w [N, K]^T, every output skinny_linear's fixed-order sum; W: the weight's
// element type (float, c10::BFloat16, c10::Half; loaded into fp32 exactly), x and y fp32
template <class W>
void skinny_linear_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y);

// The two projections above as shares of a parallel region their caller runs (decoder_stack runs
// a layer's q, k and v, or its gate and up, in one region: one fork and join, not one each).
// *_split: y's weight tiles and the tiles a task should take (tiles 0: a call of M rows that runs
// whole, the AVX2 lane panels); *_tiles: the outputs of tiles [t0, t1), the bits the whole call gives.
struct TileSplit {
  int64_t tiles, grain;
};
TileSplit packed_linear_split(int64_t M, int64_t K, int64_t N);
void packed_linear_tiles(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t block_bytes,
                         float* y, int64_t t0, int64_t t1);
TileSplit skinny_linear_split(int64_t M, int64_t K, int64_t N);
template <class W>
void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t t0,
                         int64_t t1);

// N rows of H: normed = rms_norm(x + residual) * w and new_res = x + residual (residual null:
// rms_norm(x) * w, new_res unused); rows of x and residual x_s / r_s apart, outputs H apart.
// new_res may be residual itself (each element is read before it is written).
// T (here and below): float, c10::BFloat16 or c10::Half, computed in fp32 and rounded at the
// store, as the ops do for that dtype.
template <class T>
void add_rms_norm_rows(const T* x, int64_t x_s, const T* residual, int64_t r_s, const T* w, T* normed, T* new_res,
                       int64_t N, int64_t H, float eps);

// y[i] = silu(gate[i]) * up[i], i < n
template <class T>
void silu_mul_rows(const T* gate, const T* up, T* y, int64_t n);

// Strides (elements) of a [B, heads, T, D] view, D contiguous
struct HeadStrides {
  int64_t b, h, t;
};

// One rope_kv_append: q [B, Hq, T, D] rotated into out; k rotated and v copied into the caches
// [B, Hkv, S, D] at positions [B, T] (in range: the caller checked); cos, sin [B, T, D]. E: the
// element type (float, c10::BFloat16 or c10::Half).
template <class E>
struct RopeArgsOf {
  int64_t B, Hq, Hkv, T, D;
  const E *q, *k, *v;
  HeadStrides qs, ks, vs;
  const E *cos, *sin;
  int64_t cos_b, cos_t, sin_b, sin_t;
  E *k_cache, *v_cache, *out;
  HeadStrides kcs, vcs, os;
  const int64_t* positions;
  int64_t pos_b, pos_t;
};
template <class E>
void rope_kv_append_rows(const RopeArgsOf<E>& a);

// One verify_attention: q [B, Hq, T, D], the caches [B, Hkv, S, D] (S: the keys in use), the
// rows' lengths lens [B] (each in [T, S]: the caller checked) -> out [B, Hq, T, D]
struct AttnShape {
  int64_t B, Hq, T, D, Hkv, S;
  int64_t q_b, q_h, q_t;  // strides of q (elements), D contiguous
  int64_t k_b, k_h, k_s;  // strides of k_cache (v_cache has the same)
  int64_t o_b, o_h, o_t;  // strides of out, D contiguous
  float scale;
};
template <class E>
void attend_rows(const AttnShape& sh, const E* q, const E* k, const E* v, const int64_t* lens, E* out, bool invariant);

// Explicit instantiations of a row kernel for the three element types, in its .cpp
#define SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE) \
  INSTANTIATE(float)                           \
  INSTANTIATE(c10::BFloat16)                   \
  INSTANTIATE(c10::Half)

}  // namespace cpu
}  // namespace swiftkern
