"""Prompts as token id lists: text through the tokenizer (optionally its chat template), token
ids checked to be integers inside the vocabulary."""

from __future__ import annotations

import torch

from .arg_checks import is_integer
from .errors import SwiftkernError


def encode_prompts(prompts, tokenizer, vocab_size: int, chat: bool = False) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] | integer tensor [T] or [B, T] -> one token
    id list per prompt. Text needs ``tokenizer`` (``chat``: through its chat template with the
    generation prompt). Refuses (SwiftkernError, naming the prompt) an empty prompt, a token id
    that is not an integer (a float id is not rounded) or lies outside [0, vocab_size)."""
    if torch.is_tensor(prompts):
        integer = not (prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool)
        if not integer or prompts.dim() not in (1, 2):
            raise SwiftkernError(f"a prompt tensor must hold integer token ids, [T] or [B, T]; got {prompts.dtype} "
                                 f"of shape {tuple(prompts.shape)}")
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_integer(prompts[0])):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise SwiftkernError("prompts must be a non-empty string, list of strings or token id lists")
    return [_prompt_ids(p, i, tokenizer, vocab_size, chat) for i, p in enumerate(prompts)]


def _prompt_ids(p, i: int, tokenizer, vocab_size: int, chat: bool) -> list[int]:
    if isinstance(p, str):
        if tokenizer is None:
            raise SwiftkernError("text prompts need a tokenizer: Generator(model, tokenizer)")
        if not p.strip():
            raise SwiftkernError(f"prompt {i} is empty")
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(p)["input_ids"]
        ids = list(ids)
    elif isinstance(p, (list, tuple)):
        if chat:
            raise SwiftkernError(f"chat applies the tokenizer's chat template to text; prompt {i} is token ids, "
                                 "used as given: leave chat off, or pass the text")
        if not all(is_integer(t) for t in p):
            wrong = next(t for t in p if not is_integer(t))
            raise SwiftkernError(f"prompt {i} must be text or integer token ids, got {wrong!r} "
                                 f"({type(wrong).__name__})")
        ids = [int(t) for t in p]
    else:
        raise SwiftkernError(f"prompt {i} must be text or a list of token ids, got {type(p).__name__}")
    if not ids:
        raise SwiftkernError(f"prompt {i} has no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SwiftkernError(f"prompt {i} has token ids {bad[:3]} outside [0, {vocab_size})")
    return ids
