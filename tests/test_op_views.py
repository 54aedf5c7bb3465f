"""Every public op on odd views of its inputs gives the bits it gives on contiguous copies.

Each tensor argument is drawn as a contiguous copy, a view at storage offset 1 (misaligned for
vector loads), a view of every other element of the last dim, column-major storage, or the
rows of a wider buffer. The op's outputs and what it writes in place must equal those of the
same op (same backend) on contiguous inputs, bit for bit. The one refusal allowed is the cache
layout the kernels need (D contiguous; one layout for k_cache and v_cache), with a
SwiftkernError on every backend.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from swiftkern import SwiftkernError, ops

VIEWS = ("contiguous", "offset", "every_other", "column_major", "padded_rows")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
CACHE_LAYOUT = "pass slices of the KVCache tensors"


def odd_view(t: torch.Tensor, view: str) -> torch.Tensor:
    """t's values in other memory: ``view`` is one of VIEWS."""
    if view == "contiguous" or t.dim() == 0:
        return t.clone()
    if view == "offset":
        out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    elif view == "every_other":
        out = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]
    elif view == "column_major":
        order = list(range(t.dim()))[::-1]
        return t.permute(order).contiguous().permute(order)
    else:  # padded_rows
        out = torch.empty(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)[..., 1:1 + t.shape[-1]]
    return out.copy_(t)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _calls(draw, device: str, dtype: torch.dtype):
    """(name, fn, args, indices of args written in place) for one drawn op and shape."""
    B, T, Hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    D, H, V = draw(st.sampled_from([2, 4, 16, 64])), draw(st.integers(1, 70)), draw(st.integers(1, 600))
    Hq, K = Hkv * group, draw(st.integers(0, 4))

    def rand(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    def ints(hi, *shape):
        return torch.randint(0, hi, shape, device=device)

    def num_draft():
        return torch.tensor([draw(st.integers(0, K)) for _ in range(B)], dtype=torch.int32, device=device)

    op = draw(st.sampled_from(["rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append", "verify_attention",
                               "verify_attention_invariant", "kv_compact", "greedy_accept", "rejection_sample",
                               "linear", "bi_matmul", "bi_exp", "bi_exp_sum", "bi_max_exp_sum"]))
    if op == "rms_norm":
        return op, lambda x, w: ops.rms_norm(x, w, 1e-6), [rand(B, T, H), rand(H)], []
    if op == "fused_add_rms_norm":
        return op, lambda x, r, w: ops.fused_add_rms_norm(x, r, w, 1e-6), [rand(B, T, H), rand(B, T, H), rand(H)], []
    if op == "silu_mul":
        return op, ops.silu_mul, [rand(B, T, H), rand(B, T, H)], []
    if op == "rope_kv_append":
        S = T + draw(st.integers(0, 5))
        positions = (torch.arange(T, device=device) + draw(st.integers(0, S - T))).expand(B, T).contiguous()
        angle = torch.randn(B, T, D // 2, device=device)
        cos, sin = (torch.cat([f(angle), f(angle)], -1).to(dtype) for f in (torch.cos, torch.sin))
        return op, ops.rope_kv_append, [rand(B, Hq, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D), cos, sin,
                                        rand(B, Hkv, S, D), rand(B, Hkv, S, D), positions], [5, 6]
    if op.startswith("verify_attention"):
        S = T + draw(st.integers(0, 20))
        lens = torch.tensor([draw(st.integers(T, S)) for _ in range(B)], device=device)
        fn = getattr(ops, op)
        return op, lambda q, k, v, n: fn(q, k, v, n, D ** -0.5), [rand(B, Hq, T, D), rand(B, Hkv, S, D),
                                                                   rand(B, Hkv, S, D), lens], []
    if op == "kv_compact":
        L, S, M = draw(st.integers(1, 2)), draw(st.integers(4, 12)), draw(st.integers(1, 4))
        counts = torch.tensor([draw(st.integers(0, M)) for _ in range(B)], dtype=torch.int32, device=device)
        src = torch.stack([torch.randperm(S, device=device)[:M] for _ in range(B)])
        dst = torch.tensor([draw(st.integers(0, S - int(c))) for c in counts], device=device)
        return op, ops.kv_compact, [rand(L, B, Hkv, S, D), rand(L, B, Hkv, S, D), src, dst, counts], [0, 1]
    if op == "greedy_accept":
        return op, ops.greedy_accept, [ints(V, B, K), rand(B, K + 1, V), num_draft()], []
    if op == "rejection_sample":
        q = torch.rand(B, K, V, device=device).softmax(-1).to(dtype) if draw(st.booleans()) else None
        return op, ops.rejection_sample, [ints(V, B, K), q, torch.rand(B, K + 1, V, device=device).softmax(-1).to(dtype),
                                          num_draft(), torch.rand(B, K, device=device),
                                          torch.rand(B, K + 1, device=device)], []
    if op == "linear":
        N = draw(st.integers(1, 70))
        return op, ops.linear, [rand(B * T, H), rand(N, H), rand(N) if draw(st.booleans()) else None], []
    if op == "bi_matmul":
        return op, ops.bi_matmul, [rand(B * T, H), rand(H, draw(st.integers(1, 70)))], []
    return op, getattr(ops, op), [rand(B, V)], []


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
DRAWS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@settings(max_examples=300, **DRAWS)
@given(data=st.data(), dtype=DTYPES)
def test_odd_views_give_the_bits_of_contiguous_inputs(data, dtype):
    _check_views("cpu", data, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@settings(max_examples=60, **DRAWS)  # fewer: each new stride pattern may compile another Triton kernel
@given(data=st.data(), dtype=DTYPES)
def test_odd_views_give_the_bits_of_contiguous_inputs_on_the_gpu(data, dtype):
    _check_views("cuda", data, dtype)


def _check_views(device, data, dtype):
    name, fn, args, written = _calls(data.draw, device, dtype)
    views = [data.draw(st.sampled_from(VIEWS)) if torch.is_tensor(a) else None for a in args]
    plain = [a.clone() if torch.is_tensor(a) else a for a in args]
    odd = [odd_view(a, v) if torch.is_tensor(a) else a for a, v in zip(args, views)]
    want = fn(*plain)
    try:
        got = fn(*odd)
    except SwiftkernError as e:
        assert CACHE_LAYOUT in str(e), f"{name} refused views {views}: {e}"
        return
    want = [*(want if isinstance(want, tuple) else [want]), *(plain[i] for i in written)]
    got = [*(got if isinstance(got, tuple) else [got]), *(odd[i] for i in written)]
    for i, (w, g) in enumerate(zip(want, got)):
        assert (w is None and g is None) or same_bits(w, g), f"{name} output {i} differs on views {views} ({dtype})"


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_probability_tensor_needs_no_layout(device):
    """K = 0 leaves draft_probs [B, 0, V] empty and B = 0 the logits: whatever their strides,
    no element is read, so no kernel may refuse them (the C++ and CUDA checks once did)."""
    V = 7
    q = odd_view(torch.rand(2, 0, V, device=device), "every_other")
    p = torch.rand(2, 1, V, device=device).softmax(-1)
    tokens, accepted = ops.rejection_sample(torch.zeros(2, 0, dtype=torch.int64, device=device), q, p,
                                            torch.zeros(2, dtype=torch.int32, device=device),
                                            torch.rand(2, 0, device=device), torch.rand(2, 1, device=device))
    assert tokens.shape == (2, 1) and accepted.tolist() == [0, 0]
    logits = odd_view(torch.rand(0, 3, V, device=device), "every_other")
    tokens, accepted = ops.greedy_accept(torch.zeros(0, 2, dtype=torch.int64, device=device), logits,
                                         torch.zeros(0, dtype=torch.int32, device=device))
    assert tokens.shape == (0, 3) and accepted.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("broadcast", ["cos", "sin"])
@pytest.mark.parametrize("T", [1, 2])
def test_rope_with_one_table_broadcast_beside_a_dense_other(dtype, broadcast, T):
    """cos (or sin) expanded over the batch with stride 0 beside a dense sin (or cos): the C++
    kernel widens a bf16 / fp16 cos and sin row once for the rows that share it, compared the
    cos pointer alone, and rotated every row after the first with the first row's sin (T = 1:
    the rows of one token of each batch row follow one another, their cos at one address)."""
    B, Hq, Hkv, D, S = 3, 2, 1, 16, 8
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rand(B, Hq, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    shared, own = rand(1, T, D).expand(B, T, D), rand(B, T, D)
    cos, sin = (shared, own) if broadcast == "cos" else (own, shared)
    positions = torch.arange(T).repeat(B, 1)
    results = []
    for c, s in ((cos, sin), (cos.contiguous(), sin.contiguous())):
        k_cache, v_cache = torch.zeros(B, Hkv, S, D, dtype=dtype), torch.zeros(B, Hkv, S, D, dtype=dtype)
        results.append((ops.rope_kv_append(q, k, v, c, s, k_cache, v_cache, positions), k_cache, v_cache))
    for got, want in zip(*results):
        assert torch.equal(got, want)
