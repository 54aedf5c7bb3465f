"""Input checks of the public ops: each raises SwiftkernError naming the op, the argument and
what it must be."""

from __future__ import annotations

import torch

from ..errors import SwiftkernError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensors(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise SwiftkernError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def one_device(op: str, **tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise SwiftkernError(f"{op}: all inputs must be on one device, got "
                             + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    return next(iter(devices.values()))


def check_float(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise SwiftkernError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_same_dtype(op: str, **tensors) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise SwiftkernError(f"{op}: inputs must share one dtype, got "
                             + ", ".join(f"{n} {d}" for n, d in dtypes.items()))


def check_float_tensors(op: str, **tensors) -> torch.device:
    """Tensors of one float dtype on one device (the checks above, in that order) -> the device."""
    check_tensors(op, **tensors)
    device = one_device(op, **tensors)
    check_float(op, **tensors)
    check_same_dtype(op, **tensors)
    return device


def check_shape(op: str, name: str, t: torch.Tensor, want: tuple, text: str) -> None:
    """want: a tuple of ints (None matches any size)."""
    if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
        raise SwiftkernError(f"{op}: {name} must be {text}, got shape {tuple(t.shape)}")


def check_cache_layout(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, one_layout: bool) -> None:
    """The kernels' cache layout, whatever the backend: D contiguous (stride 1 along the last
    dim) and, with ``one_layout``, k_cache and v_cache of equal strides (KVCache slices are)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise SwiftkernError(f"{op}: {name} must be contiguous along D (stride 1 in the last dim), got strides "
                                 f"{t.stride()}; pass slices of the KVCache tensors or .contiguous()")
    if one_layout and k_cache.stride() != v_cache.stride():
        raise SwiftkernError(f"{op}: k_cache and v_cache must share one layout, got strides {k_cache.stride()} and "
                             f"{v_cache.stride()}; pass slices of the KVCache tensors or .contiguous()")


def checking_values() -> bool:
    """Value checks need the data on the host: skipped while torch.compile traces."""
    return not torch.compiler.is_compiling()


def check_range(op: str, name: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Raise unless every element of t is in [lo, hi] (one reduction, one sync)."""
    if t.numel() == 0 or not checking_values():
        return
    mn, mx = (int(v) for v in torch.aminmax(t))
    if mn < lo or mx > hi:
        raise SwiftkernError(f"{op}: {name} must be in [{lo}, {hi}] ({what}), got min {mn}, max {mx}")


def check_num_draft(op: str, num_draft: torch.Tensor, K: int, max_draft: int | None = None) -> int | None:
    """Raise unless every num_draft is in [0, K]; -> max(num_draft), or None when not checked
    (empty batch, or while torch.compile traces). ``max_draft``: the caller's host-known
    max(num_draft), checked against K in place of reading num_draft back (no device sync)."""
    if max_draft is not None:
        if not (isinstance(max_draft, int) and not isinstance(max_draft, bool) and 0 <= max_draft <= K):
            raise SwiftkernError(f"{op}: max_draft must be an int in [0, K = {K}] (max(num_draft)), got {max_draft!r}")
        return max_draft
    if torch.compiler.is_compiling() or num_draft.numel() == 0:
        return None
    lo, hi = (int(v) for v in torch.aminmax(num_draft))
    if lo < 0 or hi > K:
        raise SwiftkernError(f"{op}: num_draft values must be in [0, K = {K}], got min {lo}, max {hi}")
    return hi

