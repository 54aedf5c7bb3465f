"""The interpreter speed-up the tests install (interpreter_speed.skip_nested_lang_patches): a
kernel whose helpers reach triton.language as ``tl``, as ``tl.core`` and through ``tl.math`` gives
torch's values, the helpers' re-patching is skipped (one patch a launch), and the modules hold what they held
before the launch."""

import os

import pytest
import torch
import triton
import triton.language as tl
from triton.language import core

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter's (conftest sets TRITON_INTERPRET=1 without a GPU)")


@triton.jit
def _square_plus_one(x):
    return x * x + 1.0


@triton.jit
def _at_least_zero(x):
    return core.maximum(x, 0.0)  # only triton.language.core named here


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, tl.math.exp(tl.sqrt(_at_least_zero(_square_plus_one(x)))) - 1.0, mask=offs < n)


def test_helpers_give_torchs_values_and_skip_the_repatch(monkeypatch):
    from triton.runtime import interpreter

    skip = interpreter._patch_lang
    assert getattr(skip, "skips_nested", False), "conftest did not install the skip"
    patches = []
    monkeypatch.setattr(skip, "inner", lambda fn, inner=skip.inner: patches.append(fn.__name__) or inner(fn))
    before = (tl.load, core.load, tl.math.exp)
    x = torch.randn(300)
    out = torch.full_like(x, float("nan"))
    _helpers_kernel[(3,)](x, out, x.numel(), BLOCK=128)
    torch.testing.assert_close(out, torch.exp(torch.sqrt(x * x + 1)) - 1, rtol=1e-6, atol=1e-6)
    assert patches == ["_helpers_kernel"], patches  # not the 2 helpers x 3 programs
    # as they were (Triton's interpreter itself leaves tl.core patched after some launches: a helper's
    # patch of a module its kernel does not name is never restored)
    assert (tl.load, core.load, tl.math.exp) == before
