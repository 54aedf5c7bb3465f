"""The interpreter probe of conftest.py: its kernel counts as a loop with a run-time bound must."""

import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="probes Triton's CPU interpreter; on a GPU the kernels are compiled")


@pytest.mark.parametrize("n, cap", [(0, 8), (1, 8), (5, 8), (8, 8), (13, 8), (3, 1)])
def test_the_probe_counts_to_min_of_n_and_cap(n, cap):
    from interpreter_check import count_below

    assert count_below(n, cap) == min(n, cap)

