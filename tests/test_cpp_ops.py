"""The CPU C++ kernels of swiftkern._C (torch.ops.swiftkern.<op> on CPU tensors) against
swiftkern/reference.py: hypothesis-drawn odd shapes and dtypes, the edge cases (num_draft 0, all
drafts accepted, vocabulary 1, rows with nothing to move), bad input, and opcheck (schemas with
the mutated caches declared).

greedy_accept and rejection_sample have their own files (test_greedy_accept.py,
test_rejection_sample.py); the cases here target what those do not: argmax at every lane
position of the vectorized two-pass scan, and the acceptance edge cases on the raw op.
"""

import os
import sys

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from conftest import torch_threads
from triton_cases import assert_close, check_move_ending_at_the_last_position

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

BUILT = ops.registry.extension is not None
needs_cpp = pytest.mark.skipif(not BUILT, reason="swiftkern._C is not built (SWIFTKERN_BUILD_EXT=0 or no compiler)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DRAWN = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OPS = torch.ops.swiftkern


def test_extension_is_built_with_the_cpu_kernels():
    """A failed compile stops the build (or, with SWIFTKERN_BUILD_EXT=auto, falls back to pure
    Python with a note); either way CI must notice that the kernels are missing."""
    if os.environ.get("SWIFTKERN_BUILD_EXT") == "0":
        pytest.skip("SWIFTKERN_BUILD_EXT=0: the extension is not built on purpose")
    assert BUILT, ops.backend_info()["extension"]
    info = ops.registry.extension.build_info()
    for op in ("greedy_accept", "rejection_sample", "fused_add_rms_norm", "rope_kv_append", "verify_attention",
               "kv_compact", "top_p_cut"):
        assert op in info["cpu_kernels"]
        assert "cpp" in ops.backend_info()["kernels"][op]["cpu"]
    if sys.platform != "win32":  # fp32 kernels match the reference only without contraction
        assert "-ffp-contract=off" in info["flags"]


# ---------------------------------------------------------------- greedy_accept: the argmax scan

@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 31, 32, 33, 64, 95, 1000])
def test_argmax_at_every_position(dtype, V):
    """Each row's maximum (then a NaN, then a tie, then -inf) placed at every index."""
    rows = []
    for i in range(V):
        r = torch.zeros(V)
        r[i] = 2.0
        rows.append(r)
        r = torch.zeros(V)
        r[i] = float("nan")
        if i + 1 < V:
            r[V - 1] = float("nan")  # the first NaN wins, a later one does not
        rows.append(r)
        r = torch.full((V,), -1.0)
        r[i] = 3.0
        r[(i * 7 + 5) % V] = 3.0  # a tie: the lower index wins
        rows.append(r)
    rows.append(torch.full((V,), float("-inf")))
    logits = torch.stack(rows).to(dtype).unsqueeze(1)  # [B, 1, V]: K = 0, only the argmax
    B = logits.shape[0]
    out, acc = OPS.greedy_accept(torch.empty(B, 0, dtype=torch.int64), logits, torch.zeros(B, dtype=torch.int32))
    want, want_acc = reference.greedy_accept(torch.empty(B, 0, dtype=torch.int64), logits,
                                             torch.zeros(B, dtype=torch.int32))
    assert torch.equal(out, want) and torch.equal(acc, want_acc)
    assert out[-1, 0] == 0  # a row of -inf


@needs_cpp
@DRAWN
@given(B=st.integers(0, 5), K=st.integers(0, 6), V=st.sampled_from([1, 2, 17, 33, 1000]),
       dtype=st.sampled_from(DTYPES), data=st.data())
def test_greedy_accept_edge_cases(B, K, V, dtype, data):
    """num_draft 0..K, drafts that all match (or match up to a drawn position), vocabulary 1, B 0."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    target = logits.float().argmax(-1)
    draft = target[:, :K].clone()
    for b in range(B):
        miss = data.draw(st.integers(0, K + 1))  # K + 1 or K: every draft matches
        if miss < K:
            draft[b, miss] = (draft[b, miss] + 1) % V if V > 1 else 5
    num_draft = torch.tensor([data.draw(st.integers(0, K)) for _ in range(B)], dtype=torch.int32)
    out, acc = OPS.greedy_accept(draft, logits, num_draft)
    want, want_acc = reference.greedy_accept(draft, logits, num_draft)
    assert torch.equal(out, want) and torch.equal(acc, want_acc)


# ---------------------------------------------------------------- rejection_sample: edge cases

@needs_cpp
@DRAWN
@given(B=st.integers(0, 4), K=st.integers(0, 5), V=st.sampled_from([1, 2, 7, 1025, 3000]),
       greedy_draft=st.booleans(), data=st.data())
def test_rejection_sample_edge_cases(B, K, V, greedy_draft, data):
    """Zero probabilities, q == p (an all-zero residual), u = 0 (accept whatever p > 0),
    u near 1, num_draft 0..K."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1)
    p[torch.rand(B, K + 1, V, generator=g) < 0.3] = 0.0  # exact zeros in the weights
    q = None if greedy_draft else torch.softmax(torch.randn(B, K, V, generator=g), -1)
    if q is not None and B and K and data.draw(st.booleans()):
        q[0, 0] = p[0, 0]  # residual max(0, p - q) all zero: drawn from p instead
    draft = torch.randint(0, V, (B, K), generator=g)
    num_draft = torch.tensor([data.draw(st.integers(0, K)) for _ in range(B)], dtype=torch.int32)
    u_accept = data.draw(st.sampled_from(["zero", "rand", "one-"]))
    ua = {"zero": torch.zeros(B, K), "rand": torch.rand(B, K, generator=g),
          "one-": torch.full((B, K), 1 - 2**-24)}[u_accept]
    us = torch.rand(B, K + 1, generator=g)
    us[:, :1] = data.draw(st.sampled_from([0.0, 0.5, 1 - 2**-24]))
    args = (draft, q, p, num_draft, ua, us)
    out, acc = OPS.rejection_sample(*args)
    want, want_acc = reference.rejection_sample(*args)
    assert torch.equal(out, want) and torch.equal(acc, want_acc)


