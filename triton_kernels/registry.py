"""Registration of Triton kernels as ``torch.ops.swiftkern_triton.<op>`` custom ops.

Safe to run twice in one process (a reload, or a second import under another name): what was
registered is remembered in a module kept in sys.modules, so nothing is registered twice.
"""

from __future__ import annotations

import torch

from swiftkern import cuda_device
from swiftkern.process_state import process_state

from .launch import interpreting

NAMESPACE = "swiftkern_triton"

# impls: {(op, dispatch key)}; fakes: {op}
_STATE = process_state("swiftkern._triton_state", impls=set(), fakes=set())


def dispatch_keys() -> tuple[str, ...]:
    """CUDA, plus CPU when the interpreter runs the kernels on CPU tensors."""
    return ("CUDA", "CPU") if interpreting() else ("CUDA",)


def register(name: str, schema: str, fn, fake) -> None:
    """Define swiftkern_triton::<name> with ``schema`` (once) and register ``fn`` for the
    dispatch keys of ``dispatch_keys()`` and ``fake`` as its fake implementation."""
    qual = f"{NAMESPACE}::{name}"
    if not hasattr(getattr(torch.ops, NAMESPACE), name):
        torch.library.define(qual, schema)
    for key in dispatch_keys():
        if (name, key) not in _STATE.impls:
            torch.library.impl(qual, key, _on_the_arguments_device(fn))
            _STATE.impls.add((name, key))
    if name not in _STATE.fakes:
        torch.library.register_fake(qual, fake)
        _STATE.fakes.add(name)


def _on_the_arguments_device(fn):
    """fn run with its tensors' CUDA device current (``swiftkern.cuda_device``: Triton launches
    on the current device)."""
    def run(*args):
        with cuda_device.current(cuda_device.of_arguments(args)):
            return fn(*args)

    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "run")
    return run


def registered(device_type: str = "cuda") -> set[str]:
    """Names of the swiftkern_triton ops registered for this device type ('cuda' or 'cpu')."""
    key = device_type.upper()
    return {name for name, k in _STATE.impls if k == key}
