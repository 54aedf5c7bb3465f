"""Batch-invariant ops for the deterministic verifier: a row's result never depends on the
other rows, on how many rows there are, or on where the row sits.

What breaks batch invariance, and what each op here does instead:
- a reduction whose order depends on the shape (vectorised tails, thread splits, split-K):
  reductions are a fixed tree of elementwise adds (``tree_sum``), so every row is summed in
  the same order whatever the tensor's shape;
- a matmul whose kernel choice depends on M: ``bi_linear`` runs ``ops.bi_matmul``, the
  Triton kernel (fixed tiles, no split-K) on CUDA; on the CPU the C++ ``skinny_linear``
  kernel, whose every output is a dot product in an order fixed by K alone (MKL's GEMM was
  not: on an AVX-512 Xeon its rows changed with M for K = 1536); guarded bitwise for many M
  by ``tests/test_bi_matmul.py``;
- attention over a padded key length that changes with the batch: ``bi_attention`` cuts the
  keys into fixed blocks of ``KEY_BLOCK`` from position 0 and adds the blocks in order, so
  the keys past a query (weighted by exact zeros) and extra blocks change nothing;
- an elementwise op whose scalar tail differs from its SIMD body (``F.silu`` on the CPU
  differs in the last bit for ~4 % of inputs), or a library transcendental whose result
  depends on how the library split the array (``torch.exp`` on the CPU: once in a few runs,
  the second half of a 4097-element array came back different in the last bit): ``bi_exp``
  is built from single IEEE operations (multiply, add, round, integer bit shifts), each
  exactly rounded whatever path computes it, and ``bi_silu_mul``, ``bi_log_softmax`` and
  ``bi_attention`` use it.
All ops compute in float32 and return the input dtype where the model expects it.
"""

from __future__ import annotations

import torch

from . import ops
from .errors import SwiftkernError
from .reference import tree_sum

KEY_BLOCK = 64  # keys per attention block


