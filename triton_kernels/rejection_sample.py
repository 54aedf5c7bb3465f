"""Speculative rejection sampling with the vocabulary sums and the inverse-CDF draw fused.

Every program first finds its row's first rejected draft j* (K point loads: accept draft j
while u_accept * q(x) < p(x), compared in float64). The token at j* is drawn from the weights
w = max(0, p - q) (rejection), or p (all drafts accepted, or a residual that rounding made all
zero), as the smallest i with cumsum(w)[i] > u_sample * sum(w), in float64.
Phase 1 (``_chunk_sums_kernel``): programs over (row, vocabulary chunk) sum the residual and p
over their chunk. Phase 2 (``_draw_kernel``): one program per row finds the chunk where the
cumulative sum crosses the threshold and scans only that chunk. No [B, K+1, V] temporaries;
the sums are associated by chunk and block rather than left to right, which moves the
threshold by about 1e-16 relative to the reference's sequential float64 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, acceptance_plan, check_device, empty, require

_NONE = tl.constexpr(2**31 - 1)


@triton.jit
def _first_rejection(b, draft_ptr, sd_b, q_ptr, sq_b, sq_j, p_ptr, sp_b, sp_j, nd,
                     u_acc_ptr, su_b, K, HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """-> j*: the first j < nd whose draft is rejected, or nd when all are accepted."""
    j = tl.arange(0, BLOCK_K)
    used = j < nd
    x = tl.load(draft_ptr + b * sd_b + j, mask=used, other=0)
    p = tl.load(p_ptr + b * sp_b + j * sp_j + x, mask=used, other=0.0).to(tl.float64)
    if HAS_Q:
        q = tl.load(q_ptr + b * sq_b + j * sq_j + x, mask=used, other=0.0).to(tl.float64)
    else:
        q = tl.full([BLOCK_K], 1.0, tl.float64)
    u = tl.load(u_acc_ptr + b * su_b + j, mask=used, other=0.0).to(tl.float64)
    stop = (~used) | ~(u * q < p)
    return tl.min(tl.where(stop, j, BLOCK_K), axis=0)


@triton.jit
def _weights(p_row, q_row, x_star, offs, V, rejected, use_residual, HAS_Q: tl.constexpr):
    """float64 weights of one vocabulary block: p, or max(0, p - q) when drawing the residual."""
    p = tl.load(p_row + offs, mask=offs < V, other=0.0).to(tl.float64)
    if HAS_Q:
        q = tl.load(q_row + offs, mask=tl.where(rejected, offs < V, False), other=0.0).to(tl.float64)
    else:
        q = tl.where(offs == x_star, 1.0, 0.0).to(tl.float64)
    residual = tl.maximum(p - q, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN kept, as the reference's clamp
    return p, tl.where(use_residual, residual, p)


@triton.jit
def _chunk_sums_kernel(
    draft_ptr, sd_b,  # int64 [B, K]
    q_ptr, sq_b, sq_j,  # float32 [B, K, V] (only with HAS_Q)
    p_ptr, sp_b, sp_j,  # float32 [B, K+1, V]
    nd_ptr,  # int32 [B]
    u_acc_ptr, su_b,  # float32 [B, K]
    res_sum_ptr, p_sum_ptr,  # float64 [B, SPLITS] each
    K, V, CHUNK, SPLITS,
    HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    nd = tl.load(nd_ptr + b)
    j_star = _first_rejection(b, draft_ptr, sd_b, q_ptr, sq_b, sq_j, p_ptr, sp_b, sp_j, nd, u_acc_ptr, su_b,
                              K, HAS_Q, BLOCK_K)
    rejected = j_star < nd
    x_star = tl.load(draft_ptr + b * sd_b + j_star, mask=rejected, other=-1)
    p_row = p_ptr + b * sp_b + j_star * sp_j
    q_row = q_ptr + b * sq_b + j_star * sq_j
    res_acc = tl.zeros([BLOCK], tl.float64)
    p_acc = tl.zeros([BLOCK], tl.float64)
    lo = split * CHUNK
    for start in range(lo, tl.minimum(lo + CHUNK, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p, residual = _weights(p_row, q_row, x_star, offs, V, rejected, rejected, HAS_Q)
        res_acc += residual
        p_acc += p
    tl.store(res_sum_ptr + b * SPLITS + split, tl.sum(res_acc, axis=0))
    tl.store(p_sum_ptr + b * SPLITS + split, tl.sum(p_acc, axis=0))


@triton.jit
def _draw_kernel(
    draft_ptr, sd_b, q_ptr, sq_b, sq_j, p_ptr, sp_b, sp_j, nd_ptr, u_acc_ptr, su_b,  # as above
    u_smp_ptr, sus_b,  # float32 [B, K+1]
    res_sum_ptr, p_sum_ptr,  # float64 [B, SPLITS]
    out_ptr, so_b,  # int64 [B, K+1]
    num_acc_ptr,  # int32 [B]
    K, V, CHUNK, SPLITS,
    HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nd = tl.load(nd_ptr + b)
    j_star = _first_rejection(b, draft_ptr, sd_b, q_ptr, sq_b, sq_j, p_ptr, sp_b, sp_j, nd, u_acc_ptr, su_b,
                              K, HAS_Q, BLOCK_K)
    rejected = j_star < nd
    x_star = tl.load(draft_ptr + b * sd_b + j_star, mask=rejected, other=-1)

    sp = tl.arange(0, BLOCK_S)
    res_sums = tl.load(res_sum_ptr + b * SPLITS + sp, mask=sp < SPLITS, other=0.0)
    p_sums = tl.load(p_sum_ptr + b * SPLITS + sp, mask=sp < SPLITS, other=0.0)
    use_residual = rejected & (tl.sum(res_sums, axis=0) > 0.0)
    sums = tl.where(use_residual, res_sums, p_sums)  # [BLOCK_S] float64
    # the threshold, the crossing chunk and the mass before it all from one scan of the chunk
    # sums, so a positive total always has a crossing (u < 1); NaN or 0: none, token V - 1
    cum = tl.cumsum(sums, axis=0)
    total = tl.sum(tl.where(sp == SPLITS - 1, cum, 0.0), axis=0)
    thresh = tl.load(u_smp_ptr + b * sus_b + j_star).to(tl.float64) * total
    chunk = tl.min(tl.where((cum > thresh) & (sp < SPLITS), sp, _NONE), axis=0)
    found = chunk != _NONE
    carry = tl.sum(tl.where(sp == chunk - 1, cum, 0.0), axis=0)  # mass before the crossing chunk

    p_row = p_ptr + b * sp_b + j_star * sp_j
    q_row = q_ptr + b * sq_b + j_star * sq_j
    token = tl.full([], _NONE, tl.int32)
    last = tl.full([], -1, tl.int32)  # the chunk's last token of positive weight so far
    lo = tl.where(found, chunk, 0) * CHUNK
    hi = tl.where(found, tl.minimum(lo + CHUNK, V), lo)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        _, w = _weights(p_row, q_row, x_star, offs, V, rejected, use_residual, HAS_Q)
        cdf = carry + tl.cumsum(w, axis=0)
        # a token of weight 0 is never the first to cross (in exact sums the one before it did)
        here = tl.min(tl.where((cdf > thresh) & (w > 0.0) & (offs < V), offs, _NONE), axis=0)
        token = tl.minimum(token, here)
        last = tl.maximum(last, tl.max(tl.where((w > 0.0) & (offs < V), offs, -1), axis=0))
        carry = tl.max(cdf, axis=0)  # the scan's own total (w >= 0: cdf does not decrease)
    # the chunk's block sums and this scan round apart: no crossing in it -> its last token of
    # positive weight (the crossing within rounding); no chunk at all (total 0 or NaN) -> V - 1
    token = tl.where(token == _NONE, tl.where(last >= 0, last, V - 1), token).to(tl.int64)

    j = tl.arange(0, BLOCK_K1)
    draft = tl.load(draft_ptr + b * sd_b + j, mask=j < K, other=-1)
    out = tl.where(j < j_star, draft, tl.where(j == j_star, token, -1))
    tl.store(out_ptr + b * so_b + j, out, mask=j <= K)
    tl.store(num_acc_ptr + b, j_star.to(tl.int32))


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     num_draft: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor,
                     num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens: int64 [B, K] (the first num_draft[b] in [0, V)); draft_probs: float32
    [B, K, V] or None (a greedy draft: q one-hot); target_probs: float32 [B, K+1, V];
    num_draft: int32 [B] in [0, K]; u_accept: float32 [B, K]; u_sample: float32 [B, K+1]
    -> (out_tokens int64 [B, K+1], num_accepted int32 [B]) as ``reference.rejection_sample``.
    Probabilities need unit stride over V. ``num_splits`` forces the vocabulary split (tests)."""
    op = "rejection_sample"
    check_device(op, draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs,
                 num_draft=num_draft, u_accept=u_accept, u_sample=u_sample)
    require(draft_tokens.dim() == 2 and draft_tokens.dtype == torch.int64, op,
            f"draft_tokens must be int64 [B, K], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    require(target_probs.dim() == 3 and tuple(target_probs.shape[:2]) == (B, K + 1) and target_probs.shape[2] >= 1,
            op, f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V >= 1], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    for name, t, shape in (("target_probs", target_probs, (B, K + 1, V)), ("draft_probs", draft_probs, (B, K, V))):
        if t is None:
            continue
        require(tuple(t.shape) == shape and t.dtype == torch.float32 and (t.stride(2) == 1 or V == 1 or t.numel() == 0), op,
                f"{name} must be float32 {list(shape)} with unit stride over V, got {t.dtype} {tuple(t.shape)} "
                f"strides {t.stride()}")
    for name, t, shape, dtype in (("num_draft", num_draft, (B,), torch.int32), ("u_accept", u_accept, (B, K), torch.float32),
                                  ("u_sample", u_sample, (B, K + 1), torch.float32)):
        require(tuple(t.shape) == shape and t.dtype == dtype, op,
                f"{name} must be {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    # the kernels index these small per-row tensors as contiguous: a strided view is copied (B x K values)
    draft_tokens, num_draft = draft_tokens.contiguous(), num_draft.contiguous()
    u_accept, u_sample = u_accept.contiguous(), u_sample.contiguous()
    device = draft_tokens.device
    out = empty((B, K + 1), torch.int64, device)
    num_acc = empty((B,), torch.int32, device)
    if B == 0:
        return out, num_acc
    tiles = acceptance_plan(B, K, V, device, num_splits)
    plan = tiles.vocab
    res_sum = empty((B, plan.splits), torch.float64, device)
    p_sum = empty((B, plan.splits), torch.float64, device)
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_probs  # a valid pointer, never read without HAS_Q
    common = (draft_tokens, draft_tokens.stride(0), q, q.stride(0), q.stride(1),
              target_probs, target_probs.stride(0), target_probs.stride(1), num_draft,
              u_accept, u_accept.stride(0))
    _chunk_sums_kernel[(B, plan.splits)](
        *common, res_sum, p_sum, K, V, plan.chunk, plan.splits,
        HAS_Q=has_q, BLOCK_K=tiles.block_k, BLOCK=plan.block, num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION)
    _draw_kernel[(B,)](
        *common, u_sample, u_sample.stride(0), res_sum, p_sum, out, out.stride(0), num_acc,
        K, V, plan.chunk, plan.splits, HAS_Q=has_q, BLOCK_K=tiles.block_k, BLOCK_K1=tiles.block_k1,
        BLOCK_S=tiles.block_s, BLOCK=plan.block, num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION)
    return out, num_acc


def rejection_sample_fake(draft_tokens, draft_probs, target_probs, num_draft, u_accept, u_sample):
    B, K = draft_tokens.shape
    return (draft_tokens.new_empty((B, K + 1), dtype=torch.int64),
            num_draft.new_empty((B,), dtype=torch.int32))
