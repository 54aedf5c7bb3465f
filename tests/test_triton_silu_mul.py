"""Triton silu_mul against reference.py (interpreter on CPU, native on GPU)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, FEW, assert_close, backend, opcheck, poisoned, triton_op


def inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE),
            torch.randn(shape, generator=g).to(dtype).to(DEVICE))


@FEW
@given(shape=st.sampled_from([(1,), (1, 1536), (3, 7, 1536), (5, 1000), (2, 4099)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_matches_reference(shape, dtype, seed):
    gate, up = inputs(shape, dtype, seed)
    with poisoned():
        out = triton_op("silu_mul")(gate, up)
    assert out.shape == gate.shape
    assert_close("silu_mul", out, reference.silu_mul(gate, up))


def test_extremes_and_non_contiguous_inputs():
    gate = torch.tensor([-1e4, -90.0, -20.0, 0.0, 1e-6, 20.0, 90.0, 1e4, float("inf"), float("-inf")], device=DEVICE)
    up = torch.full_like(gate, 0.5)
    assert_close("silu_mul", triton_op("silu_mul")(gate, up), reference.silu_mul(gate, up), equal_nan=True)
    g, u = inputs((8, 64), torch.float32, 1)
    with backend("triton"), poisoned():
        out = ops.silu_mul(g.t(), u.t())
    assert_close("silu_mul", out, reference.silu_mul(g.t(), u.t()))
    assert triton_op("silu_mul")(g[:0], u[:0]).shape == (0, 64)


@pytest.mark.parametrize("rows,I", [(1, 1536), (3, 7), (37, 1000), (5, 4099)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_halves_of_one_projection_are_read_in_place_with_the_same_bits(rows, I, dtype):
    """gate and up as the column halves of one [.., 2I] buffer (the verifier's grouped
    projection): read in place (no contiguous copies), and the bits of contiguous inputs."""
    g = torch.Generator().manual_seed(rows + I)
    both = (torch.randn(2, rows, 2 * I, generator=g) * 4).to(dtype).to(DEVICE)  # [2, rows, 2I]
    gate, up = both[..., :I], both[..., I:]
    with poisoned():
        out = triton_op("silu_mul")(gate, up)
    assert out.shape == gate.shape and out.is_contiguous()
    assert torch.equal(out, triton_op("silu_mul")(gate.contiguous(), up.contiguous()))
    assert_close("silu_mul", out, reference.silu_mul(gate, up))


def test_halves_skip_the_copies():
    from swiftkern.triton_kernels import silu_mul as module

    both = torch.randn(4, 64, device=DEVICE)
    assert module._row_stride(both[:, :32]) == 64
    assert module._row_stride(both.view(2, 2, 64)[..., 32:]) == 64
    assert module._row_stride(both.t()) is None  # columns apart: copied
    assert module._row_stride(both.view(2, 2, 64)[:, :1, :32]) == 128  # rows 0 and 2 (this said 64: the bug)
    assert module._row_stride(both[::2]) == 128  # rows two apart, still one stride
    assert module._row_stride(torch.randn(2, 3, 64, device=DEVICE)[:, :2]) is None  # two strides: copied
    assert module._row_stride(both[:, :32].view(4, 1, 32)) == 64  # strides (64, 32, 1): the 1 says nothing
    assert module._row_stride(both[:1, :32].view(1, 1, 32)) == 32  # one row


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_rows_of_a_grouped_projection(rows):
    """A decode step's gate and up as the runner's grouped projection gives them: halves of a
    [rows, 2I] buffer viewed as [rows, 1, I], whose size-1 dim has the stride I (torch's view
    picks it). The kernel once read their rows I apart instead of 2I: wrong values, not bits."""
    I = 96
    both = torch.randn(rows, 2 * I, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    gate, up = (half.view(rows, 1, I) for half in both.split([I, I], dim=1))
    with poisoned():
        out = triton_op("silu_mul")(gate, up)
    assert torch.equal(out, triton_op("silu_mul")(gate.contiguous(), up.contiguous()))
    assert_close("silu_mul", out, reference.silu_mul(gate, up))


def test_opcheck():
    gate, up = inputs((3, 96), torch.bfloat16, 2)
    opcheck(triton_op("silu_mul"), (gate, up))
    opcheck(torch.ops.swiftkern.silu_mul, (gate.cpu(), up.cpu()))


def test_bad_input_is_refused():
    gate, up = inputs((3, 96), torch.float32, 3)
    with pytest.raises(SwiftkernError, match="one shape"):
        ops.silu_mul(gate, up[:, :95])
    with pytest.raises(SwiftkernError, match="share one dtype"):
        ops.silu_mul(gate, up.half())
    with pytest.raises(SwiftkernError, match="must be a torch.Tensor"):
        ops.silu_mul(gate, 1.0)
