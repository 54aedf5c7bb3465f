"""bench/stack_sampler.py: where a call's time goes, without the call and return events that
CPython 3.12+'s cProfile loses around pybind11 methods (torch.inference_mode's __enter__)."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from stack_sampler import sample_call  # noqa: E402


def spin(steps: int) -> int:
    """Work counted in steps, not timed: a slow or loaded machine slows every call alike."""
    x = 0
    for i in range(steps):
        x += i * i
    return x


def heavy():
    spin(4_000_000)


def light():
    spin(1_000_000)


def sleeper():
    time.sleep(0.05)  # in C, without the interpreter: still sampled


@torch.inference_mode()
def in_inference_mode():
    heavy()


def work():
    light()
    heavy()
    sleeper()
    in_inference_mode()
    return 7


def key_of(fn) -> str:
    code = fn.__code__
    return f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"


def test_samples_split_a_call_by_where_its_time_went():
    result, samples = sample_call(work)
    assert result == 7
    own, inside = samples.own, samples.inside
    assert samples.count > 50 and samples.seconds > 0.15
    assert inside[key_of(work)] == samples.count  # every sample is inside the call, none outside it
    # spin's steps split 1 : 4 : 4 by caller: light < heavy, heavy also under inference mode
    assert 0 < inside[key_of(light)] < inside[key_of(heavy)]
    assert inside[key_of(sleeper)] > 0  # a wait in C (time.sleep) is sampled too
    assert own[key_of(spin)] == max(own.values())  # spin does the work: the innermost frame most often
    # the function cProfile loses on CPython 3.12.1 / 3.13.0 (it enters torch.inference_mode)
    assert inside[key_of(in_inference_mode.__wrapped__)] > 0
    assert "stack samples over" in samples.report() and "by own" in samples.report()


def test_a_short_call_is_repeated_for_min_seconds():
    calls = []
    result, samples = sample_call(lambda: calls.append(spin(10_000)) or len(calls), min_seconds=0.2)
    assert samples.calls == len(calls) == result > 1 and samples.seconds >= 0.2
    assert f"({len(calls)} calls)" in samples.report()


def test_the_interpreters_switch_interval_comes_back():
    before = sys.getswitchinterval()
    sample_call(lambda: spin(10_000))
    assert sys.getswitchinterval() == before
