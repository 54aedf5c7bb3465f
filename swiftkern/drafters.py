"""Drafts that cost no model call: prompt lookup (n-gram continuation of earlier context)."""

from __future__ import annotations

from typing import NamedTuple

# the longest suffix matched; on SmolLM2 a match of 4+ tokens predicts the next token 78-91 % of
# the time, of 1 token 18 % (bench prompts, 128 greedy tokens each): the length is worth knowing
LOOKUP_MAX_NGRAM = 8
# without a DrafterPolicy to judge them, lookup drafts need a match of at least 2 tokens:
# 1-token matches were mostly rejected on SmolLM2 (18 % of first drafts right) and a verify of
# k+1 tokens costs more than a decode step; the policy keeps their acceptance apart and decides
LOOKUP_MIN_NGRAM_UNJUDGED = 2


class LookupMatch(NamedTuple):
    """A prompt-lookup proposal: ``tokens`` followed an earlier occurrence of the context's
    last ``ngram`` tokens (ngram 0 and no tokens: no match)."""

    ngram: int
    tokens: list[int]


def lookup_match(context: list[int], k: int, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1,
                 vote: bool = True) -> LookupMatch:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of ``context``
    (of min_ngram..max_ngram tokens) that occurs earlier.

    Among the occurrences of that suffix the continuation is a vote: the one whose first token
    followed the suffix most often, the latest among equals (an n-gram model's most likely next
    token; vote=False: the latest occurrence). Replayed on SmolLM2's greedy outputs the vote
    drafts better (``python -m bench --routine lookup_replay``).

    context: prompt + generated tokens so far (the last one is the pending token). One pass
    over the context: each earlier position holding the last token is a candidate end of a
    match, extended backwards. Returns LookupMatch(0, []) when nothing matches or k <= 0.
    """
    size = len(context)
    longest = min(max_ngram, size - 1)
    if k <= 0 or longest < min_ngram:
        return LookupMatch(0, [])
    last = context[-1]
    # latest first; the continuation context[end + 1:] is non-empty
    candidates = ((context, end, end) for end in range(size - 2, -1, -1) if context[end] == last)
    best_n, ends = longest_matches(candidates, context, longest)  # ends: of length best_n, latest first
    if best_n < min_ngram:
        return LookupMatch(0, [])
    if not vote:
        return LookupMatch(best_n, context[ends[0] + 1:ends[0] + 1 + k])
    votes: dict[int, int] = {}
    for end in ends:
        votes[context[end + 1]] = votes.get(context[end + 1], 0) + 1
    top = max(votes.values())
    chosen = next(end for end in ends if votes[context[end + 1]] == top)  # the latest of the most voted
    return LookupMatch(best_n, context[chosen + 1:chosen + 1 + k])


def longest_matches(candidates, context: list[int], longest: int, first_n: int = 1) -> tuple[int, list[int]]:
    """(n, ends): the most tokens, up to ``longest``, that a candidate match shares with the end
    of ``context``, and the context positions of the candidates that share that many, in the
    candidates' order. candidates: (tokens, at, end) with tokens[at] the context's token at
    position ``end`` (``tokens`` the context or any list holding that stretch of it), known to
    match the last ``first_n`` tokens; context: the context, or any list ending as it does."""
    T = len(context)
    best_n, ends = 0, []
    for tokens, at, end in candidates:
        n = first_n
        while n < longest and n <= end and tokens[at - n] == context[T - 1 - n]:
            n += 1
        if n > best_n:
            best_n, ends = n, [end]
        elif n == best_n:
            ends.append(end)
    return best_n, ends


def lookup_draft(context: list[int], k: int, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """The tokens of ``lookup_match`` alone: [] when nothing matches (or k <= 0)."""
    return lookup_match(context, k, max_ngram, min_ngram).tokens
