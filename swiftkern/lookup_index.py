"""Prompt lookup over a long context without a pass over it each step: ``drafters.lookup_match``'s
answer, bit for bit, from an index of the context kept as it grows.

``lookup_match`` walks the whole context every step and extends a match backwards at each
position that holds the last token. With a prompt of thousands of tokens (or an output of
thousands) that is the step's largest host cost (SmolLM2's tokens, one row: ~35 us at 1024
tokens of context, ~120 us at 4096, ~450 us at 16384 on the Xeon), and it is paid per row: a
batch of 32 such rows spent milliseconds a step on it, longer than a decode step of a small
model on a GPU.

``ContextIndex`` keeps, for each token and each pair of adjacent tokens of the prompt and the
committed output, where they end (the positions followed by another indexed token), and grows
as tokens are committed. A step then visits only the positions that end the context's last
pair: a match of two or more tokens is the longest there can be whenever one exists, and
positions holding the last token alone match one token and cannot be among the longest matches.
Only when no pair matches are the positions of the last token visited (every one matches one
token, and they vote). The tokens not indexed (not committed yet: the pending token, mode
deterministic's unverified ones) and the last indexed position are scanned as ``lookup_match``
does. Both visit the candidate ends latest first, so the longest matches, their order and the
vote are the same.
"""

from __future__ import annotations

from .drafters import LOOKUP_MAX_NGRAM, LookupMatch, longest_matches, lookup_match


class ContextIndex:
    """Where each token and each adjacent pair of ``tokens`` ends: positions 0 .. L-2 (followed
    by an indexed token), ascending; ``extend`` appends tokens (~0.4 us a token)."""

    def __init__(self, tokens: list[int] = ()):
        self.tokens: list[int] = []
        self.singles: dict[int, list[int]] = {}
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        own, singles, pairs = self.tokens, self.singles, self.pairs
        for token in tokens:
            end = len(own) - 1  # the position ``token`` now follows
            if end >= 0:
                singles.setdefault(own[end], []).append(end)
                if end:
                    pairs.setdefault((own[end - 1], own[end]), []).append(end)
            own.append(token)

    def match(self, generated: list[int], k: int, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1,
              vote: bool = True) -> LookupMatch:
        """``lookup_match(tokens + generated, k, max_ngram, min_ngram, vote)`` without joining
        the two or walking the indexed tokens (``tokens`` and ``generated`` not both empty)."""
        P = len(self.tokens)
        size = P + len(generated)
        longest = min(max_ngram, size - 1)
        if k <= 0 or longest < min_ngram:
            return LookupMatch(0, [])
        offset = max(0, P - max_ngram)  # tail[i] is context[offset + i]: what a match reaches back to
        tail = self.tokens[offset:] + generated
        if longest >= 2:
            found = self._longest(tail, offset, longest, tail[-2])
            if found[0] >= 2:
                return self._answer(found, tail, offset, k, min_ngram, vote)
        return self._answer(self._longest(tail, offset, longest, None), tail, offset, k, min_ngram, vote)

    def _longest(self, tail: list[int], offset: int, longest: int, before: int | None) -> tuple[int, list[int]]:
        """(the longest match, its ends in context positions, latest first) among the ends that
        hold the last token (before None) or the last pair (before: the token ahead of it)."""
        return longest_matches(self._candidates(tail, offset, before), tail, longest, 1 if before is None else 2)

    def _candidates(self, tail: list[int], offset: int, before: int | None):
        """(tokens, at, end) for each end holding the last token (or pair), latest first: the
        context position ``end`` is ``tokens[at]``, ``tokens`` the tail for the tokens not indexed
        and the last indexed position (scanned), the indexed tokens for the rest."""
        P, T = len(self.tokens), len(tail)
        last = tail[-1]
        for at in range(T - 2, max(P - 2 - offset, -1), -1):
            if tail[at] == last and (before is None or (at + offset >= 1 and tail[at - 1] == before)):
                yield tail, at, at + offset
        indexed = self.singles.get(last, ()) if before is None else self.pairs.get((before, last), ())
        for end in reversed(indexed):
            yield self.tokens, end, end

    def _answer(self, found: tuple[int, list[int]], tail: list[int], offset: int, k: int, min_ngram: int,
                vote: bool) -> LookupMatch:
        best_n, ends = found
        if best_n < min_ngram:
            return LookupMatch(0, [])
        P = len(self.tokens)

        def at(i: int) -> int:
            return self.tokens[i] if i < P else tail[i - offset]

        chosen = ends[0]
        if vote:
            votes: dict[int, int] = {}
            for end in ends:
                votes[at(end + 1)] = votes.get(at(end + 1), 0) + 1
            top = max(votes.values())
            chosen = next(end for end in ends if votes[at(end + 1)] == top)  # the latest of the most voted
        start = chosen + 1
        if start >= P:
            return LookupMatch(best_n, tail[start - offset:start - offset + k])
        return LookupMatch(best_n, self.tokens[start:start + k] + tail[P - offset:P - offset + max(0, start + k - P)])


class PromptLookup:
    """``lookup_match`` for the requests of one generation: ``match(r, committed, ..., pending)``
    is ``lookup_match(prompts[r] + committed + pending, ...)``. committed: the request's output
    so far, which only grows (``Requests.out``); pending: tokens after it that may still be
    taken back (mode deterministic's unverified ones). Once a request's prompt and output reach
    ``INDEX_MIN_TOKENS`` they are indexed (``ContextIndex``), and the index follows the output
    as it grows (made again, should the output not extend what it holds); an index is dropped
    once its request is done (``done``: the requests' done flags, read, never written)."""

    INDEX_MIN_TOKENS = 256

    def __init__(self, prompts: list[list[int]], done: list[bool] | None = None):
        self.prompts = prompts
        self.done = done
        self._indexes: dict[int, ContextIndex] = {}

    def match(self, r: int, committed: list[int], k: int, min_ngram: int = 1, pending: list[int] = ()) -> LookupMatch:
        prompt = self.prompts[r]
        if len(prompt) + len(committed) < self.INDEX_MIN_TOKENS:
            return lookup_match(prompt + committed + list(pending), k, min_ngram=min_ngram)
        return self._index(r, prompt, committed).match(list(pending), k, min_ngram=min_ngram)

    def _index(self, r: int, prompt: list[int], committed: list[int]) -> ContextIndex:
        """Request r's index, holding prompt + committed."""
        index = self._indexes.get(r)
        if index is None:
            if self.done is not None:
                for gone in [q for q in self._indexes if self.done[q]]:
                    del self._indexes[gone]
        else:
            have = len(index.tokens) - len(prompt)  # the output tokens it holds
            if have <= len(committed) and (have == 0 or index.tokens[-1] == committed[have - 1]):
                index.extend(committed[have:])
                return index
        index = self._indexes[r] = ContextIndex(prompt + committed)
        return index
