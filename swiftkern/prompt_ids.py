"""Prompts as token id lists: text through the tokenizer (optionally its chat template), token
ids checked to be integers inside the vocabulary."""

from __future__ import annotations

import numpy
import torch

from .arg_checks import is_integer
from .errors import SwiftkernError


def encode_prompts(prompts, tokenizer, vocab_size: int, chat: bool = False) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] | integer tensor (or NumPy array) [T] or
    [B, T] | a list of 1-D ones (prompts of different lengths) -> one token id list per prompt.
    Text needs ``tokenizer`` (``chat``: through its chat template with the generation prompt).
    Refuses (SwiftkernError, naming the prompt) an empty prompt, a token id that is not an
    integer (a float id is not rounded) or lies outside [0, vocab_size)."""
    if _is_array(prompts):
        prompts = _array_ids(prompts, "a prompt tensor", (1, 2))
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_integer(prompts[0])):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise SwiftkernError("prompts must be a non-empty string, list of strings or token id lists")
    return [_prompt_ids(p, i, tokenizer, vocab_size, chat) for i, p in enumerate(prompts)]


def _is_array(value) -> bool:
    return torch.is_tensor(value) or isinstance(value, numpy.ndarray)


def _array_ids(array, what: str, dims: tuple[int, ...]) -> list:
    """A tensor or NumPy array of integer ids -> its nested list; refuses floats, bools and other ranks."""
    if isinstance(array, numpy.ndarray):
        integer = array.dtype.kind in "iu"  # not bool, float, str or object
    else:
        integer = not (array.is_floating_point() or array.is_complex() or array.dtype == torch.bool)
    if not integer or array.ndim not in dims:
        shape = " or ".join({1: "[T]", 2: "[B, T]"}[d] for d in dims)
        raise SwiftkernError(f"{what} must hold integer token ids, {shape}; got {array.dtype} of shape "
                             f"{tuple(array.shape)}")
    return array.tolist()


def _prompt_ids(p, i: int, tokenizer, vocab_size: int, chat: bool) -> list[int]:
    if _is_array(p):
        p = _array_ids(p, f"prompt {i}", (1,))
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
