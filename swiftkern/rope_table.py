"""Rotary cos/sin looked up by position from blocks computed once: the same bits for a position
whatever batch or chunk asks for it.

The model's rotary module computes cos/sin for the positions of each forward; torch's
vectorized cos/sin may round an element differently in a SIMD body than in a scalar tail, and
where an element falls depends on the tensor's shape. The batch-invariant runner
(``SkipModel.batch_invariant``) reads them from this table instead: blocks of ``BLOCK``
positions, each computed by the model's own rotary module the first time a position in it is
needed and never recomputed.
"""

from __future__ import annotations

import torch

from .errors import SwiftkernError

BLOCK = 1024  # positions per block
# HF rope types whose frequencies follow the longest position of the forward (dynamic NTK
# scaling, longrope's short/long factors): no table of positions can hold them, and a row's
# rotation depends on the other rows of its batch
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_follows_the_batch(rotary) -> bool:
    """Whether an HF rotary module's cos/sin for a position depend on the forward's positions."""
    kind = str(getattr(rotary, "rope_type", "default"))
    return any(k in kind for k in BATCH_DEPENDENT_ROPE)


def check_deterministic_rope(rotary) -> None:
    """Refuse, for mode deterministic (its invariant kernels read one rotation per position from
    a ``RopeTable``), a rotary module whose frequencies follow the forward's positions."""
    if rope_follows_the_batch(rotary):
        raise SwiftkernError(f"mode deterministic does not support rope_type {rotary.rope_type!r}: its "
                             "frequencies follow the longest position of a forward, and the batch-invariant "
                             "kernels read one rotation per position from a table; use mode ar or self-spec")


class RopeTable:
    """``RopeTable(rotary, dtype, device)``; ``lookup(positions, max_pos)`` -> cos, sin [B, T, D]."""

    def __init__(self, rotary, dtype: torch.dtype, device: torch.device):
        self.rotary, self.dtype, self.device = rotary, dtype, device
        self.cos = self.sin = None  # [positions computed, D]

    def _grow(self, needed: int) -> None:
        have = 0 if self.cos is None else self.cos.shape[0]
        cos, sin = [] if self.cos is None else [self.cos], [] if self.sin is None else [self.sin]
        while have < needed:
            positions = torch.arange(have, have + BLOCK, device=self.device).unsqueeze(0)  # [1, BLOCK]
            probe = torch.zeros((1, BLOCK, 1), dtype=self.dtype, device=self.device)
            c, s = self.rotary(probe, positions)  # [1, BLOCK, D]
            cos.append(c[0])
            sin.append(s[0])
            have += BLOCK
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, D] for every position below at least ``max_pos`` (grown where needed)."""
        if self.cos is None or self.cos.shape[0] < max_pos:
            self._grow(max_pos)
        return self.cos, self.sin

    def lookup(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [B, T], all below ``max_pos`` (a host-side bound) -> cos, sin [B, T, D]."""
        cos, sin = self.tables(max_pos)
        return cos[positions], sin[positions]
