"""Float32 weights that are exactly integer codes times a scale, stored as those codes.

A GGUF model loaded through transformers is dequantized to float32: SmolLM2's Q4_1 layers hold
``w = scale * code + offset`` per block of 32 inputs (code 0..15, scale and offset float16), its
Q8_0 head ``w = scale * code`` (code -128..127). Decoding on the CPU is bound by streaming those
float32 weights (4 bytes each) from memory; ``pack`` finds the codes again and checks that every
weight comes back bit for bit, and the C++ ``packed_linear`` reads 0.625 (4-bit) or 1.06 (8-bit)
bytes per weight and returns ``skinny_linear``'s result on the float32 weight, the same bits.
Nothing about the model changes: a weight that does not come back exactly is not packed, and
the runner keeps using its float32 copy.

Layout (csrc/packed_layout.h), uint8 [N, K/32, 20 | 34], per block of 32 inputs, GGUF's own
blocks byte for byte: 4-bit, Q4_1's: the float16 scale and offset (4 bytes) then 16 bytes of
codes, byte i = code[i] | code[i + 16] << 4; 8-bit, Q8_0's: the float16 scale (2 bytes) then 32
signed codes, the offset +0.
"""

from __future__ import annotations

import torch

BLOCK = 32
HEADER = {4: 4, 8: 2}  # bytes before the codes: float16 scale and offset; float16 scale
BLOCK_BYTES = {4: HEADER[4] + BLOCK // 2, 8: HEADER[8] + BLOCK}
_CODES = {4: (0, 15), 8: (-128, 127)}
_SCALE_STEPS = (0, 1, -1, 2, -2)  # float16 steps from the estimated scale that are tried, in order


def _find_codes(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """blocks: float32 [N, B, 32] -> (scale [N, B, 1], offset [N, B, 1], codes float32 [N, B, 32])
    with scale * codes + offset == blocks bit for bit (scale, offset float16 values), or None."""
    lo_code, hi_code = _CODES[bits]
    if bits == 4:  # the smallest weight has code 0, the largest 15
        offset = blocks.amin(-1, keepdim=True)
        estimate = (blocks.amax(-1, keepdim=True) - offset) / hi_code
    else:  # symmetric: the largest magnitude has code +-127
        offset = torch.zeros_like(blocks[..., :1])
        estimate = blocks.abs().amax(-1, keepdim=True) / hi_code
    if not torch.equal(offset.half().float(), offset):
        return None
    half_bits = estimate.half().view(torch.int16)
    found = torch.zeros_like(offset, dtype=torch.bool)
    scale, codes = torch.zeros_like(offset), torch.zeros_like(blocks)
    for step in _SCALE_STEPS:
        s = (half_bits + step).view(torch.float16).float()  # [N, B, 1]
        c = torch.where(s > 0, torch.round((blocks - offset) / s), 0.0).clamp_(lo_code, hi_code)
        exact = ((s * c + offset).view(torch.int32) == blocks.view(torch.int32)).all(-1, keepdim=True)
        take = exact & ~found
        scale = torch.where(take, s, scale)
        codes = torch.where(take, c, codes)
        found |= exact
        if step == 0 and found.float().mean() < 0.5:  # not this format: most blocks fit at once
            return None
        if bool(found.all()):
            return scale, offset, codes
    return None


def _layout(scale: torch.Tensor, offset: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:  # float16 values, exact (_find_codes takes no other)
        header = torch.cat([scale, offset], -1).half().contiguous().view(torch.uint8)  # [N, B, 4]
        c = codes.to(torch.uint8)
        body = c[..., :16] | (c[..., 16:] << 4)  # [N, B, 16]
    else:  # the scale is a float16 value (exact), the offset +0
        header = scale.half().contiguous().view(torch.uint8)  # [N, B, 2]
        body = codes.to(torch.int8).view(torch.uint8)  # [N, B, 32]
    return torch.cat([header, body], -1).contiguous()


def _pack_codes(weight: torch.Tensor, bits: int) -> torch.Tensor | None:
    """The torch twin of the C++ ``pack_codes`` (csrc/pack_codes_cpu.cpp), the same answer bit
    for bit: weight float32 [N, K] (K % 32 == 0) -> packed uint8 [N, K/32, 20 | 34] with
    ``bits``-bit codes, or None (a weight that is not finite never packs)."""
    if not bool(torch.isfinite(weight).all()):
        return None
    N, K = weight.shape
    found = _find_codes(weight.detach().reshape(N, K // BLOCK, BLOCK), bits)
    return None if found is None else _layout(*found, bits)


def _native_pack_codes():
    """The C++ ``pack_codes`` where the extension is built (one pass over the weight, rows in
    parallel: SmolLM2's 211 weights ~1.45 s through the twin), else None."""
    from .ops import registry

    return getattr(registry.extension, "pack_codes", None)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight: float32 [N, K] on the CPU -> packed uint8 [N, K/32, 20 | 34] holding the same
    values exactly (4-bit codes tried first, then 8-bit), or None when the weight is not such
    a quantized weight (K not a multiple of 32, a value not finite, or some block not exactly
    codes times a float16 scale plus a float16 offset)."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu"
            or weight.shape[1] % BLOCK or weight.numel() == 0):
        return None
    pack_codes = _native_pack_codes() or _pack_codes
    for bits in (4, 8):
        packed = pack_codes(weight.detach(), bits)
        if packed is not None:
            return packed
    return None


def bits_of(packed: torch.Tensor) -> int:
    """4 or 8: the code width of a packed weight."""
    for bits, size in BLOCK_BYTES.items():
        if packed.shape[-1] == size:
            return bits
    raise ValueError(f"not a packed weight: last dimension {packed.shape[-1]}, expected 20 or 34")


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/32, 20 | 34] -> the float32 weight [N, K] it holds (each weight
    scale * code + offset, one rounding)."""
    bits = bits_of(packed)
    N, B = packed.shape[:2]
    body = packed[..., HEADER[bits]:]
    if bits == 4:
        header = packed[..., :HEADER[bits]].contiguous().view(torch.float16).float()  # [N, B, 2]
        scale, offset = header[..., :1], header[..., 1:]
        codes = torch.cat([body & 0xF, body >> 4], -1).float()  # [N, B, 32]
    else:
        scale = packed[..., :HEADER[bits]].contiguous().view(torch.float16).float()  # [N, B, 1]
        offset = torch.zeros_like(scale)
        codes = body.contiguous().view(torch.int8).float()
    return (scale * codes + offset).reshape(N, B * BLOCK)


def _version(w) -> tuple | None:
    """What a packed copy of ``w`` is current for: an in-place change moves ``_version``, a new
    storage (``param.data = ...``, ``.to()`` and back) moves the address (and not the version)."""
    return None if w is None else (w._version, w.data_ptr())


def _sample_index(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where to look in a 2-D weight [N, K]: offsets int64 [N + K] from its first element, one
    element of every row and one of every column, spread over the columns and rows, so an edit
    of a whole row, a column or more (an adapter merged in, a scale, a sign flip, a rank-one
    edit) changes at least one; and the extent they span."""
    N, K = w.shape
    rows, cols = torch.arange(N), torch.arange(K)
    r = torch.cat([rows, (cols * 7919) % max(N, 1)])
    c = torch.cat([(rows * 104729) % max(K, 1), cols])
    offsets = r * w.stride(0) + c * w.stride(1)
    return offsets, int(offsets.max()) + 1 if len(offsets) else 0


def _sample(w: torch.Tensor, index: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The bits of ``w`` at ``index`` (int32 [N + K]: NaN equals itself, -0 differs from +0).
    One index_select over the weight's span (SmolLM2's 211 weights, 355k elements: ~5 ms; a
    gather by (row, column) pairs took ~13)."""
    offsets, extent = index
    return w.detach().as_strided((extent,), (1,)).index_select(0, offsets).view(torch.int32)


def _version_watch(weights: list):
    """A C++ ``VersionWatch`` over ``weights`` (csrc/version_watch.h: whether any moved its
    ``_version`` or data address, in one call) where the extension is built, else None."""
    from .ops import registry

    watch = getattr(registry.extension, "VersionWatch", None)
    return watch(weights) if watch is not None else None


class PackedSet:
    """Packed copies of a list of weights (None where a weight is absent or does not pack),
    kept current: a weight changed in place since it was packed (its ``_version`` moved) or given
    new storage (``param.data = ...``) is packed again before the list is handed out, so a stale
    copy is never read. A write through ``w.data`` (PEFT's merge of an adapter, ``.data.mul_``)
    moves neither: ``refresh()`` finds it in a sample of each weight's values (one element of
    every row and every column), once per ``Generator.generate`` call.

    ``PackedSet(weights)``; ``slots()`` -> list aligned with ``weights``; ``slot(i)``: one of
    them (checking that weight alone); ``count``: how many packed."""

    def __init__(self, weights: list):
        self.weights = weights
        self._packed = [self._pack(w) for w in weights]
        # the matrices alone are watched (a norm's or a bias's vector never packs): SmolLM2's
        # forward checks 211 of its 481 weights
        self._watched = [i for i, w in enumerate(weights) if self._packable(w)]
        self._watch_index = {i: j for j, i in enumerate(self._watched)}
        self._watched_weights = [weights[i] for i in self._watched]
        self._versions = [_version(w) for w in self._watched_weights]
        self._indices = [_sample_index(w) for w in self._watched_weights]
        self._samples = [_sample(w, index) for w, index in zip(self._watched_weights, self._indices)]
        self._watch = _version_watch(self._watched_weights)

    @staticmethod
    def _packable(w) -> bool:
        return isinstance(w, torch.Tensor) and w.dim() == 2

    @classmethod
    def _pack(cls, w):
        return pack(w) if cls._packable(w) else None

    def slot(self, i: int) -> torch.Tensor | None:
        i %= len(self.weights)
        j = self._watch_index.get(i)
        if j is not None:
            w = self.weights[i]
            if _version(w) != self._versions[j]:
                self._repack(i, j)
        return self._packed[i]

    def _repack(self, i: int, j: int) -> None:
        w = self.weights[i]
        self._packed[i] = self._pack(w)
        self._versions[j] = _version(w)
        self._samples[j] = _sample(w, self._indices[j])

    def refresh(self) -> int:
        """Pack again each weight whose sampled values changed while its version and address
        did not (a write through ``.data``); -> how many. Reads N + K elements of each weight
        [N, K] (SmolLM2: ~6 ms a call on a 2-core AMD EPYC, most of it cache misses)."""
        stale = [(i, j) for j, i in enumerate(self._watched)
                 if not torch.equal(_sample(self.weights[i], self._indices[j]), self._samples[j])]
        for i, j in stale:
            self._repack(i, j)
        return len(stale)

    def _changed(self) -> bool:
        """Whether a watched weight moved since the last look: a forward's hot path, SmolLM2's 211
        weights in one C++ loop (~71 us as ``_version`` tuples, which run where the extension is
        not built)."""
        if self._watch is not None:
            return self._watch.changed()
        return [_version(w) for w in self._watched_weights] != self._versions

    def slots(self) -> list:
        if self._changed():
            for i in self._watched:
                self.slot(i)
            if self._watch is not None:
                self._watch.look()
        return self._packed

    @property
    def count(self) -> int:
        return sum(p is not None for p in self._packed)
