"""Triton verify_attention against reference.py (interpreter on CPU, native on GPU), and its
fixed launch plan (``verify_attention_invariant``): the same attention, a query's bits
independent of the chunk it comes in and of the rows beside it.

Each row has its own length; cache slots past a row's length hold NaN for the kernel (which
must never read them) and zeros for the reference (whose masked SDPA would turn 0 * NaN into
NaN). The reference runs in float32 on the same rounded inputs.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from swiftkern.triton_kernels.verify_attention import verify_attention as launch
from swiftkern.triton_kernels.verify_attention import verify_attention_invariant as launch_invariant
from attention_invariance import chunk_vs_one_by_one, rows_alone_vs_together
from triton_cases import DEVICE, FAR, FEW, GUARD, assert_close, backend, opcheck, poisoned, triton_op, views_far_apart


def case(lens, Hq, Hkv, T, D, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)  # as the model's
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(DEVICE)
    cache_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    stale = torch.arange(S, device=DEVICE).view(1, 1, S, 1) >= cache_lens.view(B, 1, 1, 1)
    return q, k.masked_fill(stale, float("nan")), v.masked_fill(stale, float("nan")), cache_lens, stale


def want(q, k, v, cache_lens, stale, scale):
    k0, v0 = k.masked_fill(stale, 0.0), v.masked_fill(stale, 0.0)
    return reference.verify_attention(q.float(), k0.float(), v0.float(), cache_lens, scale).to(q.dtype)


@FEW
@given(heads=st.sampled_from([(9, 3), (4, 4), (6, 1)]), T=st.sampled_from([1, 2, 5]),
       D=st.sampled_from([64, 40]), splits=st.sampled_from([None, 1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_matches_reference(heads, T, D, splits, dtype, data):
    S = 150
    # rows of unequal lengths: no history (length T), one token of history, long ones
    lens = data.draw(st.lists(st.one_of(st.just(T), st.just(T + 1), st.integers(T, S)), min_size=1, max_size=3))
    q, k, v, cache_lens, stale = case(lens, *heads, T, D, S, dtype, data.draw(st.integers(0, 99)))
    scale = D ** -0.5
    with poisoned():
        got = launch(q, k, v, cache_lens, scale, num_splits=splits)
    assert got.shape == q.shape
    assert_close("verify_attention", got, want(q, k, v, cache_lens, stale, scale))


@FEW
@given(heads=st.sampled_from([(9, 3), (4, 4), (6, 1)]), T=st.sampled_from([1, 3, 7]),
       D=st.sampled_from([64, 40]), dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_invariant_plan_matches_reference(heads, T, D, dtype, data):
    S = 150
    lens = data.draw(st.lists(st.one_of(st.just(T), st.integers(T, S)), min_size=1, max_size=3))
    q, k, v, cache_lens, stale = case(lens, *heads, T, D, S, dtype, data.draw(st.integers(0, 99)))
    with poisoned():
        got = launch_invariant(q, k, v, cache_lens, D ** -0.5)
    assert_close("verify_attention", got, want(q, k, v, cache_lens, stale, D ** -0.5))


@pytest.mark.parametrize("heads", [(3, 3), (1, 8), (2, 1)])
def test_invariant_plan_a_query_has_the_same_bits_in_any_chunk(heads):
    assert chunk_vs_one_by_one(launch_invariant, *heads, 5, 64, 100, device=DEVICE) == 0


def test_invariant_plan_a_row_has_the_same_bits_in_any_batch():
    assert rows_alone_vs_together(launch_invariant, [130, 4, 77, 9], device=DEVICE) == []


def test_negative_control_a_plan_that_follows_the_batch_is_not_invariant():
    """The split plan the regular launch takes follows the batch on a GPU; a plan that splits
    the keys only when rows come together changes a row's bits (so the check above can fail)."""
    def by_batch(q, k, v, lens, scale):
        return launch(q, k, v, lens, scale, num_splits=1 if q.shape[0] == 1 else 3)
    assert rows_alone_vs_together(by_batch, [130, 4, 77, 9], device=DEVICE) != []


def test_invariant_op_runs_the_triton_plan():
    q, k, v, cache_lens, stale = case([9, 20], 9, 3, 3, 64, 24, torch.float32, 5)
    k, v = k.masked_fill(stale, 0.0), v.masked_fill(stale, 0.0)
    with backend("triton"):
        got = ops.verify_attention_invariant(q, k, v, cache_lens, 0.125)
    assert torch.equal(got, launch_invariant(q, k, v, cache_lens, 0.125))
    opcheck(triton_op("verify_attention_invariant"), (q, k, v, cache_lens, 0.125))


def test_prefill_tiles_and_registered_op():
    """T = 40 new tokens x 3 query heads per kv head: several query tiles, causal bounds per tile."""
    q, k, v, cache_lens, stale = case([40, 57], 9, 3, 40, 64, 64, torch.float32, 1)
    with poisoned():
        got = triton_op("verify_attention")(q, k, v, cache_lens, 0.125)
    assert_close("verify_attention", got, want(q, k, v, cache_lens, stale, 0.125))