@needs_cpp
def test_rejection_sample_vocab_one_and_all_accepted():
    B, K = 3, 4
    p = torch.ones(B, K + 1, 1)
    draft = torch.zeros(B, K, dtype=torch.int64)
    num_draft = torch.tensor([0, 2, 4], dtype=torch.int32)
    out, acc = OPS.rejection_sample(draft, None, p, num_draft, torch.rand(B, K), torch.rand(B, K + 1))
    assert acc.tolist() == [0, 2, 4]  # p(x) = 1 > u * 1: every draft is accepted
    assert out.tolist() == [[0, -1, -1, -1, -1], [0, 0, 0, -1, -1], [0, 0, 0, 0, 0]]


# ---------------------------------------------------------------- fused_add_rms_norm

def norm_inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    res = torch.randn(shape, generator=g).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype)
    return x, res, w


@needs_cpp
@DRAWN
@given(rows=st.sampled_from([(0,), (1,), (3,), (2, 5), (1, 1, 7)]), hidden=st.sampled_from([1, 3, 17, 64, 576, 1000]),
       dtype=st.sampled_from(DTYPES), eps=st.sampled_from([1e-6, 1e-5, 0.5]), seed=st.integers(0, 2**16))
def test_fused_add_rms_norm_matches_reference(rows, hidden, dtype, eps, seed):
    x, res, w = norm_inputs((*rows, hidden), dtype, seed)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = OPS.fused_add_rms_norm(x, res, w, eps)
    want_normed, want_res = reference.fused_add_rms_norm(x, res, w, eps)
    assert new_res.shape == normed.shape == x.shape and new_res.dtype == normed.dtype == dtype
    assert torch.equal(new_res, want_res)  # the same single rounding of residual + x
    assert_close("fused_add_rms_norm", normed, want_normed)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@needs_cpp
def test_fused_add_rms_norm_strided_rows():
    x, res, w = norm_inputs((6, 2 * 576), torch.float32, 1)
    x, res = x[:, ::2], res[:, 576:]  # a row stride; x not even unit-stride along H
    normed, new_res = OPS.fused_add_rms_norm(x, res, w[:576], 1e-5)
    want = reference.fused_add_rms_norm(x, res, w[:576], 1e-5)
    assert torch.equal(new_res, want[1])
    assert_close("fused_add_rms_norm", normed, want[0])


@needs_cpp
def test_fused_add_rms_norm_closed_form():
    """A row of equal values c normalizes to sign(c) * weight (eps 0)."""
    x = torch.full((2, 10), 1.5)
    res = torch.full((2, 10), -4.0)
    w = torch.linspace(0.5, 2.0, 10)
    normed, new_res = OPS.fused_add_rms_norm(x, res, w, 0.0)
    assert torch.equal(new_res, torch.full((2, 10), -2.5))
    torch.testing.assert_close(normed, -w.expand(2, 10), atol=1e-6, rtol=1e-6)


