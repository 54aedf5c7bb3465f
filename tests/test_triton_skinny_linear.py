"""The Triton skinny_linear (ops.linear's float32 matmul at 2-32 rows on CUDA) against
reference.skinny_linear (torch's matmul, in float64 for the bar) on odd shapes, interpreted on the
CPU and native on a GPU; its rows independent of the others (one fixed plan); and ops.linear's
and the model runner's dispatch to it, with the CUDA rule turned on for the CPU's tensors here."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import hf_greedy, tiny_model
from swiftkern import Generator, SkipModel, ops, reference
from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, FEW, TOLERANCES, backend, opcheck, poisoned, triton_op


def operands(lead, K, N, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@FEW
@given(lead=st.sampled_from([(1,), (2,), (7,), (3, 5), (32,), (33,), (0,)]),
       K=st.sampled_from([1, 31, 130, 576, 300]), N=st.sampled_from([1, 63, 65, 192]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_reference_on_odd_shapes(lead, K, N, dtype, bias, seed):
    x, w, b = operands(lead, K, N, dtype, seed, bias)
    with poisoned():
        got = triton_op("skinny_linear")(x, w, b)
    want = reference.skinny_linear(x.double(), w.double(), None if b is None else b.double()).to(dtype)
    atol, rtol = TOLERANCES["skinny_linear"][dtype]
    assert got.shape == (*lead, N) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=atol * K ** 0.5, rtol=rtol)


def test_rows_do_not_depend_on_the_others_and_strided_weights_work():
    x, w, b = operands((40,), 300, 70, torch.float32, 3)
    op = triton_op("skinny_linear")
    full = op(x, w, b)
    for m in (1, 2, 15, 16, 17, 32, 39):
        assert torch.equal(op(x[:m], w, b), full[:m]), m
    wide = torch.randn(300, 140, device=DEVICE).t()[:70]  # [70, 300] with stride (1, 140)
    torch.testing.assert_close(op(x, wide, None), x @ wide.t(), atol=1e-4, rtol=1e-5)


def test_bad_input_says_what_is_wrong():
    x, w, b = operands((4,), 16, 8, torch.float32, 1)
    op = triton_op("skinny_linear")
    for args, match in (((x, w[:, :15], b), r"x must be \[..., K\] and weight \[N, K\]"),
                        ((x, w.double(), b), "weight must be float32, bfloat16 or float16"),
                        ((x, w.bfloat16(), None), "x and weight must have one dtype"),
                        ((x, w, b[:7]), r"bias must be \[N\] = \[8\]")):
        with pytest.raises(SwiftkernError, match=f"skinny_linear: {match}"):
            op(*args)


def test_opcheck():
    opcheck(torch.ops.swiftkern_triton.skinny_linear, operands((5,), 40, 24, torch.float32, 2))


@pytest.fixture
def cuda_rule_on_cpu(monkeypatch):
    """ops.linear's CUDA rule (triton_skinny_here) turned on for this device, the runner's kernels
    rebound under it; -> the list of row counts the Triton kernel was called with."""
    from swiftkern import layer_kernels
    from swiftkern.ops import projections
    from swiftkern.triton_kernels import KERNELS

    calls = []
    kernel, fake = KERNELS["skinny_linear"]
    monkeypatch.setitem(KERNELS, "skinny_linear",
                        (lambda x, w, b: calls.append(x.numel() // x.shape[-1]) or kernel(x, w, b), fake))
    monkeypatch.setattr(projections, "triton_skinny_here", lambda device_type: device_type == DEVICE)
    monkeypatch.setattr(ops, "triton_skinny_here", projections.triton_skinny_here)
    monkeypatch.setattr(layer_kernels, "_CACHE", {})
    return calls


def test_ops_linear_takes_it_at_2_to_32_float32_rows(cuda_rule_on_cpu, monkeypatch):
    spy = []
    real = torch.ops.swiftkern_triton.skinny_linear
    monkeypatch.setattr(torch.ops.swiftkern_triton, "skinny_linear", lambda *a: spy.append(a[0].shape) or real(*a))
    for rows, dtype, taken in ((1, torch.float32, False), (2, torch.float32, True), (32, torch.float32, True),
                               (33, torch.float32, False), (8, torch.bfloat16, False)):
        spy.clear()
        x, w, b = operands((rows,), 64, 24, dtype, rows)
        with backend("reference" if DEVICE == "cpu" else "auto"):  # the CPU's C++ kernel out of the way
            got = ops.linear(x, w, b)
        assert bool(spy) is taken, (rows, dtype)
        atol, rtol = TOLERANCES["skinny_linear"][dtype]
        torch.testing.assert_close(got, reference.skinny_linear(x, w, b), atol=atol * 8, rtol=rtol)


def test_the_regular_runner_uses_it_and_keeps_hfs_tokens(cuda_rule_on_cpu):
    """A tiny Llama decoding a batch of 3 (projections of 3 rows) and self-spec verify passes of
    a few tokens go through the Triton kernel (the runner's Python loop: SWIFTKERN_BACKEND=
    reference keeps the CPU's C++ decoder stack out); greedy tokens equal HF's."""
    hf = tiny_model("llama", num_hidden_layers=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]
    want = [hf_greedy(hf, p, 6, eos_token_id=[]) for p in prompts]
    model = SkipModel(hf.to(DEVICE))
    with backend("reference" if DEVICE == "cpu" else "auto"):
        out = Generator(model).generate(prompts, max_new_tokens=6, eos_token_id=[])
        spec = Generator(model, mode="self-spec", drafter="layer-skip", layer_set="attn:1", eps=0.0,
                         k_max=3).generate(prompts[:1], max_new_tokens=6, eos_token_id=[])
    assert 3 in cuda_rule_on_cpu and any(2 <= m <= 4 for m in cuda_rule_on_cpu), cuda_rule_on_cpu
    assert out.tokens == want and spec.tokens[0] == want[0]


def test_its_plan_is_a_candidate_the_compile_check_and_the_sweep_cover():
    from swiftkern.triton_kernels.bi_matmul import CANDIDATES
    from swiftkern.triton_kernels.skinny_linear import PLAN

    assert PLAN in CANDIDATES and PLAN.precision == "ieee"


@pytest.fixture
def fresh_skinny_settings():
    """The settings read once (at the first projection) read again, before and after."""
    from swiftkern.ops import projections
    from swiftkern.triton_kernels import skinny_linear

    projections.cuda_skinny_rows.cache_clear()
    skinny_linear.plan_in_use.cache_clear()
    yield
    projections.cuda_skinny_rows.cache_clear()
    skinny_linear.plan_in_use.cache_clear()


def test_a_plan_named_by_the_environment_runs_with_the_bits_its_plan_gives(fresh_skinny_settings, monkeypatch):
    """SWIFTKERN_SKINNY_PLAN: the last_adds twin of PLAN (one launch a matmul) gives PLAN's bits
    (its tiles' last programs add the chunks in the same order); a name of no candidate is refused."""
    from swiftkern.triton_kernels import skinny_linear

    x, w, b = operands((9,), 300, 70, torch.float32, 4)
    op = triton_op("skinny_linear")
    want = op(x, w, b)
    twin = dataclasses.replace(skinny_linear.PLAN, last_adds=True)
    monkeypatch.setenv("SWIFTKERN_SKINNY_PLAN", twin.name)
    skinny_linear.plan_in_use.cache_clear()
    assert skinny_linear.plan_in_use() == twin
    assert torch.equal(op(x, w, b), want)
    monkeypatch.setenv("SWIFTKERN_SKINNY_PLAN", "16x64")
    skinny_linear.plan_in_use.cache_clear()
    with pytest.raises(SwiftkernError, match="SWIFTKERN_SKINNY_PLAN='16x64' names no candidate plan"):
        op(x, w, b)


@pytest.mark.parametrize("value,rows", [("", (2, 32)), ("1-32", (1, 32)), (" 4-4 ", (4, 4))])
def test_the_rows_range_named_by_the_environment(fresh_skinny_settings, monkeypatch, value, rows):
    from swiftkern.ops import projections

    monkeypatch.setenv("SWIFTKERN_CUDA_SKINNY_ROWS", value)
    assert projections.cuda_skinny_rows() == rows
    lo, hi = rows
    for m in (1, 2, 4, 32, 33):
        x, w, _ = operands((m,), 8, 4, torch.float32, m)
        assert ops.triton_skinny_fits(x, w) is (lo <= m <= hi), m


@pytest.mark.parametrize("value", ["0-32", "8-2", "32", "a-b", "-5"])
def test_a_bad_rows_range_is_refused_with_what_to_give(fresh_skinny_settings, monkeypatch, value):
    from swiftkern.ops import projections

    monkeypatch.setenv("SWIFTKERN_CUDA_SKINNY_ROWS", value)
    with pytest.raises(SwiftkernError, match=r"SWIFTKERN_CUDA_SKINNY_ROWS=.*give <lo>-<hi> with 1 <= lo <= hi"):
        projections.cuda_skinny_rows()
