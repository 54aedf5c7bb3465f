"""Torch's current CUDA device for work on a model's device.

Triton launches a kernel on torch's current CUDA device and its stream (its driver asks for
them), not on the device its tensors are on; torch's own ops and the C++ CUDA ops (a device
guard each) follow the tensors. For a model on ``cuda:1`` the Triton kernels went to
``cuda:0``'s stream with pointers into ``cuda:1``'s memory. Every entry point that launches
them (``Generator.generate``, ``SkipModel.forward``'s device path, the registered
``torch.ops.swiftkern_triton`` ops) runs inside ``current(device)``.
"""

from __future__ import annotations

import contextlib

import torch


def current(device: torch.device | str | None):
    """A context in which ``device`` is torch's current CUDA device; nothing for other devices
    (or None: no tensor to follow)."""
    device = torch.device(device) if device is not None else None
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


def of_arguments(args) -> torch.device | None:
    """The device of the first tensor in ``args`` (or in a list among them), None if none."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            found = of_arguments(a)
            if found is not None:
                return found
    return None
