"""SwiGLU activation: silu(gate) * up, elementwise.

As the reference, silu(gate) is rounded to the input dtype before the product (torch computes
each of the two ops in float32 and rounds its result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_device, check_float, elementwise_plan, empty_like, require


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [n] flat
    up_ptr,  # [n] flat
    out_ptr,  # [n] flat
    n, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(gate_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (act * u).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., I] (same shape and dtype) -> silu(gate) * up, [..., I] contiguous."""
    op = "silu_mul"
    check_device(op, gate=gate, up=up)
    check_float(op, gate=gate, up=up)
    require(gate.shape == up.shape and gate.dtype == up.dtype, op,
            f"gate and up must have one shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}")
    gate, up = gate.contiguous(), up.contiguous()
    out = empty_like(gate)
    n = gate.numel()
    if n:
        plan = elementwise_plan(n)
        _silu_mul_kernel[(plan.grid,)](gate, up, out, n, BLOCK=plan.block, num_warps=plan.num_warps)
    return out


def silu_mul_fake(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)
