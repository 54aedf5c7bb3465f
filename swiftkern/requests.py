"""Per-request output, stop rules, and which requests are still in the batch."""

from __future__ import annotations

import torch

from .kv_cache import KVCache


class Requests:
    """The new tokens of each request and when it stops.

    A request stops right after a stop token, when ``stop_check(r, tokens)`` says so, or at
    ``max_new_tokens``, even in the middle of a run of tokens committed at once. Batch row i of
    the cache holds request ``alive[i]``; ``drop_finished`` removes finished rows so they cost
    no further work, the last rows moving into the freed ones (the order of ``alive`` is
    not the order of arrival). ``on_commit(r, tokens)``, when given, is called with the tokens each
    commit appended (never empty): committed tokens are final in every mode, so this is what a
    stream shows. ``arrive_at[r]``: the decoding step at which request r joins the batch (0:
    from the start; default all 0), as requests arrive at a server while others decode; the
    loop advances ``step`` and ``admit`` adds those due as new cache rows; ``invariant_prefill``:
    whether their prompts run through the batch-invariant kernels (``SkipModel.batch_invariant``;
    True where the whole call does, mode deterministic without replay) or the regular ones, as
    the first prompts of the call did.
    """

    def __init__(self, num: int, max_new_tokens: int, stop_ids: frozenset[int], stop_check=None,
                 on_commit=None, arrive_at: list[int] | None = None, invariant_prefill: bool = False):
        self.out: list[list[int]] = [[] for _ in range(num)]
        self.done = [False] * num
        self.arrive_at = [0] * num if arrive_at is None else [int(s) for s in arrive_at]
        self.alive = [r for r in range(num) if self.arrive_at[r] == 0]
        self.waiting = sorted((r for r in range(num) if self.arrive_at[r] > 0), key=lambda r: (self.arrive_at[r], r))
        self.step = 0  # the decoding loop's step: a waiting request joins once it reaches its arrive_at
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.stop_check = stop_check
        self.on_commit = on_commit
        self.invariant_prefill = invariant_prefill

    def commit(self, r: int, tokens: list[int]) -> None:
        """Append tokens to request r up to (and including) the one that stops it."""
        out = self.out[r]
        before = len(out)
        for t in tokens:
            out.append(t)
            if self.stops(r, out) or len(out) >= self.max_new_tokens:
                self.done[r] = True
                break
        if self.on_commit is not None and len(out) > before:
            self.on_commit(r, out[before:])

    def stops(self, r: int, tokens: list[int]) -> bool:
        """Whether request r stops after ``tokens`` (its output, then what would follow it): the
        last is a stop id, or the text holds a stop string (``stop_check``). max_new_tokens aside."""
        return tokens[-1] in self.stop_ids or (self.stop_check is not None and self.stop_check(r, tokens))

    def admit(self, cache: KVCache) -> tuple[list[int], list[int]]:
        """The waiting requests due by ``step`` join the batch, in arrival order: rows appended
        to ``cache`` after the alive ones, or in place of every row when none is alive (the
        step then jumps to the next arrival: an empty batch waits for it). -> (the requests,
        their cache rows), both empty when none is due."""
        if not self.waiting:
            return [], []
        empty = not self.alive
        if empty:
            self.step = max(self.step, self.arrive_at[self.waiting[0]])
        due = [r for r in self.waiting if self.arrive_at[r] <= self.step]
        if not due:
            return [], []
        most = len(self.alive) + len(self.waiting)  # rows the cache can ever need from here on
        self.waiting = self.waiting[len(due):]
        self.alive = self.alive + due
        return due, cache.add_rows(len(due), replace=empty, reserve=most)

    def remaining(self, r: int) -> int:
        return self.max_new_tokens - len(self.out[r])

    def drop_finished(self, cache: KVCache, rows: torch.Tensor) -> torch.Tensor | None:
        """Keep only unfinished rows in the cache and in ``rows`` ([B, ...], indexed like the
        cache). -> the kept part of ``rows``, or None when every request is done."""
        keep = [i for i, r in enumerate(self.alive) if not self.done[r]]
        if not keep:
            self.alive = []
            return None
        if len(keep) < len(self.alive):
            keep = fill_freed_rows(keep)
            cache.select_rows(keep)
            rows = rows[keep]
            self.alive = [self.alive[i] for i in keep]
        return rows


def fill_freed_rows(kept: list[int]) -> list[int]:
    """The batch order after a departure: the kept rows (ascending) below the new batch size stay
    where they are and the kept rows past it fill the freed ones, so the fewest rows move.
    -> new row j holds old row result[j]."""
    n = len(kept)
    tail = iter(r for r in kept if r >= n)
    stays = set(kept)
    return [j if j in stays else next(tail) for j in range(n)]
