"""``top_p_cut``: where top-p sampling cuts rows sorted ascending (the CPU's top-p mask,
``swiftkern.top_p``)."""

from __future__ import annotations

import torch

from .. import reference
from ..errors import SwiftkernError
from .backends import cpu_kernel
from .checks import check_tensors, one_device


def top_p_cut(sorted_values: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The number of sorted positions HF's top-p rule removes from each row, or -1 where that
    set is not decided by the values alone.

    Args:
        sorted_values: float32 [N, V], V >= 1, each row sorted ascending (NaN last, as torch.sort).
        probs: float32 [N, V], the softmax of sorted_values along V (torch's).
        top_p: the nucleus mass in (0, 1].

    Returns:
        int64 [N]: m where the removed positions (cumulative probability, torch's ``cumsum``,
        <= 1 - top_p; never the last) are exactly the first m and sorted_values[m - 1] <
        sorted_values[m]; -1 where they are not a prefix (a NaN or negative probability) or the
        cut splits a tie (which copy goes is the sort's order, not the values').

    The C++ kernel (CPU, auto/cpp) runs one pass a row, rows over the threads, with the bits of
    ``reference.top_p_cut`` (torch's float32 cumsum on the CPU adds in double, in order); the
    reference runs elsewhere.
    """
    op = "top_p_cut"
    check_tensors(op, sorted_values=sorted_values, probs=probs)
    one_device(op, sorted_values=sorted_values, probs=probs)
    if sorted_values.dim() != 2 or sorted_values.shape != probs.shape or sorted_values.shape[1] < 1:
        raise SwiftkernError(f"{op}: sorted_values and probs must be tensors of one shape [N, V], V >= 1, got "
                             f"{tuple(sorted_values.shape)} and {tuple(probs.shape)}")
    if sorted_values.dtype != torch.float32 or probs.dtype != torch.float32:
        raise SwiftkernError(f"{op}: sorted_values and probs must be float32, got {sorted_values.dtype} and "
                             f"{probs.dtype}")
    if not 0.0 < top_p <= 1.0:
        raise SwiftkernError(f"{op}: top_p must be in (0, 1], got {top_p}")
    if cpu_kernel(op, sorted_values.device.type):
        return torch.ops.swiftkern.top_p_cut(sorted_values, probs, float(top_p))
    return reference.top_p_cut(sorted_values, probs, top_p)
