"""Static KV cache with per-row lengths and O(1) rollback."""

from __future__ import annotations

import torch

from . import device_reads
from .arg_checks import whole
from .errors import SwiftkernError


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, with an allocation that fails (CPU or GPU memory) refused as a SwiftkernError
    that says what the cache holds and what to lower: torch's own message named only a byte
    count (a batch of 64 x 5e6 new tokens on a tiny model: "DefaultCPUAllocator: can't allocate
    memory: you tried to allocate 163840098304 bytes")."""
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) is one; the CPU allocator raises a plain one
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        layers, rows, heads, positions, head_dim = shape
        gib = 2 * layers * rows * heads * positions * head_dim * torch.finfo(dtype).bits / 8 / 2**30
        raise SwiftkernError(
            f"the KV cache does not fit in {torch.device(device).type} memory: {rows} rows x {positions} positions "
            f"x {layers} layers x {heads} KV heads x {head_dim} ({dtype}), {gib:.1f} GiB of keys and values. "
            f"swiftkern allocates it for the longest prompt + max_new_tokens (+ a verify pass) up front: "
            f"lower max_new_tokens or the batch") from None


class KVCache:
    """Preallocated keys and values for every layer, row and position.

    k, v: [L, B, H_kv, S_max, D], the first B of ``capacity`` allocated rows (each layer's
    ``k[i]`` is contiguous). Row b holds ``lengths[b]`` valid positions; everything past that is
    stale and is overwritten by the next append. ``rollback`` only moves lengths, so discarding
    rejected draft tokens costs nothing. Lengths live on the host (``host_lengths``, the truth
    for control flow) and on the device (``lengths``, for kernels). Requests join and leave in
    place: ``add_rows`` takes free rows (allocating only past ``capacity``) and ``select_rows``
    moves the kept rows' valid positions down, so the batch changing never copies the cache.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        num_layers, batch, num_kv_heads, max_len, head_dim = (
            whole(f"KV cache {name}", value, 1) for name, value in (
                ("num_layers", num_layers), ("batch", batch), ("num_kv_heads", num_kv_heads),
                ("max_len", max_len), ("head_dim", head_dim)))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise SwiftkernError(f"KV cache dtype must be a floating-point torch.dtype (the model's), got {dtype!r}")
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)  # capacity = batch at first
        # zeros, not empty: attention reads (masked) positions past a short row's length, and a
        # NaN there would survive the mask (0 * NaN); every later write is a finite model value.
        # Never inference tensors (see _grow), wherever the cache is made
        with torch.inference_mode(False):
            self._k_rows = _zeros(shape, dtype, device)  # [L, capacity, H_kv, S_max, D]
            self._v_rows = _zeros(shape, dtype, device)
            self._length_rows = torch.zeros(batch, dtype=torch.int64, device=device)  # [capacity]
        self.max_len = max_len
        self._use_rows(batch)
        self.host_lengths = [0] * batch

    def _use_rows(self, batch: int) -> None:
        """Views of the first ``batch`` rows: the same storage, so their addresses stay put."""
        self.k = self._k_rows[:, :batch]  # [L, B, H_kv, S_max, D]
        self.v = self._v_rows[:, :batch]
        self.lengths = self._length_rows[:batch]  # [B]
        # set_lengths writes through this view where host values go through NumPy (the CPU)
        numpy_writes = device_reads.writes_through_numpy(self._length_rows.device)
        self._lengths_view = self._length_rows.numpy() if numpy_writes else None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lengths_view")  # a view of this cache's memory: made again for the copy's
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, ``pickle``): its row views and lengths view made again over
        its own storage (copied apart, they would alias nothing)."""
        self.__dict__.update(state)
        self._use_rows(len(self.host_lengths))

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    @property
    def capacity(self) -> int:
        """Rows allocated: the batch may grow to this without a new allocation."""
        return self._k_rows.shape[1]

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
        """Set per-row lengths (a list of ints or an int tensor [B]); never grows a row. Lengths
        that did not change are not copied to the device again (it holds them: every forward
        advances both sides), so such a rollback does not wait for a GPU's queued work."""
        new = [whole("rollback length", n) for n in (new_lengths.tolist() if torch.is_tensor(new_lengths) else new_lengths)]
        if len(new) != self.batch:
            raise SwiftkernError(f"rollback: got {len(new)} lengths for a batch of {self.batch}")
        bad = [(b, n, o) for b, (n, o) in enumerate(zip(new, self.host_lengths)) if not 0 <= n <= o]
        if bad:
            b, n, o = bad[0]
            raise SwiftkernError(f"rollback: row {b} to length {n} is outside [0, {o}]")
        if new != self.host_lengths:
            self.set_lengths(new)

    def set_lengths(self, lengths: list[int]) -> None:
        """Set every row's length (may grow a row, e.g. after a pass that wrote those positions),
        in place on the device."""
        if len(lengths) != self.batch or any(not 0 <= n <= self.max_len for n in lengths):
            raise SwiftkernError(f"set_lengths: {lengths} for {self.batch} rows of {self.max_len} positions")
        self.host_lengths = [int(n) for n in lengths]
        if self._lengths_view is not None:
            self._lengths_view[:self.batch] = self.host_lengths
        else:
            self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.int64))

    def row_view(self, b: int) -> "KVCache":
        """A one-row cache sharing row b's storage and its device length (writes land in this
        cache); after using it, ``set_row_length(b, view.host_lengths[0])``. The length is a view
        too, not a copy: a CUDA graph of a forward on the view keys on its address, which a copy
        made new in every call (every per-row prefill then ran eagerly as a new graph entry,
        pushing the decode steps' graphs out of the runner)."""
        b = whole("row_view: row", b, 0, self.batch - 1)
        view = KVCache.__new__(KVCache)
        view._k_rows, view._v_rows = self.k[:, b:b + 1], self.v[:, b:b + 1]
        view._length_rows = self._length_rows[b:b + 1]
        view.max_len = self.max_len
        view._use_rows(1)
        view.host_lengths = [self.host_lengths[b]]
        return view

    def reset(self, batch: int) -> None:
        """Use the first ``batch`` rows, all empty (a cache reused for a new call)."""
        if not 1 <= batch <= self.capacity:
            raise SwiftkernError(f"reset: batch {batch} outside [1, capacity={self.capacity}]")
        self._use_rows(batch)
        self.host_lengths = [0] * batch
        self.set_lengths(self.host_lengths)

    def set_row_length(self, b: int, length: int) -> None:
        """Set row b's length alone, on both sides (a row counted from the end is refused: -1 set
        the last row's)."""
        b = whole("set_row_length: row", b, 0, self.batch - 1)
        length = whole("set_row_length: length", length, 0, self.max_len)
        self.host_lengths[b] = length
        if self._lengths_view is not None:
            self._lengths_view[b] = length
        else:
            self.lengths[b] = length

    def add_rows(self, n: int, replace: bool = False, reserve: int = 0) -> list[int]:
        """Give ``n`` empty rows (length 0) to requests that join the batch, after the rows in
        use, or in place of every row (``replace``: none is in use any more) -> their indices.
        Past ``capacity`` the rows are reallocated once, to room for max(2 x capacity, the rows
        needed) but at most ``reserve`` rows (the most the caller can ever need) when that is
        larger than the rows needed."""
        n, reserve = whole("add_rows: n", n, 1), whole("add_rows: reserve", reserve, 0)
        first = 0 if replace else self.batch
        needed = first + n
        if needed > self.capacity:
            grown = max(2 * self.capacity, needed)
            self._grow(min(grown, reserve) if reserve > needed else grown, keep=first)
        self._use_rows(needed)
        self.host_lengths = self.host_lengths[:first] + [0] * n
        self.lengths[first:] = 0
        return list(range(first, needed))

    def _grow(self, capacity: int, keep: int) -> None:
        """Reallocate to ``capacity`` rows, keeping the first ``keep``. The new storage is made
        outside inference mode even when the caller runs in it (deterministic decoding grows the
        batch there): an inference tensor refuses the in-place updates of a later call made
        outside that mode, such as a CUDA graph runner handing this cache to another Generator."""
        with torch.inference_mode(False):
            for name in ("_k_rows", "_v_rows"):
                old = getattr(self, name)
                new = _zeros((old.shape[0], capacity) + tuple(old.shape[2:]), old.dtype, old.device)
                new[:, :keep] = old[:, :keep]
                setattr(self, name, new)
            lengths = self._length_rows.new_zeros(capacity)
            lengths[:keep] = self._length_rows[:keep]
            self._length_rows = lengths

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows, row ``rows[j]`` becoming row j (distinct; finished requests
        leave). In place: each kept row that moves copies its valid positions to its new index
        (``Requests.drop_finished`` fills the freed rows below the new batch with the last rows,
        so only those move)."""
        if not rows or any(not 0 <= r < self.batch for r in rows) or len(set(rows)) != len(rows):
            raise SwiftkernError(f"select_rows: rows {rows} must be distinct rows of [0, {self.batch}), at least one")
        moves = [(new, old) for new, old in enumerate(rows) if new != old and self.host_lengths[old]]
        src_k, src_v, src = self.k, self.v, [old for _, old in moves]  # where each move reads its row
        if _overwrites_a_source(moves):  # read the moving rows from a snapshot instead
            n = max(self.host_lengths[old] for _, old in moves)
            index = torch.tensor(src, device=self.k.device)
            src_k, src_v = (t[:, :, :, :n].index_select(1, index) for t in (self.k, self.v))  # [L, moves, H, n, D]
            src = list(range(len(moves)))
        for (new, old), j in zip(moves, src):
            m = self.host_lengths[old]
            self.k[:, new, :, :m] = src_k[:, j, :, :m]
            self.v[:, new, :, :m] = src_v[:, j, :, :m]
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self._use_rows(len(rows))
        self.set_lengths(self.host_lengths)


def _overwrites_a_source(moves: list[tuple[int, int]]) -> bool:
    """Whether copying (new <- old) in this order writes a row a later move still reads."""
    written: set[int] = set()
    for new, old in moves:
        if old in written:
            return True
        written.add(new)
    return False
