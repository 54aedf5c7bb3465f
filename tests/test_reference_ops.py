"""The model-side reference ops against naive per-row loops (their definitions)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swiftkern import reference as ref


def naive_attention(q, k_cache, v_cache, cache_lens, scale):
    B, Hq, T, D = q.shape
    group = Hq // k_cache.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(cache_lens[b])
        for h in range(Hq):
            k = k_cache[b, h // group, :n].double()
            v = v_cache[b, h // group, :n].double()
            for i in range(T):
                visible = n - T + i + 1
                s = (q[b, h, i].double() @ k[:visible].T) * scale
                out[b, h, i] = (s.softmax(-1) @ v[:visible]).to(q.dtype)
    return out


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), hkv=st.integers(1, 3), group=st.integers(1, 3), T=st.integers(1, 5),
       D=st.sampled_from([4, 8, 64]), data=st.data())
def test_verify_attention_matches_naive(B, hkv, group, T, D, data):
    S = 19
    lens = torch.tensor([data.draw(st.integers(T, S)) for _ in range(B)])
    q = torch.randn(B, hkv * group, T, D)
    k, v = torch.randn(B, hkv, S, D), torch.randn(B, hkv, S, D)
    scale = data.draw(st.sampled_from([1 / math.sqrt(D), 0.3, 1.7]))  # the caller's, not SDPA's default
    expect = naive_attention(q, k, v, lens, scale)
    torch.testing.assert_close(ref.verify_attention(q, k, v, lens, scale), expect, rtol=1e-4, atol=1e-5)
    max_len = int(lens.max())
    bias = ref.grouped_attention_bias(ref.attention_mask(lens, T, max_len), group, q.dtype)
    grouped = ref.verify_attention(q, k, v, lens, scale, max_len, mask=bias)  # the model's hint
    torch.testing.assert_close(grouped, expect, rtol=1e-4, atol=1e-5)
    if T == 1 and len(set(lens.tolist())) == 1:  # the no-mask fast path
        got = ref.verify_attention(q, k, v, lens, scale, int(lens[0]), mask=False)
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5)


def test_rope_kv_append_writes_each_rows_positions():
    B, H, T, D, S = 3, 2, 2, 8, 7
    q, k, v = torch.randn(B, 2 * H, T, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cos, sin = torch.randn(B, T, D), torch.randn(B, T, D)
    positions = torch.tensor([[0, 1], [3, 4], [5, 6]])
    kc, vc = torch.full((B, H, S, D), float("nan")), torch.full((B, H, S, D), float("nan"))
    q_rot = ref.rope_kv_append(q, k, v, cos, sin, kc, vc, positions)
    k_rot = ref.apply_rope(k, cos, sin)
    for b in range(B):
        for t in range(T):
            p = int(positions[b, t])
            torch.testing.assert_close(kc[b, :, p], k_rot[b, :, t])
            torch.testing.assert_close(vc[b, :, p], v[b, :, t])
    assert torch.isnan(kc).sum() == B * H * (S - T) * D  # nothing else written
    torch.testing.assert_close(q_rot, ref.apply_rope(q, cos, sin))
    kc2, vc2 = kc.clone(), vc.clone()
    same = torch.tensor([[2, 3]] * B)
    ref.rope_kv_append(q, k, v, cos, sin, kc, vc, same)
    ref.rope_kv_append(q, k, v, cos, sin, kc2, vc2, same, uniform_start=2)
    torch.testing.assert_close(kc, kc2, equal_nan=True)
    torch.testing.assert_close(vc, vc2, equal_nan=True)


def test_apply_rope_is_a_rotation():
    """Rotating by angle a then reading pairs (i, i + D/2) preserves their norm."""
    x = torch.randn(2, 3, 4, 8)
    angle = torch.randn(2, 4, 4)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    y = ref.apply_rope(x, cos, sin)
    norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2
    torch.testing.assert_close(norm(y), norm(x))


def test_apply_rope_closed_form_and_hf():
    """D = 2, x = (1, 0) rotated by angle a is (cos a, sin a); any shape equals transformers'
    apply_rotary_pos_emb (the twin must be HF's convention, not only a rotation)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    angle = torch.tensor([0.3, 1.2, -2.0])  # [T]
    cos = torch.stack([angle.cos()] * 2, -1)[None]  # [1, T, 2]
    sin = torch.stack([angle.sin()] * 2, -1)[None]
    y = ref.apply_rope(torch.tensor([1.0, 0.0]).expand(1, 1, 3, 2), cos, sin)
    torch.testing.assert_close(y[0, 0], torch.stack([angle.cos(), angle.sin()], -1))
    q, k = torch.randn(2, 6, 5, 16), torch.randn(2, 3, 5, 16)
    ang = torch.randn(2, 5, 8)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ref.apply_rope(q, cos, sin), hf_q, rtol=0, atol=0)
    torch.testing.assert_close(ref.apply_rope(k, cos, sin), hf_k, rtol=0, atol=0)


def test_rms_norm_and_fused_add():
    x, r, w = torch.randn(5, 33), torch.randn(5, 33), torch.randn(33)
    expect = w * (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-6)
    normed, res = ref.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(normed, expect)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(ref.silu_mul(x, r), x * torch.sigmoid(x) * r)
    small = x * 1e-3  # mean square ~1e-6: eps = 1e-5 moves the result by a factor ~3
    torch.testing.assert_close(ref.rms_norm(small, w, 1e-5),
                               w * small / torch.sqrt((small ** 2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_hfs_bit_for_bit(dtype):
    """The twin is transformers' LlamaRMSNorm operation for operation, in each dtype: bf16 and
    fp16 round where HF rounds (the normalized row to the input dtype, then the weight's product)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96) * 2)
    x = (torch.randn(7, 96) * 3).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(ref.rms_norm(x, hf.weight, 1e-5), hf(x), rtol=0, atol=0)


def test_kv_compact_closed_form():
    """Each cache entry holds its own position, so after the move entry dst_start + i of row b
    must hold src_positions[b, i]; sources out of order and overlapping their destinations,
    a row with count 0 untouched, entries past a row's run untouched."""
    L, B, H, S, D = 2, 3, 2, 12, 3
    pos = torch.arange(S, dtype=torch.float32).view(1, 1, 1, S, 1).expand(L, B, H, S, D)
    k, v = pos.clone(), -pos.clone()
    src = torch.tensor([[5, 2, 9, 0], [3, 4, 5, 6], [1, 1, 1, 1]])
    dst = torch.tensor([1, 4, 0])
    counts = torch.tensor([4, 2, 0], dtype=torch.int32)
    ref.kv_compact(k, v, src, dst, counts)
    want = pos[:, :, :, :, 0].clone()  # [L, B, H, S]
    want[:, 0, :, 1:5] = torch.tensor([5.0, 2, 9, 0])
    want[:, 1, :, 4:6] = torch.tensor([3.0, 4])
    assert torch.equal(k[..., 0], want) and torch.equal(k, k[..., :1].expand_as(k))
    assert torch.equal(v, -k)
