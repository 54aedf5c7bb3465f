// rope_kv_append on CPU: (token, head) rows in parallel; each row is rotated in fp32 and stored
// once, to the output (query heads) or into the cache at the token's position (key heads); value
// heads are copied into the cache.
//
// fp32 results are bit-identical to the reference: x1*c - x2*s and x2*c + x1*s with every
// product rounded (the build uses -ffp-contract=off), as torch's `x * cos + rotate_half(x) * sin`.
// bf16/fp16 load, compute in fp32 and round once at the store (in vectors: see Rotator).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "op_checks.h"
#include "round_store.h"
#include "row_kernels.h"

namespace swiftkern {
namespace cpu {
namespace {

inline HeadStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

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

// The row's rotation: float32 straight from x into out; bf16 / fp16 widened into f (4D floats:
// x, cos, sin, out), rotated there and rounded in vectors (exact_load.h / round_store.h: the bits
// of the element-by-element casts, which made an fp16 rope ~1.6x a float32 one in a decode profile).
// cos / sin are widened once for the rows of one (row, token) that follow one another (both
// pointers compared: cos expanded with stride 0 beside a dense sin read the first row's sin).
template <class E>
class Rotator {
 public:
  explicit Rotator(int64_t D) : D_(D), f_(std::is_same_v<E, float> ? 0 : 4 * D) {}

  void operator()(const E* x, const E* c, const E* s, E* out, Isa isa) {
    if constexpr (std::is_same_v<E, float>) {
      rotate(x, c, s, out, D_ / 2);
    } else {
      float *xf = f_.data(), *cf = xf + D_, *sf = cf + D_, *of = sf + D_;
      if (c != widened_cos_ || s != widened_sin_) {  // either may repeat alone (a stride-0 expand)
        widen_rows(isa, c, D_, cf);
        widen_rows(isa, s, D_, sf);
        widened_cos_ = c;
        widened_sin_ = s;
      }
      widen_rows(isa, x, D_, xf);
      rotate(xf, cf, sf, of, D_ / 2);
      round_rows(isa, of, D_, out);
    }
  }

 private:
  int64_t D_;
  std::vector<float> f_;
  const E* widened_cos_ = nullptr;  // the cos row in cf
  const E* widened_sin_ = nullptr;  // the sin row in sf
};

template <class E>
void rope_rows(const RopeArgsOf<E>& a) {
  static const Isa isa = pick_isa();
  const int64_t heads = a.Hq + 2 * a.Hkv;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(a.D, 1));  // ~32K elements a task
  at::parallel_for(0, a.B * a.T * heads, grain, [&](int64_t r0, int64_t r1) {
    Rotator<E> rotator(a.D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t head = r % heads, t = (r / heads) % a.T, b = r / (heads * a.T);
      const int64_t p = a.positions[b * a.pos_b + t * a.pos_t];
      const E* c = a.cos + b * a.cos_b + t * a.cos_t;
      const E* s = a.sin + b * a.sin_b + t * a.sin_t;
      if (head < a.Hq) {
        rotator(a.q + b * a.qs.b + head * a.qs.h + t * a.qs.t, c, s, a.out + b * a.os.b + head * a.os.h + t * a.os.t,
                isa);
      } else if (head < a.Hq + a.Hkv) {
        const int64_t h = head - a.Hq;
        rotator(a.k + b * a.ks.b + h * a.ks.h + t * a.ks.t, c, s, a.k_cache + b * a.kcs.b + h * a.kcs.h + p * a.kcs.t,
                isa);
      } else {
        const int64_t h = head - a.Hq - a.Hkv;
        std::memcpy(a.v_cache + b * a.vcs.b + h * a.vcs.h + p * a.vcs.t, a.v + b * a.vs.b + h * a.vs.h + t * a.vs.t,
                    a.D * sizeof(E));
      }
    }
  });
}

template <class E>
void rope_kv_append_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& positions, at::Tensor& out) {
  rope_rows<E>({q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), q.data_ptr<E>(), k.data_ptr<E>(),
                v.data_ptr<E>(), strides_of(q), strides_of(k), strides_of(v), cos.data_ptr<E>(), sin.data_ptr<E>(),
                cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), k_cache.data_ptr<E>(),
                v_cache.data_ptr<E>(), out.data_ptr<E>(), strides_of(k_cache), strides_of(v_cache), strides_of(out),
                positions.data_ptr<int64_t>(), positions.stride(0), positions.stride(1)});
}

// The tensor itself when its last dim is contiguous, else a contiguous copy (inputs only).
inline at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

template <class E>
void rope_kv_append_rows(const RopeArgsOf<E>& a) {
  rope_rows<E>(a);
}
#define INSTANTIATE(E) template void rope_kv_append_rows<E>(const RopeArgsOf<E>&);
SWIFTKERN_FOR_FLOAT_TYPES(INSTANTIATE)
#undef INSTANTIATE

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
