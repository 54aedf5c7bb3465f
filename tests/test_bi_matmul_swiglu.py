"""bi_matmul_swiglu: a layer's down projection with its SwiGLU made in the matmul's A-tile load
(triton_kernels/bi_matmul.py), against the two launches it replaces, silu_mul then bi_matmul:
bit for bit (interpreter on CPU, native on GPU), so the invariant decode and the deterministic
verifier, which both take it, keep each other's bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, poisoned

FEW = settings(max_examples=12 if DEVICE == "cuda" else 6, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow])


def kernels():
    import swiftkern.triton_kernels as tk
    from swiftkern.triton_kernels.bi_matmul import bi_matmul, bi_matmul_swiglu

    return tk.KERNELS["silu_mul"][0], bi_matmul, bi_matmul_swiglu


def halves(M, I, N, dtype, seed):
    """gate and up as the column halves of one [M, 2I] buffer (the grouped projection), and a
    down weight's transposed view [I, N]."""
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(M, 2 * I, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(N, I, generator=g).to(dtype).to(DEVICE)
    return both[:, :I], both[:, I:], w.t()


@FEW
@given(M=st.integers(1, 70), I=st.integers(1, 300), N=st.integers(1, 90),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_equals_silu_mul_then_bi_matmul_bitwise(M, I, N, dtype, seed):
    silu_mul, bi_matmul, fused = kernels()
    gate, up, w = halves(M, I, N, dtype, seed)
    with poisoned():
        got = fused(gate, up, w)
    assert got.shape == (M, N) and got.dtype == dtype
    assert torch.equal(got, bi_matmul(silu_mul(gate, up), w))


@pytest.mark.parametrize("M,I,N", [(1, 1, 1), (7, 130, 37), (33, 96, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_its_torch_twin(M, I, N, dtype):
    """reference.bi_matmul_swiglu (silu_mul, then the elementwise fixed-order bi_matmul): the
    same values to the matmul's tolerance (its sum runs in another order)."""
    from swiftkern import reference
    from triton_cases import TOLERANCES

    _, _, fused = kernels()
    gate, up, w = halves(M, I, N, dtype, M + I)
    got = fused(gate, up, w)
    atol, rtol = TOLERANCES["bi_matmul"][dtype]
    want = reference.bi_matmul_swiglu(gate, up, w)
    torch.testing.assert_close(got, want, atol=atol * I ** 0.5 * 4, rtol=rtol)  # |silu * up| reaches ~4x the entries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_shape_and_split_chunks(dtype):
    """SmolLM2's down projection (K = 1536: 12 chunks of 128 in the float32 plan), one decode
    row and a verify pass's 9: the chunked sum of the fused launch is the plain one's."""
    silu_mul, bi_matmul, fused = kernels()
    for M in (1, 9):
        gate, up, w = halves(M, 1536, 576, dtype, M)
        assert torch.equal(fused(gate, up, w), bi_matmul(silu_mul(gate, up), w))


def test_rows_do_not_depend_on_m_or_neighbours():
    _, _, fused = kernels()
    gate, up, w = halves(40, 130, 70, torch.float32, 3)
    full = fused(gate, up, w)
    for m in (1, 2, 17, 39):
        assert torch.equal(fused(gate[:m], up[:m], w), full[:m])
    assert torch.equal(fused(gate[5:6].clone(), up[5:6].clone(), w), full[5:6])  # alone, contiguous


def test_separate_tensors_with_other_strides_are_made_contiguous():
    """gate and up with different strides (not halves of one buffer): copied contiguous first,
    the same bits."""
    silu_mul, bi_matmul, fused = kernels()
    gate, _, w = halves(6, 33, 10, torch.float32, 4)
    up = torch.randn(33, 6, generator=torch.Generator().manual_seed(5)).to(DEVICE).t()  # column-major
    assert torch.equal(fused(gate, up, w), bi_matmul(silu_mul(gate.contiguous(), up.contiguous()), w))


def test_bad_input_is_refused_with_the_reason():
    _, _, fused = kernels()
    gate, up, w = halves(4, 8, 5, torch.float32, 6)
    with pytest.raises(SwiftkernError, match="bi_matmul_swiglu: gate and up must have one shape and dtype"):
        fused(gate, up[:, :7], w)
    with pytest.raises(SwiftkernError, match=r"bi_matmul_swiglu: a is \[M, K = 8\] but b is \[K = 5, N\]"):
        fused(gate, up, w.t())


def test_the_invariant_layers_and_the_verifier_take_it_with_the_same_bits():
    """The Triton invariant set (the runner's) and the fused verifier set bind it, and
    ``bi_silu_linear_triton`` (bias included) equals bi_linear of the Triton silu_mul."""
    from swiftkern import ops
    from swiftkern.batch_invariant import bi_linear, bi_silu_linear_triton
    from swiftkern.layer_kernels import LayerKernels
    from swiftkern.verifier_kernels import verifier_kernels

    silu_mul, _, _ = kernels()
    g = torch.Generator().manual_seed(7)
    both = torch.randn(2, 3, 2 * 40, generator=g).to(DEVICE)  # [B, T, 2I], as bi_linears leaves it
    gate, up = both[..., :40], both[..., 40:]
    w, b = torch.randn(24, 40, generator=g).to(DEVICE), torch.randn(24, generator=g).to(DEVICE)
    ops.set_backend("triton")
    try:
        got = bi_silu_linear_triton(gate, up, w, b)
        assert got.shape == (2, 3, 24) and torch.equal(got, bi_linear(silu_mul(gate, up), w, b))
        assert LayerKernels.for_device(torch.device(DEVICE).type, invariant=True).silu_linear is bi_silu_linear_triton
        assert verifier_kernels("fused", torch.device(DEVICE).type, torch.float32).silu_linear is bi_silu_linear_triton
    finally:
        ops.set_backend("auto")
    assert verifier_kernels("portable", "cpu", torch.float32).silu_linear is None


def test_a_forward_on_the_invariant_set_launches_it_once_a_layer(monkeypatch):
    """SkipModel's layer loop on the Triton invariant set takes the fused launch for every kept
    MLP (none for a skipped one), and its tokens are those of the two launches it replaced."""
    from conftest import tiny_model
    from swiftkern import Generator, SkipModel, ops
    import swiftkern.layer_kernels as layer_kernels
    import swiftkern.triton_kernels.bi_matmul as bm

    model = SkipModel(tiny_model("llama"))
    calls = []
    real = bm.bi_matmul_swiglu
    monkeypatch.setattr(bm, "bi_matmul_swiglu", lambda *a: calls.append(a[0].shape) or real(*a))
    ops.set_backend("triton")
    try:
        fused = Generator(model, mode="deterministic", replay="never").generate([[5, 6, 7, 8]], max_new_tokens=3,
                                                                               eos_token_id=[])
        assert len(calls) == 3 * model.num_layers  # the prefill and two decode steps
        layer_kernels._CACHE.clear()
        bind = layer_kernels._bind_invariant_triton
        monkeypatch.setattr(layer_kernels, "_bind_invariant_triton", lambda: dataclasses.replace(bind(), silu_linear=None))
        plain = Generator(model, mode="deterministic", replay="never").generate([[5, 6, 7, 8]], max_new_tokens=3,
                                                                               eos_token_id=[])
    finally:
        ops.set_backend("auto")
        layer_kernels._CACHE.clear()
    assert len(calls) == 3 * model.num_layers  # none more without it
    assert fused.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(fused.logprobs, plain.logprobs))


FUSION_PROBE = """
import re, torch
from swiftkern.triton_kernels.compile_check import recording, TARGETS
from swiftkern.triton_kernels.bi_matmul import bi_matmul, bi_matmul_swiglu
got = []
with recording(TARGETS[90], lambda fn, grid, compiled, kwargs: got.append(compiled)):
    a, b = torch.empty(8, 1536, device="meta"), torch.empty(1536, 576, device="meta")
    bi_matmul_swiglu(a, a, b)
    bi_matmul(a, b)
for compiled in got:
    ptx = compiled.asm["ptx"]
    if ".entry _bi_matmul_kernel" in ptx:
        split, source = 0, None  # subtractions in bi_matmul.py's own lines (tf32x3's split)
        for line in ptx.splitlines():
            loc = re.search(r"[.]loc[^/]*//[ ]*([^: ]+)", line)
            source = loc.group(1) if loc else source
            split += bool(re.match(r"[ \t]*sub[.a-z]*f32", line)) and source == "bi_matmul.py"
        print(len(re.findall(r"fma[.a-z]*f32", ptx)), split)
"""


def test_the_gpu_binary_rounds_the_product_before_the_tf32_split():
    """Compiled for sm_90a (no GPU needed), float32 in PLANS' plan. On an H200 (2026-12-04) the
    fused kernel's bits differed from silu_mul then bi_matmul in float32: multiply-add fusion
    turned tf32x3's split of the A tile (a - tf32(a)) into fma(act, up, -tf32(a)), a split of
    the unrounded product (16 fma, 16 of the 32 subtractions gone). The interpreter never fuses,
    so only the binary shows it: no fma, and as many subtractions in bi_matmul.py's lines as the
    plain kernel's. (Counted by the PTX's line info: Triton 3.7 writes SiLU's negation as a
    subtraction from 0, 16 more in silu_mul.py's lines, where 3.6 and 3.9 write none.)"""
    from test_triton_compile import run_outside_interpreter

    run = run_outside_interpreter("-c", FUSION_PROBE)
    assert run.returncode == 0, run.stderr[-3000:]
    (fma_swiglu, subs_swiglu), (fma_plain, subs_plain) = [tuple(map(int, line.split()))
                                                          for line in run.stdout.split("\n")[-3:-1]]
    assert fma_swiglu == 0 and fma_plain == 0
    assert subs_swiglu == subs_plain > 0
