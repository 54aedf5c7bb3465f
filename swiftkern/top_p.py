"""Which tokens top-p (nucleus) filtering removes: HF's rule, without torch.sort's argsort on the CPU.

HF's ``TopPLogitsWarper`` (and ``top_p_removed_by_sort``, its twin here) sorts a row ascending,
takes the softmax of the sorted row and its cumulative sum, and removes the tokens at the sorted
positions whose cumulative probability is <= 1 - top_p (never the last, most likely one). On the
CPU torch.sort is the whole cost of that: 4-5 ms for one row of SmolLM2's 49152 logits on the
Xeon (a whole decode step is ~8 ms), 23 ms for a verify pass's 9 rows; numpy's value sort takes
0.14 ms for the row.

``top_p_removed`` gets the same mask from the sorted values alone. The cumulative sums depend on
the values and their order only (equal values are interchangeable in them), so the softmax and
cumsum of numpy's sorted row are the reference's bit for bit, and so is m, the number of sorted
positions removed. Those are a prefix of the sorted order (a cumulative sum of non-negative
terms never falls; checked, not assumed), so the tokens removed are the ones below the
smallest kept value, plus, where that value is tied, whichever of its copies torch.sort put
first, an order torch does not define (its CPU sort is not stable). A row whose cut splits
such a tie sends the call to the reference (rare: two logits equal to the bit at the cut);
otherwise the mask is the reference's without its argsort. numpy sorts the rows on the calling
thread; the cumulative sum, the cut and both checks are one pass a row of the C++ ``ops.top_p_cut``
(torch's CPU cumsum of float32 adds in double, in order: the kernel does the same).

Why one thread: inside generation the sort comes right after torch's ops, whose OpenMP threads
spin for a while after each parallel region, so sort threads of our own compete with them for
the cores. On the 2-thread Xeon a thread pool sorted 32 rows of 49152 in 4.2 ms alone (one
thread: 5.5) but 6.0-8.3 ms right after a matmul (one thread: 5.7-5.9; with
OMP_WAIT_POLICY=PASSIVE the pool took 3.9); inside batch-32 sampled decoding the whole mask
took 10.9 ms a call with the pool and 11.0 on one thread (medians of 10 interleaved runs), so
the pool is gone. A sort in C++ on torch's own pool would not compete, but an LSD radix sort
there took 0.54-0.61 ms a row of 49152, numpy's 0.135.
"""

from __future__ import annotations

import numpy as np
import torch

from . import ops


def top_p_removed_by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's top-p rule through torch.sort. logits: float32 [N, V] -> bool [N, V], True where
    the token is removed."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1] = False  # always keep the most likely token
    return remove_sorted.scatter(-1, order, remove_sorted)


def top_p_removed(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``top_p_removed_by_sort``'s mask, bit for bit, with a value sort on the CPU (any other
    device: the sort, which reads nothing back to the host). logits: float32 [N, V] -> bool
    [N, V], True where removed."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.shape[-1] < 2:
        return top_p_removed_by_sort(logits, top_p)
    return removed_from_value_sort(logits, top_p)


def removed_from_value_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The CPU's way of ``top_p_removed``: float32 [N, V] CPU logits, V >= 2 (host reads: numpy,
    the cut per row)."""
    rows = logits.contiguous()
    sorted_values = torch.from_numpy(np.sort(rows.detach().numpy(), axis=-1))  # [N, V] ascending, NaN last as torch's
    cut = ops.top_p_cut(sorted_values, sorted_values.softmax(dim=-1), top_p)  # [N] removed, -1: not by value
    if bool((cut < 0).any()):  # a cut inside a tie (or not a prefix): all rows as the reference sorts them
        return top_p_removed_by_sort(rows, top_p)
    return rows < sorted_values.gather(-1, cut.unsqueeze(-1))  # below the smallest kept value