def lane_order_add_rms_norm(x, res, w, eps):
    """The CPU kernel's arithmetic in torch, operation for operation (one fp32 rounding each):
    s = dtype(res + x); s^2 summed into 16 lanes (element h into lane h % 16, in order), the
    lanes added in order; rstd = 1 / sqrt(sum / H + eps); normed = dtype(w * dtype(s * rstd))."""
    dt, H = x.dtype, x.shape[-1]
    s = (res.float() + x.float()).to(dt)
    sf = s.float().reshape(-1, H)
    lanes = torch.zeros(sf.shape[0], 16)
    for h in range(H):
        lanes[:, h % 16] += sf[:, h] * sf[:, h]
    total = lanes[:, 0].clone()
    for lane in range(1, 16):
        total += lanes[:, lane]
    f32 = numpy.float32  # one IEEE operation each (torch may divide by a scalar as a product)
    rstd = torch.tensor([f32(1) / numpy.sqrt(f32(t) / f32(H) + f32(eps)) for t in total.tolist()])
    scaled = (sf * rstd[:, None]).to(dt).float()
    return (w.float() * scaled).to(dt).reshape(x.shape), s


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 15, 16, 17, 40, 576])
def test_fused_add_rms_norm_is_its_lane_order_twin_bit_for_bit(hidden, dtype):
    """Every rounding of the kernel where it sits: its vector bodies (whole 16s and 8s, the tail
    of each length) give the bits of the scalar arithmetic, in every row of a batch."""
    x, res, w = norm_inputs((5, hidden), dtype, hidden)
    x[0, :hidden // 2] = x[0, :hidden // 2] * 2 ** 8  # large values, short of fp16's overflow
    want_normed, want_res = lane_order_add_rms_norm(x, res, w, 1e-6)
    normed, new_res = OPS.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, want_res)
    assert torch.equal(normed, want_normed)
    want_plain, _ = lane_order_add_rms_norm(x, torch.zeros_like(x), w, 1e-6)
    assert torch.equal(OPS.rms_norm(x, w, 1e-6), want_plain)
    ext = ops.registry.extension
    for isa in ext.skinny_linear_isas():  # every instruction set this CPU runs
        assert [torch.equal(a, b) for a, b in zip(ext.fused_add_rms_norm_isa(x, res, w, 1e-6, isa),
                                                  (want_normed, want_res))] == [True, True], isa
        plain, none = ext.fused_add_rms_norm_isa(x, None, w, 1e-6, isa)
        assert torch.equal(plain, want_plain) and none is None, isa


@needs_cpp
@DRAWN
@given(rows=st.integers(1, 4), hidden=st.integers(1, 200), dtype=st.sampled_from(DTYPES),
       scale=st.integers(-20, 7), seed=st.integers(0, 2**16))
def test_fused_add_rms_norm_twin_at_drawn_sizes_and_scales(rows, hidden, dtype, scale, seed):
    """The lane-order twin at any H and at magnitudes from fp16's subnormals (2^-20) to near its
    overflow: rows where the residual, s * rstd or the product round into subnormals or large
    values keep the scalar loop's bits in the vector bodies too."""
    x, res, w = norm_inputs((rows, hidden), dtype, seed)
    x, res = (x.float() * 2.0 ** scale).to(dtype), (res.float() * 2.0 ** scale).to(dtype)
    want_normed, want_res = lane_order_add_rms_norm(x, res, w, 1e-6)
    for isa in ops.registry.extension.skinny_linear_isas():
        normed, new_res = ops.registry.extension.fused_add_rms_norm_isa(x, res, w, 1e-6, isa)
        assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed), isa


# ---------------------------------------------------------------- rope_kv_append

def rotary(positions, D, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # [B, T, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_case(B, Hq, Hkv, T, D, S, positions, dtype, seed):
    """Projections as the model makes them ([B, T, H, D] transposed views), a NaN-filled cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    cos, sin = rotary(positions, D, dtype)
    cache = torch.full((2, B, Hkv, S, D), float("nan"), dtype=dtype)
    return q, k, v, cos, sin, cache


@needs_cpp
@DRAWN
@given(B=st.integers(1, 4), heads=st.sampled_from([(9, 3), (4, 4), (2, 1), (3, 1)]), T=st.integers(1, 5),
       D=st.sampled_from([2, 6, 8, 64, 80]), dtype=st.sampled_from(DTYPES), data=st.data())
def test_rope_kv_append_matches_reference(B, heads, T, D, dtype, data):
    S = data.draw(st.integers(T, 12))
    positions = torch.stack([torch.randperm(S, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))[:T]
                             for _ in range(B)])  # any distinct positions per row, not only a run
    q, k, v, cos, sin, cache = rope_case(B, *heads, T, D, S, positions, dtype, data.draw(st.integers(0, 99)))
    want_cache = cache.clone()
    want_q = reference.rope_kv_append(q, k, v, cos, sin, want_cache[0], want_cache[1], positions)
    got_q = OPS.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions)
    assert got_q.shape == want_q.shape and got_q.dtype == dtype
    if dtype == torch.float32:  # the same two roundings per element as torch: bit-identical
        assert torch.equal(got_q, want_q)
        assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))
    else:  # one rounding where the reference rounds each product
        assert_close("rope_kv_append", got_q, want_q)
        assert_close("rope_kv_append", cache, want_cache, equal_nan=True)
    assert torch.equal(cache[1].nan_to_num(7.0), want_cache[1].nan_to_num(7.0))  # values: a copy
    assert int(cache.isnan().sum()) == int(want_cache.isnan().sum())  # nothing else written


def rotate_once_rounded(x, cos, sin):
    """The kernel's rotation in torch: each product in fp32, one fp32 sum, one rounding into x's
    dtype (torch's own rope rounds each product in bf16 / fp16). x [..., D]; cos, sin broadcast."""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half].float(), x[..., half:].float()
    c, s = cos.float(), sin.float()
    out_lo = lo * c[..., :half] - hi * s[..., :half]
    out_hi = hi * c[..., half:] + lo * s[..., half:]
    return torch.cat([out_lo, out_hi], dim=-1).to(x.dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [2, 6, 34, 64, 80])
def test_rope_kv_append_is_one_rounding_bit_for_bit(D, dtype):
    """bf16 / fp16 rows widened, rotated in fp32 and rounded in vectors give the bits of one
    rounding per element, whatever the head size (the 16- and 8-wide bodies' tails), for query and
    key heads of several rows and tokens."""
    B, Hq, Hkv, T, S = 2, 9, 3, 3, 7
    positions = torch.tensor([[4, 1, 6], [0, 2, 5]])
    q, k, v, cos, sin, cache = rope_case(B, Hq, Hkv, T, D, S, positions, dtype, D)
    q = q * 300  # larger values: more of fp16's roundings land near a halfway point
    got_q = OPS.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions)
    assert torch.equal(got_q, rotate_once_rounded(q, cos[:, None], sin[:, None]))
    want_k = rotate_once_rounded(k, cos[:, None], sin[:, None])  # [B, Hkv, T, D]
    for b in range(B):
        assert torch.equal(cache[0, b][:, positions[b]], want_k[b])
        assert torch.equal(cache[1, b][:, positions[b]], v[b])


@needs_cpp
def test_rope_kv_append_through_the_wrapper_with_cpp_forced():
    positions = torch.tensor([[3, 4], [0, 1]])
    q, k, v, cos, sin, cache = rope_case(2, 9, 3, 2, 64, 6, positions, torch.float32, 5)
    want_cache = cache.clone()
    want_q = reference.rope_kv_append(q, k, v, cos, sin, want_cache[0], want_cache[1], positions)
    ops.set_backend("cpp")
    try:
        got_q = ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions)
    finally:
        ops.set_backend("auto")
    assert torch.equal(got_q, want_q) and torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))


