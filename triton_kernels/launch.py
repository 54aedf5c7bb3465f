"""Launch sizes of every Triton kernel, derived from tensor shapes in one place, plus the
shared input checks of the launchers.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (one program after another, in
numpy), so the plans here keep grids small there; on a GPU they aim at about two programs per
streaming multiprocessor for the reductions that would otherwise leave SMs idle.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import triton

from swiftkern.errors import SwiftkernError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Multiply-add fusion of every launch, chosen here rather than left to Triton's default (on through
# 3.9, announced to turn off in 3.10, which would change the kernels' bits and speed with the
# Triton installed). bi_exp_sum turns it off: its reference rounds a * b + c twice.
FP_FUSION = True
MAX_ROW_BLOCK = 65536  # widest row one program of a row kernel holds (norm, vocabulary block)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A GPU's launch plans where none runs: the SM count of the GPU stood for, or None. Set by
# ``gpu_launch_plans``: compile_check (which records launches on meta tensors instead of running
# them) and the tests that run a GPU's plans in the interpreter.
GPU_PLANS = {"sms": None}


@contextlib.contextmanager
def gpu_launch_plans(sms: int):
    """Inside this block the launchers plan as on a GPU with ``sms`` SMs, also under the
    interpreter (whose own plans are smaller, so its tests alone never run a GPU's), and accept
    meta tensors (compile_check records their launches without running them)."""
    before = GPU_PLANS["sms"]
    GPU_PLANS["sms"] = int(sms)
    try:
        yield
    finally:
        GPU_PLANS["sms"] = before


def _interpreter_plans() -> bool:
    """The interpreter's small plans: under TRITON_INTERPRET=1 outside ``gpu_launch_plans``."""
    return interpreting() and not GPU_PLANS["sms"]


@functools.lru_cache(maxsize=None)
def num_sms(device_type: str, index: int | None = 0) -> int:
    """Streaming multiprocessors of the GPU (2 under the interpreter, to keep grids small)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return 2


def _sms(device: torch.device) -> int:
    if GPU_PLANS["sms"]:
        return GPU_PLANS["sms"]
    return num_sms(device.type, device.index)


# ------------------------------------------------------------------------- outputs

_POISON = {"on": False}


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block every buffer the launchers allocate (outputs and scratch) starts
    filled with NaN (floats) or -7777 (integers) instead of whatever memory held, so a test
    sees any element a kernel forgot to write."""
    before = _POISON["on"]
    _POISON["on"] = True
    try:
        yield
    finally:
        _POISON["on"] = before


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, or a poisoned buffer inside ``poisoned_outputs()``."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _POISON["on"]:
        t.fill_(float("nan") if dtype.is_floating_point else -7777)
    return t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like (keeping a dense tensor's strides), poisoned like ``empty``."""
    out = torch.empty_like(t)
    if _POISON["on"]:
        out.fill_(float("nan") if t.dtype.is_floating_point else -7777)
    return out


# ------------------------------------------------------------------------- checks

def require(ok: bool, op: str, msg: str) -> None:
    """Raise SwiftkernError(f"{op}: {msg}") unless ok."""
    if not ok:
        raise SwiftkernError(f"{op}: {msg}")


def check_device(op: str, **tensors) -> torch.device:
    """All tensors on one device, and one Triton can run on (CUDA; the CPU under the
    interpreter) -> that device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    require(len(set(devices.values())) == 1, op, "all inputs must be on one device, got "
            + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    device = next(iter(devices.values()))
    if device.type == "meta" and GPU_PLANS["sms"]:
        return device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise SwiftkernError(f"{op}: the Triton kernels run on CUDA tensors (or on the CPU with "
                             f"TRITON_INTERPRET=1), got {device}; use the reference or cpp backend there")
    return device


def check_float(op: str, **tensors) -> None:
    for name, t in tensors.items():
        require(t.dtype in FLOAT_DTYPES, op, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


# ------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class RowPlan:
    """One program per row of ``width`` elements, held in one block."""
    block: int
    num_warps: int


def row_plan(op: str, width: int) -> RowPlan:
    block = next_pow2(width)
    require(block <= MAX_ROW_BLOCK, op, f"rows of {width} elements are wider than the {MAX_ROW_BLOCK} "
            "one Triton program holds; use the reference backend")
    return RowPlan(block, min(16, max(1, block // 256)))


@dataclass(frozen=True)
class ElementwisePlan:
    block: int
    grid: int
    num_warps: int


def elementwise_plan(numel: int) -> ElementwisePlan:
    block = max(16, min(4096, next_pow2(numel))) if _interpreter_plans() else 1024
    return ElementwisePlan(block, max(1, cdiv(numel, block)), 4)


@dataclass(frozen=True)
class VocabPlan:
    """A reduction over V split into ``splits`` chunks of ``chunk`` (a multiple of ``block``)."""
    block: int
    chunk: int
    splits: int
    num_warps: int


VOCAB_PROGRAMS_PER_SM = 2  # the programs per SM vocab_plan aims at (bench: a sweep of others)


def vocab_plan(rows: int, vocab: int, device: torch.device, splits: int | None = None,
               programs_per_sm: int = VOCAB_PROGRAMS_PER_SM) -> VocabPlan:
    """Split each of ``rows`` vocabulary reductions so that rows * splits fills the GPU
    (about ``programs_per_sm`` programs per SM), each chunk at least 4 blocks long."""
    block = min(next_pow2(vocab), 8192 if _interpreter_plans() else 1024)
    blocks = cdiv(vocab, block)
    if splits is None:
        want = max(1, cdiv(programs_per_sm * _sms(device), max(rows, 1)))
        splits = min(want, max(1, blocks // 4))
    splits = max(1, min(int(splits), blocks))
    chunk = cdiv(blocks, splits) * block
    return VocabPlan(block, chunk, cdiv(vocab, chunk), 4)


@dataclass(frozen=True)
class AcceptancePlan:
    """greedy_accept and rejection_sample: the vocabulary reductions' plan, then the tiles of
    the one program a row that accepts the drafts (and draws the last token) from their results."""
    vocab: VocabPlan
    block_k: int  # the K drafts (rejection_sample), at least 2
    block_k1: int  # the K + 1 verified tokens
    block_s: int  # the vocabulary splits the combine holds, at least 2


def acceptance_plan(rows: int, drafts: int, vocab: int, device: torch.device,
                    splits: int | None = None) -> AcceptancePlan:
    """``rows`` vocabulary reductions (greedy_accept: one a token, B * (K + 1); rejection_sample:
    one a row, B) of ``vocab`` entries, ``drafts`` = K a row; ``splits`` forces the split (tests)."""
    plan = vocab_plan(rows, vocab, device, splits)
    return AcceptancePlan(plan, max(2, next_pow2(drafts)), next_pow2(drafts + 1), max(2, next_pow2(plan.splits)))


@dataclass(frozen=True)
class AttentionPlan:
    """verify_attention: programs over (row x kv head, query block, key split), then one
    combine program per query row when there are several splits."""
    block_m: int  # query rows per program (query heads of one kv head x new tokens)
    block_n: int  # keys per inner step
    block_d: int
    m_blocks: int
    splits: int
    chunk: int  # keys per split, a multiple of block_n
    num_warps: int
    num_stages: int
    block_s: int  # splits one combine program holds (a power of two >= 2)
    combine_warps: int


INVARIANT_BLOCK_M = 16  # query rows per program of the invariant plan, whatever the shapes


def attention_plan(batch: int, kv_heads: int, group: int, q_len: int, max_keys: int, head_dim: int,
                   device: torch.device, splits: int | None = None, invariant: bool = False,
                   fp32: bool = False) -> AttentionPlan:
    """Queries of one kv head are ``group * q_len`` rows (token-major), tiled by up to 64;
    keys up to ``max_keys`` are split so that all programs together fill the GPU, each split at
    least two key blocks long. ``splits`` forces a split count (tests).

    ``fp32``: float32 inputs on a GPU (IEEE float32 dots, whose operands take twice the
    registers of bf16 ones): 16 query rows x 32 keys on 8 warps, the one tile of seven tried
    that stays within ``compile_check``'s spill limit on sm_80 and sm_90a at head dims 64 and 128
    (32- and 64-row float32 tiles spilled there). The interpreter's own plans keep the larger
    tiles, so its tests still cover them.

    ``invariant``: one plan whatever the batch, q_len and key count (query tiles of
    INVARIANT_BLOCK_M rows, one split, fixed warps; the key block follows the head dim alone),
    so a query runs the same operations in the same order in any call."""
    rows = group * q_len
    block_m = INVARIANT_BLOCK_M if invariant else max(16, min(64, next_pow2(rows)))
    block_d = max(16, next_pow2(head_dim))
    block_n = 64 if block_d <= 64 else 32
    num_warps = 4 if invariant or block_m * block_d <= 4096 else 8
    if _interpreter_plans():
        block_n = 32
    elif fp32 and not invariant:
        block_m, block_n, num_warps = 16, 32, 8
    m_blocks = cdiv(rows, block_m)
    key_blocks = max(1, cdiv(max_keys, block_n))
    if invariant:
        splits = 1
    elif splits is None:
        want = cdiv(2 * _sms(device), batch * kv_heads * m_blocks)
        splits = min(want, max(1, key_blocks // 2))
    splits = max(1, min(int(splits), key_blocks))
    chunk = cdiv(key_blocks, splits) * block_n
    splits = cdiv(max(max_keys, 1), chunk)
    block_s = max(2, next_pow2(splits))
    # one warp per 2048 partial values a combine program holds, up to 4 (fewer spill: compile_check)
    combine_warps = min(4, max(1, block_s * block_d // 2048))
    return AttentionPlan(block_m, block_n, block_d, m_blocks, splits, chunk, num_warps, 2, block_s, combine_warps)


@dataclass(frozen=True)
class CompactPlan:
    block_m: int
    block_d: int
    d_blocks: int
    num_warps: int
    m_blocks: int = 1  # tiles of entries a row: past 1, staged through a workspace in two launches

    @property
    def staged(self) -> bool:
        return self.m_blocks > 1


MAX_COMPACT_TILE = 16384  # entries x head-dim elements one kv_compact program holds at once
MAX_COMPACT_ENTRIES = 8192  # entries of a row one program moves (16384 spilled: one head-dim element a program)
COMPACT_TILE_PER_THREAD = 64  # tile elements a thread holds, keys and values each (at 128: 4 KB spilled a thread)
MAX_GRID_Y_Z = 65535  # CUDA's limit on a grid's axes 1 and 2
STAGED_COMPACT_ENTRIES = 64  # entries of a row one program of the staged path copies
STAGED_COMPACT_HEAD_DIM = 128  # head-dim elements one program of the staged path copies, at most


def compact_plan(op: str, max_entries: int, head_dim: int) -> CompactPlan:
    """Up to ``MAX_COMPACT_ENTRIES`` entries a row, one launch: one program holds all kept entries
    of one (layer, row, head) for a slice of the head dimension, so it reads every source before
    it writes any destination. Past that, staged (``plan.staged``): one launch copies every kept
    entry into a workspace and a second from it into place, so no program holds a whole row (as
    the CUDA kernel's workspace path), in tiles of ``STAGED_COMPACT_ENTRIES`` entries by a slice
    of the head dimension. Either way the warps grow with the tile so that a thread holds at most
    ``COMPACT_TILE_PER_THREAD`` elements of each."""
    if next_pow2(max_entries) <= MAX_COMPACT_ENTRIES:
        block_m = next_pow2(max_entries)
        block_d = max(1, min(next_pow2(head_dim), MAX_COMPACT_TILE // block_m))
        return CompactPlan(block_m, block_d, cdiv(head_dim, block_d), compact_warps(block_m, block_d))
    block_m = STAGED_COMPACT_ENTRIES
    block_d = min(next_pow2(head_dim), STAGED_COMPACT_HEAD_DIM)
    m_blocks = cdiv(max_entries, block_m)
    require(m_blocks <= MAX_GRID_Y_Z, op, f"{max_entries} entries per row is more than the "
            f"{MAX_GRID_Y_Z * block_m} one call moves; compact in several calls")
    return CompactPlan(block_m, block_d, cdiv(head_dim, block_d), compact_warps(block_m, block_d), m_blocks)


def compact_warps(block_m: int, block_d: int) -> int:
    """Warps for a kv_compact tile: a thread holds at most COMPACT_TILE_PER_THREAD elements of it."""
    return max(4, block_m * block_d // (32 * COMPACT_TILE_PER_THREAD))
