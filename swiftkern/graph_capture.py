"""How one forward is recorded and replayed: a CUDA graph, or its emulation on the CPU (tests).

``CudaGraph``, ``EmulatedGraph`` and ``RecordedGraph`` share one interface, ``capture(fn)`` then
``replay(body=None)`` -> the output (body: the current call's fn, which only ``EmulatedGraph``
runs); ``cuda_graphs.GraphRunner`` takes any. Both emulations run fn under
``no_host_reads()``, which refuses what a real capture refuses (a read of a tensor's value on
the host is a device sync), so a body that would fail to capture on a GPU fails on the CPU too.
``EmulatedGraph`` reruns fn at every replay and refuses one that launches other than the
capture did (host values, addresses: ``launch_log``), naming the launch and argument;
``RecordedGraph`` replays the captured launches as a graph does (fn's Python once, the same
output tensor), so what a caller does with a replay is tested as on a GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import SwiftkernError
from .launch_log import LaunchLog, first_difference, freed_since


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` in a shared memory pool: ``capture(fn)`` records fn's
    launches (on ``stream``), ``replay()`` reruns them and returns the output captured."""

    def __init__(self, pool, stream, keyed=frozenset()):
        self.graph, self.pool, self.stream = torch.cuda.CUDAGraph(), pool, stream
        self.out = None

    def capture(self, fn) -> None:
        # capture_begin/end on our stream rather than torch.cuda.graph(), whose entry runs a full
        # gc.collect() and empty_cache() per capture (tens of ms each with a model loaded)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool)
            try:
                self.out = fn()
            finally:
                self.graph.capture_end()

    def replay(self, body=None) -> torch.Tensor:
        """``body``: the current call's fn, which the emulation reruns; a graph ignores it."""
        self.graph.replay()
        return self.out


_HOST_READS = frozenset(("item", "tolist", "numpy", "cpu", "nonzero", "equal", "__bool__", "__int__", "__float__",
                         "__index__", "__complex__"))
# a tensor made from host data: on a GPU a copy from pageable memory, which a capture refuses (and
# whose values a graph would bake in)
_HOST_DATA = frozenset(("tensor", "as_tensor"))


class _NoHostReadCalls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in _HOST_READS:
            _refuse(func)
        if name in _HOST_DATA:
            raise SwiftkernError(f"a graphed forward made a tensor from host data (torch.{name}); a CUDA graph "
                                 "would bake its values in: pass it as an input")
        return func(*args, **(kwargs or {}))