@needs_cpp
def test_rope_kv_append_with_caches_of_another_dtype_is_refused_by_the_wrapper():
    """The reference writes a bf16 cache from float32 q, k, v; the C++ kernel needs one dtype and
    its own check raised a RuntimeError through the public op, not a SwiftkernError."""
    positions = torch.tensor([[3, 4], [0, 1]])
    q, k, v, cos, sin, cache = rope_case(2, 9, 3, 2, 64, 6, positions, torch.float32, 5)
    ops.set_backend("cpp")
    try:
        with pytest.raises(SwiftkernError, match=r"the cpp kernel writes the cache in q's dtype \(torch.float32\), "
                                                 r"got caches of torch.bfloat16"):
            ops.rope_kv_append(q, k, v, cos, sin, cache[0].bfloat16(), cache[1].bfloat16(), positions)
    finally:
        ops.set_backend("auto")


# ---------------------------------------------------------------- kv_compact

def kv_cache(L, B, H, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, B, H, S, D, generator=g).to(dtype), torch.randn(L, B, H, S, D, generator=g).to(dtype))


@needs_cpp
@DRAWN
@given(L=st.integers(1, 3), B=st.integers(1, 4), H=st.sampled_from([1, 3]), D=st.sampled_from([1, 5, 64]),
       dtype=st.sampled_from(DTYPES), data=st.data())
def test_kv_compact_matches_reference(L, B, H, D, dtype, data):
    S = data.draw(st.integers(1, 20))
    M = data.draw(st.integers(0, S))
    src, dst, counts = [], [], []
    for _ in range(B):  # entries anywhere, overlapping the destination too; counts 0 included
        n = data.draw(st.integers(0, M))
        src.append(data.draw(st.lists(st.integers(0, S - 1), min_size=M, max_size=M)))
        dst.append(data.draw(st.integers(0, S - n)))
        counts.append(n)
    src = torch.tensor(src, dtype=torch.int64).reshape(B, M)
    dst, counts = torch.tensor(dst), torch.tensor(counts, dtype=torch.int32)
    if data.draw(st.booleans()):  # index tensors as strided views: the same values, other strides
        src = src.t().contiguous().t()
        dst, counts = torch.stack([dst, dst], 1)[:, 0], torch.stack([counts, counts], 1)[:, 0]
    k, v = kv_cache(L, B, H, S, D, dtype, data.draw(st.integers(0, 99)))
    if data.draw(st.booleans()):  # a cache view with strides of a longer one
        k, v = (torch.cat([t, t], dim=3)[:, :, :, :S] for t in (k, v))
    want_k, want_v = k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts)
    OPS.kv_compact(k, v, src, dst, counts)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # a pure move: bit-exact


@needs_cpp
def test_kv_compact_closed_form_overlapping_move():
    k, v = kv_cache(2, 2, 3, 10, 4, torch.float32, 1)
    before_k, before_v = k.clone(), v.clone()
    src = torch.tensor([[3, 1, 2, 0], [4, 6, 0, 0]])
    OPS.kv_compact(k, v, src, torch.tensor([1, 5]), torch.tensor([4, 2], dtype=torch.int32))
    # row 0: entries 3, 1, 2, 0 land at 1..4 (every read before any write); row 1: 4, 6 at 5, 6
    assert torch.equal(k[:, 0, :, 1:5], before_k[:, 0, :, [3, 1, 2, 0]])
    assert torch.equal(v[:, 1, :, 5:7], before_v[:, 1, :, [4, 6]])
    assert torch.equal(k[:, 0, :, 5:], before_k[:, 0, :, 5:]) and torch.equal(k[:, 1, :, :5], before_k[:, 1, :, :5])


