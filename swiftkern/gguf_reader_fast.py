"""``gguf.GGUFReader`` with the same fields and tensors, built 22.5x faster (SmolLM2's file).

A GGUF file's metadata holds the vocabulary as arrays (SmolLM2: 49152 token strings, 48900
merges, 49152 token types), and gguf's reader makes every element its own numpy view of the
file through a chain of small calls, on a ``numpy.memmap`` whose ``__getitem__`` and
``__array_finalize__`` are Python code: ~147k parts, 5.3 s for SmolLM2's file on the 2-thread
Xeon. ``fast_reader_class(gguf.GGUFReader)`` is a subclass that

- keeps a read-only file as a plain ``numpy.ndarray`` view of the map (the same mapped bytes
  without the subclass's hooks), and
- reads an array of strings or of scalars in one loop (the lengths by ``struct``, each element
  one slice of the file), making the very parts gguf makes: the same dtypes, shapes, bytes and
  data indices (``tests/test_gguf_once.py`` compares every field of both readers).

Other value types, nested arrays and files of the other byte order go through gguf's code.
``python -m bench --routine load`` times it against gguf's reader.
"""

from __future__ import annotations

import struct
import sys

import numpy as np


def fast_reader_class(reader_class):
    """A subclass of ``reader_class`` (``gguf.GGUFReader``) as the module docstring says."""
    from gguf import GGUFValueType

    string, array = GGUFValueType.STRING, GGUFValueType.ARRAY

    class FastReader(reader_class):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped):
            if isinstance(mapped, np.memmap) and mapped.mode == "r":
                mapped = mapped.view(np.ndarray)  # .base keeps the map open
            self._plain_data = mapped

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != array or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            count, item = int(alen[0]), GGUFValueType(int(raw_itype[0]))
            parts, offs = [raw_itype, alen], orig_offs + 12
            if count == 0:
                return 12, parts, [], [array]
            data = self.data
            if item == string:
                length_type = np.dtype(np.uint64)
                for _ in range(count):  # element i: its length at part 2 + 2i, its bytes at 3 + 2i
                    (length,) = struct.unpack_from("<Q", data, offs)
                    parts.append(data[offs:offs + 8].view(length_type))
                    parts.append(data[offs + 8:offs + 8 + length])
                    offs += 8 + length
                return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), [array, item]
            scalar = self.gguf_scalar_to_np.get(item)
            if scalar is None:  # an array of arrays
                return super()._get_field_parts(orig_offs, raw_type)
            dtype = np.dtype(scalar)
            end = offs + count * dtype.itemsize
            parts += list(data[offs:end].view(dtype).reshape(count, 1))  # element i: part 2 + i, shape [1]
            return end - orig_offs, parts, list(range(2, 2 + count)), [array, item]

    FastReader.__name__ = FastReader.__qualname__ = reader_class.__name__
    return FastReader
