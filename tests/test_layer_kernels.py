"""layer_kernels: the unchecked bound ops give the public ops' bits and follow set_backend."""

import pytest
import torch

from swiftkern import ops, reference
from swiftkern.layer_kernels import LayerKernels
from triton_cases import backend


def _inputs(seed=0, B=2, T=3, Hq=4, Hkv=2, D=8, S=16, H=24, N=40):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(B, Hq, T, D), r(B, Hkv, T, D), r(B, Hkv, T, D)
    cos, sin = r(B, T, D), r(B, T, D)
    positions = torch.tensor([[5, 6, 7], [9, 10, 11]])
    return dict(x=r(B, T, H), res=r(B, T, H), w=r(H) + 1, lw=r(N, H), lb=r(N), gate=r(B, T, N), up=r(B, T, N),
                q=q, k=k, v=v, cos=cos, sin=sin, kc=r(B, Hkv, S, D), vc=r(B, Hkv, S, D), positions=positions,
                lens=torch.tensor([8, 12]))


@pytest.mark.parametrize("name", ["auto", "reference"])
def test_bound_ops_equal_the_public_ops(name):
    a = _inputs()
    with backend(name):
        kern = LayerKernels.for_device("cpu")
        assert kern.backends == {op: ops.backend_for(op, "cpu") for op in kern.backends}
        assert torch.equal(kern.linear(a["x"], a["lw"], a["lb"]), ops.linear(a["x"], a["lw"], a["lb"]))
        assert torch.equal(kern.rms_norm(a["x"], a["w"], 1e-5), ops.rms_norm(a["x"], a["w"], 1e-5))
        got = kern.fused_add_rms_norm(a["x"], a["res"], a["w"], 1e-5)
        want = ops.fused_add_rms_norm(a["x"], a["res"], a["w"], 1e-5)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(kern.silu_mul(a["gate"], a["up"]), ops.silu_mul(a["gate"], a["up"]))
        caches = [(a["kc"].clone(), a["vc"].clone()) for _ in range(2)]
        rope_args = (a["q"], a["k"], a["v"], a["cos"], a["sin"])
        got = kern.rope_kv_append(*rope_args, *caches[0], a["positions"], None, 12)
        want = ops.rope_kv_append(*rope_args, *caches[1], a["positions"], None, 12)
        assert torch.equal(got, want) and torch.equal(caches[0][0], caches[1][0])
        got = kern.verify_attention(a["q"], *caches[0], a["lens"], 0.35, 12, None)
        want = ops.verify_attention(a["q"], *caches[1], a["lens"], 0.35, 12, None)
        assert torch.equal(got, want)


def test_follows_set_backend():
    with backend("reference"):
        kern = LayerKernels.for_device("cpu")
        assert kern.rms_norm is reference.rms_norm and kern.linear is reference.skinny_linear
        assert set(kern.backends.values()) == {"reference"}
    assert LayerKernels.for_device("cpu") is not kern
