// Argument checks shared by the CPU and CUDA wrappers of the newer ops: shapes, dtypes, devices
// and layouts, each failure a message that names the argument and says what to do. Values
// inside index tensors are checked by the CPU wrappers on the host and by the CUDA kernels on
// the device.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "cpu_isa.h"

namespace swiftkern {
namespace checks {

// The instruction set named `name` ("avx512", "avx2", "portable") for op's *_isa test binding;
// refused, saying why, where unknown or where this CPU cannot run it
inline cpu::Isa named_isa(const char* op, const std::string& name) {
  for (cpu::Isa isa : cpu::kIsas)
    if (name == cpu::isa_name(isa)) {
      TORCH_CHECK(cpu::isa_supported(isa), op, ": this CPU cannot run ", name);
      return isa;
    }
  TORCH_CHECK(false, op, ": unknown instruction set '", name, "' (avx512, avx2, portable)");
}

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Every tensor on `device_type` and on one device.
inline void same_device(const char* op, c10::DeviceType device_type,
                        std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  const at::Tensor* first = tensors.begin()->second;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t->device().type() == device_type, op, " (", c10::DeviceTypeName(device_type),
                " kernel): ", name, " is on ", t->device(), "; move every input to one ",
                c10::DeviceTypeName(device_type, true), " device");
    TORCH_CHECK(t->device() == first->device(), op, ": all inputs must be on one device, got ",
                tensors.begin()->first, " on ", first->device(), " and ", name, " on ", t->device());
  }
}

// x, residual [..., H] of one float dtype; weight [H] of the same dtype.
inline void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                               const char* op = "fused_add_rms_norm") {
  TORCH_CHECK(x.dim() >= 1 && x.sizes() == residual.sizes(), op, ": x and residual must have one "
              "shape [..., H], got ", x.sizes(), " and ", residual.sizes());
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, op, ": weight must be [H] = [", H, "], got ", weight.sizes());
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              op, " (kernel): x, residual and weight must share one dtype, got ", x.scalar_type(), ", ",
              residual.scalar_type(), " and ", weight.scalar_type(), "; convert them (e.g. weight.to(x.dtype)) first");
}

// gate, up: one shape and one float dtype
inline void silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up must have one shape, got ", gate.sizes(), " and ",
              up.sizes());
  TORCH_CHECK(is_float_dtype(gate.scalar_type()) && up.scalar_type() == gate.scalar_type(),
              "silu_mul: gate and up must share one float dtype (float32, bfloat16, float16), got ",
              gate.scalar_type(), " and ", up.scalar_type());
}

// q [B, Hq, T, D]; k, v [B, Hkv, T, D]; cos, sin [B or 1, T, D]; caches [B, Hkv, S, D] with D
// contiguous; positions int64 [B, T]; one float dtype; D even.
inline void rope_kv_append(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4, "rope_kv_append: q must be [B, Hq, T, D], got ", q.sizes());
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(2) == T && k.size(3) == D && v.sizes() == k.sizes(),
              "rope_kv_append: k and v must be [B, Hkv, T, D] = [", B, ", Hkv, ", T, ", ", D, "], got ", k.sizes(),
              " and ", v.sizes());
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->dim() == 3 && (c->size(0) == B || c->size(0) == 1) && c->size(1) == T && c->size(2) == D,
                "rope_kv_append: cos and sin must be [B, T, D] = [", B, ", ", T, ", ", D, "], got ", cos.sizes(),
                " and ", sin.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == k.size(1) && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes(),
              "rope_kv_append: k_cache and v_cache must be [B, Hkv, S, D] = [", B, ", ", k.size(1), ", S, ", D,
              "], got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T,
              "rope_kv_append: positions must be [B, T] = [", B, ", ", T, "], got ", positions.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rope_kv_append: positions must be int64, got ",
              positions.scalar_type());
  TORCH_CHECK(D % 2 == 0, "rope_kv_append: the head size D must be even (rotate-half RoPE), got ", D);
  TORCH_CHECK(is_float_dtype(q.scalar_type()), "rope_kv_append: q must be float32, bfloat16 or float16, got ",
              q.scalar_type());
  for (const at::Tensor* t : {&k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "rope_kv_append (kernel): q, k, v, cos, sin and the caches "
                "must share one dtype, got q ", q.scalar_type(), " and ", t->scalar_type(),
                "; convert them (e.g. cos.to(q.dtype)) first");
  TORCH_CHECK((k_cache.stride(3) == 1 && v_cache.stride(3) == 1) || D == 1,
              "rope_kv_append: k_cache and v_cache must be contiguous along D (stride(3) == 1), got strides ",
              k_cache.strides(), " and ", v_cache.strides());
}

