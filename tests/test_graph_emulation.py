"""The CPU stand-ins for a CUDA graph (swiftkern/graph_capture.py, swiftkern/launch_log.py) on
small bodies whose right answer is known: what a real graph would do is worked out by hand.

A CUDA graph launches nothing while it captures, and each replay launches the captured kernels
with the arguments they had then (host values, tensor addresses) into the same output tensors.
``RecordedGraph`` must behave so; ``EmulatedGraph`` reruns the body and must refuse a replay
whose launches differ from the capture's.
"""

from __future__ import annotations

import math

import pytest
import torch

from swiftkern.errors import SwiftkernError
from swiftkern.graph_capture import EmulatedGraph, RecordedGraph
from swiftkern.launch_log import LaunchLog, first_difference


def _body(state, buf, host):
    """out = buf * host["scale"] + 1, and state += out.sum() in place."""
    def fn():
        out = buf * host["scale"] + 1  # [4]
        state.add_(out.sum())
        return out
    return fn


def test_recorded_capture_launches_nothing_and_replays_the_captured_host_values():
    buf, state, host = torch.arange(4.0), torch.zeros(()), {"scale": 2.0}
    graph = RecordedGraph()
    graph.capture(_body(state, buf, host))
    assert state.item() == 0.0  # a capture changes nothing
    assert torch.isnan(graph.out).all()  # its own tensors hold garbage until a replay
    out = graph.replay()
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0] and state.item() == 16.0
    host["scale"] = 10.0  # host state after the capture: a real graph never sees it
    buf.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))  # tensor contents: a real graph reads them
    again = graph.replay()
    assert again is out  # the same output tensor every replay
    assert again.tolist() == [3.0] * 4 and state.item() == 28.0


def test_recorded_replay_rewrites_the_previous_output():
    """A caller keeping a replay's output past the next replay sees it overwritten (hence the
    runner's clone)."""
    buf, state = torch.arange(4.0), torch.zeros(())
    graph = RecordedGraph()
    graph.capture(_body(state, buf, {"scale": 1.0}))
    first = graph.replay()
    kept = first.tolist()
    buf.add_(100)
    graph.replay()
    assert first.tolist() != kept


def test_recorded_graph_keeps_views_and_in_place_writes_on_the_captured_tensors():
    """Views of inputs and in-place writes go to the captured addresses: a row of a cache
    written through an index, then read back through a view."""
    cache = torch.zeros(3, 4)
    rows = torch.tensor([2])
    values = torch.ones(1, 4)

    def fn():
        cache.index_copy_(0, rows, values * 5)
        return cache[2].clone() + cache.sum()

    graph = RecordedGraph()
    graph.capture(fn)
    assert cache.abs().sum().item() == 0.0
    assert graph.replay().tolist() == [25.0] * 4
    rows.fill_(0)
    values.fill_(2)
    out = graph.replay()  # row 0 now gets 10s; row 2 keeps its 5s: the clone of row 2 + the total 60
    assert cache[0].tolist() == [10.0] * 4 and out.tolist() == [65.0] * 4


def test_emulated_graph_refuses_a_replay_with_other_host_values():
    buf, state, host = torch.arange(4.0), torch.zeros(()), {"scale": 2.0}
    graph = EmulatedGraph()
    graph.capture(_body(state, buf, host))
    graph.replay()
    graph.replay()
    host["scale"] = 3.0
    with pytest.raises(SwiftkernError, match=r"launch 0 \(aten.mul.Tensor\), argument 0.1: \('float', '2.0'\) at "
                                             r"the capture, now \('float', '3.0'\)"):
        graph.replay()


def _reads_held_table(holder: dict):
    """A body that reads holder["buf"] (whatever it holds at the call) into a running total."""
    state = torch.zeros(())

    def fn():
        out = holder["buf"] * 2
        state.add_(out.sum())
        return out
    return fn


def test_emulated_graph_refuses_a_replay_reading_a_tensor_at_another_address():
    holder = {"buf": torch.arange(4.0)}
    graph = EmulatedGraph()
    graph.capture(_reads_held_table(holder))
    graph.replay()
    before = holder["buf"]  # kept alive: this test is about the address alone
    holder["buf"] = torch.arange(4.0) + 0  # the same values at a new address
    with pytest.raises(SwiftkernError, match=r"launch 0 \(aten.mul.Tensor\), argument 0.0"):
        graph.replay()
    assert before.sum() == 6


def test_emulated_graph_refuses_a_replay_after_memory_it_read_was_freed():
    """A graph reads the capture's addresses but keeps nothing alive: a table freed after the
    capture (and maybe handed out again at the same address, as the CPU allocator did in the
    verifier's case) is refused, whether the body passed at replay reads the new one or not."""
    holder = {"buf": torch.arange(4.0)}
    fn = _reads_held_table(holder)
    graph = EmulatedGraph()
    graph.capture(fn)
    graph.replay(fn)
    graph.replay(fn)
    holder["buf"] = torch.arange(4.0) + 0  # the capture's table freed
    with pytest.raises(SwiftkernError, match=r"launch 0 \(aten.mul.Tensor\) used memory from outside the graph "
                                             r"that has been freed since"):
        graph.replay(fn)


