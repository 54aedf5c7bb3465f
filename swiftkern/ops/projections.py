"""The projections: x @ weight.T from float32, bfloat16 or float16 weights (the C++
``skinny_linear`` on the CPU at decode and verification sizes) or from weights packed as 4/8-bit
codes (``packed_linear``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

from .. import reference
from ..cpu_id import cpu_flags, cpuinfo_field
from ..errors import SwiftkernError
from . import registry
from .backends import cpu_kernel, current_backend, run, triton_ops
from .checks import check_float_tensors, check_tensors, one_device


# rows up to which ops.linear runs the C++ kernel on the CPU: a SmolLM2 forward of 20 / 26 / 32
# tokens took 60 / 68 / 74 ms with it and 71 / 74 / 78 ms with MKL; for prefill-sized inputs MKL wins
# (an Intel Xeon with AVX-512; see mkl_lags_here for where it does not)
SKINNY_MAX_ROWS = 32
SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def cpu_vendor() -> str:
    """The x86 vendor id of this CPU ("GenuineIntel", "AuthenticAMD", ...), or "" where it
    cannot be read. Read once: ``mkl_lags_here`` asks twice a forward, and /proc/cpuinfo took
    ~20 us a read."""
    return cpuinfo_field("vendor_id")


def mkl_lags_here() -> bool:
    """Whether torch's float32 CPU matmul is slower than the C++ kernels at every size here, so
    they take every projection (``skinny_max_rows``, ``packed_max_rows``): torch's matmul comes
    from MKL, whose AVX-512 code runs on Intel CPUs alone (AVX2 elsewhere), while the C++ kernels
    run AVX-512 here (``cpu_matmul_isa``). On an AMD EPYC (2 threads) SmolLM2's projections at
    33-1040 rows ran at 153-227 GFLOP/s through MKL (AVX2's ceiling) and 323-447 through
    ``skinny_linear``; eight chat prompts of 96-164 tokens prefilled in 1.37-1.41 s padded
    through MKL and 0.67 s row by row through the C++ kernels. The same bits either way for a
    row (the C++ sum is fixed-order at any number of rows); HF's greedy tokens are tested."""
    return (packed_linear_fast() and cpu_matmul_isa() == "avx512" and torch.backends.mkl.is_available()
            and cpu_vendor() not in ("GenuineIntel", ""))


def cpu_matmul_isa() -> str:
    """The instruction set the C++ matmul kernels (``skinny_linear``, ``packed_linear``) run here:
    "avx512", "avx2" or "portable"; "" without the C++ extension. On an AVX2 CPU MKL runs AVX2
    code too, so ``mkl_lags_here`` holds on AVX-512 CPUs alone: on an AMD EPYC with AVX2 (2
    threads) SmolLM2's projections (6 layers, packed weights through the C++ lane panels built
    from the codes, ``csrc/lane_panel_gemm.h``, against MKL on the float32 weights) at 64 / 130 /
    512 / 2000 rows took 20-22 / 38-40 / 140-146 / 563-633 ms against 24-25 / 39-43 / 130-135 /
    484-535 (docs/speed.md, 2026-11-28): level up to ~130 rows, MKL faster past them."""
    isas = getattr(registry.extension, "skinny_linear_isas", None) if registry.extension is not None else None
    return isas()[0] if isas else ""


# inside ``prefill_projections``: a prefill's projections, which no later pass replays
_PREFILLING = contextvars.ContextVar("swiftkern_prefilling", default=False)
# rows up to which a bf16 prefill keeps the C++ kernel where torch's bf16 matmul is native
PREFILL_BF16_SKINNY_ROWS = 32


@contextlib.contextmanager
def prefill_projections():
    """Within this context the projections are a prefill's (``prefill.prefill`` sets it). No
    later pass replays a prefill's rows, so they need not take the fixed-order kernel that
    verify passes share with decode steps: where torch's bf16 matmul runs native instructions
    (``torch_bf16_matmul_native``) a bf16 prefill takes it past PREFILL_BF16_SKINNY_ROWS rows."""
    token = _PREFILLING.set(True)
    try:
        yield
    finally:
        _PREFILLING.reset(token)


def torch_bf16_matmul_native() -> bool:
    """Whether this CPU has AVX512-BF16 or AMX-BF16, which torch's bf16 matmul (oneDNN) runs
    on. On the AMD EPYC machine (AVX512-BF16) SmolLM2's projections at 33 / 128 / 1040 rows ran
    at 590-639 / 839-885 / 955-976 GFLOP/s through it and 364-382 / 408-419 / 422-423 through
    ``skinny_linear`` (at 1 and 8 rows the C++ kernel wins: 106-111 against 39-40, 303-330
    against 268-277)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def skinny_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which ops.linear runs the C++ skinny kernel on the CPU (-1: any number).
    float32: SKINNY_MAX_ROWS, or any where torch's matmul lags (``mkl_lags_here``). A bf16
    prefill where torch's bf16 matmul is native (``prefill_projections``): PREFILL_BF16_SKINNY_ROWS.
    Other bf16 / fp16: any, so a verify pass of any size gives the bits of
    the decode steps it replays (through torch's matmul, k + 1 rows of a bf16 model summed in
    another order than one, and self-spec's output drifted from ar's); it is also as fast: 1-1024
    rows of SmolLM2's projections at 150-217 GFLOP/s, torch's bf16 matmul 22-163 (this CPU has
    no AMX)."""
    if dtype == torch.float32:
        return -1 if mkl_lags_here() else SKINNY_MAX_ROWS
    if dtype == torch.bfloat16 and _PREFILLING.get() and torch_bf16_matmul_native():
        return PREFILL_BF16_SKINNY_ROWS
    return -1


# rows at which ops.linear on CUDA takes the Triton skinny_linear, float32 (torch's matmul
# elsewhere): SmolLM2's projections and LM head on an H100 (graph replays, the bi_matmul sweep at
# 437ed43, triton_kernels/skinny_linear.py's plan) took 1.40 / 1.98 / 5.80 ms a pass of 8 / 32 /
# 128 rows against cuBLAS's 4.50 / 2.05 / 2.66; one row is cuBLAS's gemv (a decode step at
# batch 1: 1.63 ms graphed, the Triton plan's tf32x3 twin 1.70)
CUDA_SKINNY_ROWS = (2, 32)


@functools.lru_cache(maxsize=None)
def cuda_skinny_rows() -> tuple[int, int]:
    """CUDA_SKINNY_ROWS, or SWIFTKERN_CUDA_SKINNY_ROWS=<lo>-<hi> (1 <= lo <= hi) in its place, for
    measuring other ranges in whole runs (e.g. 1-32: a batch-1 decode step's projections on the
    Triton kernel, grouped, instead of cuBLAS's gemv). Read at the first projection, so a bad
    value fails that call with its message."""
    value = os.environ.get("SWIFTKERN_CUDA_SKINNY_ROWS", "").strip()
    if not value:
        return CUDA_SKINNY_ROWS
    lo, _, hi = value.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        raise SwiftkernError(f"SWIFTKERN_CUDA_SKINNY_ROWS={value!r}: give <lo>-<hi> with 1 <= lo <= hi "
                             f"(e.g. 1-32), or unset it for {CUDA_SKINNY_ROWS[0]}-{CUDA_SKINNY_ROWS[1]}")
    return int(lo), int(hi)


def triton_skinny_here(device_type: str) -> bool:
    """Whether ops.linear may take the Triton ``skinny_linear`` on ``device_type`` tensors:
    CUDA, SWIFTKERN_BACKEND auto or triton, the kernel registered (Triton importable)."""
    return (device_type == "cuda" and current_backend() in ("auto", "triton")
            and "skinny_linear" in triton_ops(device_type))


def triton_skinny_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton skinny kernel takes x @ weight.T: float32 operands, rows in
    CUDA_SKINNY_ROWS (where it was measured faster than cuBLAS; ``cuda_skinny_rows``)."""
    lo, hi = cuda_skinny_rows()
    K = x.shape[-1]
    return x.dtype == weight.dtype == torch.float32 and K > 0 and lo * K <= x.numel() <= hi * K


def skinny_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the C++ skinny kernel takes x @ weight.T, once ``_cpu_kernel`` allows it:
    operands of one dtype (float32, bfloat16 or float16), at most skinny_max_rows(dtype) rows."""
    if x.dtype != weight.dtype or x.dtype not in SKINNY_DTYPES:
        return False
    limit = skinny_max_rows(x.dtype)
    return limit < 0 or x.numel() <= limit * x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, the projection every layer of the model runner uses.

    x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N]. On the CPU with x, weight (and
    bias) of one dtype, float32 (at most SKINNY_MAX_ROWS rows: decode, verification, drafting)
    or bfloat16 / float16 (any number), it runs the C++ ``skinny_linear`` kernel: one pass over the
    weight, each output a fixed-order fp32 dot product whatever the number of rows (so a row's
    result does not depend on the batch, and a verify pass gives the bits of the decode steps it
    replays), rounded once to the dtype. On CUDA, float32 with 2-32 rows (``CUDA_SKINNY_ROWS``,
    where cuBLAS is slowest) runs the Triton ``skinny_linear`` (exact float32 products, K in fixed
    chunks; SWIFTKERN_BACKEND auto or triton). Other cases, and SWIFTKERN_BACKEND=reference |
    triton | cuda on the CPU, use torch's matmul (``reference.skinny_linear``); they all agree to
    rounding (float32's, or one bf16 / fp16 rounding of the fp32 sum).
    ``backend_info()["kernels"]["skinny_linear"]`` says which kernel is built.
    """
    op = "linear"
    tensors = dict(x=x, weight=weight) if bias is None else dict(x=x, weight=weight, bias=bias)
    check_float_tensors(op, **tensors)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise SwiftkernError(f"{op}: x must be [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise SwiftkernError(f"{op}: bias must be [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if cpu_kernel("skinny_linear", x.device.type) and skinny_fits(x, weight):
        return torch.ops.swiftkern.skinny_linear(x, weight, bias)
    if triton_skinny_here(x.device.type) and triton_skinny_fits(x, weight):
        one_device(op, **tensors)
        return torch.ops.swiftkern_triton.skinny_linear(x, weight, bias)
    return reference.skinny_linear(x, weight, bias)


# rows up to which the runner reads packed weights (packed_weights.py) on the CPU: SmolLM2's
# projections at 1 / 8 / 16 / 32 rows took 7.8 / 14.8 / 22.3 / 39.2 ms packed and 21.0 / 28.1 /
# 40.2 / 54.8 ms from float32 (the same bits). Past 32 rows the float32 weights go to torch's
# matmul, which packed weights still beat up to 64: a whole SmolLM2 forward of 48 / 64 / 96 /
# 128 rows (batched verify passes) took 71 / 88-93 / 131-138 / 178-180 ms packed and 85 /
# 101-107 / 133-138 / 169-172 ms through MKL (two alternating runs). The invariant set reads
# them at any size (64 / 128 rows: 69.8 / 135.1 ms packed, 81.8 / 152.3 ms from float32).
PACKED_MAX_ROWS = 64


def packed_max_rows() -> int:
    """Rows up to which the regular (not invariant) kernel set reads packed weights on the CPU
    (-1: any number): PACKED_MAX_ROWS, or any where the C++ kernels take every projection
    (``mkl_lags_here``)."""
    return -1 if mkl_lags_here() else PACKED_MAX_ROWS


def packed_linear_fast() -> bool:
    """Whether the C++ ``packed_linear`` runs here and beats ``skinny_linear`` on the float32
    weight: the kernel built, allowed (SWIFTKERN_BACKEND auto or cpp) and vectorized (AVX2 or
    AVX-512): SmolLM2's projections at 1 / 8 rows took 8.4 / 26.6 ms packed and 25.4 / 41.6 ms
    from float32 on an AMD EPYC with AVX2 (2 threads), 7.8 / 14.8 and 21.0 / 28.1 on an AVX-512 Xeon."""
    return (cpu_kernel("packed_linear", "cpu") and hasattr(registry.extension, "packed_linear_fast")
            and bool(registry.extension.packed_linear_fast()))


def packed_kernels_here() -> str:
    """The kernels the C++ ``packed_linear`` runs here: "avx512-gather" (AVX-512 tiles that
    gather 16 blocks' float16 scales and offsets at once: Intel), "avx512" (each block converts
    its own: elsewhere, where the gather measured slower), "avx2" or "portable"; "" without the
    extension. Every one gives the same bits."""
    here = getattr(registry.extension, "packed_linear_here", None) if registry.extension is not None else None
    return here() if here else ""


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with the weight packed as integer codes (``packed_weights.pack``).

    x: float32 [..., K] on the CPU; packed: uint8 [N, K/32, 20 | 34]; bias: float32 [N] or None
    -> float32 [..., N]. The C++ kernel (CPU, auto/cpp) gives ``skinny_linear(x, unpack(packed),
    bias)``'s bits at any number of rows (the same fixed-order sum); without it, the
    reference unpacks and calls torch's matmul.
    """
    op = "packed_linear"
    check_tensors(op, x=x, packed=packed)
    if x.dtype != torch.float32 or packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] not in (20, 34):
        raise SwiftkernError(f"{op}: x must be float32 [..., K] and packed uint8 [N, K/32, 20 or 34] "
                             f"(packed_weights.pack), got {x.dtype} {tuple(x.shape)} and {packed.dtype} "
                             f"{tuple(packed.shape)}")
    if x.dim() < 1 or x.shape[-1] != packed.shape[1] * 32:
        raise SwiftkernError(f"{op}: x [..., K] must have K = 32 * packed.shape[1] = {packed.shape[1] * 32}, "
                             f"got {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (packed.shape[0],)):
        raise SwiftkernError(f"{op}: bias must be float32 [N = {packed.shape[0]}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
    device = one_device(op, x=x, packed=packed, **({} if bias is None else {"bias": bias}))
    if device.type != "cpu":
        raise SwiftkernError(f"{op}: packed weights run on the CPU, got {device}")
    return run(op, device, x, packed, bias)