def test_kv_compact_wrapper_moves_up_to_the_last_position():
    """ops.kv_compact (the checked wrapper, on CPU the C++ kernel) at the end of the cache."""
    check_move_ending_at_the_last_position("cpu")


# ---------------------------------------------------------------- bad input and opcheck

@needs_cpp
@pytest.mark.parametrize("call, message", [
    (lambda: OPS.kv_compact(*kv_cache(1, 1, 1, 4, 2, torch.float32, 0), torch.tensor([[0, 9]]),
                            torch.tensor([0]), torch.tensor([2], dtype=torch.int32)), r"src_positions\[0, 1\] = 9"),
    (lambda: OPS.kv_compact(*kv_cache(1, 1, 1, 4, 2, torch.float32, 0), torch.tensor([[0, 1]]),
                            torch.tensor([3]), torch.tensor([2], dtype=torch.int32)), "past the cache"),
    (lambda: OPS.kv_compact(*kv_cache(1, 1, 1, 4, 2, torch.float32, 0), torch.tensor([[0, 1]]),
                            torch.tensor([0]), torch.tensor([3], dtype=torch.int32)), r"counts\[0\] = 3"),
    (lambda: OPS.kv_compact(kv_cache(1, 1, 1, 4, 2, torch.float32, 0)[0], kv_cache(1, 1, 1, 4, 2, torch.float16, 0)[1],
                            torch.tensor([[0]]), torch.tensor([0]), torch.tensor([1], dtype=torch.int32)),
     "share dtype"),
    (lambda: OPS.rope_kv_append(*rope_case(1, 2, 1, 1, 8, 4, torch.tensor([[4]]), torch.float32, 0)[:5],
                                *torch.zeros(2, 1, 1, 4, 8), torch.tensor([[4]])), r"positions\[0, 0\] = 4"),
    (lambda: OPS.rope_kv_append(*rope_case(1, 2, 1, 1, 8, 4, torch.tensor([[1]]), torch.float32, 0)[:5],
                                *torch.zeros(2, 1, 1, 4, 8, dtype=torch.bfloat16), torch.tensor([[1]])),
     "share one dtype"),
    (lambda: OPS.rope_kv_append(torch.zeros(1, 2, 1, 7), *torch.zeros(2, 1, 1, 1, 7), *torch.zeros(2, 1, 1, 7),
                                *torch.zeros(2, 1, 1, 4, 7), torch.tensor([[1]])), "head size D must be even"),
    (lambda: OPS.kv_compact(*kv_cache(1, 1, 1, 4, 2, torch.float32, 0), torch.tensor([[0]]), torch.tensor([0]),
                            torch.tensor([1])), "counts must be int32"),
    (lambda: OPS.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4, dtype=torch.float64), 1e-5),
     "share one dtype"),
    (lambda: OPS.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 5), torch.ones(4), 1e-5), "one shape"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@needs_cpp
def test_opcheck_new_ops():
    k, v = kv_cache(2, 2, 3, 8, 16, torch.bfloat16, 2)
    torch.library.opcheck(OPS.kv_compact, (k, v, torch.tensor([[3, 4], [1, 0]]), torch.tensor([1, 0]),
                                           torch.tensor([2, 1], dtype=torch.int32)))
    positions = torch.tensor([[2, 3], [0, 5]])
    q, kk, vv, cos, sin, cache = rope_case(2, 4, 2, 2, 8, 6, positions, torch.float32, 3)
    torch.library.opcheck(OPS.rope_kv_append, (q, kk, vv, cos, sin, cache[0], cache[1], positions))
    x, res, w = norm_inputs((3, 64), torch.bfloat16, 4)
    torch.library.opcheck(OPS.fused_add_rms_norm, (x, res, w, 1e-5))


# --------------------------------------------------------------------------- bi_exp

