"""The deterministic verifier: a fixed-shape, batch-invariant forward of the full model.

Every pass has exactly the shape ``verify_batch x window`` tokens: up to ``verify_batch`` slots
(a cache row, the absolute position of its first token, at most ``window`` tokens), short slots
padded, missing slots filled with dummy rows. The layers run the ops of ``batch_invariant``,
so what a slot gets back depends on its own tokens and its row's cache alone. The pass writes
each slot's keys and values into its cache row (they become the cache of record) and returns
logits only at the positions asked for (the LM head is row-invariant, so skipping the others
changes no bit of the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import reference
from .batch_invariant import (KEY_BLOCK, bi_attention, bi_linear, bi_log_softmax, bi_rms_norm,
                              bi_silu_mul)
from .errors import SwiftkernError
from .kv_cache import KVCache
from .model import SkipModel

# RoPE variants whose frequencies depend on the longest sequence in the batch
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class Slot:
    """One row of a verify pass: the tokens at positions start, start+1, ... of cache row ``row``
    and the chunk-relative indices whose logits are wanted."""

    row: int
    start: int
    tokens: list[int]
    want: list[int]


class Verifier:
    """Fixed-shape batch-invariant passes over a SkipModel's weights (shared, no copies).

    ``Verifier(model, window, verify_batch)``; ``forward`` runs one pass, ``prefill`` writes
    whole prompts through passes, ``token_logprobs`` scores a sequence from scratch.
    """

    def __init__(self, model: SkipModel, window: int, verify_batch: int):
        if window < 1 or verify_batch < 1:
            raise SwiftkernError(f"window and verify_batch must be >= 1, got {window} and {verify_batch}")
        rope_type = getattr(model.rotary, "rope_type", "default")
        if any(kind in str(rope_type) for kind in _BATCH_DEPENDENT_ROPE):
            raise SwiftkernError(f"deterministic mode does not support rope_type {rope_type!r}: its "
                                 "frequencies depend on the longest sequence in the batch")
        self.model = model
        self.window = window
        self.verify_batch = verify_batch
        self.passes = 0
        self.dummy_rows = 0

    @torch.inference_mode()
    def forward(self, cache: KVCache, slots: list[Slot]) -> torch.Tensor:
        """One pass -> float logits [sum(len(s.want)), V], slot by slot in ``want`` order.

        Writes keys and values at positions start .. start+window-1 of every slot's cache row
        (past a short slot's tokens they are padding, beyond the row's length)."""
        m, T, R = self.model, self.window, self.verify_batch
        if not 1 <= len(slots) <= R:
            raise SwiftkernError(f"a verify pass takes 1..{R} slots, got {len(slots)}")
        for s in slots:
            if not 1 <= len(s.tokens) <= T or any(not 0 <= w < len(s.tokens) for w in s.want):
                raise SwiftkernError(f"verify slot of row {s.row}: {len(s.tokens)} tokens (need 1..{T}), "
                                     f"wanted indices {s.want}")
            if s.start + T > cache.max_len:
                raise SwiftkernError(f"verify slot of row {s.row} at {s.start} + window {T} exceeds the "
                                     f"cache's {cache.max_len} positions")
        n_real = len(slots)
        self.passes += 1
        self.dummy_rows += R - n_real
        device = m.device
        tokens = torch.zeros((R, T), dtype=torch.int64)
        for i, s in enumerate(slots):
            tokens[i, :len(s.tokens)] = torch.tensor(s.tokens)
            tokens[i, len(s.tokens):] = s.tokens[-1]
        tokens = tokens.to(device)  # [R, T]
        starts = torch.tensor([s.start for s in slots] + [0] * (R - n_real), dtype=torch.int64, device=device)
        positions = starts.unsqueeze(1) + torch.arange(T, device=device)  # [R, T]
        rows = torch.tensor([s.row for s in slots], dtype=torch.int64, device=device)  # [n_real]
        key_len = -(-(int(starts.max()) + T) // KEY_BLOCK) * KEY_BLOCK
        cached = min(key_len, cache.max_len)

        hidden = F.embedding(tokens, m.embed)  # [R, T, H]
        cos, sin = m.rotary(hidden, positions)  # [R, T, D]
        for i, w in enumerate(m.layers):
            x = bi_rms_norm(hidden, w.ln_attn, m.eps)
            q = bi_linear(x, w.q, w.q_bias).view(R, T, m.num_heads, m.head_dim).transpose(1, 2)
            k = bi_linear(x, w.k, w.k_bias).view(R, T, m.num_kv_heads, m.head_dim).transpose(1, 2)
            v = bi_linear(x, w.v, w.v_bias).view(R, T, m.num_kv_heads, m.head_dim).transpose(1, 2)
            q = reference.apply_rope(q, cos, sin)
            k = reference.apply_rope(k, cos, sin)
            write_rows = rows.unsqueeze(1).expand(-1, T)  # [n_real, T]
            cache.k[i][write_rows, :, positions[:n_real]] = k[:n_real].transpose(1, 2).to(cache.k.dtype)
            cache.v[i][write_rows, :, positions[:n_real]] = v[:n_real].transpose(1, 2).to(cache.v.dtype)
            keys = hidden.new_zeros((R, m.num_kv_heads, key_len, m.head_dim), dtype=cache.k.dtype)
            values = torch.zeros_like(keys)  # dummy rows see zero keys and values: finite, unused
            keys[:n_real, :, :cached] = cache.k[i][:, :, :cached].index_select(0, rows)
            values[:n_real, :, :cached] = cache.v[i][:, :, :cached].index_select(0, rows)
            attn = bi_attention(q, keys, values, starts, m.scale)  # [R, Hq, T, D]
            attn = attn.transpose(1, 2).reshape(R, T, m.num_heads * m.head_dim)
            hidden = hidden + bi_linear(attn, w.o, w.o_bias)
            x = bi_rms_norm(hidden, w.ln_mlp, m.eps)
            act = bi_silu_mul(bi_linear(x, w.gate, w.gate_bias), bi_linear(x, w.up, w.up_bias))
            hidden = hidden + bi_linear(act, w.down, w.down_bias)
        flat = torch.tensor([i * T + j for i, s in enumerate(slots) for j in s.want], dtype=torch.int64,
                            device=device)
        picked = hidden.reshape(R * T, -1).index_select(0, flat)  # [N, H]
        picked = bi_rms_norm(picked, m.final_norm, m.eps)
        return bi_linear(picked, m.lm_head, m.lm_head_bias)

    def prefill(self, cache: KVCache, prompts: list[list[int]]) -> torch.Tensor:
        """Write every prompt into its cache row (row b = prompt b) through verify passes of
        ``window``-token chunks aligned at position 0, and set the row lengths to the prompt
        lengths. -> float logits [B, V] at each prompt's last token."""
        T, R = self.window, self.verify_batch
        chunks = [-(-len(p) // T) for p in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        for c in range(max(chunks)):
            todo = [b for b in range(len(prompts)) if chunks[b] > c]
            for g in range(0, len(todo), R):
                group = todo[g:g + R]
                slots = [Slot(b, c * T, prompts[b][c * T:(c + 1) * T],
                              [len(prompts[b]) - 1 - c * T] if chunks[b] == c + 1 else []) for b in group]
                logits = self.forward(cache, slots)
                n = 0
                for s in slots:
                    if s.want:
                        last[s.row] = logits[n]
                        n += 1
        set_lengths(cache, [len(p) for p in prompts])
        return torch.stack(last)

    @torch.inference_mode()
    def token_logprobs(self, tokens: list[int], prompt_len: int) -> torch.Tensor:
        """Score ``tokens`` from scratch (a fresh one-row cache, chunks from position 0):
        -> float32 [len(tokens) - prompt_len], the log-probability of each token after the
        prompt given everything before it. Equal bit for bit to the logprobs the deterministic
        loop reports, however its windows fell (tested)."""
        T = self.window
        cache = self.model.new_cache(1, -(-len(tokens) // T) * T)
        out = []
        for c in range(-(-len(tokens) // T)):
            chunk = tokens[c * T:(c + 1) * T]
            want = [j for j in range(len(chunk)) if prompt_len - 1 <= c * T + j < len(tokens) - 1]
            if not want:
                self.forward(cache, [Slot(0, c * T, chunk, [])])
                continue
            logits = self.forward(cache, [Slot(0, c * T, chunk, want)])
            targets = torch.tensor([tokens[c * T + j + 1] for j in want], device=logits.device)
            out.append(bi_log_softmax(logits).gather(1, targets.unsqueeze(1)).squeeze(1))
        return torch.cat(out)


def set_lengths(cache: KVCache, lengths: list[int]) -> None:
    """Set every row's length (may grow a row: a verify pass wrote those positions)."""
    if len(lengths) != cache.batch or any(not 0 <= n <= cache.max_len for n in lengths):
        raise SwiftkernError(f"set_lengths: {lengths} for {cache.batch} rows of {cache.max_len} positions")
    cache.host_lengths = list(lengths)
    cache.lengths = torch.tensor(lengths, dtype=torch.int64, device=cache.lengths.device)