def bi_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32, the same bits for an element wherever it sits: ``ops.bi_exp`` (the
    C++ kernel on the CPU, else ``reference.bi_exp``). x: any shape -> float32."""
    return ops.bi_exp(x)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a fixed-order mean of squares. x: [..., H], weight: [H] -> [..., H]"""
    x32 = x.to(torch.float32)
    variance = tree_sum(x32 * x32) / x.shape[-1]
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def bi_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from exp and exact arithmetic. gate, up: [..., I] -> [..., I]"""
    g = gate.to(torch.float32)
    return (g / (1.0 + bi_exp(-g)) * up.to(torch.float32)).to(gate.dtype)


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with row results independent of the other rows.

    x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N] in x's dtype, through
    ``ops.bi_matmul`` (Triton fixed-tile kernel on CUDA, the C++ fixed-order kernel on the CPU).
    """
    if x.shape[-1] != weight.shape[1]:
        raise SwiftkernError(f"bi_linear: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    out = ops.bi_matmul(x.reshape(-1, x.shape[-1]), weight.t())  # [M, N]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def bi_linears(x: torch.Tensor, weights: tuple, biases: tuple) -> list[torch.Tensor]:
    """``[bi_linear(x, w, b) for w, b in zip(weights, biases)]`` with the same bits; where the
    Triton kernel runs the matmul (``ops.invariant.group_in_one_launch``: CUDA), one
    ``bi_matmul_group`` launch for them all (a layer's q, k and v, or gate and up).
    x: [..., K]; weights: 1 to 3 of [N_i, K]; biases: [N_i] or None each -> [..., N_i] each
    (views into one [..., sum N_i] buffer where grouped)."""
    if not ops.invariant.group_in_one_launch(x.device.type):
        return [bi_linear(x, w, b) for w, b in zip(weights, biases)]
    out = ops.bi_matmul_group(x.reshape(-1, x.shape[-1]), [w.t() for w in weights])  # [M, sum N_i]
    parts = out.split([w.shape[0] for w in weights], dim=1)
    return [(p if b is None else p + b.to(p.dtype)).view(*x.shape[:-1], p.shape[1]) for p, b in zip(parts, biases)]


def bi_silu_linear_triton(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``bi_linear(silu_mul(gate, up), weight, bias)`` with the Triton ``silu_mul`` and
    ``bi_matmul``, the same bits, in one launch (``bi_matmul_swiglu``: the SwiGLU made in the
    matmul's A-tile load; a layer's down projection). For the Triton invariant set (CUDA; the
    CPU under TRITON_INTERPRET=1 with backend triton). gate, up: [..., I] (e.g. the halves of one
    grouped projection); weight: [N, I]; bias: [N] or None -> [..., N]"""
    from .triton_kernels.bi_matmul import bi_matmul_swiglu

    I = gate.shape[-1]
    out = bi_matmul_swiglu(gate.reshape(-1, I), up.reshape(-1, I), weight.t())  # [M, N]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*gate.shape[:-1], weight.shape[0])


def bi_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax with a fixed-order sum. logits: [..., V] -> float32 [..., V]"""
    z = logits.to(torch.float32)
    top, total = ops.bi_max_exp_sum(z)  # [..., 1] each
    return (z - top) - torch.log(total)


def bi_token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log-softmax of each row at its token, batch-invariant: ``bi_log_softmax(logits)`` at the
    tokens, the same bits, without the [N, V] result. logits: [N, V]; tokens: int64 [N] ->
    float32 [N]"""
    z = logits.to(torch.float32)
    top, total = ops.bi_max_exp_sum(z)  # [N, 1] each
    picked = z.gather(1, tokens.unsqueeze(1)) - top  # [N, 1]
    return (picked - torch.log(total)).squeeze(1)


def bi_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Causal attention of T query tokens per row against that row's keys, in fixed key blocks.

    q: [R, Hq, T, D], query t of row r sitting at absolute position q_start[r] + t;
    keys, values: [R, Hkv, S, D] holding positions 0..S-1 (S a multiple of KEY_BLOCK and
    > every query position); q_start: int64 [R]. Query at position p attends to keys 0..p.
    GQA: query head h reads kv head h // (Hq // Hkv). -> [R, Hq, T, D] in q's dtype.

    The keys are cut into blocks of KEY_BLOCK from position 0. Scores and the weighted values
    are matmuls of one fixed shape per block; the softmax max is exact whatever the order; the
    weights of a block are summed by ``tree_sum`` and the blocks one after another from block 0.
    Keys after a query weigh exactly 0, so blocks past it add exact zeros: a query's result
    depends on keys 0..p alone, not on S, on the rows beside it, or on how its tokens were
    chunked into passes.
    """
    R, Hq, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    if S % KEY_BLOCK:
        raise SwiftkernError(f"bi_attention: key length {S} must be a multiple of {KEY_BLOCK}")
    group, blocks = Hq // Hkv, S // KEY_BLOCK
    qf = q.to(torch.float32).reshape(R, Hkv, 1, group * T, D)  # query heads of a kv head folded
    k = keys.to(torch.float32).reshape(R, Hkv, blocks, KEY_BLOCK, D)
    v = values.to(torch.float32).reshape(R, Hkv, blocks, KEY_BLOCK, D)
    q_pos = (q_start.unsqueeze(1) + torch.arange(T, device=q.device)).repeat(1, group)  # [R, group*T]
    key_pos = torch.arange(S, device=q.device).view(1, 1, blocks, 1, KEY_BLOCK)
    visible = key_pos <= q_pos.view(R, 1, 1, group * T, 1)  # [R, 1, blocks, gT, KB]
    scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [R, Hkv, blocks, gT, KB]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # key 0 is always visible: finite
    p = bi_exp(scores - top).masked_fill(~visible, 0.0)
    block_sums = tree_sum(p)  # [R, Hkv, blocks, gT, 1]
    block_out = torch.matmul(p, v)  # [R, Hkv, blocks, gT, D]
    total, out = block_sums[:, :, 0], block_out[:, :, 0]
    for b in range(1, blocks):  # in block order; a block past the query adds exact zeros
        total = total + block_sums[:, :, b]
        out = out + block_out[:, :, b]
    return (out / total).reshape(R, Hq, T, D).to(q.dtype)
