"""The CUDA kernels of swiftkern._C (torch.ops.swiftkern.<op>) against swiftkern/reference.py.

Every kernel test runs twice, through the ``kernels`` fixture: ``gpu`` (torch.ops.swiftkern on
CUDA tensors; skipped, with the reason, without a GPU or a CUDA build) and ``emulated`` (the
same wrappers of csrc/ops_cuda.cpp, launchers and kernels compiled by the host compiler against
tests/cuda_emu, a CPU emulation of CUDA's threads, barriers and warp shuffles; on every machine,
so CI runs the CUDA code without a GPU). The emulation checks what the kernels compute and how
they are launched, not races, the memory model or timing.

Acceptance ops must give the same tokens as the reference on the CPU (float64 sequential sums,
which the CUDA rejection_sample reproduces exactly, falling back to the serial chain when its
parallel sums cannot decide). Moves are bit-exact; fp32 rope is bit-exact; norms within the
shared tolerance table. Device-side index checks are exercised in a subprocess on a GPU (they
stop the kernel, which poisons the CUDA context) and in-process in the emulation.
``test_compute_sanitizer_memcheck`` runs this file's GPU tests once under compute-sanitizer's
memcheck when the tool is on PATH.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swiftkern import ops, reference
from cuda_emu.build import emulated_cuda_ops
from triton_cases import assert_close, rope_reference_rounded

HAS_GPU = torch.cuda.is_available()
BUILT_CUDA = ops.registry.extension is not None and bool(ops.registry.extension.build_info().get("cuda"))
UNDER_SANITIZER = os.environ.get("SWIFTKERN_UNDER_SANITIZER") == "1"
UNDER_ASAN = os.environ.get("SWIFTKERN_EMULATED_ASAN") == "1"  # test_emulated_kernels_under_address_sanitizer's run
NEEDS_GPU = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DRAWN = settings(max_examples=12 if UNDER_SANITIZER or UNDER_ASAN else 40, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CPU_KERNELS = torch.ops.swiftkern  # on CPU tensors: the C++ CPU kernels (or the reference)


@dataclasses.dataclass(frozen=True)
class Kernels:
    ops: object  # .greedy_accept, .rejection_sample, .kv_compact, .fused_add_rms_norm, .rope_kv_append
    device: str  # where their tensors live


@pytest.fixture(scope="module", params=["gpu", "emulated", "emulated-warps"])
def kernels(request):
    """gpu: the real kernels. emulated: the emulation's lockstep schedule (every thread to its
    next barrier, then the barriers open). emulated-warps: one warp at a time, the last first,
    each as far as it can go, so a warp rewrites shared memory before the others have read it
    wherever a __syncthreads is missing (SWIFTKERN_EMULATED_SCHEDULE=warps)."""
    if request.param == "gpu":
        if not HAS_GPU:
            pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
        if not BUILT_CUDA:
            pytest.skip("swiftkern._C was built without CUDA kernels (rebuild with a CUDA torch and nvcc: "
                        "pip install --no-build-isolation -e .)")
        yield Kernels(torch.ops.swiftkern, "cuda")
        return
    if UNDER_SANITIZER:
        pytest.skip("compute-sanitizer checks the GPU kernels only")
    schedule = "warps" if request.param == "emulated-warps" else "lockstep"
    with mock.patch.dict(os.environ, {"SWIFTKERN_EMULATED_SCHEDULE": schedule}):
        yield Kernels(emulated_cuda_ops(), "cpu")


@NEEDS_GPU
def test_gpu_machine_has_the_cuda_build():
    """On a GPU machine the extension must carry the CUDA kernels (unless built without on purpose)."""
    if os.environ.get("SWIFTKERN_BUILD_EXT") == "0":
        pytest.skip("SWIFTKERN_BUILD_EXT=0")
    assert BUILT_CUDA, f"swiftkern._C: {ops.backend_info()['extension']}, build {ops.backend_info()['build']}"
    info = ops.registry.extension.build_info()
    assert set(info["cuda_kernels"]) >= {"greedy_accept", "rejection_sample", "fused_add_rms_norm",
                                         "rope_kv_append", "kv_compact"}
    for op in info["cuda_kernels"]:
        assert "cuda" in ops.backend_info()["kernels"][op]["cuda"]


# ---------------------------------------------------------------- greedy_accept

def greedy_vocab_split(on: bool):
    """SWIFTKERN_CUDA_GREEDY_SPLIT (read by the launcher at each call): 1 (or unset, the default)
    splits the CUDA greedy_accept's vocabulary for few rows, 0 runs one block per position."""
    return mock.patch.dict(os.environ, {"SWIFTKERN_CUDA_GREEDY_SPLIT": "1" if on else "0"})