@needs_cpp
@settings(max_examples=30, deadline=None)
@given(size=st.integers(0, 300), scale=st.sampled_from([1.0, 10.0, 60.0]), seed=st.integers(0, 2**31 - 1))
def test_bi_exp_kernel_equals_the_reference_bitwise(size, scale, seed):
    """The C++ kernel (SIMD body and scalar tail) does the reference's operations in its order."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(seed)) * scale
    specials = [-87.5, -87.0, -86.99, 88.0, 88.5, 0.0, -0.0, float("-inf"), float("nan"), float("inf")]
    x[::7] = torch.tensor(specials).repeat(size)[: x[::7].numel()]
    got = torch.ops.swiftkern.bi_exp(x)
    assert torch.equal(got.isnan(), x.isnan())  # the clamp kept NaN out (exp(-87) came back for it)
    assert torch.equal(got.nan_to_num(), reference.bi_exp(x).nan_to_num())
    assert torch.equal(got[1:].nan_to_num(), torch.ops.swiftkern.bi_exp(x[1:].clone()).nan_to_num())  # another alignment
    for isa in ops.registry.extension.skinny_linear_isas():  # every instruction set this CPU runs
        assert torch.equal(ops.registry.extension.bi_exp_isa(x, isa).nan_to_num(), got.nan_to_num()), isa


@needs_cpp
def test_isa_bindings_refuse_unknown_and_unsupported_instruction_sets():
    """The *_isa test bindings share one parser (op_checks.h ``named_isa``): an unknown name and
    a set this CPU cannot run are refused with the reason, before any tensor is read."""
    ext = ops.registry.extension
    x = torch.randn(2, 32)
    calls = {"skinny_linear_isa": lambda isa: ext.skinny_linear_isa(x, torch.randn(3, 32), isa),
             "packed_linear_isa": lambda isa: ext.packed_linear_isa(x, torch.zeros(3, 1, 20, dtype=torch.uint8), isa),
             "bi_exp_isa": lambda isa: ext.bi_exp_isa(x, isa),
             "silu_mul_isa": lambda isa: ext.silu_mul_isa(x, x, isa),
             "fused_add_rms_norm_isa": lambda isa: ext.fused_add_rms_norm_isa(x, x, x[0], 1e-5, isa),
             "verify_attention_isa": lambda isa: ext.verify_attention_isa(
                 torch.randn(1, 1, 1, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8),
                 torch.tensor([1]), 1.0, isa, False)}
    here = ext.skinny_linear_isas()
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: unknown instruction set 'sse'"):
            call("sse")
        for isa in ("avx512", "avx2"):
            if isa not in here:
                with pytest.raises(RuntimeError, match=f"{name}: this CPU cannot run {isa}"):
                    call(isa)
        assert call("portable") is not None


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ops_bi_exp_reads_half_precision_as_float32(dtype):
    """ops.bi_exp takes any float dtype and returns float32 (the kernel reads float32 alone)."""
    x = (torch.randn(3, 37, generator=torch.Generator().manual_seed(5)) * 20).to(dtype)
    got = ops.bi_exp(x)
    assert got.dtype == torch.float32 and torch.equal(got, reference.bi_exp(x.float()))


@needs_cpp
def test_bi_exp_opcheck_and_bad_input():
    torch.library.opcheck(torch.ops.swiftkern.bi_exp, (torch.randn(3, 37),))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.swiftkern.bi_exp(torch.randn(5).double())
    with pytest.raises(SwiftkernError, match="float tensor"):
        ops.bi_exp(torch.arange(5))


@needs_cpp
@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (2,), (5,), (2, 3)]),
       vocab=st.sampled_from([1, 2, 63, 64, 65, 191, 1000, 4097, 49152]), scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_bi_exp_sum_kernel_equals_the_reference_bitwise(lead, vocab, scale, seed):
    """The C++ kernel makes reference.tree_sum(reference.bi_exp(x))'s additions, row by row."""
    x = torch.randn(*lead, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    x = x - x.amax(-1, keepdim=True)  # as the verifier's softmax calls it
    want = reference.tree_sum(reference.bi_exp(x))
    for threads in (1, 4):  # 4: fewer rows than threads make each row's exps in chunks
        _dirty_scratch()  # bi_max_exp_sum's code, with no shift
        with torch_threads(threads):
            got = torch.ops.swiftkern.bi_exp_sum(x)
        assert got.shape == (*lead, 1)
        assert torch.equal(got, want), threads
    rows = x.reshape(-1, vocab)
    assert torch.equal(torch.ops.swiftkern.bi_exp_sum(rows[-1:].clone()), got.reshape(-1, 1)[-1:])  # alone


@needs_cpp
def test_bi_exp_sum_opcheck_and_bad_input():
    torch.library.opcheck(torch.ops.swiftkern.bi_exp_sum, (torch.randn(3, 37),))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.swiftkern.bi_exp_sum(torch.randn(5).double())
    for bad in (torch.arange(5), torch.randn(3, 0), torch.tensor(1.0)):
        with pytest.raises(SwiftkernError, match=r"float tensor \[..., V\] with V >= 1"):
            ops.bi_exp_sum(bad)


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def _dirty_scratch():
    """Leave exp(0) = 1.0 in the scratch bi_max_exp_sum keeps between calls (the row path's and
    the chunked path's), so a padding it fails to zero makes the next sums wrong."""
    for threads in (1, 4):
        with torch_threads(threads):
            torch.ops.swiftkern.bi_max_exp_sum(torch.zeros(3, 49153))


@needs_cpp
@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (2,), (5,), (2, 3)]),
       vocab=st.sampled_from([1, 2, 15, 17, 63, 64, 65, 1000, 8193, 16385, 49152]),
       scale=st.sampled_from([1.0, 30.0]), special=st.sampled_from([None, "nan", "-inf row", "+inf"]),
       seed=st.integers(0, 2**31 - 1))
