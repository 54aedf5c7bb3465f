"""``Generator.generate``'s per-call inputs, checked and put in the form the loops take.

Each function refuses a bad value with a ``SwiftkernError`` that names it and says what fits.
"""

from __future__ import annotations

from typing import Callable

from .arg_checks import is_integer, token_ids
from .errors import SwiftkernError
from .model import SkipModel


def per_prompt(name: str, value, n: int, check: Callable) -> list:
    """One value for every prompt, or a list / tuple of one per prompt -> n checked values.
    name: the values' plural ("seeds"), for the error."""
    values = [check(v) for v in (value if isinstance(value, (list, tuple)) else [value] * n)]
    if len(values) != n:
        raise SwiftkernError(f"got {len(values)} {name} for {n} prompts")
    return values


def arrival_steps(arrive_at, n: int) -> list[int] | None:
    """arrive_at: None (every request from the start) or one step >= 0 per prompt (any kind of
    int, as the other integer arguments), at least one 0 (the first batch) -> a list of ints, or None."""
    if arrive_at is None:
        return None
    if not isinstance(arrive_at, (list, tuple)):
        raise SwiftkernError(f"arrive_at: a list of one step per prompt ({n}), got {arrive_at!r}")
    arrive_at = list(arrive_at)
    steps_ok = all(is_integer(s) and s >= 0 for s in arrive_at)
    if len(arrive_at) != n or not steps_ok or 0 not in arrive_at:
        raise SwiftkernError(f"arrive_at: one step >= 0 per prompt ({n}), at least one 0; got {arrive_at}")
    return [int(s) for s in arrive_at]


def stop_token_set(model: SkipModel, tokenizer, eos_token_id, stop_token_ids) -> frozenset[int]:
    """The ids that end a row: ``stop_token_ids`` plus ``eos_token_id`` (each one id or a list,
    checked against the vocabulary), the EOS defaulting to the model's generation config's, else
    the tokenizer's."""
    V = model.vocab_size
    stops = token_ids("stop_token_ids", [] if stop_token_ids is None else stop_token_ids, V)
    if eos_token_id is not None:
        return frozenset(stops + token_ids("eos_token_id", eos_token_id, V))
    eos = getattr(model.hf_model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return frozenset(stops + [int(t) for t in eos])


def stop_string_check(tokenizer, stop: str | list[str] | None) -> Callable[[int, list[int]], bool] | None:
    """stop: a string or a list of them (None or []: none) -> ``check(request, tokens)``, True
    once the tokens' text holds one of them, or None."""
    if stop is None or (isinstance(stop, (list, tuple)) and not stop):
        return None
    if not isinstance(stop, (str, list, tuple)) or stop == "":
        raise SwiftkernError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    stop = [stop] if isinstance(stop, str) else list(stop)  # a str is one stop string, not its characters
    if not all(isinstance(s, str) and s for s in stop):
        raise SwiftkernError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if tokenizer is None:
        raise SwiftkernError("stop strings need a tokenizer: Generator(model, tokenizer)")
    return lambda r, tokens: any(s in tokenizer.decode(tokens) for s in stop)


def check_positions(model: SkipModel, longest: int, max_new_tokens: int) -> None:
    """The longest prompt and its new tokens must fit the model's positions."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and longest + max_new_tokens > limit:
        raise SwiftkernError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"{limit} positions; shorten the prompt or lower max_new_tokens (--max-new-tokens)")
