"""Static KV cache with per-row lengths and O(1) rollback."""

from __future__ import annotations

import torch

from .errors import SwiftkernError


class KVCache:
    """Preallocated keys and values for every layer, row and position.

    k, v: [L, B, H_kv, S_max, D]. Row b holds ``lengths[b]`` valid positions; everything past
    that is stale and is overwritten by the next append. ``rollback`` only moves lengths, so
    discarding rejected draft tokens costs nothing. Lengths live on the host (``host_lengths``,
    the truth for control flow) and on the device (``lengths``, for kernels).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        if batch < 1 or max_len < 1:
            raise SwiftkernError(f"KV cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        # zeros, not empty: attention reads (masked) positions past a short row's length, and a
        # NaN there would survive the mask (0 * NaN); every later write is a finite model value
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.host_lengths = [0] * batch
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)  # [B]

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    def check_room(self, num_new: int) -> None:
        """Raise SwiftkernError unless every row has room for ``num_new`` more tokens."""
        if max(self.host_lengths) + num_new > self.max_len:
            raise SwiftkernError(
                f"KV cache overflow: a row at length {max(self.host_lengths)} + {num_new} new tokens "
                f"exceeds max_len={self.max_len}; allocate a larger cache (prompt + max_new_tokens)"
            )

    def positions_for(self, num_new: int) -> torch.Tensor:
        """Absolute positions of ``num_new`` tokens appended to every row: int64 [B, T]."""
        self.check_room(num_new)
        return self.lengths.unsqueeze(1) + torch.arange(num_new, device=self.lengths.device)

    def advance(self, num_new: int) -> None:
        """Mark ``num_new`` tokens appended to every row."""
        self.advance_host(num_new)
        self.advance_device(num_new)

    def advance_host(self, num_new: int) -> None:
        self.host_lengths = [n + num_new for n in self.host_lengths]

    def advance_device(self, num_new: int) -> None:
        """In place: ``lengths`` stays the same tensor (a captured CUDA graph holds its address)."""
        self.lengths += num_new

    def rollback(self, new_lengths) -> None:
        """Set per-row lengths (a list of ints or an int tensor [B]); never grows a row."""
        new = [int(n) for n in (new_lengths.tolist() if torch.is_tensor(new_lengths) else new_lengths)]
        if len(new) != self.batch:
            raise SwiftkernError(f"rollback: got {len(new)} lengths for a batch of {self.batch}")
        bad = [(b, n, o) for b, (n, o) in enumerate(zip(new, self.host_lengths)) if not 0 <= n <= o]
        if bad:
            b, n, o = bad[0]
            raise SwiftkernError(f"rollback: row {b} to length {n} is outside [0, {o}]")
        self.set_lengths(new)

    def set_lengths(self, lengths: list[int]) -> None:
        """Set every row's length (may grow a row, e.g. after a pass that wrote those positions),
        in place on the device."""
        if len(lengths) != self.batch or any(not 0 <= n <= self.max_len for n in lengths):
            raise SwiftkernError(f"set_lengths: {lengths} for {self.batch} rows of {self.max_len} positions")
        self.host_lengths = [int(n) for n in lengths]
        self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.int64))

    def row_view(self, b: int) -> "KVCache":
        """A one-row cache sharing row b's storage (writes land in this cache); after using it,
        ``set_row_length(b, view.host_lengths[0])``."""
        if not 0 <= b < self.batch:
            raise SwiftkernError(f"row_view: row {b} outside [0, {self.batch})")
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, b:b + 1], self.v[:, b:b + 1]
        view.max_len = self.max_len
        view.host_lengths = [self.host_lengths[b]]
        view.lengths = self.lengths[b:b + 1].clone()
        return view

    def set_row_length(self, b: int, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise SwiftkernError(f"set_row_length: {length} outside [0, {self.max_len}]")
        self.host_lengths[b] = length
        self.lengths[b] = length

    def add_rows(self, n: int, replace: bool = False) -> list[int]:
        """Append ``n`` empty rows (length 0) for requests that join the batch (``replace``: in
        place of every row, when none is in use any more) -> their indices. Copies the cache,
        as ``select_rows`` does."""
        if n < 1:
            raise SwiftkernError(f"add_rows: n must be >= 1, got {n}")
        L, B, H, S, D = self.k.shape
        empty = torch.zeros((L, n, H, S, D), dtype=self.k.dtype, device=self.k.device)
        if replace:
            self.k, self.v, self.host_lengths = empty, empty.clone(), [0] * n
            self.lengths = self.lengths.new_zeros(n)
            return list(range(n))
        self.k = torch.cat([self.k, empty], dim=1)
        self.v = torch.cat([self.v, empty], dim=1)
        self.host_lengths = self.host_lengths + [0] * n
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(n)])
        return list(range(B, B + n))

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (drops finished requests; copies the kept rows)."""
        if not rows or any(not 0 <= r < self.batch for r in rows):
            raise SwiftkernError(f"select_rows: rows {rows} must be a non-empty subset of [0, {self.batch})")
        index = torch.tensor(rows, dtype=torch.int64, device=self.k.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self.lengths = self.lengths.index_select(0, index)
