"""Host reads of device results, timed.

A read (``tolist``) waits for every kernel queued before it, so on a GPU the time spent in the
decoding loops' reads is the part of decoding the host sat waiting for the device; the rest of
the decode time is host work the device waited for (launch calls, lookups, bookkeeping: the
loops read once a step, so the next step's host work cannot overlap this step's kernels). On
the CPU the kernels have run by the time a read starts: the reads take ~0 s there.
``Generator.generate`` reports both in its stats (``read_wait_s``, ``device_reads``).
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
