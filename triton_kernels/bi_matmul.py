"""Batch-invariant matmul: c = a @ b with every row of c independent of M and of the other rows.

What makes a GPU matmul batch-variant is a launch configuration picked from the shape (tile
sizes, split-K, stream-K), which changes the order in which an output element's K products
are added. Here the tiles are constants (never derived from M, N or K), one program computes
a whole output tile walking K from 0 upwards in BLOCK_K steps, and accumulates in float32. So
row i of c is the same bits whether a has 1 row or 10 000.

A plan may split K into fixed chunks (``Plan.k_chunk``): each program then sums one chunk into a
float32 partial, and a second kernel adds the partials in chunk order. Unlike a split-K that a
library picks from the shape, the chunks are the plan's constant and K's alone, never M's, so a
row's sum is the same additions in the same order at every M: still batch-invariant, with K /
k_chunk times the programs at a verify pass's few rows (whose few output tiles leave most SMs idle).
With ``Plan.last_adds`` there is no second kernel: each program counts itself done on its output
tile's counter, and the tile's last program adds the partials, in the same order (the same bits),
then zeroes the counter for the next launch. A decode step of SmolLM2 on the invariant set makes
four chunked matmuls a layer, so that is 120 of its ~370 launches.

Each input dtype has one fixed plan (``PLANS``: tiles, warps, pipeline stages and, for float32,
the dot's precision). bf16/fp16 inputs use tensor-core dots with a float32 accumulator on a
GPU; float32 inputs the plan's ``input_precision``. One launch may multiply a by up to three
weights side by side (``bi_matmul_group``: a layer's q, k and v); an output element's sum does
not depend on its tile, so each column keeps the bits of its own ``bi_matmul``. Under
TRITON_INTERPRET=1 (no GPU) tl.dot is numpy's BLAS, which gives a row different bits at
different places in a tile, and bf16 arithmetic is not the GPU's: there the tiles are upcast to
float32 and multiplied by ``interpreter_dot``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from swiftkern.errors import SwiftkernError

from .interpreter_dot import interpreter_dot
from .launch import FP_FUSION, cdiv, check_device, check_float, empty, interpreting, require
from .registry import register
from .silu_mul import silu_times

SCHEMA = "(Tensor a, Tensor b) -> Tensor"
GROUP_SCHEMA = "(Tensor a, Tensor[] bs) -> Tensor"
SWIGLU_SCHEMA = "(Tensor gate, Tensor up, Tensor b) -> Tensor"


@dataclass(frozen=True)
class Plan:
    """One launch configuration, fixed per input dtype: the one property batch invariance rests
    on is that nothing here is ever chosen from M, N or K. ``precision``: tl.dot's
    input_precision for float32 inputs ("ieee": exact float32 products on CUDA cores;
    "tf32x3": three tensor-core TF32 dots of split operands, ~float32 accuracy); 16-bit inputs
    always take native tensor-core dots. ``k_chunk``: 0 = one program walks all of K; else a
    program sums k_chunk of K (a multiple of block_k) and a second launch adds the chunks' float32
    partials in order (the chunking follows K alone, so rows stay invariant). ``last_adds`` (with
    k_chunk): the tile's last program to finish adds the partials, in the same order, in place of
    that second launch (``_add_chunks_if_last``): the same bits in one launch."""
    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    precision: str = "ieee"
    k_chunk: int = 0
    last_adds: bool = False

    def __post_init__(self):
        if self.k_chunk % self.block_k or self.k_chunk < 0:
            raise ValueError(f"k_chunk {self.k_chunk} must be 0 or a multiple of block_k {self.block_k}")
        if self.last_adds and not self.k_chunk:
            raise ValueError("last_adds adds K's chunks: it needs a k_chunk")

    @property
    def name(self) -> str:
        split = f"-k{self.k_chunk}" if self.k_chunk else ""
        last = "-last" if self.last_adds else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}-w{self.warps}-s{self.stages}-{self.precision}{split}{last}"

    def chunks(self, K: int) -> int:
        """Programs along K (1 without a split): a function of K and the plan, never of M."""
        return cdiv(K, self.k_chunk) if self.k_chunk else 1


# float32: the plan sweep's fastest on an H100 (bench/results/bi_matmul-nvidia-h100-80gb-hbm3.csv,
# 437ed43): 0.38x cuBLAS's float32 time over SmolLM2 passes of 8, 32 and 128 rows (geometric
# mean), where 64x64x32 in ieee took 3.14x; tf32x3 keeps ~float32 accuracy on tensor cores
# bfloat16: the sweep's fastest on an H200 (bench/results/bi_matmul-nvidia-h200.csv, b7b0996):
# 0.78x cuBLAS's bf16 time over the same passes, where 64x64x32 without K chunks took 0.89x;
# float16 takes bf16's plan (the same tensor-core dot and tiles; not swept in float16)
PLANS = {torch.float32: Plan(16, 64, 32, precision="tf32x3", k_chunk=128),
         torch.bfloat16: Plan(64, 64, 32, k_chunk=128), torch.float16: Plan(64, 64, 32, k_chunk=128)}
# plans ``python -m bench --routine bi_matmul`` times beside PLANS on a GPU (its triton-<plan>
# rows), and tests/test_bi_matmul.py holds to row invariance: the ones a measurement may fix.
# (64x64x64 and 128x128x32 in tf32x3 spilled 476 and 436 bytes of registers on sm_80.)
CANDIDATES = (
    Plan(64, 64, 32), Plan(32, 32, 32), Plan(64, 64, 32, precision="tf32x3"),
    Plan(64, 32, 32, precision="tf32x3"), Plan(32, 64, 32, precision="tf32x3"),
    Plan(128, 64, 32, warps=8, precision="tf32x3"), Plan(64, 128, 32, warps=8, precision="tf32x3"),
    # K in fixed chunks: more programs at few rows (SmolLM2's K = 576 / 1536: 5 / 12 chunks of 128)
    Plan(64, 64, 32, k_chunk=128), Plan(64, 64, 32, precision="tf32x3", k_chunk=128),
    Plan(32, 64, 32, precision="tf32x3", k_chunk=128), Plan(64, 64, 32, precision="tf32x3", k_chunk=256),
    # tiles of 16 rows: a decode step of a few rows through the invariant set (replay never)
    Plan(16, 64, 32, k_chunk=128), Plan(16, 64, 32, precision="tf32x3", k_chunk=128),
    # K steps of 64 (fewer loop trips; bf16's dots are half the registers of float32's)
    Plan(16, 64, 64, k_chunk=128), Plan(16, 64, 64, precision="tf32x3", k_chunk=128),
    # PLANS' float32 and 16-bit plans with their chunks added by each tile's last program (the
    # same bits, one launch instead of two)
    Plan(16, 64, 32, precision="tf32x3", k_chunk=128, last_adds=True), Plan(64, 64, 32, k_chunk=128, last_adds=True),
    # the regular path's skinny_linear plan (triton_kernels/skinny_linear.py) with its chunks added
    # by the tiles' last programs (SWIFTKERN_SKINNY_PLAN)
    Plan(16, 64, 32, k_chunk=128, last_adds=True),
)


PLAN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan_from_env(plans: dict, candidates: tuple, value: str | None) -> dict:
    """``PLANS`` with plans replaced by the candidates SWIFTKERN_BI_MATMUL_PLAN (``value``) names,
    for measuring a plan in whole runs: comma-separated items, each a candidate's name (float32's
    plan, e.g. "64x64x32-w4-s3-tf32x3") or ``<dtype>:<name>`` (dtype float32, bfloat16 or
    float16; a 16-bit plan's precision is unused: its dots are native). The verifier's bits
    follow the plan: two runs compare bit for bit only under one setting."""
    if not value:
        return plans
    named = {plan.name: plan for plan in candidates}
    picked = dict(plans)
    for item in value.split(","):
        dtype_name, _, plan_name = item.strip().rpartition(":")
        dtype = PLAN_DTYPES.get(dtype_name or "float32")
        if dtype is None or plan_name not in named:
            raise SwiftkernError(
                f"SWIFTKERN_BI_MATMUL_PLAN={value!r}: {item.strip()!r} names no "
                + (f"dtype (one of {', '.join(PLAN_DTYPES)})" if dtype is None else "candidate plan")
                + f"; give [<dtype>:]<plan>, comma-separated, with a plan one of {', '.join(named)}, or unset it")
        picked[dtype] = named[plan_name]
    return picked


@functools.lru_cache(maxsize=None)
def plans_in_use() -> dict:
    """PLANS, or with SWIFTKERN_BI_MATMUL_PLAN's plans (read at the first matmul, so a bad name
    fails that call with its message rather than the import of every Triton kernel)."""
    return plan_from_env(PLANS, CANDIDATES, os.environ.get("SWIFTKERN_BI_MATMUL_PLAN", "").strip())


MAX_GROUP = 3  # weights one launch multiplies a by (q, k, v)


@triton.jit
def _group_member(pid_n, n0, n1, n2, p0, p1, p2, sk0, sk1, sk2, sn0, sn1, sn2, BLOCK_N: tl.constexpr):
    """Column tile pid_n of the group -> (weight pointer, its N, its strides, its first column
    in c, the tile's index within that weight); every weight's tiles start at its column 0."""
    t0 = tl.cdiv(n0, BLOCK_N)
    t1 = tl.cdiv(n1, BLOCK_N)
    if pid_n < t0:
        ptr, n, sk, sn, col, tile = p0, n0, sk0, sn0, 0, pid_n
    elif pid_n < t0 + t1:
        ptr, n, sk, sn, col, tile = p1, n1, sk1, sn1, n0, pid_n - t0
    else:
        ptr, n, sk, sn, col, tile = p2, n2, sk2, sn2, n0 + n1, pid_n - t0 - t1
    return ptr, n, sk, sn, col, tile


@triton.jit(do_not_specialize=["M"])  # one binary for every M (a row's bits must not depend on M)
def _bi_matmul_kernel(
    a_ptr,  # [M, K]; with SWIGLU the gate
    up_ptr,  # [M, K] with a's strides: with SWIGLU the up projection (else a again, unread)
    b0_ptr, b1_ptr, b2_ptr,  # [K, N0], [K, N1], [K, N2]: the group's weights (unused ones: N = 0)
    c_ptr,  # [M, N0 + N1 + N2], or float32 partials [chunks, CHUNK_STRIDE] when SPLIT
    sum_ptr,  # with LAST_ADDS: [M, N0 + N1 + N2], the output (else c again, unused)
    counters_ptr,  # with LAST_ADDS: int32 [>= output tiles], all 0 (and left so; else c, unused)
    M, N0, N1, N2, K, K_CHUNK, CHUNK_STRIDE,
    stride_am, stride_ak, stride_b0k, stride_b1k, stride_b2k, stride_b0n, stride_b1n, stride_b2n,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, SPLIT: tl.constexpr, SWIGLU: tl.constexpr,
    LAST_ADDS: tl.constexpr,
):
    b_ptr, N, stride_bk, stride_bn, col, tile = _group_member(
        tl.program_id(1), N0, N1, N2, b0_ptr, b1_ptr, b2_ptr, stride_b0k, stride_b1k, stride_b2k, stride_b0n,
        stride_b1n, stride_b2n, BLOCK_N)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT:  # this program's chunk of K, in order
        k_first = tl.program_id(2) * K_CHUNK
        k_end = tl.minimum(k_first + K_CHUNK, K)
    else:  # the whole K axis, in order, in this one program
        k_first = 0
        k_end = K
    for k0 in range(k_first, k_end, BLOCK_K):
        ks = k0 + offs_k
        a_offs = offs_m[:, None] * stride_am + ks[None, :] * stride_ak
        a_mask = (offs_m[:, None] < M) & (ks[None, :] < K)
        if SWIGLU:  # silu(gate) * up made here, with _silu_mul_kernel's own function
            g = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + a_offs, mask=a_mask, other=0.0).to(tl.float32)
            a = silu_times(g, u, a_ptr.dtype.element_ty)
        else:
            a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if INTERPRET:  # numpy's BLAS behind tl.dot is not row-invariant within a tile
            acc += interpreter_dot(a, b)
        elif UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc)
    c_offs = offs_m[:, None] * stride_cm + (col + offs_n[None, :]) * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    partials_ptr = c_ptr
    if SPLIT:  # partials[chunk, :M * (N0 + N1 + N2)] is this chunk's [M, N0 + N1 + N2], contiguous
        c_ptr += tl.program_id(2).to(tl.int64) * CHUNK_STRIDE
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    if LAST_ADDS:
        tile_id = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        _add_chunks_if_last(partials_ptr, sum_ptr, counters_ptr + tile_id, c_offs, c_mask, CHUNK_STRIDE)


@triton.jit
def _add_chunks_if_last(partials_ptr, out_ptr, counter_ptr, offs, mask, chunk_stride):
    """This program's partial is stored: count it on its tile's counter, and if it is the tile's
    last, out = partials[0] + partials[1] + ... in chunk order at ``offs`` (``_sum_chunks_kernel``'s
    additions, so its bits), then zero the counter for the next launch.

    Ordering: the barrier puts every thread's partial stores before the count, whose acq_rel
    atomic (one thread's, at GPU scope) releases them and, in the last program, acquires the
    other programs' (CUTLASS's semaphore: bar.sync, then one thread's release); the partials are
    read with .cg (from L2, never a stale L1 line). No program waits for another, so any grid
    runs, resident or not."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    chunks = tl.num_programs(2)
    if arrived == chunks - 1:
        total = tl.load(partials_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for chunk in range(1, chunks):
            total += tl.load(partials_ptr + chunk * chunk_stride.to(tl.int64) + offs, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["numel"])
def _sum_chunks_kernel(
    partials_ptr,  # [CHUNKS, chunk_stride] float32; chunk_stride: numel rounded up to BLOCK
    c_ptr,  # [numel]: c, contiguous
    numel, chunk_stride, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
):
    """c = partials[0] + partials[1] + ... in chunk order, per element (so per row: invariant).
    The partials are padded to whole blocks so their loads need no mask (16-byte loads)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = tl.load(partials_ptr + offs)
    for chunk in tl.static_range(1, CHUNKS):
        total += tl.load(partials_ptr + chunk * chunk_stride.to(tl.int64) + offs)
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=offs < numel)


SUM_BLOCK = 1024  # elements a program of _sum_chunks_kernel adds up

# per device: int32 zeros, one per output tile of a last_adds launch (each launch leaves its
# counters 0 again). A larger launch gets a larger buffer; the old ones are kept, because a CUDA
# graph captured with one goes on counting in it at every replay.
_COUNTERS: dict = {}
_RETIRED_COUNTERS: list = []
MIN_COUNTERS = 4096  # the first buffer's counters (SmolLM2's LM head at 32 rows: 1536 tiles)


def counters_key(device: torch.device) -> tuple[str, int]:
    """``_COUNTERS``' key for ``device`` ("cuda" and "cuda:0" are one device)."""
    return (device.type, device.index or 0)


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 [>= tiles] zeros on ``device``, for ``_add_chunks_if_last``. Launches on one stream
    (one after another) share them; two streams running last_adds matmuls at once would not."""
    key = counters_key(device)
    have = _COUNTERS.get(key)
    if have is not None and have.numel() >= tiles:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise SwiftkernError(f"bi_matmul: a last_adds launch of {tiles} output tiles met a CUDA graph capture with "
                             "counters for fewer; run the shape once outside the capture first (the graph runner does)")
    if have is not None:
        _RETIRED_COUNTERS.append(have)
    _COUNTERS[key] = torch.zeros(max(tiles, MIN_COUNTERS, 2 * (have.numel() if have is not None else 0)),
                                 dtype=torch.int32, device=device)
    return _COUNTERS[key]


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: [M, K], b: [K, N] (same float dtype and device, any strides) -> a @ b, [M, N] in a's
    dtype, accumulated in float32 in the dtype's fixed plan (``PLANS``)."""
    return launch(a, b, plans_in_use().get(a.dtype))


def bi_matmul_group(a: torch.Tensor, bs: list[torch.Tensor]) -> torch.Tensor:
    """a: [M, K]; bs: 1 to MAX_GROUP weights [K, N_i] of a's dtype and device (any strides)
    -> [M, sum N_i]: a @ bs[0], a @ bs[1], ... side by side, in one launch.
    Each column has the bits ``bi_matmul(a, bs[i])`` gives it (an output element's sum does not
    depend on its tile), so a layer's q, k and v (or gate and up) cost one launch, whose more
    tiles also fill more of the GPU at a verify pass's few rows."""
    return launch(a, bs, plans_in_use().get(a.dtype))


def bi_matmul_swiglu(gate: torch.Tensor, up: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gate, up: [M, K]; b: [K, N] -> silu_mul(gate, up) @ b, [M, N], in one launch (a layer's
    down projection with its SwiGLU in the A tile's load): the bits of
    ``bi_matmul(silu_mul(gate, up), b)`` with the Triton ``silu_mul``, without its launch and
    its [M, K] product in memory. gate and up may be the column halves of one buffer."""
    return launch(gate, b, plans_in_use().get(gate.dtype), up=up)


def launch(a: torch.Tensor, b: torch.Tensor | list[torch.Tensor], plan: Plan | None,
           up: torch.Tensor | None = None) -> torch.Tensor:
    """``bi_matmul`` (b a tensor), ``bi_matmul_group`` (b a list) or, given ``up``,
    ``bi_matmul_swiglu`` (a the gate) in a given plan (the bench's plan sweep calls this; the
    ops always run ``PLANS``). Rows are invariant within one plan; two plans give different bits."""
    op = "bi_matmul_swiglu" if up is not None else "bi_matmul" if torch.is_tensor(b) else "bi_matmul_group"
    bs = [b] if torch.is_tensor(b) else list(b)
    require(1 <= len(bs) <= (1 if up is not None else MAX_GROUP), op, f"takes 1 to {MAX_GROUP} weights, got {len(bs)}")
    named = {f"b{i}": x for i, x in enumerate(bs)} if len(bs) > 1 else {"b": bs[0]}
    check_device(op, a=a, **({"up": up} if up is not None else {}), **named)
    check_float(op, a=a, **named)
    require(a.dim() == 2 and all(x.dim() == 2 for x in bs), op, f"a must be [M, K] and b [K, N], got "
            f"{tuple(a.shape)} and {', '.join(str(tuple(x.shape)) for x in bs)}")
    if up is not None:
        require(up.shape == a.shape and up.dtype == a.dtype, op, f"gate and up must have one shape and dtype, got "
                f"{tuple(a.shape)} {a.dtype} and {tuple(up.shape)} {up.dtype}")
        if up.stride() != a.stride():  # the kernel reads both at the gate's strides
            a, up = a.contiguous(), up.contiguous()
    for name, x in named.items():
        require(a.shape[1] == x.shape[0], op, f"a is [M, K = {a.shape[1]}] but {name} is [K = {x.shape[0]}, N]")
        require(a.dtype == x.dtype, op, f"a and {name} must have one dtype, got {a.dtype} and {x.dtype}")
    M, K = a.shape
    widths = [x.shape[1] for x in bs] + [0] * (MAX_GROUP - len(bs))
    N = sum(widths)
    c = empty((M, N), a.dtype, a.device)
    if M and N:
        if K == 0:
            return c.zero_()
        ptrs = bs + [bs[0]] * (MAX_GROUP - len(bs))
        chunks, stride = plan.chunks(K), cdiv(M * N, SUM_BLOCK) * SUM_BLOCK
        out = empty((chunks, stride), torch.float32, a.device) if chunks > 1 else c  # partials, or c
        grid = (cdiv(M, plan.block_m), sum(cdiv(n, plan.block_n) for n in widths), chunks)
        last_adds = plan.last_adds and chunks > 1
        counters = tile_counters(a.device, grid[0] * grid[1]) if last_adds else c
        # No multiply-add fusion: with it, the SwiGLU product act * up was fused into tf32x3's
        # split (a - tf32(a)) on a GPU, which then split the product unrounded, and the bits
        # differed from silu_mul then bi_matmul (the interpreter never fuses)
        _bi_matmul_kernel[grid](a, up if up is not None else a, *ptrs, out, c, counters, M, *widths, K, plan.k_chunk,
                                stride,
                                a.stride(0), a.stride(1), *(x.stride(0) for x in ptrs),
                                *(x.stride(1) for x in ptrs), N, 1,
                                BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                                UPCAST=a.dtype == torch.float32, PRECISION=plan.precision,
                                INTERPRET=interpreting(), SPLIT=chunks > 1, SWIGLU=up is not None,
                                LAST_ADDS=last_adds, num_warps=plan.warps, num_stages=plan.stages,
                                enable_fp_fusion=False)
        if chunks > 1 and not last_adds:
            _sum_chunks_kernel[(stride // SUM_BLOCK,)](out, c, M * N, stride, CHUNKS=chunks, BLOCK=SUM_BLOCK,
                                                      enable_fp_fusion=FP_FUSION)
    return c


def bi_matmul_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def bi_matmul_group_fake(a, bs):
    return a.new_empty((a.shape[0], sum(b.shape[1] for b in bs)))


def bi_matmul_swiglu_fake(gate, up, b):
    return gate.new_empty((gate.shape[0], b.shape[1]))


register("bi_matmul", SCHEMA, bi_matmul, bi_matmul_fake)
register("bi_matmul_group", GROUP_SCHEMA, bi_matmul_group, bi_matmul_group_fake)
register("bi_matmul_swiglu", SWIGLU_SCHEMA, bi_matmul_swiglu, bi_matmul_swiglu_fake)
