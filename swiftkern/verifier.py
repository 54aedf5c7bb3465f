"""The deterministic verifier: a fixed-shape, batch-invariant forward of the full model.

Every verify pass has exactly the shape ``verify_batch x window`` tokens: up to
``verify_batch`` slots (a cache row, the absolute position of its first token, its tokens),
short slots padded, missing slots filled with dummy rows. A prefill pass takes one row a slot
and the longest slot rounded up to 16 tokens (at most ``prefill_chunk``); inside CUDA graphs
both round up to powers of two, so that its few shapes replay graphs (``prefill_shape``). The
layers run ``batch_invariant.bi_linear`` (a layer's q/k/v and gate/up in one launch each where
the Triton matmul runs) and a ``verifier_kernels`` set (portable
torch compositions, or one fused kernel per op), so what a slot gets back depends on its
own tokens and its row's cache alone (and, the kernels being row- and chunk-invariant too, not
on the pass width or on where a chunk starts). The pass writes each slot's keys and values
into its cache row (the cache of record) and returns logits only at the positions asked for
(the LM head is row-invariant, so skipping the others changes no bit of the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import ops
from .batch_invariant import KEY_BLOCK, bi_linear, bi_linears, bi_log_softmax
from .cuda_graphs import attention_span
from .errors import SwiftkernError
from .kv_cache import KVCache
from .model import SkipModel, head_norm
from .verifier_kernels import verifier_kernels
from .rope_table import check_deterministic_rope

# RoPE variants whose frequencies depend on the longest sequence in the batch
PREFILL_CHUNK = 128  # tokens per row of a prefill pass, at most
PREFILL_WIDTH_STEP = 16  # a prefill pass narrower than PREFILL_CHUNK is a multiple of this


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

    ``Verifier(model, window, verify_batch, prefill_chunk=PREFILL_CHUNK, kernels="auto")``: a
    verify pass is ``verify_batch x window`` tokens, a prefill pass ``verify_batch x
    prefill_chunk`` (wider: a prompt needs fewer passes and each matmul more rows). ``kernels``:
    the per-row ops' set, "auto" | "portable" | "fused" (``verifier_kernels``; the bits depend
    on the set, the invariance does not). ``forward`` runs one pass, ``prefill`` writes whole
    prompts, ``token_logprobs`` scores a sequence from scratch.
    """

    def __init__(self, model: SkipModel, window: int, verify_batch: int, prefill_chunk: int = PREFILL_CHUNK,
                 kernels: str = "auto"):
        if window < 1 or verify_batch < 1 or prefill_chunk < 1:
            raise SwiftkernError(f"window, verify_batch and prefill_chunk must be >= 1, got {window}, "
                                 f"{verify_batch} and {prefill_chunk}")
        check_deterministic_rope(model.rotary)
        self.model = model
        self.kernels = verifier_kernels(kernels, model.device.type, model.dtype)
        self._packed_index = _packed_index(model)
        self.window = window
        self.verify_batch = verify_batch
        self.prefill_chunk = prefill_chunk
        self.passes = 0
        self.dummy_rows = 0

    @torch.inference_mode()
    def forward(self, cache: KVCache, slots: list[Slot], width: int | None = None,
                rows: int | None = None) -> torch.Tensor:
        """One pass of shape [rows, width] (by default [verify_batch, window]: every verify
        pass) -> float logits [sum(len(s.want)), V], slot by slot in ``want`` order.

        Writes the keys and values of every slot's tokens into its cache row; padding (after a
        short slot's tokens, and the dummy rows) is computed and thrown away. A row's bits do
        not depend on the pass's shape (every op is per row, in fixed plans; tested across
        windows and verify batches), so prefill passes take only the rows and width they fill."""
        m, R = self.model, rows or self.verify_batch
        T = width or self.window
        if not 1 <= len(slots) <= R:
            raise SwiftkernError(f"a verify pass takes 1..{R} slots, got {len(slots)}")
        for s in slots:
            if not 1 <= len(s.tokens) <= T or any(not 0 <= w < len(s.tokens) for w in s.want):
                raise SwiftkernError(f"verify slot of row {s.row}: {len(s.tokens)} tokens (need 1..{T}), "
                                     f"wanted indices {s.want}")
            if s.start + len(s.tokens) > cache.max_len:
                raise SwiftkernError(f"verify slot of row {s.row}: {len(s.tokens)} tokens at {s.start} exceed the "
                                     f"cache's {cache.max_len} positions")
        n_real = len(slots)
        self.passes += 1
        self.dummy_rows += R - n_real
        device = m.device
        tokens = torch.zeros((R, T), dtype=torch.int64)
        for i, s in enumerate(slots):
            tokens[i, :len(s.tokens)] = torch.tensor(s.tokens)
            tokens[i, len(s.tokens):] = s.tokens[-1]
        # every index list has one fixed length, so a pass of this shape is one CUDA graph: dummy
        # rows read row 0's keys (their outputs are dropped), and the list of real tokens whose
        # keys and values are written is padded by repeating its last entry (the same value to
        # the same place)
        rows = [s.row for s in slots] + [slots[0].row] * (R - n_real)
        real = [i * T + j for i, s in enumerate(slots) for j in range(len(s.tokens))]
        write_rows = [s.row for s in slots for _ in s.tokens]
        real += real[-1:] * (R * T - len(real))
        write_rows += write_rows[-1:] * (R * T - len(write_rows))
        starts = [s.start for s in slots] + [0] * (R - n_real)
        wanted = [i * T + j for i, s in enumerate(slots) for j in s.want]  # the rows of the logits returned
        key_blocks = -(-(max(s.start for s in slots) + T) // KEY_BLOCK)  # past every slot's last (padded) token
        inputs, wanted = _copy_in(device, tokens, starts, rows, real, write_rows, wanted)
        runner = m.graphs
        if runner is None:
            hidden = self._pass(cache, KEY_BLOCK * key_blocks, *inputs)
        else:  # extra key blocks change no bit (bi_attention), so the key length is bucketed
            key_len = KEY_BLOCK * attention_span(key_blocks, -(-(cache.max_len + T) // KEY_BLOCK), minimum=1)
            kind = "verify" if (R, T) == (self.verify_batch, self.window) else "prefill"
            key = (kind, R, T, key_len, cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape),
                   cache.k.stride(), self.kernels.name)
            hidden = runner.run(key, lambda *x: self._pass(cache, key_len, *x), inputs)
        return self._linear(hidden.index_select(0, wanted), m.lm_head, m.lm_head_bias)  # [N, V]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``bi_linear``; where the model keeps ``weight`` packed (``SkipModel.packed``: a GGUF
        model on an AVX2 or AVX-512 CPU) the C++ ``packed_linear`` reads its codes instead, which gives
        ``skinny_linear``'s bits (``bi_matmul`` on the CPU) at any number of rows from a sixth
        of the bytes (tested bit for bit against the float32 weight)."""
        slot = self._packed_index.get(id(weight))
        packed = self.model.packed.slot(slot) if slot is not None else None
        if packed is None:
            return bi_linear(x, weight, bias)
        out = torch.ops.swiftkern.packed_linear(x, packed, None)
        return out + bias.to(out.dtype) if bias is not None else out

    def _linears(self, x: torch.Tensor, weights: tuple, biases: tuple) -> list[torch.Tensor]:
        """``[_linear(x, w, b) for w, b]`` with the same bits; where the Triton kernel runs the
        matmul (CUDA), one ``bi_matmul_group`` launch for them all: x: [..., K] -> [..., N_i]
        each (views into one [..., sum N_i] buffer)."""
        if self._packed_index:
            return [self._linear(x, w, b) for w, b in zip(weights, biases)]
        return bi_linears(x, weights, biases)

    def _pass(self, cache: KVCache, key_len: int, tokens: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor,
              real: torch.Tensor, write_rows: torch.Tensor) -> torch.Tensor:
        """The pass itself, from device tensors alone (a CUDA graph's body): tokens [R, T];
        starts, rows [R]: each slot's first position and cache row; real, write_rows [R * T]:
        flat indices of the tokens whose keys and values are written, and their cache rows;
        key_len: a multiple of KEY_BLOCK, at least every slot's start + T.
        -> normed hidden [R * T, H] (the final norm is per row: picking rows later is the same)."""
        m, kern = self.model, self.kernels
        R, T = tokens.shape
        Hkv, D = m.num_kv_heads, m.head_dim
        cached = min(key_len, cache.max_len)
        positions = starts.unsqueeze(1) + torch.arange(T, device=tokens.device)  # [R, T]
        ends = starts + T  # [R]: past each slot's last (padded) token
        write_pos = positions.reshape(-1).index_select(0, real)  # [R * T]
        hidden = F.embedding(tokens, m.embed)  # [R, T, H]
        cos, sin = m.rotary(hidden, positions)  # [R, T, D]
        delta = None  # the last sub-layer's output, added to the residual stream by the next norm
        for i, w in enumerate(m.layers):
            x, hidden = _add_norm(kern, hidden, delta, w.ln_attn, m.eps)
            q, k, v = self._linears(x, (w.q, w.k, w.v), (w.q_bias, w.k_bias, w.v_bias))
            q = head_norm(kern, q.view(R, T, m.num_heads, D), w.q_norm, m.eps).transpose(1, 2)
            k = head_norm(kern, k.view(R, T, Hkv, D), w.k_norm, m.eps).transpose(1, 2)
            v = v.view(R, T, Hkv, D).transpose(1, 2)
            q, k, v = kern.rope(q, k, v, cos, sin)
            for new, store in ((k, cache.k[i]), (v, cache.v[i])):  # store: [B, Hkv, S, D]
                flat = new.transpose(1, 2).reshape(R * T, Hkv, D).index_select(0, real)
                store[write_rows, :, write_pos] = flat.to(store.dtype)
            if cached == key_len:  # every key inside the cache: one gather
                keys = cache.k[i][:, :, :key_len].index_select(0, rows)  # [R, Hkv, key_len, D]
                values = cache.v[i][:, :, :key_len].index_select(0, rows)
            else:  # the last block reaches past the cache's end: zeros there
                keys = hidden.new_zeros((R, Hkv, key_len, D), dtype=cache.k.dtype)
                values = torch.zeros_like(keys)
                keys[:, :, :cached] = cache.k[i][:, :, :cached].index_select(0, rows)
                values[:, :, :cached] = cache.v[i][:, :, :cached].index_select(0, rows)
            attn = kern.attention(q, keys, values, starts, ends, m.scale)  # [R, Hq, T, D]
            attn = attn.transpose(1, 2).reshape(R, T, m.num_heads * D)
            x, hidden = _add_norm(kern, hidden, self._linear(attn, w.o, w.o_bias), w.ln_mlp, m.eps)
            gate, up = self._linears(x, (w.gate, w.up), (w.gate_bias, w.up_bias))
            if kern.silu_linear is not None:  # one launch, the same bits
                delta = kern.silu_linear(gate, up, w.down, w.down_bias)
            else:
                delta = self._linear(kern.silu_mul(gate, up), w.down, w.down_bias)
        delta = None if delta is None else delta.reshape(R * T, -1)
        return _add_norm(kern, hidden.reshape(R * T, -1), delta, m.final_norm, m.eps)[0]

    def prefill(self, cache: KVCache, prompts: list[list[int]], rows: list[int] | None = None) -> torch.Tensor:
        """Write prompts into their cache rows (row b = prompt b; only ``rows`` when given)
        through passes of ``prefill_chunk``-token chunks from position 0 (up to verify_batch
        prompts a pass, no dummy rows: a request arriving alone is prefilled alone), and set
        those rows' lengths to the prompt lengths. -> float logits [len(rows), V] at each last
        prompt token. Inside CUDA graphs (``model.graphs``) a pass's width and rows are
        rounded up to powers of two (``prefill_shape``): few shapes, so prefills replay graphs
        too instead of paying the host time of an eager pass (the same bits either way)."""
        C, R = self.prefill_chunk, self.verify_batch
        graphed = self.model.graphs is not None
        rows = list(range(len(prompts))) if rows is None else list(rows)
        chunks = {b: -(-len(prompts[b]) // C) for b in rows}
        lengths = list(cache.host_lengths)
        for b in rows:
            lengths[b] = len(prompts[b])
        cache.set_lengths(lengths)  # first: the passes read none (a slot has its start), the copy waits for nothing
        last: dict[int, torch.Tensor] = {}
        for c in range(max(chunks.values(), default=0)):
            todo = [b for b in rows if chunks[b] > c]
            for g in range(0, len(todo), R):
                slots = [Slot(b, c * C, prompts[b][c * C:(c + 1) * C],
                              [len(prompts[b]) - 1 - c * C] if chunks[b] == c + 1 else []) for b in todo[g:g + R]]
                width, n_rows = prefill_shape(max(len(s.tokens) for s in slots), len(slots), C, R, graphed)
                logits = self.forward(cache, slots, width, rows=n_rows)
                wanted = [s.row for s in slots if s.want]
                for n, b in enumerate(wanted):
                    last[b] = logits[n]
        return torch.stack([last[b] for b in rows])

    @torch.inference_mode()
    def token_logprobs(self, tokens: list[int], prompt_len: int) -> torch.Tensor:
        """Score ``tokens`` from scratch (a fresh one-row cache, prefill chunks from position 0):
        -> float32 [len(tokens) - prompt_len], the log-probability of each token after the
        prompt given everything before it. Equal bit for bit to the logprobs the deterministic
        loop reports, however its windows fell (tested)."""
        C = self.prefill_chunk
        cache = self.model.new_cache(1, len(tokens))
        out = []
        for c in range(-(-len(tokens) // C)):
            chunk = tokens[c * C:(c + 1) * C]
            want = [j for j in range(len(chunk)) if prompt_len - 1 <= c * C + j < len(tokens) - 1]
            logits = self.forward(cache, [Slot(0, c * C, chunk, want)], prefill_width(len(chunk), C), rows=1)
            if want:
                targets = torch.tensor([tokens[c * C + j + 1] for j in want], device=logits.device)
                out.append(bi_log_softmax(logits).gather(1, targets.unsqueeze(1)).squeeze(1))
        return torch.cat(out)


def _copy_in(device, tokens: torch.Tensor, *lists: list[int]) -> tuple[tuple, torch.Tensor]:
    """A pass's host inputs on ``device`` in one copy (on a GPU each blocking copy is a sync):
    tokens int64 [R, T] on the host, then starts, rows [R], real, write_rows [R*T] and wanted
    [N] as lists. -> ((tokens, starts, rows, real, write_rows), wanted), views of one tensor."""
    flat = torch.cat([tokens.reshape(-1), torch.tensor([x for xs in lists for x in xs], dtype=torch.int64)])
    parts = flat.to(device).split([tokens.numel()] + [len(xs) for xs in lists])
    return (parts[0].view(tokens.shape),) + parts[1:-1], parts[-1]


def _add_norm(kern, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(norm(hidden + delta), hidden + delta) in one kernel, or (norm(hidden), hidden) with no
    delta. hidden, delta: [..., H]; weight: [H]."""
    if delta is None:
        return kern.rms_norm(hidden, weight, eps), hidden
    return kern.add_rms_norm(delta, hidden, weight, eps)


def _packed_index(model: SkipModel) -> dict:
    """{id(weight): its slot in model.packed} where the C++ packed_linear runs, else {}."""
    if model.packed is None or not ops.backends.cpu_kernel("packed_linear", model.device.type):
        return {}
    return {id(w): i for i, w in enumerate(model.packed.weights) if w is not None}


def prefill_shape(longest: int, slots: int, chunk: int, verify_batch: int, graphed: bool) -> tuple[int, int]:
    """(width, rows) of a prefill pass of ``slots`` slots, the longest ``longest`` tokens: the
    tightest (``prefill_width``, one row a slot), or with CUDA graphs a power of two times
    PREFILL_WIDTH_STEP wide and a power of two rows high (at most ``chunk`` and
    ``verify_batch``), so that passes repeat a few shapes and replay their graphs. Padding rows
    and tokens cost device time only; no bit of a real slot changes (every op is row- and
    width-invariant)."""
    if not graphed:
        return prefill_width(longest, chunk), slots
    width = PREFILL_WIDTH_STEP * _next_pow2(-(-longest // PREFILL_WIDTH_STEP))
    return min(chunk, width), min(verify_batch, _next_pow2(slots))


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def prefill_width(longest: int, chunk: int) -> int:
    """Tokens per row of a prefill pass whose longest slot has ``longest`` tokens: rounded up to
    a multiple of PREFILL_WIDTH_STEP, at most ``chunk``. A prompt's last chunk is mostly padding
    at the full width (it halved the cost of prefilling SmolLM2's benchmark prompts); a
    narrower pass gives the same bits, since every verifier op is invariant to the pass width
    (the decode-vs-prefill tests compare widths 16 and 128 bit for bit)."""
    return min(chunk, -(-longest // PREFILL_WIDTH_STEP) * PREFILL_WIDTH_STEP)
