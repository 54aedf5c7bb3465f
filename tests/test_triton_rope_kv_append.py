"""Triton rope_kv_append against reference.py (interpreter on CPU, native on GPU)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops
from swiftkern.errors import SwiftkernError
from triton_cases import (DEVICE, FAR, FEW, GUARD, assert_close, backend, opcheck, poisoned, rope_reference_rounded,
                         triton_op, views_far_apart)


def rotary(B, T, D, positions, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = positions.cpu().to(torch.float32).unsqueeze(-1) * inv  # [B, T, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)


def case(B, Hq, Hkv, T, D, S, starts, dtype, seed, scattered=False):
    """Projections as the model makes them ([B, T, H, D] transposed), a NaN-filled cache; each
    row's positions start + [0, T), or (scattered) T distinct positions of [0, S) in any order."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    positions = torch.tensor(starts).unsqueeze(1) + torch.arange(T)
    if scattered:
        positions = torch.stack([torch.randperm(S, generator=g)[:T] for _ in range(B)])
    positions = positions.to(DEVICE)
    cos, sin = rotary(B, T, D, positions, dtype)
    cache = torch.full((2, B, Hkv, S, D), float("nan"), dtype=dtype, device=DEVICE)
    return q, k, v, cos, sin, cache, positions


@FEW
@given(B=st.integers(1, 4), heads=st.sampled_from([(9, 3), (4, 4), (2, 1)]), T=st.sampled_from([1, 2, 5]),
       D=st.sampled_from([8, 64, 80]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scattered=st.booleans(), data=st.data())
def test_matches_reference(B, heads, T, D, dtype, scattered, data):
    S = 24
    starts = data.draw(st.lists(st.integers(0, S - T), min_size=B, max_size=B))
    q, k, v, cos, sin, cache, positions = case(B, *heads, T, D, S, starts, dtype, data.draw(st.integers(0, 99)),
                                               scattered)
    want_q, want_cache = rope_reference_rounded(q, k, v, cos, sin, cache, positions)
    with poisoned():
        got_q = triton_op("rope_kv_append")(q, k, v, cos, sin, cache[0], cache[1], positions)
    assert_close("rope_kv_append", got_q, want_q)
    assert_close("rope_kv_append", cache, want_cache, equal_nan=True)  # untouched slots stay NaN
    assert int(cache.isnan().sum()) == int(want_cache.isnan().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scattered_positions(dtype):
    """Each token to its own position, out of order (the op's contract: any position per token):
    every row of the cache written where its position says, nothing else."""
    q, k, v, cos, sin, cache, positions = case(3, 9, 3, 5, 64, 24, [0, 0, 0], dtype, 7, scattered=True)
    want_q, want_cache = rope_reference_rounded(q, k, v, cos, sin, cache, positions)
    with poisoned():
        got_q = triton_op("rope_kv_append")(q, k, v, cos, sin, cache[0], cache[1], positions)
    assert_close("rope_kv_append", got_q, want_q)
    assert_close("rope_kv_append", cache, want_cache, equal_nan=True)
    assert int(cache.isnan().sum()) == int(want_cache.isnan().sum())


def test_wrapper_with_uniform_start_and_contiguous_cache_dtype():
    q, k, v, cos, sin, cache, positions = case(2, 9, 3, 3, 64, 10, [4, 4], torch.float32, 1)
    want_q, want_cache = rope_reference_rounded(q, k, v, cos, sin, cache, positions, 4)
    with backend("triton"):
        got_q = ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions, uniform_start=4)
    assert_close("rope_kv_append", got_q, want_q)
    assert_close("rope_kv_append", cache, want_cache, equal_nan=True)
    cache.fill_(float("nan"))
    with backend("triton"):  # the max_len hint: no device-side range check, same result
        got_q = ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions, max_len=7)
    assert_close("rope_kv_append", got_q, want_q)
    assert_close("rope_kv_append", cache, want_cache, equal_nan=True)