def test_bi_max_exp_sum_kernel_equals_the_reference_bitwise(lead, vocab, scale, special, seed):
    """Each instruction set gives reference.bi_max_exp_sum's bits: the row's max, then the tree
    sum of the exps of the row minus it; a row alone as in a batch; a NaN, an all -inf row and a
    +inf come out NaN / -inf where the reference's do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, vocab, generator=g) * scale
    rows = x.view(-1, vocab)
    at = int(torch.randint(0, vocab, (1,), generator=g))
    if special == "nan":
        rows[-1, at] = float("nan")
    elif special == "-inf row":
        rows[-1] = float("-inf")
    elif special == "+inf":
        rows[-1, at] = float("inf")
    want_top, want_sum = reference.bi_max_exp_sum(x)
    assert want_top.shape == want_sum.shape == (*lead, 1)
    ext = ops.registry.extension
    for isa in ext.skinny_linear_isas():
        for threads in (1, 4):  # 4: fewer rows than threads make each row's exps in chunks
            _dirty_scratch()
            with torch_threads(threads):
                top, total = ext.bi_max_exp_sum_isa(x, isa)
            assert _same_or_both_nan(top, want_top) and _same_or_both_nan(total, want_sum), (isa, threads)
    top, total = torch.ops.swiftkern.bi_max_exp_sum(x)
    assert _same_or_both_nan(top, want_top) and _same_or_both_nan(total, want_sum)
    alone = torch.ops.swiftkern.bi_max_exp_sum(rows[:1].clone())
    assert all(_same_or_both_nan(a, b.reshape(-1, 1)[:1]) for a, b in zip(alone, (top, total)))


@needs_cpp
def test_bi_max_exp_sum_opcheck_and_bad_input():
    torch.library.opcheck(torch.ops.swiftkern.bi_max_exp_sum, (torch.randn(3, 37),))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.swiftkern.bi_max_exp_sum(torch.randn(5).double())
    with pytest.raises(RuntimeError, match="bi_max_exp_sum_isa: unknown instruction set 'sse'"):
        ops.registry.extension.bi_max_exp_sum_isa(torch.randn(2, 5), "sse")
    for bad in (torch.arange(5), torch.randn(3, 0), torch.tensor(1.0)):
        with pytest.raises(SwiftkernError, match=r"bi_max_exp_sum: x must be a float tensor \[..., V\] with V >= 1"):
            ops.bi_max_exp_sum(bad)
    top, total = ops.bi_max_exp_sum(torch.zeros(0, 7))  # no rows: empty results
    assert top.shape == total.shape == (0, 1)


@needs_cpp
def test_the_logprobs_keep_the_reference_backends_bits():
    """bi_token_logprob and bi_log_softmax through the C++ bi_max_exp_sum give the bits of the
    torch max, subtraction and reference sum (backend reference): a decode step's logprob, one
    row at SmolLM2's vocabulary, and a batch of odd rows."""
    from swiftkern.batch_invariant import bi_log_softmax, bi_token_logprob

    g = torch.Generator().manual_seed(4)
    for x in (torch.randn(1, 49152, generator=g) * 6, torch.randn(5, 1003, generator=g) * 20):
        tokens = torch.randint(0, x.shape[1], (x.shape[0],), generator=g)
        got = bi_token_logprob(x, tokens), bi_log_softmax(x)
        ops.set_backend("reference")
        try:
            want = bi_token_logprob(x, tokens), bi_log_softmax(x)
        finally:
            ops.set_backend("auto")
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bi_token_logprob_is_bi_log_softmax_at_the_tokens():
    """The gathered shortcut gives the full log-softmax's bits at the tokens (either backend)."""
    from swiftkern.batch_invariant import bi_log_softmax, bi_token_logprob

    x = torch.randn(6, 1001, generator=torch.Generator().manual_seed(0)) * 8
    tokens = torch.tensor([0, 1000, 5, 77, 500, 3])
    full = bi_log_softmax(x).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert torch.equal(bi_token_logprob(x, tokens), full)
    assert torch.allclose(full, torch.log_softmax(x, -1).gather(1, tokens.unsqueeze(1)).squeeze(1), atol=1e-5)


# --------------------------------------------------------------------------- rms_norm, silu_mul

