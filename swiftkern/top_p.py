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
otherwise the mask is the reference's without its argsort. numpy sorts the rows over threads; the
cumulative sum, the cut and both checks are one pass a row of the C++ ``ops.top_p_cut``
(torch's CPU cumsum of float32 adds in double, in order: the kernel does the same).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

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
    sorted_values = torch.from_numpy(sorted_rows(rows.detach().numpy()))  # [N, V] ascending, NaN last as torch's
    cut = ops.top_p_cut(sorted_values, sorted_values.softmax(dim=-1), top_p)  # [N] removed, -1: not by value
    if bool((cut < 0).any()):  # a cut inside a tie (or not a prefix): all rows as the reference sorts them
        return top_p_removed_by_sort(rows, top_p)
    return rows < sorted_values.gather(-1, cut.unsqueeze(-1))  # below the smallest kept value


# fewer elements than this are sorted on one thread: handing rows to the pool costs ~0.1 ms (on the
# Xeon, `--routine top_p`: 9 x 1000 logits 0.40 ms on one thread, 0.49 on two; 32 x 1000 0.80 / 0.71)
SPLIT_MIN_ELEMENTS = 32768


def sorted_rows(x: np.ndarray) -> np.ndarray:
    """x: float32 [N, V] -> a copy with each row sorted ascending (NaN last), the rows spread over
    torch's intra-op thread count (numpy copies and sorts without the GIL; its sort takes one row
    after another): the calling thread takes the last share."""
    workers = min(torch.get_num_threads(), x.shape[0])
    if workers <= 1 or x.size < SPLIT_MIN_ELEMENTS:
        return np.sort(x, axis=-1)
    out = np.empty_like(x)
    bounds = [x.shape[0] * i // workers for i in range(workers + 1)]

    def share(i: int) -> None:
        part = out[bounds[i]:bounds[i + 1]]
        part[...] = x[bounds[i]:bounds[i + 1]]
        part.sort(axis=-1)

    others = [_pool(workers - 1).submit(share, i) for i in range(workers - 1)]
    share(workers - 1)
    for job in others:
        job.result()
    return out


_POOLS: dict = {}  # (process id, workers) -> ThreadPoolExecutor (a forked child makes its own)


def _pool(workers: int) -> ThreadPoolExecutor:
    key = (os.getpid(), workers)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="swiftkern-top-p")
    return _POOLS[key]
