"""What the Triton kernel tests share: the device, the ONE tolerance table, poisoning, settings.

Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run on CPU tensors
in Triton's interpreter; with a GPU the same tests run natively on it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, settings

from swiftkern import ops, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NATIVE = DEVICE == "cuda"

# Interpreter cost grows with programs x work, so the examples are few without a GPU.
FEW = settings(max_examples=16 if NATIVE else 8, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# (atol, rtol) of a kernel output against the reference on the same inputs. bf16/fp16 outputs
# may differ by one or two units in the last place: the kernels compute in fp32 and round once
# where the reference may round twice, and the interpreter rounds fp32 -> bf16 toward zero.
TOLERANCES = {
    "rms_norm": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)},
    "fused_add_rms_norm": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)},
    "silu_mul": {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-2, 2e-2), torch.float16: (1e-3, 2e-3)},
    "rope_kv_append": {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-2, 2e-2), torch.float16: (1e-3, 2e-3)},
    # against the reference computed in float32 on the same (rounded) inputs
    "verify_attention": {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)},
    # per unit of sqrt(K): both accumulate K products in fp32, in different orders
    "bi_matmul": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)},
    "skinny_linear": {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)},
}


def rope_reference_rounded(q, k, v, cos, sin, cache, positions, *hint):
    """reference.rope_kv_append computed in float32 on the same inputs, rounded once to their
    dtype -> (q rotated, cache [2, B, Hkv, S, D]). What a kernel that computes in fp32 and rounds
    once should give (the CUDA kernel bit for bit). The reference run in bf16 rounds each product
    and the sum: it can be 1.5 units in the last place of the products away from this, more than
    any fixed tolerance where the products cancel (0.03 at |q| ~ 4)."""
    cache32 = cache.float()
    q_rot = reference.rope_kv_append(q.float(), k.float(), v.float(), cos.float(), sin.float(), cache32[0],
                                     cache32[1], positions, *hint)
    return q_rot.to(q.dtype), cache32.to(cache.dtype)


def assert_close(op: str, got: torch.Tensor, want: torch.Tensor, **kw) -> None:
    atol, rtol = TOLERANCES[op][got.dtype]
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, **kw)


@contextlib.contextmanager
def poisoned():
    """Every buffer the launchers allocate starts as NaN / -7777 (see launch.poisoned_outputs)."""
    from swiftkern.triton_kernels.launch import poisoned_outputs

    with poisoned_outputs():
        yield


@contextlib.contextmanager
def backend(name: str):
    ops.set_backend(name)
    try:
        yield
    finally:
        ops.set_backend("auto")


def triton_op(name: str):
    """torch.ops.swiftkern_triton.<name> (importing the kernels registers it)."""
    import swiftkern.triton_kernels  # noqa: F401

    return getattr(torch.ops.swiftkern_triton, name)


def opcheck(op, args) -> None:
    """torch.library.opcheck, all its tests (schema, fake tensor, autograd registration, AOT)."""
    torch.library.opcheck(op, args)


needs_gpu = pytest.mark.skipif(not NATIVE, reason="needs a CUDA GPU (the interpreter tests cover the kernels on CPU)")


H100_SMS = 132  # the streaming multiprocessors of the GPU whose launch plans the interpreter runs


@pytest.fixture(params=["own", "h100"])
def plans(request):
    """A test using it runs twice: in the launch plans of the device the kernels run on, and
    (without a GPU) in an H100's, run by the interpreter (see test_triton_gpu_plans.py)."""
    if request.param == "h100" and NATIVE:
        pytest.skip("on a GPU the kernels run its own plans")
    from swiftkern.triton_kernels.launch import gpu_launch_plans

    with gpu_launch_plans(H100_SMS) if request.param == "h100" else contextlib.nullcontext():
        yield request.param


def check_move_ending_at_the_last_position(device) -> None:
    """ops.kv_compact (whichever backend is in use) with dst_start + counts == S, which is in
    range, and int64 counts, which the wrapper converts, moves as the closed form says: row 0's
    entries 5, 0, 3 land at 3, 4, 5 (two sources inside the destination), row 1 keeps all."""
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(2, 2, 3, 6, 8, generator=g).to(device) for _ in range(2))
    before_k, before_v = k.clone(), v.clone()
    ops.kv_compact(k, v, torch.tensor([[5, 0, 3], [1, 2, 4]], device=device), torch.tensor([3, 6], device=device),
                   torch.tensor([3, 0], device=device))
    assert torch.equal(k[:, 0, :, 3:], before_k[:, 0, :, [5, 0, 3]])
    assert torch.equal(v[:, 0, :, 3:], before_v[:, 0, :, [5, 0, 3]])
    assert torch.equal(k[:, 0, :, :3], before_k[:, 0, :, :3]) and torch.equal(k[:, 1], before_k[:, 1])
    assert torch.equal(v[:, 1], before_v[:, 1])


FAR = 2 ** 31 - 16  # a stride that fits int32 while twice it wraps to -32 in int32 arithmetic
GUARD = 64  # NaN elements before the first view: where an offset wrapped to -32 lands


def views_far_apart(shape, stride, dtype, offsets):
    """NaN-filled views of ``shape`` and ``stride`` (element strides, ~FAR apart) at ``offsets``
    of one buffer of ~2**32 elements -> (buffer, views). Its pages are backed when first
    touched, so only the views and the GUARD elements before them cost memory on the CPU. An
    index computed in int32 lands in the guard or in another view, where a test sees it."""
    extent = sum((n - 1) * s for n, s in zip(shape, stride)) + 1
    buffer = torch.empty(max(offsets) + extent, dtype=dtype, device=DEVICE)
    buffer[:min(offsets)].fill_(float("nan"))
    views = [buffer.as_strided(shape, stride, offset) for offset in offsets]
    for view in views:
        view.fill_(float("nan"))
    return buffer, views
