"""Rotary embedding of q and k plus the write of k and v into the KV cache, one pass.

One program per (row, new token) handles all heads of that token: it rotates q (stored to a
new tensor) and k, and writes rotated k and v at ``positions[b, t]`` of row b's cache. The
rounding steps of ``reference.apply_rope`` (x*cos and rotate_half(x)*sin each rounded to the
input dtype, then their sum) are reproduced, so bf16/fp16 results match the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiftkern.ops.checks import check_same_dtype

from .launch import FP_FUSION, check_device, check_float, empty_like, next_pow2, require


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    """(x1, x2) halves [H, HALF] fp32 -> rotated halves, rounded like x*cos + rotate_half(x)*sin."""
    a1 = (x1 * c1).to(DTYPE).to(tl.float32)
    b1 = (x2 * s1).to(DTYPE).to(tl.float32)
    a2 = (x2 * c2).to(DTYPE).to(tl.float32)
    b2 = (x1 * s2).to(DTYPE).to(tl.float32)
    return (a1 - b1).to(DTYPE), (a2 + b2).to(DTYPE)


@triton.jit(do_not_specialize=["T", "sp_b"])  # one binary for every T (the invariant verifier's set)
def _rope_kv_append_kernel(
    q_ptr, sq_b, sq_h, sq_t, sq_d,  # [B, Hq, T, D]
    k_ptr, sk_b, sk_h, sk_t, sk_d,  # [B, Hkv, T, D]
    v_ptr, sv_b, sv_h, sv_t, sv_d,  # [B, Hkv, T, D]
    cos_ptr, sin_ptr, sc_b, sc_t, sc_d, ss_b, ss_t, ss_d,  # [B, T, D] each
    kc_ptr, skc_b, skc_h, skc_s, skc_d,  # [B, Hkv, S, D] written
    vc_ptr, svc_b, svc_h, svc_s, svc_d,  # [B, Hkv, S, D] written
    pos_ptr, sp_b, sp_t,  # int64 [B, T]
    qo_ptr, sqo_b, sqo_h, sqo_t, sqo_d,  # [B, Hq, T, D] out
    T, HQ, HKV, S, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    cs = cos_ptr + b * sc_b + t * sc_t
    sn = sin_ptr + b * ss_b + t * ss_t
    c1 = tl.load(cs + d * sc_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cs + (d + HALF) * sc_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sn + d * ss_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sn + (d + HALF) * ss_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ).to(tl.int64)[:, None]  # head x head stride can pass 2**31 (long caches)
    q_ok = (hq < HQ) & d_ok[None, :]
    qp = q_ptr + b * sq_b + t * sq_t + hq * sq_h
    q1 = tl.load(qp + d[None, :] * sq_d, mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(qp + (d[None, :] + HALF) * sq_d, mask=q_ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate(q1, q2, c1, c2, s1, s2, q_ptr.dtype.element_ty)
    op = qo_ptr + b * sqo_b + t * sqo_t + hq * sqo_h
    tl.store(op + d[None, :] * sqo_d, o1, mask=q_ok)
    tl.store(op + (d[None, :] + HALF) * sqo_d, o2, mask=q_ok)

    pos = tl.load(pos_ptr + b * sp_b + t * sp_t)
    hk = tl.arange(0, BLOCK_HKV).to(tl.int64)[:, None]
    kv_ok = (hk < HKV) & d_ok[None, :]
    pos_row = tl.full([BLOCK_HKV, 1], 0, tl.int64) + pos
    dst_ok = kv_ok & (pos_row >= 0) & (pos_row < S)  # the ops wrapper refuses other positions
    kp = k_ptr + b * sk_b + t * sk_t + hk * sk_h
    k1 = tl.load(kp + d[None, :] * sk_d, mask=kv_ok, other=0.0).to(tl.float32)
    k2 = tl.load(kp + (d[None, :] + HALF) * sk_d, mask=kv_ok, other=0.0).to(tl.float32)
    r1, r2 = _rotate(k1, k2, c1, c2, s1, s2, k_ptr.dtype.element_ty)
    kc = kc_ptr + b * skc_b + pos * skc_s + hk * skc_h
    tl.store(kc + d[None, :] * skc_d, r1.to(kc_ptr.dtype.element_ty), mask=dst_ok)
    tl.store(kc + (d[None, :] + HALF) * skc_d, r2.to(kc_ptr.dtype.element_ty), mask=dst_ok)
    vp = v_ptr + b * sv_b + t * sv_t + hk * sv_h
    vc = vc_ptr + b * svc_b + pos * svc_s + hk * svc_h
    for half in tl.static_range(2):
        dd = d[None, :] + half * HALF
        val = tl.load(vp + dd * sv_d, mask=kv_ok, other=0.0)
        tl.store(vc + dd * svc_d, val.to(vc_ptr.dtype.element_ty), mask=dst_ok)


def rope_kv_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; cos, sin: [B, T, D]; k_cache, v_cache:
    [B, Hkv, S, D] (written in place); positions: int64 [B, T], each in [0, S) (positions outside
    are not written: the ops wrapper refuses them). Any strides. -> rotated q [B, Hq, T, D]
    (same strides as q when q is dense). D must be even."""
    op = "rope_kv_append"
    check_device(op, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, positions=positions)
    check_float(op, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, op, "q, k, v must be 4-D [B, H, T, D], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    S = k_cache.shape[2] if k_cache.dim() == 4 else -1
    require(D % 2 == 0, op, f"head_dim must be even for the rotate-half rotary embedding, got {D}")
    require(tuple(k.shape) == (B, Hkv, T, D) and v.shape == k.shape, op,
            f"k and v must be [B, Hkv, T, D] = [{B}, Hkv, {T}, {D}], got {tuple(k.shape)}, {tuple(v.shape)}")
    require(cos.shape == (B, T, D) and sin.shape == (B, T, D), op,
            f"cos and sin must be [B, T, D] = [{B}, {T}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    require(k_cache.dim() == 4 and tuple(k_cache.shape) == (B, Hkv, S, D) and v_cache.shape == k_cache.shape,
            op, f"k_cache and v_cache must be [B, Hkv, S, D] = [{B}, {Hkv}, S, {D}], got "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    require(positions.shape == (B, T) and positions.dtype == torch.int64, op,
            f"positions must be int64 [B, T] = [{B}, {T}], got {positions.dtype} {tuple(positions.shape)}")
    check_same_dtype(op, q=q, k=k, v=v, cos=cos, sin=sin)  # the products are rounded to q's dtype
    check_same_dtype(op, k_cache=k_cache, v_cache=v_cache)
    q_out = empty_like(q)
    if B * T == 0 or Hq + Hkv == 0:  # no query heads: the keys and values are still written
        return q_out
    _rope_kv_append_kernel[(B * T,)](
        q, *q.stride(), k, *k.stride(), v, *v.stride(),
        cos, sin, *cos.stride(), *sin.stride(),
        k_cache, *k_cache.stride(), v_cache, *v_cache.stride(),
        positions, *positions.stride(), q_out, *q_out.stride(),
        T, Hq, Hkv, S, D // 2,
        BLOCK_HQ=next_pow2(Hq), BLOCK_HKV=next_pow2(Hkv), BLOCK_HALF=next_pow2(D // 2), num_warps=4,
        enable_fp_fusion=FP_FUSION)
    return q_out


def rope_kv_append_fake(q, k, v, cos, sin, k_cache, v_cache, positions):
    return torch.empty_like(q)
