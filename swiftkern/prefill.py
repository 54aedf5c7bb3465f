"""Prompts into the KV cache: a batch at the start, and requests that join it later."""

from __future__ import annotations

import torch

from . import ops
from .kv_cache import KVCache
from .model import SkipModel
from .requests import Requests


def prefill(model: SkipModel, cache: KVCache, prompts: list[list[int]], per_row: bool = False,
            rows: list[int] | None = None) -> torch.Tensor:
    """Run all prompts through the model: one right-padded forward, or (``per_row``) one
    forward per prompt at its own length, no padding computed (the batch-invariant kernels are
    compute-bound at prefill sizes, so padding costs its full share there). ``rows`` (per_row
    only): the cache row of each prompt (default: prompt b in row b).

    Padding sits after each row's real tokens, so causal attention keeps it out of the real
    positions; the cache is then rolled back to the real lengths. A longrope model prefills per
    row whatever ``per_row`` says: its prompt's frequencies follow the prompt's own length
    (``longrope``), and a padded batch's would follow the longest. -> last logits [B, V]
    """
    per_row = per_row or model.longrope_limit is not None
    with ops.prefill_projections():
        return _prefill(model, cache, prompts, per_row, rows)


def _prefill(model: SkipModel, cache: KVCache, prompts: list[list[int]], per_row: bool,
             rows: list[int] | None) -> torch.Tensor:
    lengths = [len(p) for p in prompts]
    if per_row:
        last = []
        for b, p in zip(rows if rows is not None else range(len(prompts)), prompts):
            view = cache.row_view(b)
            logits = model.forward(torch.tensor([p], dtype=torch.int64, device=model.device), view,
                                   logits_positions=torch.tensor([[len(p) - 1]], device=model.device))
            cache.set_row_length(b, view.host_lengths[0])
            last.append(logits[0, 0])
        return torch.stack(last)
    width = max(lengths)
    tokens = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts],
                          dtype=torch.int64, device=model.device)  # [B, width]
    last = torch.tensor(lengths, dtype=torch.int64, device=model.device).sub_(1).unsqueeze(1)
    logits = model.forward(tokens, cache, logits_positions=last)  # [B, 1, V]
    cache.rollback(lengths)
    return logits[:, 0]


def per_row_pays(model: SkipModel) -> bool:
    """Whether ``prefill`` should run one forward per prompt outside the invariant set too: where
    the projections at prefill sizes are the fixed-order CPU kernel (bf16 / fp16 on the CPU,
    ``ops.skinny_max_rows``), compute-bound, so padding costs its full share; the same bits
    either way there, every kernel being row-invariant. torch's float32 matmul takes a padded
    batch about as fast. SmolLM2, 8 chat prompts of 96-164 tokens: bf16 1.86-2.02 s padded,
    1.53-1.56 s per row; float32 1.07 s padded, 1.13-1.17 s per row. bf16 / fp16 prefill per row
    also where torch's native bf16 matmul takes a prefill past 32 rows
    (``ops.prefill_projections``): its sum over a row follows the number of rows, so a padded
    batch would give a prompt other bits than alone, and a request's output would depend on the
    batch (SmolLM2's, in tests/test_smollm2.py); alone, a prompt's rows are its own."""
    return (model.device.type == "cpu"
            and (model.dtype != torch.float32 or ops.skinny_max_rows(torch.float32) < 0)
            and ops.backends.cpu_kernel("skinny_linear", "cpu"))


def admit_arrivals(model: SkipModel, cache: KVCache, requests: Requests,
                   prompts: list[list[int]]) -> torch.Tensor | None:
    """Requests due by now join the batch (``Requests.admit``: new cache rows after the alive
    ones), each prompt prefilled on its own into its row (one forward a prompt: the prefill a
    server gives a new request, and what the batch-invariant kernels need), through the kernel
    set of the call's first prefill (``requests.invariant_prefill``) whatever set the decoding
    runs. -> their last logits [n, V], or None when none joined."""
    due, rows = requests.admit(cache)
    if not due:
        return None
    with model.batch_invariant(requests.invariant_prefill):
        return prefill(model, cache, [prompts[r] for r in due], per_row=True, rows=rows)
