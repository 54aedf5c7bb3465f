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
otherwise the mask is the reference's without its argsort.
"""

from __future__ import annotations

import numpy as np
import torch


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
    one bool)."""
    rows = logits.contiguous()
    sorted_values = torch.from_numpy(np.sort(rows.detach().numpy(), axis=-1))  # [N, V] ascending, NaN last as torch's
    remove_sorted = sorted_values.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)  # [N, V]
    remove_sorted[..., -1] = False
    cut = remove_sorted.sum(dim=-1, keepdim=True)  # [N, 1] sorted positions removed
    first_kept = remove_sorted.view(torch.uint8).argmin(dim=-1, keepdim=True)  # [N, 1] (the last is kept)
    prefix = first_kept == cut  # [N, 1]
    smallest_kept = sorted_values.gather(-1, cut)  # [N, 1]
    largest_removed = sorted_values.gather(-1, (cut - 1).clamp(min=0))  # [N, 1]
    exact = prefix & ((cut == 0) | (largest_removed < smallest_kept))  # no copy of smallest_kept is cut
    if not bool(exact.all()):  # a cut inside a tie (or not a prefix): all rows as the reference sorts them
        return top_p_removed_by_sort(rows, top_p)
    return rows < smallest_kept