class _NoHostReadOps(TorchDispatchMode):
    READS = frozenset(getattr(torch.ops.aten, name).default for name in
                      ("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item"))
    # an output whose size follows the values: on a GPU the size is read back (a sync); the CPU
    # kernels count on the host without a nested op that the mode would see
    SIZED_BY_VALUES = frozenset((torch.ops.aten.masked_select.default, torch.ops.aten._unique.default,
                                 torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
                                 torch.ops.aten.unique_consecutive.default))
    MASKS = (torch.bool, torch.uint8)
    REPEATS_FROM_A_TENSOR = frozenset((torch.ops.aten.repeat_interleave.Tensor,
                                       torch.ops.aten.repeat_interleave.self_Tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS or func in self.SIZED_BY_VALUES:
            _refuse(func)
        if func is torch.ops.aten.index.Tensor and any(  # x[mask]
                isinstance(i, torch.Tensor) and i.dtype in self.MASKS for i in args[1]):
            _refuse(func)
        if func in self.REPEATS_FROM_A_TENSOR and kwargs.get("output_size") is None:
            _refuse(func)  # (seen decomposed or not, as the modes above it go)
        return func(*args, **kwargs)


def _refuse(func) -> None:
    raise SwiftkernError(f"a graphed forward read a tensor's value on the host ({getattr(func, '__name__', func)}); "
                         "a CUDA graph cannot capture that")


@contextlib.contextmanager
def no_host_reads():
    """Raises SwiftkernError on every read of a tensor's values on the host inside: ``.item()``,
    ``.tolist()``, ``int(t)``, ``bool(t)``, ``.cpu()``, ``nonzero``, ``torch.equal``, ... (from
    Python, and the aten ops behind them from C++). On a GPU each is a device sync, which a CUDA
    graph capture refuses, and its result would be baked into the graph. The same for a tensor
    made from host data (``torch.tensor``, ``torch.as_tensor``), and for an op whose output
    size follows the values (``x[mask]``, ``masked_select``, ``unique``, ``repeat_interleave``
    by a tensor without ``output_size``): on a GPU that size is read back."""
    with _NoHostReadCalls(), _NoHostReadOps():
        yield


class EmulatedGraph:
    """A stand-in for ``CudaGraph`` where there is no GPU (tests): ``capture`` keeps fn,
    ``replay`` calls it again on the same static buffers, under ``no_host_reads()``, and checks
    that it launched what the first replay (the capture's stand-in) did: the same ops with the
    same host values, reading and writing the same addresses (``launch_log``). A real graph
    would replay the capture's launches whatever the host state is now, so a body whose
    launches depend on host state outside the graph's key fails here. With the cache's host
    lengths hidden while fn runs (``GraphRunner`` does that for both kinds), a body that read
    them fails too; so does a replay after memory the capture read from outside was freed
    (``launch_log.freed_since``)."""

    def __init__(self, pool=None, stream=None, keyed=frozenset()):
        self.fn = None
        self.launches = None  # what the capture launched: launch_log.LaunchLog.launches
        self.external = {}  # and the memory from outside it read: LaunchLog.external
        self.keyed = keyed  # the addresses in the graph's key (launch_log.freed_since)

    def capture(self, fn) -> None:
        self.fn = fn

    def replay(self, body=None) -> torch.Tensor:
        """``body``: the current call's fn (``GraphRunner`` passes it), rerun instead of the
        captured one, which is then let go, as a graph lets the capture's Python go: what only
        the capture's fn kept alive is freed, and a graph that still reads it fails here."""
        if self.launches is not None:
            freed = freed_since(self.external, self.keyed)
            if freed is not None:
                raise SwiftkernError(f"a replay after its capture: {freed}; a CUDA graph would read it at the "
                                     "same address: whatever a graph reads must live as long as the graph")
        fn = self.fn if body is None else body
        if body is not None:
            self.fn = None
        with no_host_reads(), LaunchLog() as log:
            out = fn()
        if self.launches is None:
            self.launches, self.external = log.launches, log.external
        else:
            difference = first_difference(self.launches, log.launches)
            if difference is not None:
                raise SwiftkernError(f"a replay launched differently from its capture: {difference}; a CUDA "
                                     "graph would replay the captured launches: what changed must be in the "
                                     "graph's key or read from a static input tensor")
        return out


class RecordedGraph:
    """The stand-in closest to a CUDA graph (tests): ``capture`` runs fn once under
    ``no_host_reads()`` and records its launches (``launch_log``), then leaves behind what a
    capture does (nothing launched: the state fn changed put back, its own tensors garbage);
    ``replay`` launches the recorded launches again, with the arguments and tensors they had
    then, and returns the same output tensor every time. fn's Python runs once, at the
    capture, as with a real graph: a caller that needs Python to run per call, or that keeps
    a replay's output past the next replay, fails here as on a GPU."""

    def __init__(self, pool=None, stream=None, keyed=frozenset()):
        self.tape, self.out = None, None

    def capture(self, fn) -> None:
        with no_host_reads(), LaunchLog(as_capture=True) as log:
            self.out = fn()
        self.tape = log.tape

    def replay(self, body=None) -> torch.Tensor:
        """``body`` is ignored, as by a graph: the tape runs."""
        for launch in self.tape:
            launch()
        return self.out
