"""Checks of the scalar arguments of the public API: a wrong type or value is refused with a
SwiftkernError naming the argument, rather than truncated (2.5 -> 2) or failing deep inside."""

from __future__ import annotations

import numbers

import numpy

from .errors import SwiftkernError


def is_integer(value) -> bool:
    """An int of any kind (Python, numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int; refuses a non-integer (float, bool, str) and one outside [lo, hi]."""
    if not is_integer(value):
        raise SwiftkernError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise SwiftkernError(f"{name} must be {bounds}, got {value}")
    return value


def flag(name: str, value) -> bool:
    """``value`` as a bool; refuses anything but a bool (Python or numpy), such as "yes" or None,
    which would otherwise pass as its truth value."""
    if not isinstance(value, (bool, numpy.bool_)):
        raise SwiftkernError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def real(name: str, value) -> float:
    """``value`` as a float; refuses a non-number (str, None, bool)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise SwiftkernError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """One token id or a list of them -> a list of ints, each in [0, vocab_size)."""
    items = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
    return [whole(f"{name} entry", t, 0, vocab_size - 1) for t in items]
