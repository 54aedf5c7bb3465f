"""skinny_linear: ops.linear and the raw op against a float64 reference, batch invariance
(any number of rows), every instruction set giving the same bits, bfloat16 / float16 as the
float32 sum rounded once (and against torch's matmul in that dtype), the > SKINNY_MAX_ROWS fallback
of ops.linear, bad input and opcheck."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from swiftkern import SwiftkernError, ops, reference

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

OP = torch.ops.swiftkern.skinny_linear
KS = [1, 7, 31, 32, 33, 576, 1000]
NS = [1, 5, 577, 1536]
needs_cpp = pytest.mark.skipif(ops.backend_info()["ops"]["skinny_linear"]["cpu"] != "cpp",
                               reason="the C++ skinny_linear kernel was not built")


def make(lead, K, N, bias, seed):
    """x float32 [*lead, K], weight [N, K], bias [N] or None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    return x, w, torch.randn(N, generator=g) if bias else None


def check_close(y, x, w, b):
    """y [..., N] vs the float64 reference: exact shape, finite, error within float32 rounding
    of the fixed-order dot (bounded by 1e-5 * sum |x_k w_k| + |b| per element). Not relative to
    |ref|: where a dot cancels that is ill-conditioned (K = 576 terms summing to 0.0013 out of
    sum |x_k w_k| = 14.3 were 4e-9 off by this bound and 5e-5 off relative to the result)."""
    ref = reference.skinny_linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = (y.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-30).all(), float((err / scale.clamp_min(1e-30)).max())


