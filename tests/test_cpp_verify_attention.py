"""The C++ CPU verify_attention (torch.ops.swiftkern.verify_attention on CPU tensors) against
the definition (a float64 loop per query, test_reference_ops.naive_attention) on odd shapes:
GQA groups, new tokens per row 1-16 (both the one-query-at-a-time path and the 16-lane path
the kernel takes from 8 queries per kv head), head sizes off the vector width, rows of unequal
lengths including length T (nothing cached) and S (a full cache), caches sliced to the keys in
use, bf16/fp16, caches long enough that a task walks them once for all its queries; that a
query's result does not depend on the batch; bad input."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_invariance import chunk_vs_one_by_one, poison_stale, rows_alone_vs_together
from swiftkern import ops
from test_reference_ops import naive_attention
from triton_cases import assert_close

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

needs_cpp = pytest.mark.skipif(ops.registry.COMPILED["verify_attention"]["cpu"] != "cpp",
                               reason="swiftkern._C is not built with the CPU verify_attention kernel")
OPS = torch.ops.swiftkern
DRAWN = settings(max_examples=60, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def case(B, Hkv, group, T, D, S, dtype, data, slack=3):
    """q [B, Hq, T, D] (a transposed view, as the model passes it), caches [B, Hkv, S + slack, D]
    sliced to S keys, lens in [T, S], NaN past each row's length (never read)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, T, Hkv * group, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S + slack, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S + slack, D, generator=g).to(dtype)
    lens = torch.tensor([data.draw(st.integers(T, S)) for _ in range(B)])
    poison_stale(k, v, lens)
    return q, k[:, :, :S], v[:, :, :S], lens


@needs_cpp
@DRAWN
@given(B=st.integers(1, 3), heads=st.sampled_from([(1, 1), (3, 3), (2, 4), (1, 8), (3, 6)]), T=st.integers(1, 16),
       D=st.sampled_from([1, 20, 64, 100, 130]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       data=st.data())
def test_matches_the_definition(B, heads, T, D, dtype, data):
    Hkv, group = heads
    S = T + data.draw(st.integers(0, 40))
    q, k, v, lens = case(B, Hkv, group, T, D, S, dtype, data)
    got = OPS.verify_attention(q, k, v, lens, D ** -0.5)
    want = naive_attention(q.float(), k.float(), v.float(), lens, D ** -0.5).to(dtype)
    assert got.shape == (B, Hkv * group, T, D) and got.is_contiguous()
    assert_close("verify_attention", got, want)


@needs_cpp
@pytest.mark.parametrize("heads, T, D, S", [
    ((2, 4), 9, 128, 600),  # 36 queries per kv head: three lane blocks walk each key block once
    ((1, 9), 2, 64, 1100),  # 18: two lane blocks, one short
    ((2, 4), 1, 128, 700),  # 4: one query at a time, key blocks shared by the group
])
def test_long_caches_read_once_per_head(heads, T, D, S):
    """Keys + values of a head past 512 KiB: the paths that walk them once per task."""
    Hkv, group = heads
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, Hkv * group, T, D, generator=g)
    k, v = torch.randn(1, Hkv, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g)
    lens = torch.tensor([S - 3])
    poison_stale(k, v, lens)
    got = OPS.verify_attention(q, k, v, lens, D ** -0.5)
    assert_close("verify_attention", got, naive_attention(q, k, v, lens, D ** -0.5))


ISAS = ops.registry.extension.skinny_linear_isas() if ops.registry.extension is not None else []  # widest first


@needs_cpp
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, T, D, S", [((3, 3), 9, 64, 150), ((1, 9), 2, 20, 70), ((2, 4), 1, 100, 600),
                                            ((3, 6), 5, 1, 33), ((1, 3), 3, 128, 90)])
