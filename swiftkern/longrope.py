"""LongRoPE's two frequency sets, chosen per token as HF's batch-1 ``generate`` chooses them.

HF's longrope rotary module rotates every position of a call with its long factors when the
call's largest position reaches ``original_max_position_embeddings`` (the limit), else with its
short factors. Batch-1 greedy ``generate`` calls it once for the prompt (its tokens take the
long set iff the prompt is longer than the limit) and once per new token (the long set iff
that token's position reaches the limit). A verify pass of k + 1 tokens that straddles the
limit, a layer-skipped draft, or a batch whose longest row is past it would rotate them all
with the long set: on a tiny Llama (limit 64; 6 prompts of 5-100 tokens, 120 new tokens)
self-spec and prompt lookup then left HF's greedy tokens on 2 prompts, and a batch in mode ar
did on a tiny Qwen3.
``rotate`` gives each token the set its own batch-1 decoding gives it, so a row's rotation
depends on its own tokens alone, whatever the batch and the pass: one forward per prompt at
prefill (``prefill.prefill`` does that for these models), and a forward starting at position 0
is a prompt's.
"""

from __future__ import annotations

import torch


def longrope_limit(rotary) -> int | None:
    """The position from which an HF longrope rotary module takes its long factors (the one
    its own ``longrope_frequency_update`` reads: transformers 5.x's ``rope_parameters``, 4.x's
    config attribute or ``max_position_embeddings``), or None for any other rope type."""
    if str(getattr(rotary, "rope_type", "default")) != "longrope":
        return None
    cfg = rotary.config
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "original_max_position_embeddings" in params:  # 5.x
        return int(params["original_max_position_embeddings"])
    return int(getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)  # 4.x


def rotate(rotary, x: torch.Tensor, positions: torch.Tensor, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] of ``rotary`` (called with ``x`` for its dtype and device) at
    ``positions`` (int64 [B, T], each row consecutive). ``limit`` None: the module's own call.
    Else (``longrope_limit``) each token's set as batch-1 generate picks it: the long set at
    positions >= limit, and for every token of a row that starts at position 0 (a prompt's
    prefill) whose last position reaches it. No host reads (the choice is made on the device)."""
    cos, sin = rotary(x, positions)  # the long set wherever a token below needs it, else the short one
    if limit is None:
        return cos, sin
    prompt_rows = positions[:, :1] == 0  # [B, 1]
    long = (positions >= limit) | (prompt_rows & (positions[:, -1:] >= limit))  # [B, T]
    short_cos, short_sin = rotary(x, positions.masked_fill(long, 0))  # every position below the limit
    pick = long.unsqueeze(-1)  # [B, T, 1]
    return torch.where(pick, cos, short_cos), torch.where(pick, sin, short_sin)
