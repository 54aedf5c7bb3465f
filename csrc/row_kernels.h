// The float32 CPU kernels on raw rows: what each op (packed_linear, skinny_linear, the norms,
// rope_kv_append, verify_attention, silu_mul) runs once its tensors are checked, allocated and
// laid out. The ops call these, and so does decoder_stack's float32 path, which checks its
// inputs once a call and keeps every intermediate in one buffer: a SmolLM2 decode step ran
// ~1500 ATen calls (allocations, views, checks), ~20 % of its time on the main thread while the
// other thread waited. Same functions, same arithmetic: the same bits either way.
#pragma once

#include <cstdint>

namespace swiftkern {
namespace cpu {

// y [M, N] = x [M, K] @ w^T, w packed uint8 [N, K/32, block_bytes] (24: 4-bit codes, 34: 8-bit; packed_layout.h)
void packed_linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t block_bytes,
                        float* y);

// y [M, N] = x [M, K] @ w [N, K]^T, every output skinny_linear's fixed-order sum
void skinny_linear_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y);

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
void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int64_t t0,
                         int64_t t1);

// N rows of H: normed = rms_norm(x + residual) * w and new_res = x + residual (residual null:
// rms_norm(x) * w, new_res unused); rows of x and residual x_s / r_s apart, outputs H apart.
// new_res may be residual itself (each element is read before it is written).
void add_rms_norm_rows(const float* x, int64_t x_s, const float* residual, int64_t r_s, const float* w, float* normed,
                       float* new_res, int64_t N, int64_t H, float eps);

// y[i] = silu(gate[i]) * up[i], i < n
void silu_mul_rows(const float* gate, const float* up, float* y, int64_t n);

// Strides (elements) of a [B, heads, T, D] view, D contiguous
struct HeadStrides {
  int64_t b, h, t;
};

// One rope_kv_append: q [B, Hq, T, D] rotated into out; k rotated and v copied into the caches
// [B, Hkv, S, D] at positions [B, T] (in range: the caller checked); cos, sin [B, T, D]. E: the
// element type (float here; the op takes bf16 and fp16 too).
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
using RopeArgs = RopeArgsOf<float>;
void rope_kv_append_rows(const RopeArgs& a);

// One verify_attention: q [B, Hq, T, D], the caches [B, Hkv, S, D] (S: the keys in use), the
// rows' lengths lens [B] (each in [T, S]: the caller checked) -> out [B, Hq, T, D]
struct AttnShape {
  int64_t B, Hq, T, D, Hkv, S;
  int64_t q_b, q_h, q_t;  // strides of q (elements), D contiguous
  int64_t k_b, k_h, k_s;  // strides of k_cache (v_cache has the same)
  int64_t o_b, o_h, o_t;  // strides of out, D contiguous
  float scale;
};
void attend_rows(const AttnShape& sh, const float* q, const float* k, const float* v, const int64_t* lens, float* out,
                 bool invariant);

}  // namespace cpu
}  // namespace swiftkern