@st.composite
def shapes(draw):
    lead = draw(st.one_of(st.tuples(st.integers(1, 16)),
                          st.integers(1, 4).flatmap(lambda B: st.tuples(st.just(B), st.integers(1, 16 // B)))))
    return lead, draw(st.sampled_from(KS)), draw(st.sampled_from(NS)), draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes())
def test_matches_float64_reference(case):
    lead, K, N, bias, seed = case
    x, w, b = make(lead, K, N, bias, seed)
    check_close(ops.linear(x, w, b), x, w, b)
    check_close(OP(x, w, b), x, w, b)


@pytest.mark.parametrize("K, N", [(33, 577), (576, 1536), (1000, 5)])
def test_batch_invariance(K, N):
    """A row's output is bitwise the same alone (M = 1), among 16 rows, or in a 3-D batch."""
    x, w, b = make((16,), K, N, True, K + N)
    y16 = ops.linear(x, w, b)
    assert torch.equal(y16.view(2, 8, N), ops.linear(x.view(2, 8, K), w, b))
    for i in range(16):
        assert torch.equal(ops.linear(x[i:i + 1], w, b)[0], y16[i])
        assert torch.equal(OP(x[i], w, b), y16[i])  # 1-D x: one row
    assert torch.equal(ops.linear(x[3:10], w, b), y16[3:10])


HALF_DTYPES = [torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def cast(tensors, dtype):
    return [None if t is None else t.to(dtype) for t in tensors]


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("K, N", [(15, 9), (576, 577), (1536, 67)])
def test_raw_op_rows_do_not_depend_on_m(K, N, dtype):
    """The raw op takes any number of rows; row i has the same bits for every M > i (register
    tiles of 4 rows, thread splits and tails change no output's order of summation), in every
    dtype: what makes a verify pass give the bits of the decode steps it replays."""
    x, w, b = cast(make((301,), K, N, True, K * N), dtype)
    full = OP(x, w, b)
    if dtype == torch.float32:
        check_close(full, x, w, b)
    bad = [m for m in list(range(1, 40)) + [63, 64, 65, 128, 200, 300] if not torch.equal(OP(x[:m], w, b), full[:m])]
    assert not bad, f"rows differ for M in {bad}"
    perm = torch.randperm(301, generator=torch.Generator().manual_seed(1))
    assert torch.equal(OP(x[perm], w, b), full[perm])


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(576, 7), (33, 16)])
def test_avx2_row_groups_give_the_portable_bits(K, N, dtype):
    """AVX2 splits a call's rows into near-equal groups of up to 3 (4 rows: 2 + 2, 7: 3 + 2 + 2)
    with tiles as wide as the largest group's (4 / 3 / 2 weight rows at 1 / 2 / 3 x rows):
    every row count up to the lane panels (20) and past, against the portable loop, bit for bit;
    N = 7 and 16 leave partial weight tiles at every width."""
    from swiftkern import _C

    if "avx2" not in _C.skinny_linear_isas():
        pytest.skip("this CPU has no AVX2")
    for M in range(1, 25):
        x, w, _ = make((M,), K, N, False, 1000 + M)
        x, w = x.to(dtype), w.to(dtype)
        want = _C.skinny_linear_isa(x, w, "portable")
        assert torch.equal(_C.skinny_linear_isa(x, w, "avx2"), want), M


@needs_cpp
@settings(max_examples=25, deadline=None)
@given(M=st.one_of(st.integers(1, 11), st.integers(15, 40), st.sampled_from([120, 130])),
       K=st.sampled_from([1, 7, 15, 16, 17, 31, 33, 100, 576]), N=st.one_of(st.integers(1, 13), st.sampled_from([16, 17, 33])),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, *HALF_DTYPES]))
def test_every_instruction_set_gives_the_same_bits(M, K, N, seed, dtype):
    """AVX-512, AVX2 and the portable loop follow one order of summation: equal bit for bit
    (only the sets this CPU runs; the portable one always), bf16 / fp16 weights loaded exactly
    (their result: the float32 portable loop's on the upcast inputs, rounded once). Rows past
    one register tile too: 15-40, and 120 / 130 (at K = 576 two L2 blocks of x rows); AVX2 takes
    more than 20 rows as lane panels of 16 outputs (lane_panel_gemm.h), so N = 16, 17, 33 too."""
    from swiftkern import _C

    x, w, _ = make((M,), K, N, False, seed)
    want = _C.skinny_linear_isa(x, w, "portable")
    check_close(want, x, w, None)
    if dtype != torch.float32:
        x, w = cast((x, w), dtype)
        want = _C.skinny_linear_isa(x.float(), w.float(), "portable").to(dtype)
    isas = _C.skinny_linear_isas()
    assert "portable" in isas
    for isa in isas:
        assert torch.equal(_C.skinny_linear_isa(x, w, isa), want), isa
    assert torch.equal(OP(x, w, None), want)


@needs_cpp
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes(), st.sampled_from(HALF_DTYPES))
def test_bf16_and_fp16_are_the_float32_sum_rounded_once(case, dtype):
    """x, weight, bias in bf16 / fp16: each output is the float32 kernel's on the exactly upcast
    inputs, rounded once (ops.linear and the raw op), and within that rounding, plus the float32
    sums' own difference, of torch's matmul in the dtype (``reference.skinny_linear``)."""
    lead, K, N, bias, seed = case
    x, w, b = cast(make(lead, K, N, bias, seed), dtype)
    want = OP(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    for y in (OP(x, w, b), ops.linear(x, w, b)):
        assert y.dtype == dtype and torch.equal(y, want)
    twin = reference.skinny_linear(x, w, b).float()
    scale = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
    err = (want.float() - twin).abs()
    assert (err <= 2 * UNIT_ROUNDOFF[dtype] * torch.maximum(want.float().abs(), twin.abs()) + 1e-5 * scale).all()


@pytest.mark.parametrize("lead", [(ops.SKINNY_MAX_ROWS + 1,), (40,), (3, 17)])
def test_more_than_skinny_max_rows_uses_matmul_and_matches(lead, monkeypatch):
    from swiftkern.ops import projections

    monkeypatch.setattr(projections, "mkl_lags_here", lambda: False)  # the rule of a CPU where MKL runs AVX-512
    x, w, b = make(lead, 576, 577, True, 1)
    assert not ops.skinny_fits(x, w)
    check_close(ops.linear(x, w, b), x, w, b)
    check_close(ops.linear(x, w, None), x, w, None)


@needs_cpp
@pytest.mark.parametrize("lead", [(ops.SKINNY_MAX_ROWS,), (2, ops.SKINNY_MAX_ROWS // 2)])
def test_up_to_skinny_max_rows_takes_the_cpp_kernel(lead, monkeypatch):
    """At the limit itself ops.linear is still the fixed-order kernel: each row the bits it has alone."""
    from swiftkern.ops import projections

    monkeypatch.setattr(projections, "mkl_lags_here", lambda: False)
    x, w, b = make(lead, 576, 577, True, 2)
    assert ops.skinny_fits(x, w)
    y = ops.linear(x, w, b).reshape(-1, 577)
    rows = x.reshape(-1, 576)
    assert torch.equal(y, OP(rows, w, b))
    assert all(torch.equal(y[i], ops.linear(rows[i:i + 1], w, b)[0]) for i in (0, len(rows) - 1))


def test_empty_reduction_axis():
    x, w, b = make((3,), 0, 5, True, 0)
    assert torch.equal(ops.linear(x, w, b), b.expand(3, 5))
    assert torch.equal(ops.linear(x, w, None), torch.zeros(3, 5))
    assert torch.equal(ops.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()), b.bfloat16().expand(3, 5))


def test_zero_rows_and_strided_input():
    x, w, b = make((0,), 33, 5, True, 0)
    assert ops.linear(x, w, b).shape == (0, 5)
    x, w, b = make((4,), 66, 577, True, 2)
    xs, ws = x[:, ::2], w[:, :33]  # non-contiguous x [4, 33] and weight [577, 33]
    check_close(ops.linear(xs, ws, b), xs, ws, b)
    check_close(OP(xs, ws, None), xs, ws, None)


@needs_cpp
@pytest.mark.parametrize(
    "args, message",
    [
        (lambda x, w, b: (x.double(), w.double(), b.double()), "must be float32, bfloat16 or float16"),
        (lambda x, w, b: (x.bfloat16(), w, b), "one dtype"),
        (lambda x, w, b: (x, w.double(), b), "must be float32"),
        (lambda x, w, b: (x.half(), w.half(), b), "bias must be float16"),
        (lambda x, w, b: (x[:, :7], w, b), "must match weight"),
        (lambda x, w, b: (x, w[None], b), r"weight must be \[N, K\]"),
        (lambda x, w, b: (x, w, b[:3]), "bias must be float32"),
    ],
)
def test_bad_input_to_the_raw_op_raises(args, message):
    x, w, b = make((4,), 31, 5, True, 0)
    with pytest.raises(RuntimeError, match=message):
        OP(*args(x, w, b))


def test_bad_input_to_linear_raises():
    """A SwiftkernError naming what is wrong, before any kernel (the C++ kernel's RuntimeError was
    all a K mismatch got, a float64 weight got torch's, an int x ran)."""
    x, w, b = make((4,), 31, 5, True, 0)
    for args, match in (((x[:, :7], w, b), r"x must be \[..., K\] and weight \[N, K\]"),
                        ((x, w, b[:4]), r"bias must be \[N\] = \[5\]"),
                        ((x, w.double(), b), "weight must be float32, bfloat16 or float16"),
                        ((x.bfloat16(), w, b), "inputs must share one dtype"),
                        ((x, w, b.half()), "inputs must share one dtype"),
                        ((x.long(), w.long(), None), "x must be float32"),
                        ((x, w.tolist(), b), "weight must be a torch.Tensor")):
        with pytest.raises(SwiftkernError, match=match):
            ops.linear(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, K, N, bias", [((3,), 33, 577, True), ((2, 5), 7, 5, False), ((16,), 1, 1, True)])
def test_opcheck(lead, K, N, bias, dtype):
    torch.library.opcheck(OP, tuple(cast(make(lead, K, N, bias, 0), dtype)))


@pytest.mark.parametrize("vendor,isa,mkl,lags", [
    ("AuthenticAMD", "avx512", True, True),  # MKL's AVX2 code against the C++ kernels' AVX-512
    ("GenuineIntel", "avx512", True, False),  # MKL runs AVX-512 there: it takes prefill-sized inputs
    ("AuthenticAMD", "avx2", True, False),  # AVX2 both: MKL wins past 64 rows
    ("AuthenticAMD", "portable", True, False),  # no vectorized C++ kernels here
    ("AuthenticAMD", "avx512", False, False),  # another BLAS
    ("", "avx512", True, False),  # vendor unknown
])
def test_the_cpp_kernels_take_every_projection_where_mkl_lags(vendor, isa, mkl, lags, monkeypatch):
    from swiftkern.ops import projections

    monkeypatch.setattr(projections, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(projections, "cpu_matmul_isa", lambda: isa)
    monkeypatch.setattr(projections, "packed_linear_fast", lambda: isa != "portable")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert ops.mkl_lags_here() == lags
    assert ops.skinny_max_rows(torch.float32) == (-1 if lags else ops.SKINNY_MAX_ROWS)
    assert ops.packed_max_rows() == (-1 if lags else ops.PACKED_MAX_ROWS)
    assert ops.skinny_max_rows(torch.bfloat16) == -1
    x, w, b = make((ops.SKINNY_MAX_ROWS + 9,), 64, 33, True, 4)
    assert ops.skinny_fits(x, w) == lags
    check_close(ops.linear(x, w, b), x, w, b)
