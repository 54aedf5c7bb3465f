"""skinny_linear on CUDA: x @ weight.T + bias for the few rows of a decode step or a verify pass.

cuBLAS's float32 matmul is slowest just there: on an H100, SmolLM2's projections and LM head
(graph replays, bench/results/bi_matmul-nvidia-h100-80gb-hbm3.csv) took 4.50 ms for a pass of 8
rows against 2.05 ms for 32, so a verify pass of 8 tokens cost 3.4 decode steps (verify_cost:
5.51 against 1.63 ms) and `ar` at batch 8 stepped slower than at batch 32. This is
``bi_matmul``'s kernel in a plan of exact float32 products ("ieee") whose 16-row tiles walk K in
fixed chunks of 128 (the chunks' float32 partials added in order by a second launch): 1.40 ms
for that pass of 8 rows, 1.98 for 32. A regular-path kernel: its rows are batch-invariant within
the plan, but ``ops.linear`` takes it only for ``CUDA_SKINNY_ROWS`` rows and torch's matmul
elsewhere, so the regular path as a whole stays batch-variant.
"""

from __future__ import annotations

import torch

from .bi_matmul import Plan, launch
from .launch import check_device, check_float, require

PLAN = Plan(16, 64, 32, k_chunk=128)  # ieee: exact float32 products, as cuBLAS's


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None, one float dtype and device ->
    [..., N] in x's dtype, accumulated in float32 (``PLAN``)."""
    op = "skinny_linear"
    check_device(op, x=x, weight=weight, bias=bias)
    check_float(op, x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    require(x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1], op,
            f"x must be [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    require(x.dtype == weight.dtype, op, f"x and weight must have one dtype, got {x.dtype} and {weight.dtype}")
    require(bias is None or tuple(bias.shape) == (weight.shape[0],), op,
            f"bias must be [N] = [{weight.shape[0]}], got {None if bias is None else tuple(bias.shape)}")
    out = launch(x.reshape(-1, x.shape[-1]), weight.t(), PLAN)  # [M, N]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def skinny_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
