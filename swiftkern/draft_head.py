"""A pruned LM head for drafting: logits over a subset of the vocabulary.

A draft step of a small model pays the whole LM head (SmolLM2-135M: 49152 x 576, 21 % of the
model's bytes). The draft only needs tokens it is likely to propose: the tokens already in the
prompt and output, plus the most frequent ones. The ranking of "most frequent" is the
tokenizer's own: byte-level BPE vocabularies number tokens in merge order, and a merge is made
earlier the more often its pair occurs, so low ids are the frequent tokens (on SmolLM2 the
first 8192 ids cover 82 % of the tokens of English prose and Python). Verification always
uses the full head, so the output does not depend on the subset: a draft outside it is simply
never proposed.
"""

from __future__ import annotations

import torch

from .errors import SwiftkernError

DEFAULT_DRAFT_VOCAB = 8192


class DraftHead:
    """The rows of the LM head for a growing set of token ids.

    ``DraftHead(lm_head, bias, num_frequent, context_ids, packed_head)``: lm_head [V, H]; bias
    [V] or None; the subset starts as ids [0, num_frequent) plus ``context_ids`` and grows with
    ``add``; packed_head: the LM head packed (``packed_weights``, uint8 [V, H/32, bytes]) or None,
    whose rows are then kept too. ``head`` is the (weight [n, H], bias [n] or None, packed rows
    [n, H/32, bytes] or None) triple for ``SkipModel.forward(head=...)``; ``ids`` (int64 [n])
    maps a column of the pruned logits back to its token id. ``DraftHead.for_model`` takes a
    SkipModel's head (and its packed copy).
    """

    def __init__(self, lm_head: torch.Tensor, bias: torch.Tensor | None, num_frequent: int = DEFAULT_DRAFT_VOCAB,
                 context_ids=(), packed_head: torch.Tensor | None = None):
        V, H = lm_head.shape
        if num_frequent < 1:
            raise SwiftkernError(f"draft vocabulary must keep >= 1 frequent token, got {num_frequent}")
        self.lm_head, self.bias, self.packed_head = lm_head, bias, packed_head
        self.vocab_size = V
        first = list(range(min(num_frequent, V)))
        self._member = torch.zeros(V, dtype=torch.bool)  # host-side membership
        self._member[: len(first)] = True
        self._ids = first
        self._capacity = 0
        # row buffers of (lm_head, bias, packed_head), [capacity, ...] each (None where the source
        # is None); rows [0, n) are live
        self._rows: list = [None, None, None]
        self._grow(len(first) + 1024)
        self._fill(0, first)
        self.add(context_ids)

    @classmethod
    def for_model(cls, model, num_frequent: int = DEFAULT_DRAFT_VOCAB, context_ids=()) -> "DraftHead":
        """The pruned head of a SkipModel's LM head (with its packed rows where the model reads
        packed weights)."""
        return cls(model.lm_head, model.lm_head_bias, num_frequent, context_ids, model.packed_head)

    def __len__(self) -> int:
        return len(self._ids)

    def _sources(self) -> tuple:
        return self.lm_head, self.bias, self.packed_head

    def _grow(self, capacity: int) -> None:
        n = len(self._ids) if self._capacity else 0
        for i, src in enumerate(self._sources()):
            if src is not None:
                rows = src.new_empty((capacity, *src.shape[1:]))
                if n:
                    rows[:n] = self._rows[i][:n]
                self._rows[i] = rows
        self._capacity = capacity

    def _fill(self, start: int, ids: list[int]) -> None:
        index = torch.tensor(ids, dtype=torch.int64, device=self.lm_head.device)
        for src, rows in zip(self._sources(), self._rows):
            if src is not None:  # straight into the buffer: a temporary of 8192 rows cost ~10 ms of page faults
                torch.index_select(src.detach(), 0, index, out=rows[start:start + len(ids)])
        self._ids_t = None

    def add(self, token_ids) -> None:
        """Add the ids not yet in the subset (out-of-range ids are refused)."""
        new = []
        for t in token_ids:
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise SwiftkernError(f"draft head: token id {t} outside [0, {self.vocab_size})")
            if not self._member[t]:
                self._member[t] = True
                new.append(t)
        if not new:
            return
        n = len(self._ids)
        if n + len(new) > self._capacity:
            self._grow(2 * (n + len(new)))
        self._fill(n, new)
        self._ids.extend(new)

    @property
    def head(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        n = len(self._ids)
        return tuple(rows[:n] if rows is not None else None for rows in self._rows)

    @property
    def ids(self) -> torch.Tensor:
        if self._ids_t is None:
            self._ids_t = torch.tensor(self._ids, dtype=torch.int64, device=self.lm_head.device)
        return self._ids_t

    def to_full(self, pruned: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Scatter pruned values [..., n] into full-vocabulary ones [..., V] (``fill`` elsewhere)."""
        full = pruned.new_full((*pruned.shape[:-1], self.vocab_size), fill)
        full.index_copy_(-1, self.ids, pruned)
        return full