def test_every_instruction_set_matches_the_definition(isa, invariant, dtype, heads, T, D, S):
    """The portable loops, the AVX2 and the AVX-512 paths (those this CPU runs), forced in turn,
    regular and invariant, in float32 and in bf16 / fp16 (loaded into the float32 kernels),
    NaN past each row's length; D 20 and 100 leave a tail of a 16-column register."""
    Hkv, group = heads
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(2, T, Hkv * group, D, generator=g).to(dtype).transpose(1, 2)
    k, v = torch.randn(2, Hkv, S, D, generator=g).to(dtype), torch.randn(2, Hkv, S, D, generator=g).to(dtype)
    lens = torch.tensor([S, T + (S - T) // 3])
    poison_stale(k, v, lens)
    got = ops.registry.extension.verify_attention_isa(q, k, v, lens, D ** -0.5, isa, invariant)
    assert got.dtype == dtype
    want = naive_attention(q.float(), k.float(), v.float(), lens, D ** -0.5).to(dtype)
    assert_close("verify_attention", got, want)


@needs_cpp
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T, D, L", [(9, 64, 150), (5, 20, 70), (16, 100, 300)])
def test_every_instruction_sets_invariant_kernel_is_chunk_and_batch_invariant(isa, T, D, L):
    """The invariant variant on each instruction set, forced: a chunk of T tokens gives each
    query the bits it gets alone, and a row the bits it gets in a batch (D 20 and 100 leave a
    tail of 8 / 16 columns). SmolLM2's heads (3 kv heads, group 3)."""
    def op(q, k, v, lens, scale):
        return ops.registry.extension.verify_attention_isa(q, k, v, lens, scale, isa, True)
    assert chunk_vs_one_by_one(op, 3, 3, T, D, L) == 0
    assert rows_alone_vs_together(op, [L, 9, L // 2, 40], T=4, D=D) == []


@needs_cpp
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("T", [1, 8])
def test_a_nan_score_makes_its_query_nan_as_the_definition_does(isa, invariant, T):
    """A NaN in a query or in a seen key makes that query's output NaN (the definition's
    softmax). The kernels' exp clamped NaN to exp(-87): a NaN query came back as the mean of
    the values, a NaN key was dropped: a broken model's NaN hidden as numbers."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (T, 40, 40))
    q[0, 0, T - 1, 3] = float("nan")  # head 0: its last query
    k[0, 1, 5, 0] = float("nan")  # head 1: a key every query sees
    lens = torch.tensor([40])
    got = ops.registry.extension.verify_attention_isa(q, k, v, lens, 0.25, isa, invariant)
    want = naive_attention(q, k, v, lens, 0.25)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()


@needs_cpp
@pytest.mark.parametrize("T", [1, 8])  # one query at a time; the 16-lane path
def test_a_row_does_not_depend_on_the_batch(T):
    torch.manual_seed(0)
    B, Hkv, group, D, S = 5, 3, 3, 64, 70
    q, k, v = torch.randn(B, Hkv * group, T, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    lens = torch.tensor([70, 9, 33, T, 64])
    poison_stale(k, v, lens)
    full = OPS.verify_attention(q, k, v, lens, 0.125)
    for b in range(B):
        alone = OPS.verify_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], lens[b:b + 1], 0.125)
        assert torch.equal(alone, full[b:b + 1])


@needs_cpp
def test_one_key_gives_its_value():
    """Closed form: a query that sees one key returns that key's value row."""
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    out = OPS.verify_attention(q, k, v, torch.tensor([1]), 0.25)
    torch.testing.assert_close(out[0, :, 0], v[0, [0, 0, 1, 1], 0], rtol=1e-6, atol=1e-6)


@needs_cpp
@pytest.mark.parametrize("call, message", [
    (lambda: OPS.verify_attention(torch.ones(1, 3, 1, 8), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8),
                                  torch.tensor([2]), 1.0), "multiple of kv heads"),
    (lambda: OPS.verify_attention(torch.ones(1, 2, 2, 8), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8),
                                  torch.tensor([5]), 1.0), r"cache_lens\[0\] = 5"),
    (lambda: OPS.verify_attention(torch.ones(1, 2, 2, 8), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8),
                                  torch.tensor([1]), 1.0), r"cache_lens\[0\] = 1"),
    (lambda: OPS.verify_attention(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8,
                                  dtype=torch.bfloat16), torch.tensor([2]), 1.0), "share one dtype"),
    (lambda: OPS.verify_attention(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8),
                                  torch.tensor([2], dtype=torch.int32), 1.0), "int64"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@needs_cpp
def test_opcheck():
    q, k, v = torch.randn(2, 6, 3, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    torch.library.opcheck(OPS.verify_attention, (q, k, v, torch.tensor([9, 3]), 0.25))
