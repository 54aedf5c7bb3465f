"""Streaming: each request's tokens as they become final, and as text.

``Generator.generate(..., streamer=fn)`` calls ``fn(request, tokens)`` with the tokens each
commit appended to request ``request`` (``Requests.on_commit``), in order, so that the tokens
of all calls for one request are its output. A committed token is final in every mode: ``ar``
commits each decoded token; ``self-spec`` commits the accepted drafts and the full model's own
token after a verify pass, never a draft that may still be rejected; ``deterministic`` commits
only what its verifier has replayed (LLM-42: unverified tokens are never streamed), or, where
no replay is needed (``Generator.replay_elided``), each token as it is decoded. A request run
with ``deterministic=False`` streams its fast-path tokens at once: they are its output.

``TextStream`` turns that into text pieces, holding back a piece that ends inside a character
(a byte-level BPE token may carry half of one) until the next token completes it, and, with a
tokenizer that cleans up spaces, the text from the last whitespace on (a later "," or "'s"
takes back the space before it).
"""

from __future__ import annotations

import sys
from typing import Callable

from .errors import SwiftkernError

_INCOMPLETE = "\ufffd"  # what a tokenizer decodes a cut UTF-8 sequence to
_WHITESPACE = " \t\n\r"


class TextStream:
    """A ``streamer`` for ``Generator.generate`` that writes each request's new text.

    tokenizer: decodes token ids (``decode(ids, skip_special_tokens=True)``).
    write(request, text): gets every new piece of request ``request``'s text; by default the
    pieces go to stdout (meant for one request). ``finish()`` writes what was held back (a
    request that ended inside a character, or its last word) and returns the text of every
    request streamed, the same as ``GenerationOutput.texts``. The pieces of a request join to
    that text: where the tokenizer cleans up spaces (``clean_up_tokenization_spaces``: " ," ->
    ",", " n't" -> "n't", ...) a token can remove the space before the word it ends, so the
    text from the last whitespace on waits for the next whitespace or ``finish()``.
    """

    def __init__(self, tokenizer, write: Callable[[int, str], None] | None = None):
        if not callable(getattr(tokenizer, "decode", None)):
            raise SwiftkernError(f"TextStream needs a tokenizer with decode(ids), got {type(tokenizer).__name__}")
        if write is not None and not callable(write):
            raise SwiftkernError(f"TextStream: write must be a callable write(request, text), got {type(write).__name__}")
        self.tokenizer = tokenizer
        self.write = write or _to_stdout
        self.tokens: dict[int, list[int]] = {}
        self.sent: dict[int, int] = {}  # characters of each request's text written so far
        self.hold_last_word = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def __call__(self, request: int, tokens: list[int]) -> None:
        ids = self.tokens.setdefault(request, [])
        ids.extend(tokens)
        text = self._text(request)
        if text.endswith(_INCOMPLETE):
            return
        if self.hold_last_word:  # HF's clean-up drops spaces before the last word, or after a final quote
            cut = max(text.rfind(c) for c in _WHITESPACE)  # where the held-back tail starts
            if cut >= 0:  # the whole last run: "  ' s" cleans to "'s" (" ' ", then " 's")
                cut = len(text[:cut].rstrip(_WHITESPACE))
            elif text.endswith("'"):  # " ' " cleaned to "'": a later " !" (cleaned first) leaves " '!"
                cut = len(text) - 1
            text = text[:cut] if cut >= 0 else text
        self._write_from(request, text)

    def finish(self) -> dict[int, str]:
        """Write what is held back; -> {request: its whole text}."""
        texts = {}
        for request in self.tokens:
            texts[request] = self._text(request)
            self._write_from(request, texts[request])
        return texts

    def _text(self, request: int) -> str:
        return self.tokenizer.decode(self.tokens[request], skip_special_tokens=True)

    def _write_from(self, request: int, text: str) -> None:
        start = self.sent.get(request, 0)
        if len(text) > start:
            self.write(request, text[start:])
            self.sent[request] = len(text)


def _to_stdout(request: int, text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