// Caches [L, B, H, S, D], one shape, dtype and strides, D contiguous; src_positions int64
// [B, M]; dst_start int64 [B]; counts int32 [B].
inline void kv_compact(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& src_positions,
                       const at::Tensor& dst_start, const at::Tensor& counts) {
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes(), "kv_compact: k_cache and v_cache must be "
              "[L, B, H, S, D] of one shape, got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v_cache.strides() == k_cache.strides(),
              "kv_compact (kernel): k_cache and v_cache must share dtype and strides, got ", k_cache.scalar_type(),
              " ", k_cache.strides(), " and ", v_cache.scalar_type(), " ", v_cache.strides());
  TORCH_CHECK(k_cache.stride(4) == 1 || k_cache.size(4) <= 1, "kv_compact: the caches must be contiguous along D "
              "(stride(4) == 1), got strides ", k_cache.strides());
  const int64_t B = k_cache.size(1);
  TORCH_CHECK(src_positions.dim() == 2 && src_positions.size(0) == B, "kv_compact: src_positions must be [B, M] "
              "with B = ", B, ", got ", src_positions.sizes());
  TORCH_CHECK(dst_start.dim() == 1 && dst_start.size(0) == B && counts.dim() == 1 && counts.size(0) == B,
              "kv_compact: dst_start and counts must be [B] = [", B, "], got ", dst_start.sizes(), " and ",
              counts.sizes());
  TORCH_CHECK(src_positions.scalar_type() == at::kLong && dst_start.scalar_type() == at::kLong,
              "kv_compact: src_positions and dst_start must be int64, got ", src_positions.scalar_type(), " and ",
              dst_start.scalar_type());
  TORCH_CHECK(counts.scalar_type() == at::kInt, "kv_compact: counts must be int32, got ", counts.scalar_type());
}

// q [B, Hq, T, D]; k_cache, v_cache [B, Hkv, S, D] of one layout with D contiguous, Hq a multiple
// of Hkv; cache_lens int64 [B]; one float dtype.
inline void verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& cache_lens) {
  TORCH_CHECK(q.dim() == 4, "verify_attention: q must be [B, Hq, T, D], got ", q.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(),
              "verify_attention: k_cache and v_cache must be [B, Hkv, S, D] = [", B, ", Hkv, S, ", D, "], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t Hkv = k_cache.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "verify_attention: query heads (", Hq, ") must be a multiple of kv heads (",
              Hkv, ")");
  TORCH_CHECK(is_float_dtype(q.scalar_type()), "verify_attention: q must be float32, bfloat16 or float16, got ",
              q.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "verify_attention: q, k_cache and v_cache must share one dtype, got ", q.scalar_type(), ", ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK((k_cache.stride(3) == 1 || D <= 1) && k_cache.strides() == v_cache.strides(),
              "verify_attention (kernel): k_cache and v_cache must share one layout with D contiguous, got strides ",
              k_cache.strides(), " and ", v_cache.strides(), "; pass slices of the KVCache tensors or .contiguous()");
  TORCH_CHECK(cache_lens.dim() == 1 && cache_lens.size(0) == B && cache_lens.scalar_type() == at::kLong,
              "verify_attention: cache_lens must be int64 [B] = [", B, "], got ", cache_lens.scalar_type(), " ",
              cache_lens.sizes());
}

}  // namespace checks

// x [..., H] as rows of H with a unit inner stride, for the row kernels (the norms): reshape
// copies only when the leading dims cannot merge, and the rows are copied only when strided inside
inline at::Tensor unit_stride_rows(const at::Tensor& x) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

}  // namespace swiftkern
