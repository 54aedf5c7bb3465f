"""Where a call's host time goes, by sampling its thread's Python stack from a second thread.

cProfile (and ``profile``) build their tree from call and return events, which CPython 3.12+
loses around a pybind11 method (pybind/pybind11#5600): ``torch.inference_mode``'s ``__enter__``
is one, so on CPython 3.12.1 and 3.13.0 a profile of ``Generator.generate`` lacked generate
itself and every loop above a forward. A sampler reads the stack as it is, so it needs no
events: every ``interval`` seconds it records the innermost Python frame (own time: the
function, or the C call it is in, such as a device wait) and each function on the stack
(time inside). Samples land where the thread holds the interpreter or waits in C, at about
the interval (the sampler lowers the interpreter's switch interval to it while it runs).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class StackSamples:
    """Counts of stack samples: ``own`` by innermost function, ``inside`` by every function on
    the stack (once a sample, recursion or not); keys "file:line(function)"."""

    count: int = 0
    seconds: float = 0.0
    calls: int = 0
    own: collections.Counter = field(default_factory=collections.Counter)
    inside: collections.Counter = field(default_factory=collections.Counter)

    def report(self, top: int = 25) -> str:
        """The ``top`` functions by own samples and by samples inside them, as shares."""
        lines = [f"{self.count} stack samples over {self.seconds:.3f} s ({self.calls} calls)"]
        for title, counts in (("own (innermost frame)", self.own), ("inside (on the stack)", self.inside)):
            lines.append(f"  by {title}:")
            for where, n in counts.most_common(top):
                lines.append(f"    {100.0 * n / max(self.count, 1):6.1f} %  {n:7d}  {where}")
        return "\n".join(lines)


def where(frame) -> str:
    code = frame.f_code
    return f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"


def sample_call(fn, interval: float = 2e-4, min_seconds: float = 0.0):
    """Run ``fn()`` on this thread, again and again until ``min_seconds`` have passed (once at
    least: a short call gives few samples), while a second thread samples its stack. -> (the
    last call's result, StackSamples). Only the frames under fn's calls are counted (not this
    function's or its callers', nor the sampler's start and stop)."""
    target, samples, done = threading.get_ident(), StackSamples(), threading.Event()

    def call():
        while True:
            result = fn()
            samples.calls += 1
            if time.perf_counter() - start >= min_seconds:
                return result

    def sampler():
        while not done.is_set():
            frame = sys._current_frames().get(target)
            stack = []
            while frame is not None and frame.f_code is not call.__code__:
                stack.append(where(frame))
                frame = frame.f_back
            if stack and frame is not None:  # under call(): inside fn
                samples.count += 1
                samples.own[stack[0]] += 1
                for key in set(stack):
                    samples.inside[key] += 1
            time.sleep(interval)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, interval))
    thread = threading.Thread(target=sampler, name="stack-sampler", daemon=True)
    start = time.perf_counter()
    thread.start()
    try:
        result = call()
    finally:
        samples.seconds = time.perf_counter() - start
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    return result, samples
