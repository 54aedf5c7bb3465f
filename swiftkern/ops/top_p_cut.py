"""``top_p_cut``: where top-p sampling cuts rows sorted ascending (the CPU's top-p mask,
``swiftkern.top_p``)."""

from __future__ import annotations

import torch

from .. import reference
from ..errors import SwiftkernError
from .backends import cpu_kernel


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
    if (not isinstance(sorted_values, torch.Tensor) or not isinstance(probs, torch.Tensor)
            or sorted_values.dim() != 2 or sorted_values.shape != probs.shape or sorted_values.shape[1] < 1):
        raise SwiftkernError("top_p_cut: sorted_values and probs must be tensors of one shape [N, V], V >= 1")
    if sorted_values.dtype != torch.float32 or probs.dtype != torch.float32 or sorted_values.device != probs.device:
        raise SwiftkernError(f"top_p_cut: sorted_values and probs must be float32 on one device, got "
                             f"{sorted_values.dtype} on {sorted_values.device} and {probs.dtype} on {probs.device}")
    if not 0.0 < top_p <= 1.0:
        raise SwiftkernError(f"top_p_cut: top_p must be in (0, 1], got {top_p}")
    if cpu_kernel("top_p_cut", sorted_values.device.type):
        return torch.ops.swiftkern.top_p_cut(sorted_values, probs, float(top_p))
    return reference.top_p_cut(sorted_values, probs, top_p)
