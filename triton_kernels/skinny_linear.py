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

The model runner's regular set on CUDA also takes it two more ways, each column's bits those of
``skinny_linear``: ``skinny_linear_group`` (a layer's q, k and v, or gate and up, in one launch)
and ``skinny_silu_linear`` (the down projection with its SwiGLU made in the A tile's load). With
K in chunks each matmul is two launches (the chunks, then their sum): a layer's seven projections
and its SwiGLU were 15 launches, and are 8.
"""

from __future__ import annotations

import functools
import os

import torch

from swiftkern.errors import SwiftkernError

from .bi_matmul import CANDIDATES, MAX_GROUP, Plan, launch
from .launch import check_device, check_float, require
from .registry import register

PLAN = Plan(16, 64, 32, k_chunk=128)  # ieee: exact float32 products, as cuBLAS's


@functools.lru_cache(maxsize=None)
def plan_in_use() -> Plan:
    """PLAN, or the ``bi_matmul`` candidate SWIFTKERN_SKINNY_PLAN names (e.g. its ``last_adds``
    twin "16x64x32-w4-s3-ieee-k128-last": one launch a matmul), for measuring a plan in whole
    runs. Read at the first matmul, so a bad name fails that call with its message. The bits
    follow the plan (the regular path is batch-variant anyway)."""
    value = os.environ.get("SWIFTKERN_SKINNY_PLAN", "").strip()
    if not value:
        return PLAN
    named = {plan.name: plan for plan in CANDIDATES}
    if value not in named:
        raise SwiftkernError(f"SWIFTKERN_SKINNY_PLAN={value!r} names no candidate plan; give one of "
                             f"{', '.join(named)}, or unset it for {PLAN.name}")
    return named[value]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None, one float dtype and device ->
    [..., N] in x's dtype, accumulated in float32 (``plan_in_use()``: PLAN unless
    SWIFTKERN_SKINNY_PLAN names another)."""
    op = "skinny_linear"
    check_device(op, x=x, weight=weight, bias=bias)
    check_float(op, x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    _check_weight(op, x, weight, bias)
    out = _plus_bias(launch(x.reshape(-1, x.shape[-1]), weight.t(), plan_in_use()), bias)  # [M, N]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out [M, N] + bias [N] (None: out), in out's dtype, as torch's linear adds it."""
    return out if bias is None else out + bias.to(out.dtype)


def skinny_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _check_weight(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, i: str = "") -> None:
    """x [..., K] against weight{i} [N, K] and bias{i} [N] or None, their dtypes one."""
    name = f"weight{i}"
    require(x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1], op,
            f"x must be [..., K] and {name} [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    require(x.dtype == weight.dtype, op, f"x and {name} must have one dtype, got {x.dtype} and {weight.dtype}")
    require(bias is None or tuple(bias.shape) == (weight.shape[0],), op,
            f"bias{i} must be [N] = [{weight.shape[0]}], got {None if bias is None else tuple(bias.shape)}")


def skinny_linear_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """``skinny_linear(x, weights[i], biases[i])`` for 1 to 3 weights side by side, in one matmul
    launch (a layer's q, k and v; gate and up): x: [..., K]; weights: [N_i, K] each; biases:
    [N_i] or None each (one per weight) -> [..., sum N_i] in x's dtype. Each column has the bits
    of its own ``skinny_linear`` (an output element's sum does not depend on its tile), with
    a third of the launches of three calls at a verify pass's few rows."""
    op = "skinny_linear_group"
    require(1 <= len(weights) <= MAX_GROUP and len(biases) == len(weights), op,
            f"takes 1 to {MAX_GROUP} weights and one bias (or None) each, got {len(weights)} and {len(biases)}")
    named = {f"weight{i}": w for i, w in enumerate(weights)}
    named.update({f"bias{i}": b for i, b in enumerate(biases) if b is not None})
    check_device(op, x=x, **named)
    check_float(op, x=x, **named)
    for i, (w, b) in enumerate(zip(weights, biases)):
        _check_weight(op, x, w, b, str(i))
    out = launch(x.reshape(-1, x.shape[-1]), [w.t() for w in weights], plan_in_use())  # [M, sum N_i]
    col = 0
    for w, b in zip(weights, biases):
        if b is not None:
            out[:, col:col + w.shape[0]] += b.to(out.dtype)
        col += w.shape[0]
    return out.reshape(*x.shape[:-1], col)


def skinny_silu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``skinny_linear(silu_mul(gate, up), weight, bias)`` with the Triton ``silu_mul``, the same
    bits, in one matmul launch (the SwiGLU made in the A tile's load; a layer's down projection):
    gate, up: [..., I] (e.g. the halves of ``skinny_linear_group``'s gate/up output); weight:
    [N, I]; bias: [N] or None -> [..., N] in gate's dtype."""
    op = "skinny_silu_linear"
    check_device(op, gate=gate, up=up, weight=weight, bias=bias)
    check_float(op, gate=gate, up=up, weight=weight, **({} if bias is None else {"bias": bias}))
    require(up.shape == gate.shape and up.dtype == gate.dtype, op,
            f"gate and up must have one shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
            f"{tuple(up.shape)} {up.dtype}")
    _check_weight(op, gate, weight, bias)
    I = gate.shape[-1]
    out = _plus_bias(launch(gate.reshape(-1, I), weight.t(), plan_in_use(), up=up.reshape(-1, I)), bias)  # [M, N]
    return out.reshape(*gate.shape[:-1], weight.shape[0])


def skinny_linear_group_fake(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def skinny_silu_linear_fake(gate, up, weight, bias):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


register("skinny_linear_group", "(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor", skinny_linear_group,
         skinny_linear_group_fake)
register("skinny_silu_linear", "(Tensor gate, Tensor up, Tensor weight, Tensor? bias) -> Tensor", skinny_silu_linear,
         skinny_silu_linear_fake)
