"""The deterministic verifier's softmax denominator, sum(exp(x)) along each row, in one launch.

``reference.bi_exp_sum`` defines the bits: ``bi_exp`` of every element (range reduction and a
degree-7 Taylor polynomial in single IEEE operations), zero-padded to a multiple of 64, halved
by elementwise adds (element i + element i + half) while the length is even, and the odd rest
added column after column. As torch ops on a GPU that is 44 launches a call at SmolLM2's
vocabulary and 536 at Llama-3's (one per polynomial step, per halving and per odd column),
each a few microseconds, paid on every token of mode deterministic (its logprobs). Here
one program per row makes the same operations in the same order: the exps and the first
halving in one pass over the row, the later halvings in place in a scratch row, a barrier
between them (each halving reads what other threads of the program wrote), then the odd rest.
The compiler's multiply-add fusion is off (``enable_fp_fusion=False``): a fused a * b + c
rounds once where the reference rounds twice. Rounding to the nearest integer (half to even,
as torch.round) is (y + 1.5 * 2^23) - 1.5 * 2^23, exact for |y| < 2^22.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from swiftkern.reference import _EXP_TAYLOR, _LN2_HI, _LN2_LO, _LOG2E

from .launch import _interpreter_plans, check_device, empty, require


def _f32(x: float) -> float:
    """x rounded to float32 (as torch rounds a Python scalar that meets a float32 tensor)."""
    return float(np.float32(x))


# globals a kernel reads must be constexpr
LOG2E, LN2_HI, LN2_LO = (tl.constexpr(_f32(c)) for c in (_LOG2E, _LN2_HI, _LN2_LO))
C0, C1, C2, C3, C4, C5, C6, C7 = (tl.constexpr(_f32(c)) for c in _EXP_TAYLOR)
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23


@triton.jit
def _bi_exp(x):
    """reference.bi_exp on a float32 block, operation for operation."""
    tiny = x < -87.0
    x = tl.where(x < -87.0, -87.0, tl.where(x > 88.0, 88.0, x))  # clamp; NaN stays NaN
    n = (x * LOG2E + ROUND) - ROUND
    r = (x - n * LN2_HI) - n * LN2_LO
    p = tl.full(r.shape, C0, tl.float32)
    p = p * r + C1
    p = p * r + C2
    p = p * r + C3
    p = p * r + C4
    p = p * r + C5
    p = p * r + C6
    p = p * r + C7
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2^n
    return tl.where(tiny, 0.0, p * scale)


@triton.jit
def _bi_exp_sum_kernel(
    x_ptr,  # float32 [rows, V] contiguous
    scratch_ptr,  # float32 [rows, P // 2]: the halvings, in place
    out_ptr,  # float32 [rows]
    V, P, LEVELS,  # P: V padded to a multiple of 64; LEVELS: halvings until P >> LEVELS is odd
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x = x_ptr + row * V
    half = P // 2
    s = scratch_ptr + row * half
    # the exps (zero past V) and the first halving: s[i] = e[i] + e[i + half]
    for start in range(0, half, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < half
        lo = tl.where(i < V, _bi_exp(tl.load(x + i, mask=inside & (i < V), other=0.0)), 0.0)
        hi = tl.where(i + half < V, _bi_exp(tl.load(x + i + half, mask=inside & (i + half < V), other=0.0)), 0.0)
        tl.store(s + i, lo + hi, mask=inside)
    for _ in range(1, LEVELS):
        tl.debug_barrier()  # the last halving's writes, by every thread, before this one reads them
        half = half // 2
        for start in range(0, half, BLOCK):
            i = start + tl.arange(0, BLOCK)
            inside = i < half
            a = tl.load(s + i, mask=inside, volatile=True)
            b = tl.load(s + i + half, mask=inside, volatile=True)
            tl.store(s + i, a + b, mask=inside)
    tl.debug_barrier()
    total = tl.load(s, volatile=True)
    for j in range(1, half):  # the odd rest, one column after another
        total = total + tl.load(s + j, volatile=True)
    tl.store(out_ptr + row, total)


def halvings(padded: int) -> int:
    """How many times a length of ``padded`` (a multiple of 64) halves before it is odd."""
    return (padded & -padded).bit_length() - 1


def bi_exp_sum(x: torch.Tensor) -> torch.Tensor:
    """x: float32 [..., V], V >= 1 -> float32 [..., 1], ``reference.bi_exp_sum``'s bits, each row
    by one program (its result depends on that row alone)."""
    op = "bi_exp_sum"
    check_device(op, x=x)
    require(x.dtype == torch.float32, op, f"x must be float32, got {x.dtype}")
    require(x.dim() >= 1 and x.shape[-1] >= 1, op, f"x must be [..., V] with V >= 1, got {tuple(x.shape)}")
    V = x.shape[-1]
    rows = x.numel() // V
    out = empty((*x.shape[:-1], 1), torch.float32, x.device)
    if rows == 0:
        return out
    x = x.reshape(rows, V).contiguous()
    P = -(-V // 64) * 64
    scratch = empty((rows, P // 2), torch.float32, x.device)  # poisoned in the tests: every read is written first
    block = min(triton.next_power_of_2(P // 2), 256 if _interpreter_plans() else 2048)
    _bi_exp_sum_kernel[(rows,)](x, scratch, out, V, P, halvings(P), BLOCK=block,
                                num_warps=8 if block >= 2048 else 4, enable_fp_fusion=False)
    return out


def bi_exp_sum_fake(x):
    return x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