def test_opcheck():
    q, k, v, cos, sin, cache, positions = case(2, 9, 3, 2, 64, 8, [0, 5], torch.bfloat16, 2)
    cache.zero_()
    opcheck(triton_op("rope_kv_append"), (q, k, v, cos, sin, cache[0], cache[1], positions))
    c = cache.cpu().contiguous()
    opcheck(torch.ops.swiftkern.rope_kv_append,
            tuple(t.cpu().contiguous() for t in (q, k, v, cos, sin)) + (c[0], c[1], positions.cpu()))


def test_bad_input_is_refused():
    q, k, v, cos, sin, cache, positions = case(2, 9, 3, 2, 64, 8, [0, 5], torch.float32, 3)
    with pytest.raises(SwiftkernError, match=r"positions must be in \[0, 7\]"):
        ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions + 2)
    with pytest.raises(SwiftkernError, match="max_len 9 is beyond"):
        ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions, max_len=9)
    with pytest.raises(SwiftkernError, match="uniform_start 7"):
        ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions, uniform_start=7)
    with pytest.raises(SwiftkernError, match=r"k must be \[B, Hkv, T, D\]"):
        ops.rope_kv_append(q, k[:, :, :1], v, cos, sin, cache[0], cache[1], positions)
    with pytest.raises(SwiftkernError, match="even"):
        ops.rope_kv_append(q[..., :3], k[..., :3], v[..., :3], cos[..., :3], sin[..., :3], cache[0, ..., :3],
                           cache[1, ..., :3], positions)
    with pytest.raises(SwiftkernError, match="int64"):
        ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions.int())


def test_the_launcher_refuses_mixed_dtypes():
    """The model runner calls the launcher unchecked (``ops.unchecked``): bf16 q with float32
    cos and sin came back bf16 with the products rounded, where the reference gives float32."""
    from swiftkern.triton_kernels.rope_kv_append import rope_kv_append as launch

    q, k, v, cos, sin, cache, positions = case(1, 2, 1, 2, 8, 4, [0], torch.bfloat16, 5)
    with pytest.raises(SwiftkernError, match="must share one dtype"):
        launch(q, k, v, cos.float(), sin.float(), cache[0], cache[1], positions)


def test_keys_and_values_are_written_with_no_query_heads():
    """Hq = 0 (the wrapper takes it): the launcher returned before the launch, so k and v never
    reached the cache, which the reference and the C++ kernel write."""
    q, k, v, cos, sin, cache, positions = case(1, 0, 1, 2, 8, 4, [1], torch.float32, 6)
    with backend("triton"):
        got = ops.rope_kv_append(q, k, v, cos, sin, cache[0], cache[1], positions)
    assert got.shape == q.shape
    assert torch.equal(cache[1, :, :, 1:3], v) and not cache[0, :, :, 1:3].isnan().any()


def test_head_offsets_past_int32():
    """Head index x head stride past 2**31 elements (a cache of Hkv 32, D 128 holding ~541k
    tokens): computed in int32, head 2's offset wrapped and its keys and values landed 32
    elements before the cache, its slots left unwritten."""
    B, Hq, Hkv, T, D, S = 1, 3, 3, 2, 8, 4
    q, k, v, cos, sin, cache, positions = case(B, Hq, Hkv, T, D, S, [1], torch.bfloat16, 8)
    want_q, want_cache = rope_reference_rounded(q, k, v, cos, sin, cache, positions)
    buffer, (k_cache, v_cache) = views_far_apart((B, Hkv, S, D), (Hkv * FAR, FAR, D, 1), torch.bfloat16,
                                                 [GUARD, GUARD + S * D])
    got_q = triton_op("rope_kv_append")(q, k, v, cos, sin, k_cache, v_cache, positions)
    assert_close("rope_kv_append", got_q, want_q)
    assert_close("rope_kv_append", k_cache, want_cache[0], equal_nan=True)
    assert_close("rope_kv_append", v_cache, want_cache[1], equal_nan=True)
    assert buffer[:GUARD].isnan().all()
