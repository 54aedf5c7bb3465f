"""Move each row's kept KV-cache entries into one contiguous run, in place.

Up to ``launch.MAX_COMPACT_ENTRIES`` entries a row, in one launch: one program per (layer, row,
head, slice of the head dimension) loads all kept entries of its slice (at most
``launch.MAX_COMPACT_TILE`` elements) before it stores any, and no two programs touch the same
elements, so sources and destinations may overlap as in the reference. More entries than that,
in two launches through a workspace (``launch.compact_plan``'s staged plans): the first copies every
kept entry out, the second copies them into place, so any overlap is safe again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, check_device, compact_plan, require


@triton.jit
def _kv_compact_kernel(
    k_ptr, v_ptr, s_l, s_b, s_h, s_s, s_d,  # [L, B, H, S, D] each, same strides, written in place
    src_ptr, ss_b, ss_m,  # int64 [B, M]
    dst_ptr, sd_b,  # int64 [B]
    count_ptr, sc_b,  # int32 [B]
    B, H, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # (l * B + b) * H + h
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    n = tl.load(count_ptr + b * sc_b)
    i = tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (i[:, None] < n) & (d[None, :] < D)
    src = tl.load(src_ptr + b * ss_b + i * ss_m, mask=i < n, other=0)
    dst = tl.load(dst_ptr + b * sd_b) + i
    base = layer * s_l + b * s_b + h * s_h
    src_off = base + src[:, None] * s_s + d[None, :] * s_d
    dst_off = base + dst[:, None] * s_s + d[None, :] * s_d
    keys = tl.load(k_ptr + src_off, mask=ok)
    values = tl.load(v_ptr + src_off, mask=ok)
    tl.debug_barrier()  # every load of this program lands before its first store
    tl.store(k_ptr + dst_off, keys, mask=ok)
    tl.store(v_ptr + dst_off, values, mask=ok)


@triton.jit
def _kv_compact_staged_kernel(
    k_ptr, v_ptr, s_l, s_b, s_h, s_s, s_d,  # [L, B, H, S, D] each, same strides
    src_ptr, ss_b, ss_m,  # int64 [B, M]
    dst_ptr, sd_b,  # int64 [B]
    count_ptr, sc_b,  # int32 [B]
    work_k_ptr, work_v_ptr,  # [L * B * H, M, D] each, contiguous
    B, H, M, D,
    TO_WORKSPACE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # (l * B + b) * H + h
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    n = tl.load(count_ptr + b * sc_b)
    i = tl.program_id(2).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (i[:, None] < n) & (d[None, :] < D)
    base = layer * s_l + b * s_b + h * s_h
    work_off = (pid * M + i[:, None]) * D + d[None, :]
    if TO_WORKSPACE:
        src = tl.load(src_ptr + b * ss_b + i * ss_m, mask=i < n, other=0)
        cache_off = base + src[:, None] * s_s + d[None, :] * s_d
        tl.store(work_k_ptr + work_off, tl.load(k_ptr + cache_off, mask=ok), mask=ok)
        tl.store(work_v_ptr + work_off, tl.load(v_ptr + cache_off, mask=ok), mask=ok)
    else:
        cache_off = base + (tl.load(dst_ptr + b * sd_b) + i)[:, None] * s_s + d[None, :] * s_d
        tl.store(k_ptr + cache_off, tl.load(work_k_ptr + work_off, mask=ok), mask=ok)
        tl.store(v_ptr + cache_off, tl.load(work_v_ptr + work_off, mask=ok), mask=ok)


def kv_compact(k_cache: torch.Tensor, v_cache: torch.Tensor, src_positions: torch.Tensor,
               dst_start: torch.Tensor, counts: torch.Tensor) -> None:
    """k_cache, v_cache: [L, B, H, S, D] (same strides; written in place); src_positions:
    int64 [B, M], the first counts[b] of row b in [0, S); dst_start: int64 [B]; counts: int32
    [B] in [0, M], with dst_start[b] + counts[b] <= S. Entry i of row b moves from
    src_positions[b, i] to dst_start[b] + i in every layer and head (``reference.kv_compact``).
    Any M: past ``launch.MAX_COMPACT_ENTRIES`` through a workspace of 2 x [L * B * H, M, D]."""
    op = "kv_compact"
    check_device(op, k_cache=k_cache, v_cache=v_cache, src_positions=src_positions, dst_start=dst_start,
                 counts=counts)
    require(k_cache.dim() == 5 and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
            and v_cache.dtype == k_cache.dtype, op,
            f"k_cache and v_cache must be [L, B, H, S, D] of one shape, dtype and layout, got "
            f"{tuple(k_cache.shape)} {k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}")
    L, B, H, S, D = k_cache.shape
    require(src_positions.dim() == 2 and src_positions.shape[0] == B and src_positions.dtype == torch.int64, op,
            f"src_positions must be int64 [B, M] with B = {B}, got {src_positions.dtype} {tuple(src_positions.shape)}")
    require(dst_start.shape == (B,) and dst_start.dtype == torch.int64, op,
            f"dst_start must be int64 [B] = [{B}], got {dst_start.dtype} {tuple(dst_start.shape)}")
    require(counts.shape == (B,) and counts.dtype == torch.int32, op,
            f"counts must be int32 [B] = [{B}], got {counts.dtype} {tuple(counts.shape)}")
    M = src_positions.shape[1]
    if L * B * H * D == 0 or M == 0:
        return
    plan = compact_plan(op, M, D)
    if plan.staged:
        _kv_compact_staged(plan, k_cache, v_cache, src_positions, dst_start, counts)
        return
    _kv_compact_kernel[(L * B * H, plan.d_blocks)](
        k_cache, v_cache, *k_cache.stride(), src_positions, *src_positions.stride(), dst_start, dst_start.stride(0),
        counts, counts.stride(0), B, H, D, BLOCK_M=plan.block_m, BLOCK_D=plan.block_d, num_warps=plan.num_warps,
        enable_fp_fusion=FP_FUSION)


def _kv_compact_staged(plan, k_cache, v_cache, src_positions, dst_start, counts) -> None:
    """kv_compact past MAX_COMPACT_ENTRIES entries a row: out to a workspace, then into place."""
    L, B, H, S, D = k_cache.shape
    M = src_positions.shape[1]
    work_k, work_v = torch.empty((2, L * B * H, M, D), dtype=k_cache.dtype, device=k_cache.device)  # [L*B*H, M, D]
    for to_workspace in (True, False):  # stream order: every entry is out before any lands
        _kv_compact_staged_kernel[(L * B * H, plan.d_blocks, plan.m_blocks)](
            k_cache, v_cache, *k_cache.stride(), src_positions, *src_positions.stride(), dst_start,
            dst_start.stride(0), counts, counts.stride(0), work_k, work_v, B, H, M, D, TO_WORKSPACE=to_workspace,
            BLOCK_M=plan.block_m, BLOCK_D=plan.block_d, num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION)


def kv_compact_fake(k_cache, v_cache, src_positions, dst_start, counts):
    return None
