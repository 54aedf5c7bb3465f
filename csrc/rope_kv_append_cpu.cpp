// rope_kv_append on CPU: (token, head) rows in parallel; each row is rotated in fp32 and stored
// once, to the output (query heads) or into the cache at the token's position (key heads); value
// heads are copied into the cache.
//
// fp32 results are bit-identical to the reference: x1*c - x2*s and x2*c + x1*s with every
// product rounded (the build uses -ffp-contract=off), as torch's `x * cos + rotate_half(x) * sin`.
// bf16/fp16 load, compute in fp32 and round once at the store.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "op_checks.h"

namespace swiftkern {
namespace cpu {
namespace {

struct Strides3 {
  int64_t b, h, t;
};
inline Strides3 strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

template <class E>
inline void rotate(const E* __restrict x, const E* __restrict c, const E* __restrict s, E* __restrict out,
                   int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float lo = static_cast<float>(x[i]), hi = static_cast<float>(x[i + half]);
    const float a = lo * static_cast<float>(c[i]), b = hi * static_cast<float>(s[i]);
    const float d = hi * static_cast<float>(c[i + half]), e = lo * static_cast<float>(s[i + half]);
    out[i] = static_cast<E>(a - b);
    out[i + half] = static_cast<E>(d + e);
  }
}

template <class E>
void rope_kv_append_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& positions, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t half = D / 2, heads = Hq + 2 * Hkv;
  const Strides3 qs = strides_of(q), ks = strides_of(k), vs = strides_of(v), os = strides_of(out);
  const Strides3 kcs = strides_of(k_cache), vcs = strides_of(v_cache);
  const E *qp = q.data_ptr<E>(), *kp = k.data_ptr<E>(), *vp = v.data_ptr<E>();
  const E *cp = cos.data_ptr<E>(), *sp = sin.data_ptr<E>();
  E *kcp = k_cache.data_ptr<E>(), *vcp = v_cache.data_ptr<E>(), *op = out.data_ptr<E>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t ps_b = positions.stride(0), ps_t = positions.stride(1);
  const int64_t c_sb = cos.stride(0), c_st = cos.stride(1), s_sb = sin.stride(0), s_st = sin.stride(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(D, 1));  // ~32K elements a task
  at::parallel_for(0, B * T * heads, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t head = r % heads, t = (r / heads) % T, b = r / (heads * T);
      const int64_t p = pos[b * ps_b + t * ps_t];
      const E* c = cp + b * c_sb + t * c_st;
      const E* s = sp + b * s_sb + t * s_st;
      if (head < Hq) {
        rotate(qp + b * qs.b + head * qs.h + t * qs.t, c, s, op + b * os.b + head * os.h + t * os.t, half);
      } else if (head < Hq + Hkv) {
        const int64_t h = head - Hq;
        rotate(kp + b * ks.b + h * ks.h + t * ks.t, c, s, kcp + b * kcs.b + h * kcs.h + p * kcs.t, half);
      } else {
        const int64_t h = head - Hq - Hkv;
        std::memcpy(vcp + b * vcs.b + h * vcs.h + p * vcs.t, vp + b * vs.b + h * vs.h + t * vs.t, D * sizeof(E));
      }
    }
  });
}

// The tensor itself when its last dim is contiguous, else a contiguous copy (inputs only).
inline at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace
}  // namespace cpu

// q [B, Hq, T, D]; k, v [B, Hkv, T, D]; cos, sin [B or 1, T, D]; k_cache, v_cache [B, Hkv, S, D]
// (written in place); positions int64 [B, T] in [0, S) -> rotated q [B, Hq, T, D] (contiguous)
at::Tensor rope_kv_append_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& positions) {
  checks::rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions);
  checks::same_device("rope_kv_append", c10::DeviceType::CPU,
                      {{"q", &q}, {"k", &k}, {"v", &v}, {"cos", &cos}, {"sin", &sin}, {"k_cache", &k_cache},
                       {"v_cache", &v_cache}, {"positions", &positions}});
  const int64_t B = q.size(0), T = q.size(2), S = k_cache.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = pos[b * positions.stride(0) + t * positions.stride(1)];
      TORCH_CHECK(p >= 0 && p < S, "rope_kv_append: positions[", b, ", ", t, "] = ", p,
                  " is outside the cache [0, S = ", S, ")");
    }
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, as the op's fake impl says
  if (q.numel() == 0 && k.numel() == 0) return out;
  const at::Tensor qc = cpu::last_dim_contiguous(q), kc = cpu::last_dim_contiguous(k),
                   vc = cpu::last_dim_contiguous(v);
  const at::Tensor cc = cpu::last_dim_contiguous(cos).expand({B, T, q.size(3)});
  const at::Tensor sc = cpu::last_dim_contiguous(sin).expand({B, T, q.size(3)});
  switch (q.scalar_type()) {
    case at::kFloat: cpu::rope_kv_append_kernel<float>(qc, kc, vc, cc, sc, k_cache, v_cache, positions, out); break;
    case at::kBFloat16:
      cpu::rope_kv_append_kernel<c10::BFloat16>(qc, kc, vc, cc, sc, k_cache, v_cache, positions, out);
      break;
    default: cpu::rope_kv_append_kernel<c10::Half>(qc, kc, vc, cc, sc, k_cache, v_cache, positions, out);
  }
  return out;
}

}  // namespace swiftkern
