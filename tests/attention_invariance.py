"""What the invariant-attention tests share (the C++ kernel in test_invariant_kernels, the
Triton one in test_triton_verify_attention): inputs, and how many queries change bits with the
chunk they come in or with the rows beside them."""

from __future__ import annotations

import torch


def poison_stale(k, v, lens):
    """k, v [B, Hkv, S, D] with NaN at every position >= lens[b] of row b (in place): a kernel
    that reads a key or value past a row's length then shows NaN. -> (k, v)"""
    for b, n in enumerate(lens.tolist()):
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    return k, v


def attention_case(B, Hkv, group, T, D, S, dtype, seed, device="cpu", lens=None):
    """q [B, Hq, T, D] (a view of [B, T, Hq, D], as the model's), k, v [B, Hkv, S, D]; with
    ``lens`` [B], NaN past each row's length."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hkv * group, D, generator=g).to(dtype).to(device).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(device)
    if lens is not None:
        poison_stale(k, v, lens)
    return q, k, v


def chunk_vs_one_by_one(op, Hkv, group, T, D, L, seed=0, device="cpu"):
    """How many of T queries get other bits from a T-token call than from T calls of one token
    (query i alone sees keys < L - T + i + 1, as in the chunk), rows of two lengths."""
    lens = torch.tensor([L, L - 3], device=device)
    q, k, v = attention_case(2, Hkv, group, T, D, L, torch.float32, seed, device, lens)
    chunk = op(q, k, v, lens, D ** -0.5)
    differ = 0
    for i in range(T):
        one = op(q[:, :, i:i + 1].contiguous(), k, v, lens - (T - 1 - i), D ** -0.5)
        differ += not torch.equal(one[:, :, 0], chunk[:, :, i])
    return differ


def rows_alone_vs_together(op, lens, Hkv=3, group=3, T=4, D=64, seed=1, device="cpu"):
    """Indices of the rows whose output alone differs in any bit from the same row in one call
    with all rows (cache lengths ``lens``)."""
    S = max(lens)
    lens_t = torch.tensor(lens, device=device)
    q, k, v = attention_case(len(lens), Hkv, group, T, D, S, torch.float32, seed, device, lens_t)
    together = op(q, k, v, lens_t, 0.125)
    return [b for b in range(len(lens))
            if not torch.equal(op(q[b:b + 1], k[b:b + 1], v[b:b + 1], lens_t[b:b + 1], 0.125), together[b:b + 1])]
