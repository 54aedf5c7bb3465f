"""The launches a graphed body makes, in the terms a CUDA graph bakes in (for the CPU stand-ins
``EmulatedGraph`` and ``RecordedGraph`` in graph_capture.py).

A CUDA graph replays the launches its capture recorded with the arguments they had then: every
host value (a size, a flag, an eps, a grid) and the address of every tensor it reads or writes
that was not made inside the graph. ``EmulatedGraph`` reruns the body instead, so a body whose
launches follow host state outside the graph's key (an attribute changed since the capture, a
table reallocated at a new address) is right on the CPU and wrong from a real graph.
``LaunchLog`` records each launch as such a signature, so the emulation can compare every
replay's launches with its capture's, and as a callable that launches it again (the tape
``RecordedGraph`` replays):

- every aten and ``torch.ops.swiftkern`` op (a ``TorchDispatchMode``), with its arguments;
- Triton launches (``JITFunction.run``, and the interpreter's ``InterpretedFunction.run``), with
  the grid and the launch options;
- calls that launch work outside both (``opaque_call``: the C++ decoder stack), whose inner ops
  are not logged one by one.

A tensor argument is named by where it comes from: made inside the body, by the position of the
launch that made it (its address may change from run to run, as a graph's pool would not let
it); else by its address, shape, strides and dtype. The storages from outside are also kept as
weak references (``LaunchLog.external``): a graph does not keep them alive, so one freed after
the capture leaves the graph reading whatever the allocator put there next (``freed_since``),
which an address compare misses when the allocator hands the same address back.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The LaunchLog recording now in this thread, if any: per thread, as the dispatch mode it is
# (another thread's launches are not the body's)
_ACTIVE = threading.local()


def _active():
    return getattr(_ACTIVE, "log", None)


class LaunchLog(TorchDispatchMode):
    """``with LaunchLog() as log: body()`` -> ``log.launches``: one (name, arguments) tuple of
    plain values per launch, in launch order; two runs of a body launch alike when their
    lists are equal. ``log.tape``: one callable per launch that launches it again with the
    same arguments (the same tensors) and copies what it returns into the tensors it returned
    the first time, as a graph's replay rewrites its outputs in place.

    ``LaunchLog(as_capture=True)`` leaves behind what a CUDA capture does, which launches
    nothing: every tensor not made inside is put back as it was before (their storages saved
    at first sight), and the storages of the tensors made inside are filled with 0xff bytes
    (NaN, -1) until a replay writes them."""

    def __init__(self, as_capture: bool = False):
        super().__init__()
        self.launches: list = []
        self.tape: list = []
        self.as_capture = as_capture
        self._made: dict = {}  # id(tensor) -> (launch index, output index)
        self._keep: list = []  # the tensors in _made, alive while recording so ids stay unique
        self._saved: dict = {}  # storage address -> (its bytes, a copy): tensors not made inside
        # storage address -> (a weak reference to the storage, the first launch that read it, the
        # addresses of the tensors read from it): memory from outside the body, which a graph
        # reads at those addresses on every replay
        self.external: dict = {}
        self._paused = 0

    def __enter__(self):
        if _active() is not None:
            raise RuntimeError("LaunchLog does not nest")
        self._patches = _patch_triton_launches()
        self._patches.__enter__()
        try:
            entered = super().__enter__()
        except BaseException:
            self._patches.__exit__(None, None, None)
            raise
        _ACTIVE.log = self  # last: a failed entry leaves no log recording
        return entered

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.__exit__(*exc)
            _ACTIVE.log = None
            if self.as_capture:
                self._undo()
            self._made, self._keep, self._saved = {}, [], {}

    def _undo(self) -> None:
        for whole, copy in self._saved.values():
            whole.copy_(copy)
        for t in self._keep:
            if _storage_key(t) not in self._saved:
                _bytes(t).fill_(0xFF)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        return self._record(str(func), lambda: func(*args, **kwargs), (args, kwargs))

    def _record(self, name: str, run, arguments):
        index = len(self.launches)
        self.launches.append((name, self._signature(arguments)))
        tensors = [t for t in tree_leaves(arguments) if isinstance(t, torch.Tensor)]
        self._paused += 1
        try:
            if self.as_capture:
                for t in tensors:
                    if id(t) not in self._made and _storage_key(t) not in self._saved:
                        whole = _bytes(t)
                        self._saved[_storage_key(t)] = (whole, whole.clone())
            out = run()
        finally:
            self._paused -= 1
        for t in tensors:
            if id(t) not in self._made:
                if _storage_key(t) not in self.external:
                    self.external[_storage_key(t)] = (StorageWeakRef(t.untyped_storage()), f"launch {index} ({name})",
                                                      set())
                self.external[_storage_key(t)][2].add(t.data_ptr())
        inputs = {id(t) for t in tensors}
        read = {_storage_key(t) for t in tensors}
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for j, t in enumerate(made):
            if id(t) not in inputs and id(t) not in self._made:
                self._made[id(t)] = (index, j)
                self._keep.append(t)
        fresh = [(j, t) for j, t in enumerate(made) if _storage_key(t) not in read]  # not views or in place
        self.tape.append(functools.partial(_launch_again, run, fresh))
        return out

    def _signature(self, x):
        if isinstance(x, torch.Tensor):
            where = self._made.get(id(x))
            if where is None:
                where = ("at", x.data_ptr(), str(x.device))
            return ("tensor", where, tuple(x.shape), x.stride(), x.storage_offset(), str(x.dtype))
        if isinstance(x, (list, tuple)):
            return tuple(self._signature(y) for y in x)
        if isinstance(x, dict):
            return tuple((k, self._signature(v)) for k, v in sorted(x.items()))
        if isinstance(x, float):
            return ("float", repr(x))  # exact: repr round-trips
        if x is None or isinstance(x, (bool, int, str)):
            return (type(x).__name__, x)
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(x).__name__, str(x))
        if callable(x):  # a Triton grid function: the launch's sizes are in its other arguments
            return ("callable", getattr(x, "__qualname__", type(x).__name__))
        value = getattr(x, "value", None)  # triton.language.constexpr
        return (type(x).__name__, self._signature(value) if value is not None else repr(x))


def freed_since(external: dict, keyed=frozenset()) -> str | None:
    """The first of ``LaunchLog.external``'s storages freed since it was recorded, in words
    (None: all alive). A CUDA graph would go on reading and writing that address, whatever
    now lives there. A storage read at an address in ``keyed`` (the graph's key: the runner
    replays the graph only while that address holds what its key says, e.g. a cache made anew at
    the same place) may have been replaced; the others must be the very storages of the capture."""
    for ref, where, addresses in external.values():
        if ref.expired() and not addresses & keyed:
            return f"{where} used memory from outside the graph that has been freed since"
    return None


def _launch_again(run, fresh: list) -> None:
    out = run()
    if fresh:
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for j, target in fresh:
            target.copy_(made[j])


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t``, as uint8 [nbytes]."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def first_difference(captured: list, now: list) -> str | None:
    """Where two ``LaunchLog.launches`` lists first differ, in words (None: they are equal):
    the launch, its name and the argument (a path of indices into its arguments) with both
    values."""
    for i, (a, b) in enumerate(zip(captured, now)):
        if a == b:
            continue
        if a[0] != b[0]:
            return f"launch {i} was {a[0]}, now {b[0]}"
        path, x, y = _first_leaf_difference(a[1], b[1], ())
        return f"launch {i} ({a[0]}), argument {'.'.join(map(str, path))}: {x} at the capture, now {y}"
    if len(captured) != len(now):
        return f"{len(captured)} launches at the capture, now {len(now)}"
    return None


def _first_leaf_difference(a, b, path: tuple):
    leaf = lambda v: not isinstance(v, tuple) or not v or isinstance(v[0], str)  # noqa: E731 (tagged values)
    if leaf(a) or leaf(b) or len(a) != len(b):
        return path, a, b
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return _first_leaf_difference(x, y, path + (j,))
    return path, a, b


def opaque_call(name: str, fn, *args):
    """fn(*args), logged as one launch named ``name`` while a LaunchLog records (its inner ops
    are not logged; the tensors it returns count as made by it)."""
    return _launch(name, lambda: fn(*args), args)


def _launch(name: str, run, arguments):
    """run(), recorded as one launch of ``arguments`` by the LaunchLog recording now, if any
    (and not inside another recorded launch)."""
    log = _active()
    if log is None or log._paused:
        return run()
    return log._record(name, run, arguments)


@contextlib.contextmanager
def _patch_triton_launches():
    """Triton's launch entry points logged as launches while a LaunchLog records."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    saved = [(cls, cls.__dict__["run"]) for cls in classes if "run" in cls.__dict__]

    def logged(original):
        def run(self, *args, grid, warmup, **kwargs):
            launch = lambda: original(self, *args, grid=grid, warmup=warmup, **kwargs)  # noqa: E731
            if warmup:  # compiles, launches nothing
                return launch()
            name = "triton:" + getattr(getattr(self, "fn", None), "__name__", type(self).__name__)
            return _launch(name, launch, (args, grid, kwargs))
        return run

    for cls, original in saved:
        cls.run = logged(original)
    try:
        yield
    finally:
        for cls, original in saved:
            cls.run = original
