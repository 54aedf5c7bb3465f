"""The deterministic verifier's batch-invariant ops: exp, the softmax denominator and the
matmul, each giving a row the same bits whatever the rows and sizes around it."""

from __future__ import annotations

import torch

from .. import reference
from ..errors import SwiftkernError
from .backends import cpu_kernel, current_backend, resolve, run, triton_ops
from .checks import check_float, check_tensors


def bi_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for the deterministic verifier, the same bits for an element whatever the tensor
    around it (size, offset, SIMD body or tail, threads). x: float tensor [...] -> float32 [...].

    One definition, ``reference.bi_exp`` (range reduction + degree-7 Taylor polynomial, single
    IEEE operations; within 2 ulps of exp, 0 below -87); the C++ kernel (CPU, auto/cpp) does
    the same operations in the same order and gives the same bits (tested).
    """
    op = "bi_exp"
    check_tensors(op, x=x)
    if not x.is_floating_point():
        raise SwiftkernError(f"{op}: x must be a float tensor, got {x.dtype}")
    x = x.to(torch.float32)
    if cpu_kernel(op, x.device.type):
        return torch.ops.swiftkern.bi_exp(x)
    return reference.bi_exp(x)


def _float32_rows(op: str, x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows [..., V], V >= 1, or a SwiftkernError that says what is wrong."""
    check_tensors(op, x=x)
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] < 1:
        raise SwiftkernError(f"{op}: x must be a float tensor [..., V] with V >= 1, got {x.dtype} "
                             f"{tuple(x.shape)}")
    return x.to(torch.float32)


def bi_exp_sum(x: torch.Tensor) -> torch.Tensor:
    """sum(exp(x)) along the last axis for the deterministic verifier's softmax: the same bits
    for a row whatever the rows around it. x: float tensor [..., V], V >= 1 -> float32 [..., 1].

    One definition, ``reference.bi_exp_sum``: ``bi_exp`` of every element, then ``tree_sum``
    (zero-padded to a multiple of 64, halved by elementwise adds, the rest added in order); the
    C++ kernel (CPU, auto/cpp) makes the same additions and gives the same bits (tested) in one
    pass, without the torch ops of every halving (SmolLM2's vocabulary: ~120 -> ~20 us a row);
    so does the Triton kernel (CUDA, auto/triton; the CPU under TRITON_INTERPRET=1 with
    backend triton) in one launch where the torch ops take 44 at SmolLM2's vocabulary and 536
    at Llama-3's (each a few microseconds on a GPU). Other backends take the reference.
    """
    op = "bi_exp_sum"
    x = _float32_rows(op, x)
    device = x.device.type
    if cpu_kernel(op, device):
        return torch.ops.swiftkern.bi_exp_sum(x)
    wants_triton = current_backend() == "triton" or (device == "cuda" and current_backend() == "auto")
    if wants_triton and op in triton_ops(device):
        return torch.ops.swiftkern_triton.bi_exp_sum(x)
    return reference.bi_exp_sum(x)


def bi_max_exp_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic verifier's softmax shift and denominator of each row: (top, sum) with
    top = x.amax(-1) and sum = ``bi_exp_sum(x - top)``, the same bits for a row whatever the rows
    around it. x: float tensor [..., V], V >= 1 -> (float32 [..., 1], float32 [..., 1]).

    One definition, ``reference.bi_max_exp_sum``. The C++ kernel (CPU, auto/cpp) gives its bits
    in one call without the [..., V] difference, and spreads even a single row over the threads:
    the logprob of a decode step's token, which the torch max, subtraction and ``bi_exp_sum``
    took in three calls. Elsewhere the max and the subtraction are torch ops and the sum is
    ``bi_exp_sum`` (the Triton kernel on CUDA).
    """
    op = "bi_max_exp_sum"
    x = _float32_rows(op, x)
    if cpu_kernel(op, x.device.type):
        return torch.ops.swiftkern.bi_max_exp_sum(x)
    return max_then_exp_sum(x)


def max_then_exp_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bi_max_exp_sum`` in three calls: torch max, torch subtraction, ``bi_exp_sum`` (the
    Triton kernel on CUDA, the C++ one on the CPU). x: float32 [..., V] -> (float32 [..., 1],
    float32 [..., 1])"""
    top = x.amax(dim=-1, keepdim=True)
    return top, bi_exp_sum(x - top)


