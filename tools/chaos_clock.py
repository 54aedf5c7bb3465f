"""A pytest plugin that makes ``time.perf_counter`` lie, to find tests whose outcome rests on
timings.

    PYTHONPATH=tools CHAOS_SEED=1 .venv/bin/python -m pytest -q -n 2 -p chaos_clock tests

The clock stays monotonic, but each step of it is the real one times a factor drawn from 0.05,
0.3, 1, 3 or 20 (seeded by CHAOS_SEED and the process id, so every run and every xdist worker
draws its own). The drafter policy's and the replay policy's choices follow what they time, so
under this clock they choose as on a machine that is slow, fast or noisy in turns. A test that
fails here but not under the real clock leans on the timings of the machine it ran on: the
padded-widths test of tests/test_cuda_graphs.py did (before its lookup run was put on the
policy's fixed cost model, 7 of 10 runs failed under a first version of this clock and 2 of 10
under this one; a CI run had failed the same way).

A ``time.sleep`` is told at its real length (a test that sleeps 0.3 s in a step and checks
the step was timed at least that long, as test_deterministic.py's
``test_the_replays_prefill_is_timed_as_prefill`` does, would otherwise fail by construction).
"""

from __future__ import annotations

import os
import random
import time

_FACTORS = (0.05, 0.3, 1.0, 3.0, 20.0)
_real_clock = time.perf_counter
_rng = random.Random(int(os.environ.get("CHAOS_SEED", "0")) * 1_000_003 + os.getpid())
_last = {"real": _real_clock(), "told": _real_clock()}


def _chaos_clock() -> float:
    now = _real_clock()
    step = now - _last["real"]
    _last["real"] = now
    _last["told"] += step * _rng.choice(_FACTORS)
    return _last["told"]


def _told_sleep(seconds: float) -> None:
    _chaos_clock()  # the time so far, lied about as any other step
    _real_sleep(seconds)
    now = _real_clock()
    _last["told"] += now - _last["real"]  # the sleep itself, as long as it was
    _last["real"] = now


_real_sleep = time.sleep
time.perf_counter = _chaos_clock
time.sleep = _told_sleep
