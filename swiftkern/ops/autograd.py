"""Backward formulas for the ops a patched HF model runs (``patching``): ``rms_norm`` and
``silu_mul``. Their kernels (C++, CUDA, Triton) compute forward only; without these a patched
model trained silently wrong (``loss.backward()`` ran, and only the LM head got a gradient).
The gradients are the reference arithmetic's, in float32, returned in each input's dtype.
``register_autograd(namespace)`` attaches them to ``torch.ops.<namespace>.<op>`` once per process.
"""

from __future__ import annotations

import torch

from .registry import _STATE


def _silu_mul_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # gate, up: [..., I]


def _silu_mul_backward(ctx, grad: torch.Tensor):
    """silu(g) * u: d/dg = u * s * (1 + g * (1 - s)) with s = sigmoid(g); d/du = silu(g)."""
    gate, up = ctx.saved_tensors
    g, u, gy = gate.float(), up.float(), grad.float()
    s = torch.sigmoid(g)
    return (gy * u * s * (1 + g * (1 - s))).to(gate.dtype), (gy * g * s).to(up.dtype)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps = inputs  # x: [..., H]; weight: [H]
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad: torch.Tensor):
    """y = w * n, n = x * r, r = rsqrt(mean(x^2) + eps): dw = sum over rows of dy * n,
    dx = r * (dy * w - n * mean(dy * w * n))."""
    x, weight = ctx.saved_tensors
    xf, gy = x.float(), grad.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    n = xf * r
    gn = gy * weight.float()
    gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
    gw = (gy * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
    return gx.to(x.dtype), gw, None


BACKWARDS = {"rms_norm": (_rms_norm_backward, _rms_norm_setup),
             "silu_mul": (_silu_mul_backward, _silu_mul_setup)}


def register_autograd(namespace: str) -> None:
    """Give ``torch.ops.<namespace>``'s rms_norm and silu_mul their backward (once per process)."""
    done = _STATE.autograd
    for op, (backward, setup) in BACKWARDS.items():
        qual = f"{namespace}::{op}"
        if qual in done or not hasattr(getattr(torch.ops, namespace), op):
            continue
        torch.library.register_autograd(qual, backward, setup_context=setup)
        done.add(qual)