def test_decode_rows_of_length_one_and_wrapper_hints():
    q, k, v, cache_lens, stale = case([1, 1, 9], 9, 3, 1, 64, 16, torch.bfloat16, 2)
    with backend("triton"), poisoned():
        got = ops.verify_attention(q, k, v, cache_lens, 0.125, max_len=9)
        got_nohint = ops.verify_attention(q, k, v, cache_lens, 0.125)
    expected = want(q, k, v, cache_lens, stale, 0.125)
    assert_close("verify_attention", got, expected)
    assert_close("verify_attention", got_nohint, expected)
    # merging heads as the model does is a free view of the kernel's [B, T, Hq, D] output
    assert got.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("invariant", [False, True])
def test_lengths_given_as_a_strided_or_expanded_view(invariant):
    """cache_lens as a column of a [B, 2] table and as one length expanded to B rows: the kernel
    read it as contiguous, so rows took another row's (or past the table's) value as their
    length, and a length past S reads keys outside the cache."""
    lens = [5, 9, 12]
    q, k, v, cache_lens, stale = case(lens, 9, 3, 1, 64, 16, torch.float32, 4)
    run = launch_invariant if invariant else launch
    table = torch.stack([cache_lens, torch.full_like(cache_lens, 99)], dim=1)  # [B, 2]
    with poisoned():
        got = run(q, k, v, table[:, 0], 0.125)
    assert_close("verify_attention", got, want(q, k, v, cache_lens, stale, 0.125))
    same = torch.tensor([12], dtype=torch.int64, device=DEVICE).expand(3)  # stride 0
    _, k2, v2, _, stale2 = case([12] * 3, 9, 3, 1, 64, 16, torch.float32, 4)
    with poisoned():
        got = run(q, k2, v2, same, 0.125)
    assert_close("verify_attention", got, want(q, k2, v2, same.contiguous(), stale2, 0.125))


@pytest.mark.parametrize("invariant", [False, True])
def test_key_offsets_past_int32(invariant):
    """Key position x key stride past 2**31 elements (a long cache, or a [B, S, Hkv, D] one
    viewed as [B, Hkv, S, D]): computed in int32, key 2's offset wrapped to 32 elements before
    the cache and the kernel read NaN there."""
    D, S = 8, 3
    q, k, v, cache_lens, stale = case([S], 1, 1, 1, D, S, torch.bfloat16, 9)
    buffer, (k_far, v_far) = views_far_apart((1, 1, S, D), (S * FAR, S * FAR, FAR, 1), torch.bfloat16,
                                             [GUARD, GUARD + D])
    k_far.copy_(k)
    v_far.copy_(v)
    got = launch(q, k_far, v_far, cache_lens, D ** -0.5, invariant=invariant)
    assert_close("verify_attention", got, want(q, k, v, cache_lens, stale, D ** -0.5))
    assert buffer[:GUARD].isnan().all()


def test_opcheck():
    q, k, v, cache_lens, stale = case([3, 7], 9, 3, 2, 64, 8, torch.bfloat16, 3)
    k, v = k.masked_fill(stale, 0.0), v.masked_fill(stale, 0.0)
    opcheck(triton_op("verify_attention"), (q, k, v, cache_lens, 0.125))
    opcheck(torch.ops.swiftkern.verify_attention, (q.cpu().contiguous(), k.cpu(), v.cpu(), cache_lens.cpu(), 0.125))


def test_bad_input_is_refused():
    q, k, v, cache_lens, _ = case([3, 7], 9, 3, 2, 64, 8, torch.float32, 4)
    with pytest.raises(SwiftkernError, match=r"cache_lens must be in \[2, 8\]"):
        ops.verify_attention(q, k, v, cache_lens + 5, 0.125)
    with pytest.raises(SwiftkernError, match=r"cache_lens must be in \[2, 8\]"):
        ops.verify_attention(q, k, v, cache_lens - 2, 0.125)
    with pytest.raises(SwiftkernError, match="max_len 9"):
        ops.verify_attention(q, k, v, cache_lens, 0.125, max_len=9)
    with pytest.raises(SwiftkernError, match=r"max_len 1 must be in \[T = 2, S = 8\]"):  # fewer keys than T
        ops.verify_attention(q, k, v, cache_lens, 0.125, max_len=1)
    for op in (ops.verify_attention, ops.verify_attention_invariant):  # a ValueError from float() before
        with pytest.raises(SwiftkernError, match="scale must be a number"):
            op(q, k, v, cache_lens, "0.125")
    with pytest.raises(SwiftkernError, match="multiple of kv heads"):
        ops.verify_attention(q[:, :8], k, v, cache_lens, 0.125)
    with pytest.raises(SwiftkernError, match="share one dtype"):
        ops.verify_attention(q, k.half(), v.half(), cache_lens, 0.125)
