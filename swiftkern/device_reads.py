"""Host reads of device results, timed.

A read (``tolist``) waits for every kernel queued before it, so on a GPU the time spent in the
decoding loops' reads is the part of decoding the host sat waiting for the device; the rest of
the decode time is host work the device waited for (launch calls, lookups, bookkeeping: the
loops read once a step, so the next step's host work cannot overlap this step's kernels). On
the CPU the kernels have run by the time a read starts: the reads take ~0 s there.
``Generator.generate`` reports both in its stats (``read_wait_s``, ``device_reads``).
The other way across, ``writes_through_numpy`` says where host values are written into tensors
through NumPy instead of torch ops.
"""

from __future__ import annotations

import time

import torch


class ReadClock:
    """Seconds spent in ``read`` and the number of reads, since the process started (a
    process-wide counter, like torch.cuda's memory stats: a caller takes differences)."""

    def __init__(self):
        self.seconds = 0.0
        self.reads = 0

    def snapshot(self) -> tuple[float, int]:
        return self.seconds, self.reads


CLOCK = ReadClock()


def writes_through_numpy(device: torch.device) -> bool:
    """Whether host values bound for tensors on ``device`` are written through NumPy (a view of
    the tensor's memory, or an array made into a tensor) instead of torch ops: on the CPU, where
    each small torch op runs cold after a forward has streamed the weights (SmolLM2, a 2-core AMD
    EPYC: a rollback's ``torch.tensor`` + ``copy_`` ~170 us against ~30 through a view, a verify
    pass's tokens ~100 us a step against ~54). Tests whose CPU tensors stand for device tensors
    turn it off, so the torch ops a GPU runs are what they see."""
    return device.type == "cpu"


def read(t: torch.Tensor) -> list:
    """``t.tolist()``, its wait added to ``CLOCK``."""
    return read_host(t.tolist)


def read_host(fn, *args):
    """``fn(*args)``, timed and counted as a read: ``read``'s ``tolist``, or a call that hands back
    host values itself (a CPU kernel's lists, in place of a ``read`` of its tensors)."""
    start = time.perf_counter()
    out = fn(*args)
    CLOCK.seconds += time.perf_counter() - start
    CLOCK.reads += 1
    return out