def test_a_replay_lets_go_of_the_capturing_body():
    """A graph keeps none of the capturing call's Python: a table that only the capture's body
    held is freed once a replay runs the current call's body, and a later replay, which would
    read the capture's address, is refused as a read of freed memory (the verifier's table in
    f0bf2ed). A stand-in that kept the body alive would hide that."""
    def body_over(table):
        def fn():
            return table * 2
        return fn

    graph, first = EmulatedGraph(), body_over(torch.arange(4.0))  # the capture's table: held by its body alone
    graph.capture(first)
    graph.replay(first)  # the capturing call's replay
    del first  # that call is over
    with pytest.raises(SwiftkernError, match="used memory from outside the graph that has been freed since"):
        graph.replay(body_over(torch.arange(4.0) + 2))


def test_launch_log_names_tensors_made_inside_by_their_launch():
    """Two runs of one body allocate their temporaries anew (other addresses, after a third
    tensor took the first's): the logs are equal all the same, and differ where a host value does."""
    x = torch.randn(5, 3)

    def body(k):
        y = x.softmax(-1) * k  # a temporary, then one made from it
        return (y + 1).sum(0)

    with LaunchLog() as a:
        body(2.0)
    keep = torch.empty(1000)  # noqa: F841 (moves later allocations)
    with LaunchLog() as b:
        body(2.0)
    with LaunchLog() as c:
        body(2.5)
    assert a.launches == b.launches and len(a.launches) >= 4
    assert first_difference(a.launches, b.launches) is None
    assert "argument 0.1" in first_difference(a.launches, c.launches)
    made = [arg for name, (args, _kw) in a.launches for arg in args if arg[0] == "tensor" and arg[1][0] != "at"]
    assert made, "the temporaries are named by their launch"


def test_launch_log_counts_fewer_launches():
    x = torch.ones(3)
    with LaunchLog() as a:
        (x + 1).sum()
    with LaunchLog() as b:
        x + 1
    assert first_difference(a.launches, b.launches) == f"{len(a.launches)} launches at the capture, now 1"


def test_launch_log_does_not_nest():
    with LaunchLog():
        with pytest.raises(RuntimeError, match="does not nest"):
            LaunchLog().__enter__()


def test_a_failed_entry_leaves_no_log_recording(monkeypatch):
    """A LaunchLog whose entry failed (patching Triton's launches, pushing the dispatch mode)
    left itself as the one recording: every later LaunchLog in the process then raised "does
    not nest", and every emulated capture and replay failed with it."""
    import swiftkern.launch_log as launch_log

    def broken():
        raise RuntimeError("patching failed")

    monkeypatch.setattr(launch_log, "_patch_triton_launches", broken)
    with pytest.raises(RuntimeError, match="patching failed"):
        LaunchLog().__enter__()
    monkeypatch.undo()
    with LaunchLog() as log:
        torch.ones(2) + 1
    assert [name for name, _ in log.launches][-1] == "aten.add.Tensor"


def test_another_threads_launches_are_not_the_bodys():
    """The dispatch mode records this thread's ops only; a launch logged by name (``opaque_call``,
    Triton's) from another thread went into the recording thread's log too, so a body's launches
    depended on what other threads ran meanwhile."""
    import threading

    from swiftkern.launch_log import opaque_call

    started, release = threading.Event(), threading.Event()
    x = torch.ones(3)

    def other():
        release.wait(5)
        opaque_call("other_thread_kernel", torch.neg, x)
        started.set()

    worker = threading.Thread(target=other)
    worker.start()
    with LaunchLog() as log:
        opaque_call("body_kernel", torch.abs, x)
        release.set()
        assert started.wait(5)
    worker.join()
    assert [name for name, _ in log.launches] == ["body_kernel"]


def test_recorded_capture_refuses_host_reads():
    """The refusal ends the capture, which still puts back what the body had changed."""
    graph = RecordedGraph()
    x = torch.ones(3)
    with pytest.raises(SwiftkernError, match="read a tensor's value on the host"):
        graph.capture(lambda: x.add_(1).sum().item())
    assert math.isclose(x.sum().item(), 3.0)


def test_a_freed_storage_whose_address_is_in_the_key_may_be_replaced():
    """A runner keys a graph on the addresses it reads (a call's cache): a new cache made at the
    same address is what the graph should read, so only the storages read at addresses outside
    the key must outlive the capture (``freed_since``)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from swiftkern.launch_log import freed_since

    table = torch.arange(4.0)
    address = table[1:].data_ptr()  # read as a view into the storage
    external = {("cpu", table.data_ptr()): (StorageWeakRef(table.untyped_storage()), "launch 3 (x)", {address})}
    assert freed_since(external) is None
    del table
    assert freed_since(external) == "launch 3 (x) used memory from outside the graph that has been freed since"
    assert freed_since(external, keyed=frozenset({address})) is None
    assert freed_since(external, keyed=frozenset({address + 4})) is not None
