"""Triton rms_norm and fused_add_rms_norm against reference.py (interpreter on CPU, native on GPU)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, FEW, NATIVE, assert_close, backend, opcheck, poisoned, triton_op

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(shape, generator=g) * 3).to(dtype), torch.randn(shape, generator=g).to(dtype)
    w = (1 + torch.randn(shape[-1], generator=g) / 4).to(dtype)
    return x.to(DEVICE), res.to(DEVICE), w.to(DEVICE)


@FEW
@given(rows=st.sampled_from([(1,), (3,), (2, 5), (1, 1, 7)]), hidden=st.sampled_from([1, 7, 64, 576, 1000]),
       dtype=st.sampled_from(DTYPES), eps=st.sampled_from([1e-5, 1e-6, 0.5]), seed=st.integers(0, 2**16))
def test_matches_reference(rows, hidden, dtype, eps, seed):
    x, res, w = inputs((*rows, hidden), dtype, seed)
    with poisoned():
        out = triton_op("rms_norm")(x, w, eps)
        normed, new_res = triton_op("fused_add_rms_norm")(x, res, w, eps)
    assert_close("rms_norm", out, reference.rms_norm(x, w, eps))
    want_normed, want_res = reference.fused_add_rms_norm(x, res, w, eps)
    if NATIVE:  # one rounding of the same sum (the interpreter rounds toward zero instead)
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
    assert_close("fused_add_rms_norm", new_res, want_res)
    assert_close("fused_add_rms_norm", normed, want_normed)
    assert torch.equal(x, inputs((*rows, hidden), dtype, seed)[0])  # inputs untouched


def test_strided_rows_and_wrappers():
    x, res, w = inputs((6, 2 * 576), torch.float32, 1)
    x, res = x[:, ::2], res[:, 576:]  # rows with a stride: not unit-stride / not contiguous rows
    with backend("triton"), poisoned():
        normed, new_res = ops.fused_add_rms_norm(x, res, w[:576], 1e-5)
        out = ops.rms_norm(x, w[:576], 1e-5)
    want = reference.fused_add_rms_norm(x, res, w[:576], 1e-5)
    assert_close("fused_add_rms_norm", normed, want[0])
    assert_close("fused_add_rms_norm", new_res, want[1])
    assert_close("rms_norm", out, reference.rms_norm(x, w[:576], 1e-5))


def test_a_strided_weight_is_read_at_its_strides():
    """A weight of every other element of a buffer (the GPU run of test_op_views found the kernel
    reading it at unit stride: wrong values from the second column on)."""
    x, res, w = inputs((3, 2 * 37), torch.float32, 2)
    x, res, w = x[:, :37], res[:, :37], w[::2]
    with backend("triton"), poisoned():
        out = ops.rms_norm(x, w, 1e-6)
        normed, new_res = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert_close("rms_norm", out, reference.rms_norm(x, w, 1e-6))
    want = reference.fused_add_rms_norm(x, res, w, 1e-6)
    assert_close("fused_add_rms_norm", normed, want[0])
    assert_close("fused_add_rms_norm", new_res, want[1])


def test_empty_rows():
    x, res, w = inputs((0, 64), torch.float32, 2)
    out, new = triton_op("fused_add_rms_norm")(x, res, w, 1e-5)
    assert out.shape == new.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x, res, w = inputs((3, 576), dtype, 3)
    opcheck(triton_op("rms_norm"), (x, w, 1e-5))
    opcheck(triton_op("fused_add_rms_norm"), (x, res, w, 1e-5))
    opcheck(torch.ops.swiftkern.rms_norm, (x.cpu(), w.cpu(), 1e-5))
    opcheck(torch.ops.swiftkern.fused_add_rms_norm, (x.cpu(), res.cpu(), w.cpu(), 1e-5))


def test_bad_input_is_refused():
    x, res, w = inputs((3, 64), torch.float32, 4)
    with pytest.raises(SwiftkernError, match=r"weight must be \[H\] = \[64\]"):
        ops.rms_norm(x, w[:10], 1e-5)
    with pytest.raises(SwiftkernError, match="share one dtype"):
        ops.fused_add_rms_norm(x, res.half(), w, 1e-5)
    with pytest.raises(SwiftkernError, match="residual must have the shape"):
        ops.fused_add_rms_norm(x, res[:2], w, 1e-5)
    with pytest.raises(SwiftkernError, match="eps must be"):
        ops.rms_norm(x, w, -1.0)
    with pytest.raises(SwiftkernError, match="float32, bfloat16 or float16"):
        ops.rms_norm(x.long(), w.long(), 1e-5)
    with pytest.raises(SwiftkernError, match="weight dtype"):
        triton_op("rms_norm")(x, w.half(), 1e-5)
    wide, wide_w = inputs((1, 65537), torch.float32, 5)[0::2]  # one past launch.MAX_ROW_BLOCK
    with pytest.raises(SwiftkernError, match="wider than the 65536 one Triton program holds"):
        triton_op("rms_norm")(wide, wide_w, 1e-5)
