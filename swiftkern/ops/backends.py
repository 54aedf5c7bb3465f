"""Which backend runs an op on a device: ``SWIFTKERN_BACKEND`` (read at import; ``set_backend``
changes it), the compiled kernels of ``registry.COMPILED`` and the Triton kernels, imported on
first need. The choice is made once per (op, device type) and kept until ``set_backend``.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

from .. import reference
from ..errors import SwiftkernError
from . import registry

BACKENDS = ("auto", "reference", "cpp", "triton", "cuda")

_TRITON = {"loaded": False, "error": None}


def triton_ops(device_type: str) -> set:
    """Ops with a Triton kernel for this device type; imports swiftkern.triton_kernels (and
    triton) on first use and remembers why that failed, if it did."""
    if not _TRITON["loaded"]:
        _TRITON["loaded"] = True
        try:
            importlib.import_module("swiftkern.triton_kernels")
        except Exception as e:  # ImportError without triton; anything a broken triton raises
            _TRITON["error"] = f"{type(e).__name__}: {e}"
    if _TRITON["error"] is not None:
        return set()
    from ..triton_kernels import registered
    return registered(device_type)


def triton_status() -> str:
    triton_ops("cuda")
    if _TRITON["error"] is not None:
        return f"not available ({_TRITON['error']})"
    from ..triton_kernels import interpreting
    version = sys.modules["triton"].__version__
    return f"{version} (TRITON_INTERPRET=1: kernels also run on CPU tensors)" if interpreting() else version


_RESOLVED: dict = {}  # (op, device type) -> backend, for the current SWIFTKERN_BACKEND


def set_backend(name: str) -> None:
    """Choose the backend of the public wrappers: auto | reference | cpp | triton | cuda (see
    ``swiftkern.ops``). An unknown name is refused at the next op call."""
    global _BACKEND
    _BACKEND = name
    _RESOLVED.clear()


set_backend(os.environ.get("SWIFTKERN_BACKEND", "auto").strip().lower() or "auto")


def current_backend() -> str:
    """The backend chosen (auto | reference | cpp | triton | cuda); refuses an unknown name."""
    if _BACKEND not in BACKENDS:
        raise SwiftkernError(f"SWIFTKERN_BACKEND must be one of {', '.join(BACKENDS)}, got {_BACKEND!r}")
    return _BACKEND


def _unavailable(op: str, device_type: str, backend: str) -> str | None:
    """Why ``backend`` cannot run ``op`` on ``device_type`` tensors, or None when it can."""
    hint = "; set SWIFTKERN_BACKEND to auto (or reference)"
    if backend == "cpp":
        if device_type != "cpu":
            return f"cpp is the CPU backend, not for {device_type} tensors{hint}"
        if registry.extension is None:
            return f"the extension is {registry.EXTENSION_STATUS}{hint}"
        if registry.COMPILED.get(op, {}).get("cpu") != "cpp":
            return f"swiftkern._C has no C++ CPU kernel for {op}{hint}"
    elif backend == "cuda":
        if device_type != "cuda":
            return f"cuda is the GPU backend, not for {device_type} tensors{hint}"
        if registry.COMPILED.get(op, {}).get("cuda") != "cuda":
            return (f"swiftkern._C has no CUDA kernel for {op} (extension {registry.EXTENSION_STATUS}); build it with a "
                    f"CUDA torch and nvcc{hint}")
    elif backend == "triton":
        if op not in triton_ops(device_type):
            if _TRITON["error"] is not None:
                return f"swiftkern.triton_kernels cannot be imported ({_TRITON['error']}){hint}"
            if device_type == "cpu":
                return ("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1, set before "
                        f"triton is first imported{hint}")
            return f"there is no Triton kernel for {op} on {device_type}{hint}"
    return None


def resolve(op: str, device_type: str) -> str:
    """The backend that runs ``op`` on ``device_type`` tensors now: reference | cpp | cuda |
    triton. Raises SwiftkernError when a forced backend cannot."""
    key = (op, device_type)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    backend = current_backend()
    if backend == "auto":
        compiled = registry.COMPILED.get(op, {}).get(device_type, "reference")
        if compiled != "reference":
            backend = compiled
        elif device_type == "cuda" and op in triton_ops("cuda"):
            backend = "triton"
        else:
            backend = "reference"
    elif backend != "reference":
        why = _unavailable(op, device_type, backend)
        if why is not None:
            raise SwiftkernError(f"{op}: SWIFTKERN_BACKEND={backend} cannot run on {device_type}: {why}")
    _RESOLVED[key] = backend
    return backend


def backend_for(op: str, device) -> str:
    """The backend ``op`` runs with on tensors of ``device`` (a torch.device or 'cpu'/'cuda'):
    'reference', 'cpp', 'cuda' or 'triton'. Raises SwiftkernError when a forced backend cannot."""
    return resolve(op, torch.device(device).type)


def run(op: str, device: torch.device, *args, **hints):
    """Run ``op`` with the backend for ``device``; reference functions also get the hints."""
    backend = resolve(op, device.type)
    if backend == "reference":
        return getattr(reference, op)(*args, **hints)
    if backend == "triton":
        return getattr(torch.ops.swiftkern_triton, op)(*args)
    return getattr(torch.ops.swiftkern, op)(*args)


def unchecked(op: str, device_type: str):
    """The callable that runs ``op`` on ``device_type`` tensors with the backend chosen now,
    without the public wrapper's input checks: for callers whose inputs are valid by
    construction (the model runner's hot loop; see ``layer_kernels``). Takes the positional
    arguments of ``registry.SCHEMAS[op]``. Triton ops are the launchers themselves, which skips the
    dispatcher's round trip through ``torch.ops``; a new ``set_backend`` needs a new call."""
    backend = resolve(op, device_type)
    if backend == "reference":
        return getattr(reference, op)
    if backend == "triton":
        from ..triton_kernels import KERNELS
        return KERNELS[op][0]
    return getattr(torch.ops.swiftkern, op)


def backend_info() -> dict:
    """What runs where. {"extension": "built (cpu)" | "built (cpu+cuda)" | "not built: <reason>",
    "build": swiftkern._C.build_info() or None, "triton": version or "not available (<why>)",
    "swiftkern_backend": auto | reference | cpp | triton | cuda,
    "ops": {op: {"cpu": backend, "cuda": backend}} with backend reference | cpp | cuda | triton, or
    "unavailable: <why>" for a forced backend that cannot run there,
    "kernels": {op: {"cpu": [...], "cuda": [...]}} the backends built for each op and device}.
    """
    triton = triton_status()
    ops, kernels = {}, {}
    for op in registry.SCHEMAS:
        ops[op], kernels[op] = {}, {}
        for dev in ("cpu", "cuda"):
            try:
                ops[op][dev] = resolve(op, dev)
            except SwiftkernError as e:
                ops[op][dev] = "unavailable: " + str(e).split(": ", 2)[-1]
            built = ["reference"] + [b for b in ("cpp", "cuda") if registry.COMPILED[op][dev] == b]
            built += ["triton"] if op in triton_ops(dev) else []
            kernels[op][dev] = built
    ext = registry.extension
    return {"extension": registry.EXTENSION_STATUS, "build": ext.build_info() if ext is not None else None,
            "triton": triton, "swiftkern_backend": _BACKEND, "ops": ops, "kernels": kernels}


def cpu_kernel(op: str, device_type: str) -> bool:
    """True when ``op``'s C++ kernel may run on tensors of ``device_type``: the CPU, the kernel
    built, and SWIFTKERN_BACKEND auto or cpp. For the ops whose reference is the same function
    (bits aside for linear), other backends take the reference rather than refusing."""
    return device_type == "cpu" and registry.COMPILED[op]["cpu"] == "cpp" and current_backend() in ("auto", "cpp")
