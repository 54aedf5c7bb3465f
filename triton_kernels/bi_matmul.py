"""Batch-invariant matmul: c = a @ b with every row of c independent of M and of the other rows.

What makes a GPU matmul batch-variant is a launch configuration picked from the shape (tile
sizes, split-K, stream-K), which changes the order in which an output element's K products
are added. Here the tiles are constants (never derived from M, N or K), one program computes
a whole output tile walking K from 0 upwards in BLOCK_K steps (no split-K), and accumulates
in float32. So row i of c is the same bits whether a has 1 row or 10 000.

bf16/fp16 inputs use tensor-core dots with a float32 accumulator on a GPU, float32 inputs
IEEE float32 dots. Under TRITON_INTERPRET=1 (no GPU) tl.dot is numpy's BLAS, which gives a
row different bits at different places in a tile, and bf16 arithmetic is not the GPU's: there
the tiles are upcast to float32 and multiplied by ``interpreter_dot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter_dot import interpreter_dot
from .launch import cdiv, check_device, check_float, empty, interpreting, require
from .registry import register

SCHEMA = "(Tensor a, Tensor b) -> Tensor"
# fixed tiles: the one property batch invariance rests on (never chosen from the shape)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit(do_not_specialize=["M"])  # one binary for every M (a row's bits must not depend on M)
def _bi_matmul_kernel(
    a_ptr,  # [M, K]
    b_ptr,  # [K, N]
    c_ptr,  # [M, N]
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the whole K axis, in order, in this one program
        ks = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if INTERPRET:  # numpy's BLAS behind tl.dot is not row-invariant within a tile
            acc += interpreter_dot(a, b)
        elif UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [M, K], b: [K, N] (same float dtype and device, any strides) -> a @ b, [M, N] in a's
    dtype, accumulated in float32 with tiles fixed at (BLOCK_M, BLOCK_N, BLOCK_K)."""
    op = "bi_matmul"
    check_device(op, a=a, b=b)
    check_float(op, a=a, b=b)
    require(a.dim() == 2 and b.dim() == 2, op, f"a must be [M, K] and b [K, N], got {tuple(a.shape)} "
            f"and {tuple(b.shape)}")
    require(a.shape[1] == b.shape[0], op, f"a is [M, K = {a.shape[1]}] but b is [K = {b.shape[0]}, N]")
    require(a.dtype == b.dtype, op, f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    M, K = a.shape
    N = b.shape[1]
    c = empty((M, N), a.dtype, a.device)
    if M and N:
        if K == 0:
            return c.zero_()
        grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
        _bi_matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                c.stride(0), c.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                UPCAST=a.dtype == torch.float32, INTERPRET=interpreting(), num_warps=4)
    return c


def bi_matmul_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


register("bi_matmul", SCHEMA, bi_matmul, bi_matmul_fake)
