"""ops.greedy_tokens, the greedy pick of every decode step, against torch.argmax: odd
vocabularies, the three float dtypes, ties, NaN and -inf, rows that are strided views of a
forward's [B, T, V] logits, and a vocabulary axis that is not contiguous; on the CPU with the
C++ kernels it must take greedy_accept's kernel, not torch.argmax."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swiftkern import ops
from swiftkern.errors import SwiftkernError
from swiftkern.launch_log import LaunchLog

BUILT = ops.registry.extension is not None
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DRAWN = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def spiked_rows(n: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """[n, V] float32: random rows, some with a tied maximum, a NaN or nothing but -inf."""
    rows = torch.randn(n, V, generator=gen)
    for i in range(n):
        kind = i % 4
        a, b = torch.randint(0, V, (2,), generator=gen).tolist()
        if kind == 1:
            rows[i, a] = rows[i, b] = 50.0  # a tie unless a == b: the lower index wins
        elif kind == 2:
            rows[i, a] = float("nan")  # NaN counts as the maximum
        elif kind == 3 and i % 8 == 3:
            rows[i] = float("-inf")
    return rows


@DRAWN
@given(n=st.integers(1, 9), T=st.integers(1, 4), V=st.sampled_from([1, 2, 31, 33, 1000, 49152]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_greedy_tokens_equal_torch_argmax(n, T, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = spiked_rows(n * T, V, gen).to(dtype).view(n, T, V)  # a forward's logits
    last = logits[:, -1]  # [n, V], rows strided by T * V
    assert torch.equal(ops.greedy_tokens(last), last.argmax(-1))
    across = logits.reshape(n * T, V).t().contiguous().t()  # [n * T, V], V not contiguous
    assert torch.equal(ops.greedy_tokens(across), across.argmax(-1))


@pytest.mark.skipif(not BUILT, reason="swiftkern._C is not built")
def test_greedy_tokens_take_the_cpp_kernel_on_the_cpu():
    logits = torch.randn(3, 1000)
    with LaunchLog() as log:
        got = ops.greedy_tokens(logits)
    names = [name for name, _ in log.launches]
    assert any("swiftkern.greedy_accept" in name for name in names), names
    assert not any("argmax" in name for name in names), names
    assert torch.equal(got, logits.argmax(-1))


def test_greedy_tokens_refuse_what_they_cannot_pick_from():
    for bad in (torch.randn(4), torch.randn(2, 0), torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64)):
        with pytest.raises(SwiftkernError, match="greedy_tokens"):
            ops.greedy_tokens(bad)
    assert ops.greedy_tokens(torch.randn(0, 7)).shape == (0,)
