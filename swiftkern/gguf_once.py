"""Loading a GGUF model through transformers without parsing the file three times.

``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` reads the config and then the weights,
and ``AutoTokenizer.from_pretrained`` the vocabulary, each through transformers'
``load_gguf_checkpoint``, which builds a new ``gguf.GGUFReader`` every time: SmolLM2's reader
holds ~147k fields (its 49152-token vocabulary and merges). Its weight-name map then builds
``gguf.get_tensor_name_map(arch, n_blocks)`` once for every module of the model (397 times for
SmolLM2), and Python's garbage collector walks the growing heap thousands of times meanwhile.
A reader of a file that does not change, and a name map, are pure functions of their
arguments, so inside ``gguf_parsed_once()`` each is built once and handed out again, and the
collector is paused. ``load_model("smollm2")`` on the 2-thread Xeon (2026-11-28): 21.5 s ->
15.7 s with one reader, 11.9 s with the collector paused too, 8.5 s with one name map; a later
session's A/B (a second load in one process): 9.3-10.5 -> 6.0 s with the reader's file as a
plain array, then ~4-5 s with its arrays read in one loop (``gguf_reader_fast``), the weights
dequantized by ``gguf_dequant`` and their codes found in C++ (``python -m bench --routine
load``: 8.07x transformers' own path).
The model, config and tokenizer are the same (``tests/test_gguf_once.py`` compares a load
with and without it).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading

from .gguf_dequant import fast_dequantize
from .gguf_reader_fast import fast_reader_class


def _memoized(function, key):
    """function, with each result kept under key(*args, **kwargs) and handed out again."""
    results = {}

    def call(*args, **kwargs):
        k = key(*args, **kwargs)
        if k not in results:
            results[k] = function(*args, **kwargs)
        return results[k]

    return call


def _reader_key(path, mode="r"):
    return os.path.realpath(os.fspath(path)), mode


def _args_key(*args, **kwargs):
    return args, tuple(sorted(kwargs.items()))


def _one_reader_a_file(reader_class):
    return _memoized(fast_reader_class(reader_class) if isinstance(reader_class, type) else reader_class,
                     _reader_key)


# gguf's function name -> what it is while a block is open, made from the original
_REPLACEMENTS = {
    "GGUFReader": _one_reader_a_file,
    "get_tensor_name_map": lambda original: _memoized(original, _args_key),
    "dequantize": fast_dequantize,
}


class _Patched:
    """What the open blocks share: how many are open, and what the first one replaced."""

    lock = threading.Lock()
    depth = 0
    originals: dict = {}  # gguf function name -> the function the first block replaced
    collecting = False  # whether the collector ran before the first block


def _enter() -> None:
    with _Patched.lock:
        _Patched.depth += 1
        if _Patched.depth > 1:
            return
        try:
            import gguf
        except ImportError:
            gguf = None
        if gguf is not None:
            for name, replacement in _REPLACEMENTS.items():
                if callable(getattr(gguf, name, None)):
                    _Patched.originals[name] = original = getattr(gguf, name)
                    setattr(gguf, name, replacement(original))
        _Patched.collecting = gc.isenabled()
        gc.disable()


def _exit() -> None:
    with _Patched.lock:
        _Patched.depth -= 1
        if _Patched.depth > 0:
            return
        if _Patched.originals:
            import gguf

            for name, original in _Patched.originals.items():
                setattr(gguf, name, original)
            _Patched.originals = {}
        if _Patched.collecting:
            gc.enable()


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside the block: ``gguf.GGUFReader(path)`` returns one reader per file (and mode),
    ``gguf.get_tensor_name_map(arch, n)`` one map per (arch, n), and the garbage collector is
    paused; the reader is ``gguf_reader_fast``'s (the same fields, its file a plain array, its
    metadata arrays read in one loop each: 22.5x faster on SmolLM2's file), and
    ``gguf.dequantize`` takes Q4_1 and Q8_0 through ``gguf_dequant`` (the same floats). When the
    last open block closes (an error too) ``gguf``'s functions and the collector are as before
    the first one opened, and the readers are dropped: blocks may nest or overlap in threads
    (two models loading at once share the readers, and neither leaves the other's patch
    behind). Without the ``gguf`` package only the collector is paused."""
    _enter()
    try:
        yield
    finally:
        _exit()
