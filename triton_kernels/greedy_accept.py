"""Greedy acceptance: the argmax over the vocabulary fused with the acceptance rule.

Phase 1 (``_argmax_kernel``): programs over (row b and position j, vocabulary chunk) reduce
their chunk of target_logits[b, j] to (max, index). Phase 2 (``_accept_kernel``): one program
per row merges the chunks of its K+1 positions into target tokens and applies the rule. The
only temporaries are [B, K+1, chunks] partials. Argmax as torch.argmax: computed in float32,
ties to the lowest index, a NaN counts as the maximum (the first NaN wins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, acceptance_plan, check_device, empty, require

_NONE = tl.constexpr(2**31 - 1)  # "no index yet"; larger than any vocabulary index


@triton.jit
def _block_argmax(v, idx):
    """v: float32 [..., N] (masked lanes -inf), idx: int32 [..., N] -> (value, index) over the
    last axis; a NaN beats everything and the first NaN wins; ties go to the lowest index."""
    is_nan = v != v
    nan_at = tl.min(tl.where(is_nan, idx, _NONE), axis=-1)
    top = tl.max(tl.where(is_nan, float("-inf"), v), axis=-1)
    top_at = tl.min(tl.where(v == tl.expand_dims(top, -1), idx, _NONE), axis=-1)
    has_nan = nan_at != _NONE
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_at, top_at)


@triton.jit
def _argmax_kernel(
    logits_ptr, s_b, s_j,  # [B, K+1, V], unit stride over V
    part_val_ptr,  # float32 [B * (K+1), SPLITS]
    part_idx_ptr,  # int32 [B * (K+1), SPLITS]
    K1, V, CHUNK, SPLITS,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # b * (K+1) + j
    split = tl.program_id(1)
    row = logits_ptr + (r // K1) * s_b + (r % K1) * s_j
    # per lane, the best of the elements it has seen (indices increase): its first NaN, else its
    # first maximum; one block reduction at the end, not one a step (a step's three reductions
    # across the program made the loop wait on shared memory: 54 % of copy bandwidth on an H200
    # at B = 256, V = 128256, where the CUDA kernel's per-thread scan reaches 86 %)
    lane_val = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_at = tl.full([BLOCK], _NONE, tl.int32)
    lo = split * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < V
        v = tl.load(row + offs, mask=inside, other=float("-inf")).to(tl.float32)
        lane_nan = lane_val != lane_val
        take = inside & (~lane_nan) & ((v != v) | (v > lane_val) | (lane_at == _NONE))
        lane_val = tl.where(take, v, lane_val)
        lane_at = tl.where(take, offs, lane_at)
    best_val, best_at = _block_argmax(lane_val, lane_at)
    tl.store(part_val_ptr + r * SPLITS + split, best_val)
    tl.store(part_idx_ptr + r * SPLITS + split, best_at)


@triton.jit
def _accept_kernel(
    part_val_ptr,  # float32 [B * (K+1), SPLITS]
    part_idx_ptr,  # int32 [B * (K+1), SPLITS]
    draft_ptr, sd_b,  # int64 [B, K]
    num_draft_ptr,  # int32 [B]
    out_ptr, so_b,  # int64 [B, K+1]
    num_acc_ptr,  # int32 [B]
    K, SPLITS,
    BLOCK_K1: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K1)
    sp = tl.arange(0, BLOCK_S)
    ok = (j[:, None] <= K) & (sp[None, :] < SPLITS)
    slot = (b * (K + 1) + j[:, None]) * SPLITS + sp[None, :]
    vals = tl.load(part_val_ptr + slot, mask=ok, other=float("-inf"))
    at = tl.load(part_idx_ptr + slot, mask=ok, other=_NONE)
    _, best_split = _block_argmax(vals, tl.broadcast_to(sp[None, :], [BLOCK_K1, BLOCK_S]))
    target = tl.sum(tl.where(sp[None, :] == best_split[:, None], at, 0), axis=1).to(tl.int64)  # [BLOCK_K1]

    draft = tl.load(draft_ptr + b * sd_b + j, mask=j < K, other=-1)
    nd = tl.load(num_draft_ptr + b)
    stop = (j >= nd) | (draft != target)
    n_acc = tl.min(tl.where(stop, j, BLOCK_K1), axis=0)  # <= nd, as j = nd stops
    final = tl.sum(tl.where(j == n_acc, target, 0), axis=0)
    out = tl.where(j < n_acc, draft, tl.where(j == n_acc, final, -1))
    tl.store(out_ptr + b * so_b + j, out, mask=j <= K)
    tl.store(num_acc_ptr + b, n_acc.to(tl.int32))


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor,
                  num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens: int64 [B, K]; target_logits: float [B, K+1, V] (unit stride over V);
    num_draft: int32 [B] in [0, K] -> (out_tokens int64 [B, K+1], num_accepted int32 [B]),
    as ``reference.greedy_accept``. ``num_splits`` forces the vocabulary split (tests)."""
    op = "greedy_accept"
    check_device(op, draft_tokens=draft_tokens, target_logits=target_logits, num_draft=num_draft)
    require(draft_tokens.dim() == 2 and draft_tokens.dtype == torch.int64, op,
            f"draft_tokens must be int64 [B, K], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    require(target_logits.dim() == 3 and tuple(target_logits.shape[:2]) == (B, K + 1)
            and target_logits.shape[2] >= 1, op,
            f"target_logits must be [B, K+1, V] = [{B}, {K + 1}, V >= 1], got {tuple(target_logits.shape)}")
    require(target_logits.dtype in (torch.float32, torch.bfloat16, torch.float16), op,
            f"target_logits must be float32, bfloat16 or float16, got {target_logits.dtype}")
    require(target_logits.stride(2) == 1 or target_logits.shape[2] == 1 or target_logits.numel() == 0, op,
            "target_logits must have unit stride over V (call .contiguous())")
    require(num_draft.shape == (B,) and num_draft.dtype == torch.int32, op,
            f"num_draft must be int32 [B] = [{B}], got {num_draft.dtype} {tuple(num_draft.shape)}")
    V = target_logits.shape[2]
    draft_tokens, num_draft = draft_tokens.contiguous(), num_draft.contiguous()  # indexed as contiguous by the kernel
    device = draft_tokens.device
    out = empty((B, K + 1), torch.int64, device)
    num_acc = empty((B,), torch.int32, device)
    if B == 0:
        return out, num_acc
    tiles = acceptance_plan(B * (K + 1), K, V, device, num_splits)
    plan = tiles.vocab
    part_val = empty((B * (K + 1), plan.splits), torch.float32, device)
    part_idx = empty((B * (K + 1), plan.splits), torch.int32, device)
    _argmax_kernel[(B * (K + 1), plan.splits)](
        target_logits, target_logits.stride(0), target_logits.stride(1), part_val, part_idx,
        K + 1, V, plan.chunk, plan.splits, BLOCK=plan.block, num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION)
    _accept_kernel[(B,)](
        part_val, part_idx, draft_tokens, draft_tokens.stride(0), num_draft, out, out.stride(0), num_acc,
        K, plan.splits, BLOCK_K1=tiles.block_k1, BLOCK_S=tiles.block_s, num_warps=1, enable_fp_fusion=FP_FUSION)
    return out, num_acc


def greedy_accept_fake(draft_tokens, target_logits, num_draft):
    B, K = draft_tokens.shape
    return (draft_tokens.new_empty((B, K + 1), dtype=torch.int64),
            num_draft.new_empty((B,), dtype=torch.int32))