def bi_matmul_checks(a, b, op: str) -> None:
    """Refuse what no bi_matmul can multiply, saying why."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2:
        raise SwiftkernError(f"{op}: a must be a tensor [M, K] and b a tensor [K, N]")
    check_float(op, a=a, b=b)
    if a.shape[1] != b.shape[0] or a.dtype != b.dtype or a.device != b.device:
        raise SwiftkernError(f"{op}: a {tuple(a.shape)} {a.dtype} on {a.device} and b {tuple(b.shape)} {b.dtype} "
                             f"on {b.device} must share K, dtype and device")


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batch-invariant matmul for the deterministic verifier: a @ b with each row of the result
    independent of M and of the other rows (same bits for a row alone or in any batch).

    a: [M, K], b: [K, N] (one float dtype and device, any strides) -> [M, N] in a's dtype,
    accumulated in float32. CUDA (auto): the Triton kernel ``triton_kernels/bi_matmul.py`` (fixed
    tiles, no split-K); CPU (auto, cpp): the C++ ``skinny_linear`` kernel, whose every output is
    a dot product in an order fixed by K alone; CPU without it: ``reference.bi_matmul`` (the
    same order from elementwise torch ops, slow); SWIFTKERN_BACKEND=triton also runs the
    Triton kernel on CPU tensors under TRITON_INTERPRET=1.
    """
    bi_matmul_checks(a, b, "bi_matmul")
    return _bi_matmul(a, b)


def _bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``bi_matmul`` on checked inputs."""
    if cpu_kernel("skinny_linear", a.device.type):
        # b.t(): [N, K], no copy for b = weight.t(); bf16 / fp16 are summed in fp32 and rounded once
        return torch.ops.swiftkern.skinny_linear(a, b.t(), None)
    return run("bi_matmul", a.device, a, b)


def group_in_one_launch(device_type: str) -> bool:
    """True where ``bi_matmul`` runs the Triton kernel (CUDA, or SWIFTKERN_BACKEND=triton under
    the interpreter), which multiplies a group of weights in one launch; elsewhere
    ``bi_matmul_group`` is ``bi_matmul`` per weight. Raises SwiftkernError where a forced
    backend cannot run ``bi_matmul`` (as ``bi_matmul`` itself would)."""
    return not cpu_kernel("skinny_linear", device_type) and resolve("bi_matmul", device_type) == "triton"


def bi_matmul_group(a: torch.Tensor, bs: list[torch.Tensor]) -> torch.Tensor:
    """``bi_matmul(a, b)`` for each b of ``bs`` side by side, with each column's bits as in
    its own ``bi_matmul``: a layer's q, k and v projections (or gate and up) as one op.

    a: [M, K]; bs: 1 to 3 weights [K, N_i] (a's dtype and device, any strides) -> [M, sum N_i]
    in a's dtype. Where ``bi_matmul`` runs the Triton kernel (``group_in_one_launch``): one
    launch (``triton_kernels/bi_matmul.py``), whose extra tiles also fill more of the GPU at a
    verify pass's few rows; elsewhere ``bi_matmul`` per weight, concatenated.
    """
    op = "bi_matmul_group"
    if not isinstance(a, torch.Tensor) or not isinstance(bs, (list, tuple)) or not 1 <= len(bs) <= 3 or not all(
            isinstance(b, torch.Tensor) for b in bs):
        raise SwiftkernError(f"{op}: a must be a tensor [M, K] and bs a list of 1 to 3 tensors [K, N_i]")
    for b in bs:
        bi_matmul_checks(a, b, op)
    if not group_in_one_launch(a.device.type):
        return torch.cat([_bi_matmul(a, b) for b in bs], dim=1)
    return torch.ops.swiftkern_triton.bi_matmul_group(a, list(bs))
