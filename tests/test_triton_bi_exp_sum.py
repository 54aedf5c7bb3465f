"""Triton bi_exp_sum against reference.bi_exp_sum, bit for bit (interpreter on CPU, native on
GPU): the deterministic verifier's softmax denominator has one definition on every backend."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, FEW, backend, opcheck, poisoned, triton_op

# V: one element, around the 64-padding, SmolLM2's and Llama-3's vocabularies (odd rests of
# 3 and 501 columns after the halvings), a power of two (rest 1), odd sizes
VOCABS = [1, 2, 63, 64, 65, 301, 1000, 1024, 4099, 49152, 128256]


def logits(shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    flat = x.view(-1, shape[-1])
    specials = torch.tensor([float("-inf"), -1e4, -87.5, -87.0, -86.9, 0.0, 87.9, 88.0, 90.0, float("inf")])
    n = min(shape[-1], specials.numel())
    flat[0, :n] = specials[:n]  # clamps, flush to zero and saturation in the first row
    return x.to(DEVICE)


@FEW
@given(vocab=st.sampled_from(VOCABS), lead=st.sampled_from([(1,), (3,), (2, 5)]),
       scale=st.sampled_from([0.5, 8.0, 40.0]), seed=st.integers(0, 2**16))
def test_equals_the_reference_bitwise(vocab, lead, scale, seed):
    x = logits((*lead, vocab), scale, seed)
    with poisoned():
        got = triton_op("bi_exp_sum")(x)
    want = reference.bi_exp_sum(x)
    assert got.shape == (*lead, 1) and got.dtype == torch.float32
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("vocab", [65, 301, 1000, 4099])
def test_the_padding_past_v_adds_nothing(vocab):
    """V in [P / 2, P) (P: V padded to a multiple of 64): the first halving's upper half reaches
    past V, where the kernel must add 0, not exp of its masked load (exp(0) = 1). Logits near -30
    (sums ~V * 1e-13) make one stray 1 visible in every row, which the drawn cases above may not
    (a row with exp(88) in it hides it)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, vocab, generator=g) * 0.5 - 30.0).to(DEVICE)
    with poisoned():
        got = triton_op("bi_exp_sum")(x)
    want = reference.bi_exp_sum(x)
    assert float(want.max()) < 1e-6 and torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_a_row_alone_has_the_bits_it_has_among_others(vocab):
    """128256 = 2^8 x 501: after 8 halvings, 501 columns of the odd rest (one scalar load each: 8
    rows here take ~20 s in the interpreter)."""
    x = logits((4, vocab), 10.0, vocab)
    together = triton_op("bi_exp_sum")(x)
    for i in (0, 3):
        assert torch.equal(triton_op("bi_exp_sum")(x[i:i + 1].clone()), together[i:i + 1])
    assert torch.equal(triton_op("bi_exp_sum")(x[1:3]), together[1:3])  # a slice at an offset


def test_ops_wrapper_takes_the_kernel_under_backend_triton(monkeypatch):
    """ops.bi_exp_sum (the logprobs' denominator: bi_token_logprob) runs the Triton op under
    backend triton (and auto on CUDA), converts other float dtypes to float32 first, and gives
    the reference's bits either way."""
    import swiftkern.triton_kernels as tk

    calls = []
    real = tk.KERNELS["bi_exp_sum"][0]
    x = logits((4, 1000), 8.0, 1).to(torch.bfloat16)
    want = reference.bi_exp_sum(x.float())
    with backend("triton"):
        monkeypatch.setattr(torch.ops.swiftkern_triton, "bi_exp_sum", lambda t: calls.append(t.dtype) or real(t))
        got = ops.bi_exp_sum(x)
    assert calls == [torch.float32] and torch.equal(got, want)
    with backend("reference"):
        assert torch.equal(ops.bi_exp_sum(x), want) and len(calls) == 1


@pytest.mark.parametrize("name", ["triton", "reference"])
def test_ops_max_exp_sum_off_the_cpp_kernel_is_the_references(name):
    """Without the C++ kernel ops.bi_max_exp_sum is three calls (max, shift, bi_exp_sum): the
    definition's bits, the shift included (logits past 88 would overflow an unshifted sum)."""
    x = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * 8.0).to(DEVICE)
    x[1, 7] = 120.0
    want_top, want_sum = reference.bi_max_exp_sum(x)
    with backend(name):
        top, total = ops.bi_max_exp_sum(x)
    assert torch.equal(top, want_top) and torch.equal(total, want_sum), (total - want_sum).abs().max()


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(SwiftkernError, match="bi_exp_sum: x must be float32"):
        triton_op("bi_exp_sum")(torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(SwiftkernError, match=r"bi_exp_sum: x must be \[..., V\] with V >= 1"):
        triton_op("bi_exp_sum")(torch.zeros(2, 0, device=DEVICE))
    assert triton_op("bi_exp_sum")(torch.zeros(0, 5, device=DEVICE)).shape == (0, 1)


def test_halvings_closed_form():
    from swiftkern.triton_kernels.bi_exp_sum import halvings

    for padded in range(64, 64 * 200, 64):
        n, levels = padded, 0
        while n % 2 == 0:
            n, levels = n // 2, levels + 1
        assert halvings(padded) == levels


def test_opcheck():
    opcheck(triton_op("bi_exp_sum"), (logits((3, 130), 4.0, 2),))


FMA_PROBE = """
import re, torch
from swiftkern.triton_kernels.compile_check import recording, TARGETS
from swiftkern.triton_kernels.bi_exp_sum import bi_exp_sum
got = []
with recording(TARGETS[90], lambda fn, grid, compiled, kwargs: got.append(compiled)):
    bi_exp_sum(torch.empty(1, 49152, device="meta"))
ptx = got[0].asm["ptx"]
print(len(re.findall(r"fma", ptx)), len(re.findall(r"mul\\.rn\\.f32", ptx)), len(re.findall(r"bar\\.sync", ptx)))
"""


def test_the_gpu_binary_rounds_every_product_and_sum_on_its_own():
    """Compiled for sm_90a (no GPU needed): no fused multiply-add (the reference rounds a * b,
    then the sum), every float32 product rounded to nearest (.rn: ptxas may not contract it
    either), and the barriers between the halvings."""
    from test_triton_compile import run_outside_interpreter

    run = run_outside_interpreter("-c", FMA_PROBE)
    assert run.returncode == 0, run.stderr[-3000:]
    fma, mul_rn, barriers = map(int, run.stdout.split()[-3:])
    assert fma == 0 and mul_rn >= 10 and barriers >= 2
