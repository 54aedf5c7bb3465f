"""Prompt lookup over a long prompt without a pass over it each step: ``drafters.lookup_match``'s
answer, bit for bit, from an index of the prompt made once.

``lookup_match`` walks the whole context every step and extends a match backwards at each
position that holds the last token. With a prompt of thousands of tokens that is the step's
largest host cost (SmolLM2's tokens, one row: ~25 us at 1024 tokens of context, ~100 us at
4096, ~420 us at 16384 on the Xeon), and it is paid per row: a batch of 32 such rows spent
milliseconds a step on it, longer than a decode step of a small model on a GPU.

``PromptIndex`` keeps, for each token and each pair of adjacent tokens of the prompt, where they
end (the positions followed by another prompt token). A step then visits only the prompt
positions that end the context's last pair: a match of two or more tokens is the longest there
can be whenever one exists, and positions holding the last token alone match one token and
cannot be among the longest matches. Only when no pair matches are the positions of the last
token visited (every one matches one token, and they vote). The generated tokens (and the
prompt's last position, followed by the first of them) are scanned as ``lookup_match`` does.
Both visit the candidate ends latest first, so the longest matches, their order and the vote
are the same.
"""

from __future__ import annotations

from .drafters import LOOKUP_MAX_NGRAM, LookupMatch, longest_matches, lookup_match

NO_MATCH = LookupMatch(0, [])


class PromptIndex:
    """Where each token and each adjacent pair of ``prompt`` ends: positions 0 .. P-2 (followed
    by a prompt token), ascending. Made once (~0.4 us a token); the prompt is copied."""

    def __init__(self, prompt: list[int]):
        self.prompt = list(prompt)
        singles: dict[int, list[int]] = {}
        pairs: dict[tuple[int, int], list[int]] = {}
        before = None
        for end, token in enumerate(self.prompt[:-1]):
            singles.setdefault(token, []).append(end)
            if end:
                pairs.setdefault((before, token), []).append(end)
            before = token
        self.singles, self.pairs = singles, pairs

    def match(self, generated: list[int], k: int, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1,
              vote: bool = True) -> LookupMatch:
        """``lookup_match(prompt + generated, k, max_ngram, min_ngram, vote)`` without joining
        the two or walking the prompt."""
        prompt = self.prompt
        P = len(prompt)
        size = P + len(generated)
        longest = min(max_ngram, size - 1)
        if k <= 0 or longest < min_ngram:
            return NO_MATCH
        offset = max(0, P - max_ngram)  # tail[i] is context[offset + i]: what a match reaches back to
        tail = prompt[offset:] + generated
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
        context position ``end`` is ``tokens[at]``, ``tokens`` the tail for the generated part and
        the prompt's last position (scanned), the prompt for the rest (from the index)."""
        P, T = len(self.prompt), len(tail)
        last = tail[-1]
        for at in range(T - 2, max(P - 2 - offset, -1), -1):
            if tail[at] == last and (before is None or (at + offset >= 1 and tail[at - 1] == before)):
                yield tail, at, at + offset
        indexed = self.singles.get(last, ()) if before is None else self.pairs.get((before, last), ())
        for end in reversed(indexed):
            yield self.prompt, end, end

    def _answer(self, found: tuple[int, list[int]], tail: list[int], offset: int, k: int, min_ngram: int,
                vote: bool) -> LookupMatch:
        best_n, ends = found
        if best_n < min_ngram:
            return NO_MATCH
        P = len(self.prompt)

        def at(i: int) -> int:
            return self.prompt[i] if i < P else tail[i - offset]

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
        return LookupMatch(best_n, self.prompt[start:start + k] + tail[P - offset:P - offset + max(0, start + k - P)])


class PromptLookup:
    """``lookup_match`` for the requests of one generation: ``match(r, generated, ...)`` is
    ``lookup_match(prompts[r] + generated, ...)``. Prompts of ``INDEX_MIN_TOKENS`` or more are
    indexed (``PromptIndex``) the first time they are matched; an index is dropped once its
    request is done (``done``: the requests' done flags, read, never written)."""

    INDEX_MIN_TOKENS = 256

    def __init__(self, prompts: list[list[int]], done: list[bool] | None = None):
        self.prompts = prompts
        self.done = done
        self._indexes: dict[int, PromptIndex] = {}

    def match(self, r: int, generated: list[int], k: int, min_ngram: int = 1) -> LookupMatch:
        prompt = self.prompts[r]
        if len(prompt) < self.INDEX_MIN_TOKENS:
            return lookup_match(prompt + generated, k, min_ngram=min_ngram)
        index = self._indexes.get(r)
        if index is None:
            if self.done is not None:
                for gone in [q for q in self._indexes if self.done[q]]:
                    del self._indexes[gone]
            index = self._indexes[r] = PromptIndex(prompt)
        return index.match(generated, k, min_ngram=min_ngram)
