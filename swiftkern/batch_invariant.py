"""Batch-invariant ops for the deterministic verifier: a row's result never depends on the
other rows, on how many rows there are, or on where the row sits.

What breaks batch invariance, and what each op here does instead:
- a reduction whose order depends on the shape (vectorised tails, thread splits, split-K):
  reductions are a fixed pairwise tree of elementwise adds (``tree_sum``) over a power-of-two
  padded axis, so every row is summed in the same order whatever the tensor's shape;
- a matmul whose kernel choice depends on M: ``bi_linear`` runs ``ops.bi_matmul``, the
  Triton kernel (fixed tiles, no split-K) on CUDA; on the CPU an MKL GEMM over at least 16
  rows, whose row results are independent of M and of the row's position (measured, and
  guarded bitwise for every M in 1..300 by ``tests/test_bi_matmul.py``);
- attention over a padded key length that changes with the batch: ``bi_attention`` walks
  the keys in fixed blocks of ``KEY_BLOCK`` from position 0 with an online softmax, so the
  keys past a query (masked to exact zeros) and extra all-masked blocks change nothing;
- an elementwise op whose scalar tail differs from its SIMD body (``F.silu`` on the CPU
  differs in the last bit for ~4 % of inputs): ``bi_silu_mul`` is built from ``exp`` (the
  same result in the body and the tail) and exact arithmetic.
All ops compute in float32 and return the input dtype where the model expects it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .errors import SwiftkernError

KEY_BLOCK = 64  # keys per attention block (a power of two: tree_sum needs no padding)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in a fixed pairwise order: [..., N] -> float32 [..., 1].

    The axis is zero-padded to a power of two and halved with elementwise adds, so the order
    of additions depends only on N, never on the other rows or the tensor's layout.
    """
    x = x.to(torch.float32)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a fixed-order mean of squares. x: [..., H], weight: [H] -> [..., H]"""
    x32 = x.to(torch.float32)
    variance = tree_sum(x32 * x32) / x.shape[-1]
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def bi_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from exp and exact arithmetic. gate, up: [..., I] -> [..., I]"""
    g = gate.to(torch.float32)
    return (g / (1.0 + torch.exp(-g)) * up.to(torch.float32)).to(gate.dtype)


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with row results independent of the other rows.

    x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N] in x's dtype, through
    ``ops.bi_matmul`` (Triton fixed-tile kernel on CUDA, padded MKL GEMM on the CPU).
    """
    if x.shape[-1] != weight.shape[1]:
        raise SwiftkernError(f"bi_linear: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    out = ops.bi_matmul(x.reshape(-1, x.shape[-1]), weight.t())  # [M, N]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def bi_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax with a fixed-order sum. logits: [..., V] -> float32 [..., V]"""
    z = logits.to(torch.float32)
    z = z - z.amax(dim=-1, keepdim=True)
    return z - torch.log(tree_sum(torch.exp(z)))


def bi_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Causal attention of T query tokens per row against that row's keys, in fixed key blocks.

    q: [R, Hq, T, D], query t of row r sitting at absolute position q_start[r] + t;
    keys, values: [R, Hkv, S, D] holding positions 0..S-1 (S a multiple of KEY_BLOCK and
    > every query position); q_start: int64 [R]. Query at position p attends to keys 0..p.
    GQA: query head h reads kv head h // (Hq // Hkv). -> [R, Hq, T, D] in q's dtype.

    Blocks of KEY_BLOCK keys from position 0 are folded in with an online softmax (running max,
    sum and weighted values, all float32). Keys after a query weigh exactly 0, and a block wholly
    after a query leaves its running values bit for bit unchanged, so a query's result depends
    on keys 0..p alone: not on S, on the rows beside it, or on how its tokens were chunked.
    """
    R, Hq, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    if S % KEY_BLOCK:
        raise SwiftkernError(f"bi_attention: key length {S} must be a multiple of {KEY_BLOCK}")
    group = Hq // Hkv
    qf = q.to(torch.float32).reshape(R, Hkv, group * T, D)  # query heads of a kv head folded
    q_pos = (q_start.unsqueeze(1) + torch.arange(T, device=q.device)).repeat(1, group)  # [R, group*T]
    run_max = torch.full((R, Hkv, group * T, 1), float("-inf"), device=q.device)
    run_sum = torch.zeros((R, Hkv, group * T, 1), device=q.device)
    acc = torch.zeros((R, Hkv, group * T, D), device=q.device)
    offsets = torch.arange(KEY_BLOCK, device=q.device)
    for start in range(0, S, KEY_BLOCK):
        k = keys[:, :, start:start + KEY_BLOCK].to(torch.float32)  # [R, Hkv, KB, D]
        v = values[:, :, start:start + KEY_BLOCK].to(torch.float32)
        visible = ((start + offsets).view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [R, 1, gT, KB]
        scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [R, Hkv, gT, KB]
        scores = scores.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(dim=-1, keepdim=True))
        # exact 1 when the max did not move (also for a block wholly after the query)
        rescale = torch.where(new_max == run_max, torch.ones_like(run_max), torch.exp(run_max - new_max))
        p = torch.exp(scores - new_max).masked_fill(~visible, 0.0)  # [R, Hkv, gT, KB]
        run_sum = run_sum * rescale + tree_sum(p)
        acc = acc * rescale + torch.matmul(p, v)
        run_max = new_max
    return (acc / run_sum).reshape(R, Hq, T, D).to(q.dtype)