@needs_cpp
@DRAWN
@given(rows=st.sampled_from([(0,), (1,), (3,), (2, 5), (1, 1, 7)]), hidden=st.sampled_from([1, 3, 17, 64, 576, 1000]),
       dtype=st.sampled_from(DTYPES), eps=st.sampled_from([1e-6, 0.5]), seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference_and_the_fused_kernel(rows, hidden, dtype, eps, seed):
    x, _, w = norm_inputs((*rows, hidden), dtype, seed)
    got = OPS.rms_norm(x, w, eps)
    assert got.shape == x.shape and got.dtype == dtype
    assert_close("fused_add_rms_norm", got, reference.rms_norm(x, w, eps))
    # the same arithmetic as the fused kernel with a zero residual (x + 0 = x exactly)
    assert torch.equal(got, OPS.fused_add_rms_norm(x, torch.zeros_like(x), w, eps)[0])


@needs_cpp
def test_rms_norm_rows_do_not_depend_on_the_batch():
    x, _, w = norm_inputs((9, 576), torch.float32, 3)
    together = OPS.rms_norm(x, w, 1e-5)
    assert all(torch.equal(OPS.rms_norm(x[i:i + 1], w, 1e-5), together[i:i + 1]) for i in range(9))


@needs_cpp
@DRAWN
@given(shape=st.sampled_from([(0,), (1,), (17,), (3, 96), (2, 5, 1536), (40001,)]), dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_silu_mul_matches_reference(shape, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * scale).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    got = OPS.silu_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype
    assert_close("silu_mul", got, reference.silu_mul(gate, up))


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_bi_silu_mul_bit_for_bit_at_any_place(dtype):
    """The kernel does batch_invariant.bi_silu_mul's operations (bi_exp, then single IEEE ops,
    bf16 / fp16 loaded exactly and rounded once): the same bits, in the SIMD body and the scalar
    tail, at any offset, with every instruction set."""
    from swiftkern.batch_invariant import bi_silu_mul

    gate = torch.randn(1000) * 12
    gate[::9] = torch.tensor([0.0, -0.0, 88.5, -88.5, 100.0, -100.0, 1e-30]).repeat(200)[: gate[::9].numel()]
    gate, up = gate.to(dtype), torch.randn(1000).to(dtype)
    got = OPS.silu_mul(gate, up)
    assert torch.equal(got, bi_silu_mul(gate, up))
    for start in (1, 5, 16, 17):
        assert torch.equal(OPS.silu_mul(gate[start:].clone(), up[start:].clone()), got[start:])
    for isa in ops.registry.extension.skinny_linear_isas():  # every instruction set this CPU runs
        assert torch.equal(ops.registry.extension.silu_mul_isa(gate, up, isa), got), isa


def rounding_cases() -> torch.Tensor:
    """float32 values where rounding into bf16 / fp16 can go wrong: for every bf16 value, its bit
    pattern with the low 16 bits at and around the halfway point (ties to even both ways) and at
    the ends; the same around fp16's halfway points (13 dropped bits) over its exponents, its
    subnormals and the overflow to infinity; infinities, zeros, NaNs with payloads; random bits."""
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bf16 = (high[:, None] | low[None, :]).flatten()
    sign = torch.tensor([0, 1 << 31], dtype=torch.int64)
    exps = torch.arange(100, 145, dtype=torch.int64) << 23  # 2^-27 .. 2^17: fp16 subnormals to past its max
    mant = torch.randint(0, 1 << 10, (64,), generator=torch.Generator().manual_seed(0), dtype=torch.int64) << 13
    tail = torch.tensor([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF], dtype=torch.int64)
    fp16 = (sign[:, None, None, None] | exps[None, :, None, None] | mant[None, None, :, None] | tail).flatten()
    special = torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FA12345,
                            0x477FEFFF, 0x477FF000, 0xC77FF000, 0x33000000, 0x33000001, 0x387FE000],
                           dtype=torch.int64)
    rand = torch.randint(0, 1 << 32, (4099,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    bits = torch.cat([bf16, fp16, special, rand])
    return bits.to(torch.int32).view(torch.float32)  # the int32 cast wraps: any 32-bit pattern


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_rows_is_c10s_rounding_with_every_instruction_set(dtype):
    """round_store.h's vector rounding (the bf16 / fp16 stores of silu_mul and of the row path's
    projections) against c10's scalar conversion (the portable loop) and torch's own .to(): every
    float32 bit pattern gave the same bits when this was written (2^32, both dtypes, AVX-512 and
    AVX2); here the halfway points, subnormals, overflow and NaN payloads, at every offset of a vector
    and in the tail. NaNs come out as c10 makes them (0x7FC0; sign | 0x7E00), not the payload."""
    ext = ops.registry.extension
    x = rounding_cases()
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    scalar = ext.round_rows_isa(x, name, "portable")
    real = ~torch.isnan(x)
    assert torch.equal(scalar[real].view(torch.int16), x[real].to(dtype).view(torch.int16))
    nan_bits = scalar[~real].view(torch.int16).to(torch.int64) & 0xFFFF
    want = torch.full_like(nan_bits, 0x7FC0) if dtype == torch.bfloat16 else \
        (x[~real].view(torch.int32).to(torch.int64) >> 16 & 0x8000) | 0x7E00
    assert torch.equal(nan_bits, want)
    for isa in ext.skinny_linear_isas():
        for start in (0, 1, 7, 13):  # each element at another lane, and a tail of another length
            got = ext.round_rows_isa(x[start:], name, isa)
            assert torch.equal(got.view(torch.int16), scalar[start:].view(torch.int16)), (isa, start)
    with pytest.raises(RuntimeError, match="dtype must be bfloat16 or float16"):
        ext.round_rows_isa(x, "float64", "portable")


@needs_cpp
def test_rms_norm_and_silu_mul_opcheck_and_bad_input():
    x, _, w = norm_inputs((3, 64), torch.bfloat16, 4)
    torch.library.opcheck(OPS.rms_norm, (x, w, 1e-5))
    torch.library.opcheck(OPS.silu_mul, (torch.randn(3, 40), torch.randn(3, 40)))
    with pytest.raises(RuntimeError, match="rms_norm: weight must be"):
        OPS.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: gate and up must have one shape"):
        OPS.silu_mul(torch.ones(2, 4), torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="share one float dtype"):
        OPS.silu_mul(torch.ones(4), torch.ones(4, dtype=torch.float64))
