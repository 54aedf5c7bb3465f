"""SwiGLU activation: silu(gate) * up, elementwise.

As the reference, silu(gate) is rounded to the input dtype before the product (torch computes
each of the two ops in float32 and rounds its result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, check_device, check_float, elementwise_plan, empty, empty_like, require


@triton.jit
def silu_times(g, up, DTYPE: tl.constexpr):
    """silu(g) * up from float32 blocks, rounded to DTYPE as the reference rounds: silu first,
    then the product. The one definition of an element's SwiGLU bits (``bi_matmul_swiglu``'s
    A-tile load makes them with it too)."""
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (act * up).to(DTYPE)


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [n] flat, or [rows, I] rows stride_in apart (ROWS)
    up_ptr,  # as gate
    out_ptr,  # [n] flat ([rows, I] contiguous)
    n, I, stride_in, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    if ROWS:  # program (row, column block): the inputs are column slices of wider rows
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < I
        row = tl.program_id(0).to(tl.int64)
        src = row * stride_in + cols
        dst = row * I + cols
    else:
        src = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = src < n
        dst = src
    g = tl.load(gate_ptr + src, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + src, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, silu_times(g, u, out_ptr.dtype.element_ty), mask=inside)


def _row_stride(x: torch.Tensor) -> int | None:
    """The stride between rows of x seen as [rows, x.shape[-1]] without a copy (contiguous
    rows, dims before the last mergeable), or None. Dims of size 1 are passed over: their
    strides mean nothing (a [3, 96] column slice viewed as [3, 1, 96] has strides (192, 96, 1),
    and its rows are 192 apart, not 96)."""
    if x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    outer = [(n, stride) for n, stride in zip(x.shape[:-1], x.stride()[:-1]) if n > 1]  # (size, stride)
    for (_, stride), (n_in, stride_in) in zip(outer, outer[1:]):
        if stride != stride_in * n_in:
            return None
    return outer[-1][1] if outer else x.shape[-1]  # one row: any stride


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., I] (same shape and dtype) -> silu(gate) * up, [..., I] contiguous.
    Inputs whose rows are column slices of wider rows with one stride (the verifier's gate
    and up: halves of one grouped projection) are read in place; other layouts are copied
    contiguous first. Each element's arithmetic is the same either way."""
    op = "silu_mul"
    check_device(op, gate=gate, up=up)
    check_float(op, gate=gate, up=up)
    require(gate.shape == up.shape and gate.dtype == up.dtype, op,
            f"gate and up must have one shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}")
    I = gate.shape[-1] if gate.dim() else 1
    stride = _row_stride(gate)
    rows_in_place = (not (gate.is_contiguous() and up.is_contiguous()) and stride is not None
                     and stride == _row_stride(up) and gate.numel() > 0)
    if not rows_in_place:
        gate, up = gate.contiguous(), up.contiguous()
    out = empty(tuple(gate.shape), gate.dtype, gate.device) if rows_in_place else empty_like(gate)
    n = gate.numel()
    if n:
        plan = elementwise_plan(I if rows_in_place else n)
        grid = (n // I, plan.grid) if rows_in_place else (plan.grid,)
        _silu_mul_kernel[grid](gate, up, out, n, I, stride if rows_in_place else 0, BLOCK=plan.block,
                               ROWS=rows_in_place, num_warps=plan.num_warps, enable_fp_fusion=FP_FUSION)
    return out


def silu_mul_fake(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)
