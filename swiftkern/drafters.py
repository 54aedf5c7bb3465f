"""Drafts that cost no model call: prompt lookup (n-gram continuation of earlier context)."""

from __future__ import annotations


def lookup_draft(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of context's last n tokens.

    Tries n = max_ngram down to min_ngram; the first n with an earlier match wins, and among
    its matches the most recent one. Returns [] when nothing matches (or k <= 0).
    context: prompt + generated tokens so far (the last one is the pending token).
    """
    size = len(context)
    if k <= 0:
        return []
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = context[size - n:]
        for start in range(size - n - 1, -1, -1):  # latest earlier occurrence first
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + k]
                if follow:
                    return follow
    return []
