"""``swiftkern generate --prompt-file``: prompts (and their arrival steps) from a JSONL file, each
line checked, a bad one refused with its path and line number."""

from __future__ import annotations

import contextlib
import json
import os
import sys

from .errors import SwiftkernError


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a JSONL file: one {"prompt": "..."} (or {"text": "..."}) object per non-empty line."""
    return read_prompt_records(path)[0]


# generation options a line might carry: not read per request, so a line with one is refused
# rather than generated with the command's flags instead (other keys, such as a "kind", pass)
REQUEST_OPTIONS = ("seed", "max_new_tokens", "max_tokens", "temperature", "top_k", "top_p", "do_sample",
                   "stop", "stop_token_ids", "eos_token_id", "deterministic", "mode", "chat")


def _lines(f, path: str):
    """(line number, line) of a file opened in binary, each line decoded as UTF-8 (a line that
    is not: refused with its number); a byte-order mark opening the file (Windows editors write
    one) is not part of its first line."""
    for n, raw in enumerate(f, 1):
        try:
            yield n, raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError:
            raise SwiftkernError(f"{path}:{n}: not UTF-8 text; save the prompt file as UTF-8") from None


def _open(path: str):
    """The prompt file opened in binary: "-" is standard input (``cat p.jsonl | swiftkern
    generate --prompt-file -``); a pipe or FIFO (``<(...)``, /dev/stdin) is read as a file."""
    if path == "-":
        return contextlib.nullcontext(sys.stdin.buffer)
    if not os.path.exists(path):
        raise SwiftkernError(f"prompt file {path!r} does not exist")
    if os.path.isdir(path):
        raise SwiftkernError(f"prompt file {path!r} is a directory; give a JSONL file (or - for standard input)")
    return open(path, "rb")


def read_prompt_records(path: str) -> tuple[list[str], list[int] | None]:
    """(prompts, arrive_at) from a JSONL file of {"prompt": "..."} objects (or "text"), each
    with an optional "arrive_at": the decoding step at which it joins the batch (0 when left
    out); arrive_at is None when no line has one. ``path`` "-": standard input."""
    prompts, arrive_at = [], []
    with _open(path) as f:
        for n, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SwiftkernError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if isinstance(obj, dict) and "prompt" in obj and "text" in obj:
                raise SwiftkernError(f'{path}:{n}: has both "prompt" and "text"; give the prompt under one of them')
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise SwiftkernError(f'{path}:{n}: expected an object like {{"prompt": "..."}} (or "text")')
            options = [k for k in REQUEST_OPTIONS if k in obj]
            if options:
                raise SwiftkernError(f'{path}:{n}: per-request {", ".join(map(repr, options))} is not read from a '
                                     "prompt file (a line holds a prompt and its arrive_at); pass it as a flag "
                                     "for the whole file, or run the requests separately")
            step = obj.get("arrive_at", 0)
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise SwiftkernError(f'{path}:{n}: "arrive_at" must be a whole number >= 0, got {step!r}')
            prompts.append(text)
            arrive_at.append(step)
    if not prompts:
        raise SwiftkernError(f"prompt file {path!r} has no prompts")
    return prompts, arrive_at if any(arrive_at) else None
