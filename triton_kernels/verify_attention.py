"""Attention of T new tokens per row against a KV cache with per-row lengths (split-KV).

Decode (T = 1) and verification (T = k + 1) in one kernel: query i of row b sees the keys
j < cache_lens[b] - T + i + 1 (causal within the new tokens), each row its own length, all rows
in one launch. GQA: the ``group`` query heads of one kv head and the T tokens form the rows of
one query tile (token-major), so each key block is loaded once for all of them.

Programs run over (row x kv head, query tile, key split). With one split the program writes
the output; with several, each writes its normalized partial output and log-sum-exp (base 2)
to float32 scratch and ``_combine_kernel`` merges them (flash-decoding). Keys past a row's
longest visible prefix are never read, so stale or poisoned cache entries cannot leak in.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .interpreter_dot import interpreter_dot
from .launch import FP_FUSION, attention_plan, check_device, check_float, empty, interpreting, require


@triton.jit(do_not_specialize=["T"])  # one binary for every T: the invariant verifier relies on it
def _verify_attention_kernel(
    q_ptr, sq_b, sq_h, sq_t, sq_d,  # [B, Hq, T, D]
    k_ptr, sk_b, sk_h, sk_s, sk_d,  # [B, Hkv, S, D]
    v_ptr, sv_b, sv_h, sv_s, sv_d,  # [B, Hkv, S, D]
    lens_ptr, s_lens,  # int64 [B], including the T new tokens (any stride: a view, an expand)
    out_ptr, so_b, so_h, so_t, so_d,  # [B, Hq, T, D] (one split only)
    mid_o_ptr,  # float32 [B, Hq, T, SPLITS, D] (several splits only)
    mid_lse_ptr,  # float32 [B, Hq, T, SPLITS]
    scale_log2e, T, GROUP, HKV, HQ, D, CHUNK, SPLITS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * T
    t = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    length = tl.load(lens_ptr + b * s_lens).to(tl.int32)
    limit = tl.where(row_ok, length - T + t + 1, 0)  # [BLOCK_M] keys < limit are visible
    lo = tl.program_id(2) * CHUNK
    chunk_end = lo + CHUNK
    hi = tl.minimum(chunk_end, tl.max(limit, axis=0))

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_at = n.to(tl.int64)  # position x key stride passes 2**31 in long or [B, S, Hkv, D] caches
        k = tl.load(k_base + n_at[None, :] * sk_s + d[:, None] * sk_d, mask=(n[None, :] < hi) & d_ok[:, None],
                    other=0.0)  # [BLOCK_D, BLOCK_N]
        if INTERPRET:  # numpy's BLAS behind tl.dot: a row's bits would follow its place in the tile
            s = interpreter_dot(q, k)
        elif FP32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        visible = (n[None, :] < limit[:, None]) & (n[None, :] < chunk_end)
        s = tl.where(visible, s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n_at[:, None] * sv_s + d[None, :] * sv_d, mask=(n[:, None] < hi) & d_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_D]
        if INTERPRET:
            pv = interpreter_dot(p, v)
        elif FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    out_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        row_id = (b * HQ + h) * T + t  # [BLOCK_M]
        slot = row_id * SPLITS + tl.program_id(2)
        tl.store(mid_o_ptr + slot[:, None] * D + d[None, :], o, mask=out_ok)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + slot, lse, mask=row_ok)
    else:
        tl.store(out_ptr + b * so_b + h[:, None] * so_h + t[:, None] * so_t + d[None, :] * so_d,
                 o.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _combine_kernel(
    mid_o_ptr,  # float32 [B, Hq, T, SPLITS, D]
    mid_lse_ptr,  # float32 [B, Hq, T, SPLITS]
    out_ptr, so_b, so_h, so_t, so_d,  # [B, Hq, T, D]
    HQ, T, D, SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row_id = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * T + t
    t = row_id % T
    h = (row_id // T) % HQ
    b = row_id // (T * HQ)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < SPLITS
    lse = tl.load(mid_lse_ptr + row_id * SPLITS + sp, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)  # [BLOCK_S], 0 for splits that saw no key
    parts = tl.load(mid_o_ptr + (row_id * SPLITS + sp[:, None]) * D + d[None, :],
                    mask=sp_ok[:, None] & (d[None, :] < D), other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * so_b + h * so_h + t * so_t + d * so_d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                     scale: float, num_splits: int | None = None, invariant: bool = False) -> torch.Tensor:
    """q: [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, S, D] (any strides, e.g. a [:, :, :max_len]
    view); cache_lens: int64 [B], each in [T, S]; Hq a multiple of Hkv. -> [B, Hq, T, D] in q's
    dtype, a transposed view of a [B, T, Hq, D] buffer (so merging the heads costs no copy).
    ``num_splits`` forces the number of key splits (tests); by default it follows the shapes.
    ``invariant``: the fixed plan of ``verify_attention_invariant``."""
    op = "verify_attention_invariant" if invariant else "verify_attention"
    check_device(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_lens=cache_lens)
    check_float(op, q=q, k_cache=k_cache, v_cache=v_cache)
    require(q.dim() == 4 and k_cache.dim() == 4, op,
            f"q must be [B, Hq, T, D] and the caches [B, Hkv, S, D], got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    require(tuple(k_cache.shape) == (B, Hkv, S, D) and v_cache.shape == k_cache.shape, op,
            f"k_cache and v_cache must be [B, Hkv, S, D] = [{B}, Hkv, S, {D}], got "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    require(Hkv > 0 and Hq % Hkv == 0, op, f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    require(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, op,
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    require(cache_lens.shape == (B,) and cache_lens.dtype == torch.int64, op,
            f"cache_lens must be int64 [B] = [{B}], got {cache_lens.dtype} {tuple(cache_lens.shape)}")
    out = empty((B, T, Hq, D), q.dtype, q.device).transpose(1, 2)
    if out.numel() == 0:
        return out
    group = Hq // Hkv
    plan = attention_plan(B, Hkv, group, T, S, D, q.device, num_splits, invariant, fp32=q.dtype == torch.float32)
    fp32_dot = q.dtype == torch.float32  # the interpreter takes interpreter_dot (float32) instead
    split = plan.splits > 1
    if split:
        mid_o = empty((B, Hq, T, plan.splits, D), torch.float32, q.device)
        mid_lse = empty((B, Hq, T, plan.splits), torch.float32, q.device)
    else:
        mid_o = mid_lse = out  # unused
    grid = (B * Hkv, plan.m_blocks, plan.splits)
    _verify_attention_kernel[grid](
        q, *q.stride(), k_cache, *k_cache.stride(), v_cache, *v_cache.stride(), cache_lens, cache_lens.stride(0),
        out, *out.stride(), mid_o, mid_lse,
        float(scale) * math.log2(math.e), T, group, Hkv, Hq, D, plan.chunk, plan.splits,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, SPLIT=split, FP32_DOT=fp32_dot,
        INTERPRET=interpreting(),
        num_warps=plan.num_warps, num_stages=plan.num_stages, enable_fp_fusion=FP_FUSION)
    if split:
        _combine_kernel[(B * Hq * T,)](
            mid_o, mid_lse, out, *out.stride(), Hq, T, D, plan.splits,
            BLOCK_S=plan.block_s, BLOCK_D=plan.block_d, num_warps=plan.combine_warps,
            enable_fp_fusion=FP_FUSION)
    return out


def verify_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``verify_attention`` (same arguments and result) in one fixed launch plan: query tiles of
    INVARIANT_BLOCK_M rows, no key splits, key blocks and warps fixed by the head dim. Each
    query row of a tile is computed on its own (its own running max and sum; a fixed-order dot
    over D per score and over the block's keys per output), key blocks are visited from key 0
    in order, and a block past a query's last key leaves its state unchanged (scale 1, weights
    0), so a query's bits depend on its q and its keys alone: not on T, the GQA tile it lands
    in, or the other rows. The deterministic verifier's attention on a GPU."""
    return verify_attention(q, k_cache, v_cache, cache_lens, scale, invariant=True)


def verify_attention_fake(q, k_cache, v_cache, cache_lens, scale):
    B, Hq, T, D = q.shape
    return q.new_empty((B, T, Hq, D)).transpose(1, 2)