def drafts_on(dev, draft: torch.Tensor, in_tokens: bool) -> torch.Tensor:
    """draft int64 [B, K] on ``dev``: contiguous, or as a verify step passes it (columns 1.. of
    its [B, K+1] tokens, ``verify_step.verify_tokens``: row stride K+1)."""
    if not in_tokens:
        return draft.to(dev)
    tokens = torch.cat([torch.zeros(draft.shape[0], 1, dtype=draft.dtype), draft], 1).to(dev)  # [B, K+1]
    return tokens[:, 1:]


@DRAWN
@given(B=st.integers(0, 6), K=st.integers(0, 9), V=st.sampled_from([1, 3, 8, 33, 1001, 49152]),
       dtype=st.sampled_from(DTYPES), offset=st.integers(0, 7), split=st.booleans(), data=st.data())
def test_greedy_accept_matches_reference(kernels, B, K, V, dtype, offset, split, data):
    """Odd V and a storage offset put rows at every 16-byte misalignment (head, vectors, tail);
    ties, NaN, a row of -inf and signed zeros (-0.0 == 0.0: the lower index) follow torch.argmax;
    the drafts contiguous or strided as a verify step passes them."""
    dev = kernels.device
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    flat = torch.randn(offset + B * (K + 1) * V, generator=g)
    logits = flat[offset:].view(B, K + 1, V).to(dtype)
    special = data.draw(st.sampled_from(["none", "tie", "nan", "nans", "-inf", "signed-zero"]))
    if B and special == "tie":
        logits[..., V // 2] = logits[..., 0] = 50
    elif B and special == "signed-zero" and V > 2:  # -0.0 == 0.0: the lower index wins
        logits[0, 0] = -1
        logits[0, 0, 1], logits[0, 0, V - 1] = -0.0, 0.0
    elif B and special == "nan":
        logits[0, 0, V - 1] = float("nan")
    elif B and special == "nans" and V > 2:  # the first NaN wins, whatever the sign bits
        logits[0, 0, V // 2] = float("nan")
        logits[0, 0, V - 1] = -float("nan")
    elif B and special == "-inf":
        logits[0] = float("-inf")
    target = logits.float().argmax(-1)
    draft = target[:, :K].clone()
    for b in range(B):
        miss = data.draw(st.integers(0, K + 1))
        if miss < K:
            draft[b, miss] = (draft[b, miss] + 1) % V if V > 1 else 3
    num_draft = torch.tensor([data.draw(st.integers(0, K)) for _ in range(B)], dtype=torch.int32)
    cuda_logits = torch.empty(offset + logits.numel(), dtype=dtype, device=dev)[offset:].view_as(logits)
    cuda_logits.copy_(logits)  # keep the misalignment on the device
    with greedy_vocab_split(split):
        out, acc = kernels.ops.greedy_accept(drafts_on(dev, draft, data.draw(st.booleans())), cuda_logits,
                                             num_draft.to(dev))
    want, want_acc = reference.greedy_accept(draft, logits, num_draft)
    assert out.device.type == dev
    assert torch.equal(out.cpu(), want) and torch.equal(acc.cpu(), want_acc)


@pytest.mark.parametrize("B, V", [(1, 49152), (1, 128256), (2, 128256), (8, 128256), (3, 16392)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [True, False])
def test_greedy_accept_vocabulary_split(kernels, B, V, dtype, split):
    """Few rows, with the split on: each position's argmax is split over vocabulary chunks
    (greedy_vocab_chunks, 15 chunks at B = 1, V = 128256 on 132 SMs), each chunk's best an
    argmax_key in a scratch that the walk's block reduces (tests/test_argmax_key.py checks the key
    alone); off: one block a position.
    Equal maxima, NaNs and signed zeros sit far apart (first / middle / last chunk), so a
    combine that broke torch.argmax's rules across chunks picks another token."""
    dev = kernels.device
    K = 8
    g = torch.Generator().manual_seed(V + B)
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    logits[0, 0, 1] = logits[0, 0, V - 1] = logits[0, 0, V // 2] = 40  # ties: index 1
    logits[0, 1, V - 2] = -float("nan")
    logits[0, 1, V // 2 + 3] = float("nan")  # the first NaN: V // 2 + 3
    logits[0, 2] = -1
    logits[0, 2, 5], logits[0, 2, V - 5] = -0.0, 0.0  # -0.0 == 0.0: index 5
    logits[0, 3] = float("-inf")  # index 0
    logits[-1, 4, V - 1] = 60  # the last element of the last chunk
    target = logits.float().argmax(-1)  # [B, K+1]
    draft = target[:, :K].clone()
    draft[:, 6] = (draft[:, 6] + 1) % V  # every row rejects at 6
    num_draft = torch.full((B,), K, dtype=torch.int32)
    with greedy_vocab_split(split):
        out, acc = kernels.ops.greedy_accept(draft.to(dev), logits.to(dev), num_draft.to(dev))
    want, want_acc = reference.greedy_accept(draft, logits, num_draft)
    assert want_acc.tolist() == [6] * B and want[0, :4].tolist() == [1, V // 2 + 3, 5, 0]
    assert torch.equal(out.cpu(), want) and torch.equal(acc.cpu(), want_acc)


@pytest.mark.parametrize("B, V, split", [(1, 49152, True), (8, 128256, True), (300, 1000, True), (1, 49152, False)])
def test_greedy_accept_is_two_launches_and_no_memset(B, V, split):
    """A CUDA graph of greedy_accept holds two nodes, as the Triton version's: the argmax and the
    walk. With the vocabulary split the chunks' bests used to be atomicMax-ed into a zeroed
    output: a memset, a third node, and at B <= 8 the op trailed Triton's on an H200 (8.8
    against 5.0 us at B = 1, V = 49152). Counted by the emulation (kernel launches, memsets)."""
    emu = emulated_cuda_ops()
    K = 8
    logits = torch.randn(B, K + 1, V)
    draft = logits[:, :K].argmax(-1)
    with greedy_vocab_split(split):
        before = emu.stream_work()
        out, acc = emu.greedy_accept(draft, logits, torch.full((B,), K, dtype=torch.int32))
        kernels, memsets = (a - b for a, b in zip(emu.stream_work(), before))
    assert (kernels, memsets) == (2, 0)
    assert torch.equal(out, reference.greedy_accept(draft, logits, torch.full((B,), K, dtype=torch.int32))[0])


# ---------------------------------------------------------------- rejection_sample

def rejection_case(B, K, V, with_q, seed, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * sharp, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * sharp, -1) if with_q else None
    draft = torch.randint(0, V, (B, K), generator=g)
    return draft, q, p, torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)


def same_tokens_as_reference(kernels, draft, q, p, num_draft, ua, us, in_tokens: bool = False):
    args = (draft, q, p, num_draft, ua, us)
    on = [drafts_on(kernels.device, draft, in_tokens)] + [a.to(kernels.device) if a is not None else None
                                                          for a in args[1:]]
    out, acc = kernels.ops.rejection_sample(*on)
    want, want_acc = reference.rejection_sample(*args)
    assert torch.equal(out.cpu(), want) and torch.equal(acc.cpu(), want_acc)
    cpu_out, _ = CPU_KERNELS.rejection_sample(*args)  # the CPU kernel: the same chain of float64 sums
    assert torch.equal(out.cpu(), cpu_out)


@DRAWN
@given(B=st.integers(0, 5), K=st.integers(0, 6), V=st.sampled_from([1, 2, 7, 1025, 4099, 49152]),
       with_q=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_rejection_sample_matches_reference(kernels, B, K, V, with_q, seed, data):
    draft, q, p, ua, us = rejection_case(B, K, V, with_q, seed)
    if data.draw(st.booleans()) and B:
        p[0][torch.rand(K + 1, V) < 0.5] = 0.0  # exact zeros, unnormalized rows
    if with_q and B and K and data.draw(st.booleans()):
        q[0, 0] = p[0, 0]  # an all-zero residual: drawn from p
    num_draft = torch.tensor([data.draw(st.integers(0, K)) for _ in range(B)], dtype=torch.int32)
    same_tokens_as_reference(kernels, draft, q, p, num_draft, ua, us, in_tokens=data.draw(st.booleans()))


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sample_exact_boundaries_take_the_serial_path(kernels, with_q):
    """Dyadic weights put u * total exactly on a running sum: the parallel sums cannot decide
    (the margin test fails), and the serial chain must give the reference's token."""
    V, B = 4096, 8
    p = torch.zeros(B, 1, V)
    p[:, 0, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125])  # running sums 0.5, 0.75, 0.875, 1 exactly
    us = torch.tensor([0.0, 0.5, 0.75, 0.875, 0.25, 1 - 2**-24, 0.4999999, 0.6]).unsqueeze(1)
    q = torch.zeros(B, 0, V) if with_q else None
    same_tokens_as_reference(kernels, torch.empty(B, 0, dtype=torch.int64), q, p, torch.zeros(B, dtype=torch.int32),
                             torch.empty(B, 0), us)


def test_rejection_sample_negative_and_nan_weights_follow_the_cpu_kernel(kernels):
    """Not probabilities (negative, NaN): no defined sample, but the CUDA kernel's serial path
    gives the CPU kernel's token."""
    B, V = 4, 3000
    p = torch.rand(B, 1, V) - 0.3
    p[1, 0, 17] = float("nan")
    args = (torch.empty(B, 0, dtype=torch.int64), None, p, torch.zeros(B, dtype=torch.int32), torch.empty(B, 0),
            torch.rand(B, 1))
    out, acc = kernels.ops.rejection_sample(*(a.to(kernels.device) if a is not None else None for a in args))
    want, want_acc = CPU_KERNELS.rejection_sample(*args)
    assert torch.equal(out.cpu(), want) and torch.equal(acc.cpu(), want_acc)


def test_rejection_sample_large_batch_vocab_49152(kernels):
    draft, q, p, ua, us = rejection_case(64, 8, 49152, True, 7, sharp=6.0)
    same_tokens_as_reference(kernels, draft, q, p, torch.randint(0, 9, (64,), dtype=torch.int32), ua, us)


# ---------------------------------------------------------------- kv_compact

@DRAWN
@given(L=st.integers(1, 3), B=st.integers(1, 4), H=st.sampled_from([1, 3]), D=st.sampled_from([1, 3, 8, 64, 256]),
       M=st.sampled_from([0, 1, 5, 64]), dtype=st.sampled_from(DTYPES), data=st.data())
def test_kv_compact_matches_reference(kernels, L, B, H, D, M, dtype, data):
    """M x D x size above 48 KiB (M = 64, D = 256, fp32) takes the workspace path."""
    dev = kernels.device
    S = max(M, 1) + data.draw(st.integers(0, 10))
    src, dst, counts = [], [], []
    for _ in range(B):
        n = data.draw(st.integers(0, M))
        src.append([data.draw(st.integers(0, S - 1)) for _ in range(M)])
        dst.append(data.draw(st.integers(0, S - n) if n else st.integers(-3, S + 3)))  # n = 0: any start, a no-op
        counts.append(n)
    src = torch.tensor(src, dtype=torch.int64).reshape(B, M)
    dst, counts = torch.tensor(dst), torch.tensor(counts, dtype=torch.int32)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    k, v = (torch.randn(L, B, H, S, D, generator=g).to(dtype) for _ in range(2))
    want_k, want_v = k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts)
    ck, cv = k.to(dev), v.to(dev)
    if data.draw(st.booleans()):  # strides of a longer cache
        ck, cv = (torch.cat([t, t], dim=3)[:, :, :, :S] for t in (ck, cv))
    kernels.ops.kv_compact(ck, cv, src.to(dev), dst.to(dev), counts.to(dev))
    assert torch.equal(ck.cpu(), want_k) and torch.equal(cv.cpu(), want_v)


def test_kv_compact_with_no_columns_refuses_a_count(kernels):
    """M = 0: no kernel runs, so nothing checked counts on the device and a count of 2 moved
    nothing, silently (the CPU kernel and the reference refuse it)."""
    k = torch.zeros(1, 2, 1, 4, 2, device=kernels.device)
    src = torch.zeros(2, 0, dtype=torch.int64, device=kernels.device)
    dst, counts = torch.zeros(2, dtype=torch.int64, device=kernels.device), torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"counts\[1\] = 2|every counts\[b\] must be 0"):
        kernels.ops.kv_compact(k, k.clone(), src, dst, counts.to(kernels.device))
    kernels.ops.kv_compact(k, k.clone(), src, dst, torch.zeros(2, dtype=torch.int32, device=kernels.device))


@pytest.mark.parametrize("M", [16, 17])
def test_kv_compact_at_the_register_path_limit(kernels, M):
    """float32, D = 128 (32 copy units of 16 bytes an entry): M = 16 fills the register kernel
    (512 units, four a thread), M = 17 takes the staged one. Every row moves entries backwards
    over its own sources (src i -> start + i with src > start), the overlap that needs every
    read before any write."""
    L, B, H, S, D = 2, 3, 2, 40, 128
    g = torch.Generator().manual_seed(M)
    k, v = (torch.randn(L, B, H, S, D, generator=g) for _ in range(2))
    src = torch.stack([torch.arange(M) * 2 + 3 + b for b in range(B)])  # [B, M], sparse, past the starts
    dst, counts = torch.tensor([2, 4, 0]), torch.tensor([M, M - 1, M], dtype=torch.int32)
    want_k, want_v = k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts)
    ck, cv = k.to(kernels.device), v.to(kernels.device)
    kernels.ops.kv_compact(ck, cv, src.to(kernels.device), dst.to(kernels.device), counts.to(kernels.device))
    assert torch.equal(ck.cpu(), want_k) and torch.equal(cv.cpu(), want_v)


# ---------------------------------------------------------------- fused_add_rms_norm

@DRAWN
@given(rows=st.sampled_from([(0,), (1,), (3,), (2, 5)]),
       hidden=st.sampled_from([1, 7, 64, 576, 577, 4096, 8192, 20001, 40000, 65537]), dtype=st.sampled_from(DTYPES),
       eps=st.sampled_from([1e-6, 1e-5, 0.5]), seed=st.integers(0, 2**16))
def test_fused_add_rms_norm_matches_reference(kernels, rows, hidden, dtype, eps, seed):
    """576: 16-byte path; 577: scalar path; 20001: scalar read back (more than 16 values a thread);
    40000: 16-byte read back (more than 4 or 8 chunks a thread); 65537: scalar, past the old limit."""
    dev = kernels.device
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(*rows, hidden, generator=g).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    normed, new_res = kernels.ops.fused_add_rms_norm(x.to(dev), res.to(dev), w.to(dev), eps)
    want_normed, want_res = reference.fused_add_rms_norm(x, res, w, eps)
    assert torch.equal(new_res.cpu(), want_res)  # one rounding of the same sum
    assert_close("fused_add_rms_norm", normed.cpu(), want_normed)


def test_fused_add_rms_norm_strided_rows(kernels):
    dev = kernels.device
    x = torch.randn(6, 2 * 576, device=dev)
    res = torch.randn(6, 2 * 576, device=dev)
    w = torch.rand(576, device=dev) + 0.5
    normed, new_res = kernels.ops.fused_add_rms_norm(x[:, ::2], res[:, 576:], w, 1e-5)
    want = reference.fused_add_rms_norm(x[:, ::2], res[:, 576:], w, 1e-5)
    assert torch.equal(new_res, want[1])
    assert_close("fused_add_rms_norm", normed, want[0])


# ---------------------------------------------------------------- rope_kv_append

def rope_case(B, Hq, Hkv, T, D, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    positions = torch.stack([torch.randperm(S, generator=g)[:T] for _ in range(B)])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = positions.float().unsqueeze(-1) * inv
    ang = torch.cat([ang, ang], -1)
    cache = torch.full((2, B, Hkv, S, D), float("nan"), dtype=dtype)
    return q, k, v, ang.cos().to(dtype), ang.sin().to(dtype), cache, positions


@DRAWN
@given(B=st.integers(1, 4), heads=st.sampled_from([(9, 3), (32, 8), (2, 1)]), T=st.integers(1, 9),
       D=st.sampled_from([2, 6, 16, 64, 128]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 999))
def test_rope_kv_append_matches_reference(kernels, B, heads, T, D, dtype, seed):
    """D 2 and 6: scalar path; 16+: 16-byte path (fp32 D 16 too). The kernel computes in fp32 as
    torch does (each product rounded, then the sum) and rounds once to the dtype, so its output is
    the float32 reference on the same inputs, rounded: bit for bit in every dtype. (Against the
    reference run in bf16, seed 2, B 2, heads 32/8, T 6, D 64 was 0.03 off: see
    triton_cases.rope_reference_rounded.)"""
    dev = kernels.device
    S = T + 7
    q, k, v, cos, sin, cache, positions = rope_case(B, *heads, T, D, S, dtype, seed)
    want_q, want_cache = rope_reference_rounded(q, k, v, cos, sin, cache, positions)
    dev_cache = cache.to(dev)
    got_q = kernels.ops.rope_kv_append(q.to(dev), k.to(dev), v.to(dev), cos.to(dev), sin.to(dev), dev_cache[0],
                                       dev_cache[1], positions.to(dev))
    got_q, got_cache = got_q.cpu(), dev_cache.cpu()
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))  # unwritten slots stay NaN


# ---------------------------------------------------------------- opcheck, device checks, sanitizer

@NEEDS_GPU
@pytest.mark.skipif(not BUILT_CUDA, reason="swiftkern._C was built without CUDA kernels")
def test_opcheck_all_cuda_ops():
    cuda = torch.ops.swiftkern
    draft, q, p, ua, us = rejection_case(2, 3, 100, True, 1)
    nd = torch.tensor([3, 1], dtype=torch.int32)
    to = lambda *ts: tuple(t.to("cuda") if t is not None else None for t in ts)  # noqa: E731
    torch.library.opcheck(cuda.rejection_sample, to(draft, q, p, nd, ua, us))
    torch.library.opcheck(cuda.greedy_accept, to(draft, p, nd))
    k, v = torch.randn(2, 2, 3, 8, 16, device="cuda"), torch.randn(2, 2, 3, 8, 16, device="cuda")
    torch.library.opcheck(cuda.kv_compact, (k, v) + to(torch.tensor([[3, 4], [1, 0]]), torch.tensor([1, 0]),
                                                       torch.tensor([2, 1], dtype=torch.int32)))
    rq, rk, rv, cos, sin, cache, positions = rope_case(2, 4, 2, 2, 8, 6, torch.bfloat16, 3)
    cache = cache.to("cuda")
    torch.library.opcheck(cuda.rope_kv_append, to(rq, rk, rv, cos, sin) + (cache[0], cache[1]) + to(positions))
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(cuda.fused_add_rms_norm, (x, x.clone(), torch.ones_like(x[0]), 1e-5))


# (op, its arguments as an expression on device {dev}, what the kernel says): an index out of range
DEVICE_SIDE_CHECKS = [
    ("rope_kv_append", "*[torch.zeros(1, 1, 1, 8, device={dev})] * 3, *[torch.zeros(1, 1, 8, device={dev})] * 2, "
     "*torch.zeros(2, 1, 1, 4, 8, device={dev}), torch.tensor([[9]], device={dev})", "positions[0, 0] = 9 is outside"),
    ("kv_compact", "torch.zeros(1, 1, 1, 4, 2, device={dev}), torch.zeros(1, 1, 1, 4, 2, device={dev}), "
     "torch.tensor([[7]], device={dev}), torch.tensor([0], device={dev}), "
     "torch.tensor([1], dtype=torch.int32, device={dev})", "src_positions[0, 0] = 7 is outside"),
    ("greedy_accept", "torch.zeros(1, 2, dtype=torch.int64, device={dev}), torch.zeros(1, 3, 5, device={dev}), "
     "torch.tensor([4], dtype=torch.int32, device={dev})", "num_draft[0] = 4 is outside"),
]


@NEEDS_GPU
@pytest.mark.skipif(not BUILT_CUDA, reason="swiftkern._C was built without CUDA kernels")
@pytest.mark.skipif(UNDER_SANITIZER, reason="stops a kernel on purpose")
@pytest.mark.parametrize("op, args, message", DEVICE_SIDE_CHECKS)
def test_device_side_index_checks_stop_the_kernel(op, args, message):
    """The kernel prints what is wrong and traps; the host sees the launch failure at the sync.
    (CUDA documents no flush of device printf after a trap, so the failure alone also counts.)"""
    code = (f"import torch, swiftkern.ops\ntorch.ops.swiftkern.{op}({args.format(dev=repr('cuda'))})\n"
            "torch.cuda.synchronize()\nprint('no error')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "no error" not in run.stdout, text
    assert message in text or "unspecified launch failure" in text, text


@pytest.mark.skipif(UNDER_SANITIZER, reason="compute-sanitizer checks the GPU kernels only")
@pytest.mark.parametrize("op, args, message", DEVICE_SIDE_CHECKS)
def test_device_side_index_checks_stop_the_emulated_kernel(op, args, message, capfd):
    """In the emulation the trap ends the launch, which the wrapper reports as CUDA's launch
    failure, after the kernel's own message."""
    emulated = emulated_cuda_ops()
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        getattr(emulated, op)(*eval(f"({args.format(dev=repr('cpu'))},)"))
    assert message in capfd.readouterr().out


def _libasan() -> str | None:
    """The host compiler's AddressSanitizer runtime, or None."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        return None
    path = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(UNDER_SANITIZER or UNDER_ASAN, reason="already running under a sanitizer")
def test_emulated_kernels_under_address_sanitizer(tmp_path):
    """This file's emulated kernel tests (the lockstep schedule), with the emulation built with
    -fsanitize=address and libasan preloaded: no read or write outside the tensors, the CPU's
    stand-in for compute-sanitizer's memcheck. (The device-side check tests and the host-side
    refusals are left out: the C++ exception they end in trips ASan's preloaded interceptor; so
    is the vocabulary split at V = 128256, ~5 s a case under ASan: the split's code runs at
    V = 49152 and 16392 as well, with other chunk counts and tails.)"""
    libasan = _libasan()
    if libasan is None:
        pytest.skip("the host compiler has no libasan.so (c++ -print-file-name=libasan.so)")
    env = dict(os.environ, SWIFTKERN_EMULATED_ASAN="1", LD_PRELOAD=libasan,
               ASAN_OPTIONS=f"detect_leaks=0:log_path={tmp_path / 'asan'}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                          "-k", "emulated and not emulated-warps and not index_checks and not refuses and not 128256"],
                         capture_output=True, text=True, timeout=1200, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    reports = "".join(p.read_text() for p in tmp_path.glob("asan*"))
    assert "ERROR: AddressSanitizer" not in reports, reports[:6000]
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]


@NEEDS_GPU
@pytest.mark.skipif(UNDER_SANITIZER, reason="already running under compute-sanitizer")
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
def test_compute_sanitizer_memcheck():
    """This file's kernel tests under memcheck: no out-of-bounds or misaligned access."""
    env = dict(os.environ, SWIFTKERN_UNDER_SANITIZER="1")
    run = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "97",
                          sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                         capture_output=True, text=True, timeout=3000, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in run.stdout + run.stderr
