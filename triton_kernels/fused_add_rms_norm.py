"""RMSNorm, alone or fused with the residual add before it (one pass over the hidden state).

Numerics are those of ``reference.fused_add_rms_norm`` (HF LlamaRMSNorm): the new residual is
rounded to the input dtype before it is normalized, the mean of squares is taken in float32,
the normalized row is rounded to the input dtype and then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FP_FUSION, check_device, check_float, empty, require, row_plan


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [N, H], rows at stride H (every tensor here)
    res_ptr,  # [N, H] (unused without HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [N, H]
    new_res_ptr,  # [N, H] (unused without HAS_RESIDUAL)
    H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    base = tl.program_id(0).to(tl.int64) * H
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    s = tl.load(x_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
        s_stored = s.to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + base + cols, s_stored, mask=inside)
        s = s_stored.to(tl.float32)  # normalize the residual as stored, like the reference
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
    normed = (s * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + base + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=inside)


def _canonical(t: torch.Tensor, H: int) -> torch.Tensor:
    """[..., H] -> [N, H] rows at stride H from a 16-byte aligned address: a view where ``t``
    is one, else a fresh copy. Triton specializes a kernel on its pointers' 16-byte alignment and
    its integers' divisibility by 16, and the layout it then gives the loads (elements per thread)
    sets the order in which a row's squares are summed: an offset or row-strided input compiled
    to another binary and gave a row other bits (seen on an H100; ``compile_check`` now compiles
    such views and requires one binary). So every input reaches the kernel as a fresh contiguous
    tensor would, and a row's bits depend on its values, H and the dtype alone."""
    t2 = t.reshape(-1, H)
    if t2.stride(-1) == 1 and (t2.stride(0) == H or t2.shape[0] <= 1) and t2.data_ptr() % 16 == 0:
        return t2
    return t2.clone(memory_format=torch.contiguous_format)


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> int:
    check_device(op, x=x, weight=weight, residual=residual)
    check_float(op, x=x, weight=weight)
    H = x.shape[-1] if x.dim() else 0
    require(x.dim() >= 1 and H >= 1, op, f"x must be [..., H] with H >= 1, got shape {tuple(x.shape)}")
    require(weight.shape == (H,), op, f"weight must be [H] = [{H}], got {tuple(weight.shape)}")
    require(weight.dtype == x.dtype, op, f"weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    if residual is not None:
        require(residual.shape == x.shape and residual.dtype == x.dtype, op,
                f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}")
    return H


def _launch(x, residual, weight, eps, out, new_residual):
    H = x.shape[-1]
    plan = row_plan("rms_norm", H)
    x2 = _canonical(x, H)
    res2 = _canonical(residual, H) if residual is not None else x2
    weight = _canonical(weight, H)[0]  # read at unit stride (a view of every other element once read wrong)
    out2 = out.view(-1, H)
    new2 = new_residual.view(-1, H) if new_residual is not None else out2
    if x2.shape[0] == 0:
        return
    _fused_add_rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, new2, H, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=plan.block, num_warps=plan.num_warps,
        enable_fp_fusion=FP_FUSION)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H] (same dtype) -> weight * normalize(x), [..., H] in x.dtype."""
    _check("rms_norm", x, weight, None)
    out = empty(x.shape, x.dtype, x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H]; weight: [H] -> (rms_norm(residual + x), residual + x), both [..., H]."""
    _check("fused_add_rms_norm", x, weight, residual)
    out = empty(x.shape, x.dtype, x.device)
    new_residual = empty(x.shape, x.dtype, x.device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual


def rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def fused_add_rms_norm_fake(x, residual, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))
