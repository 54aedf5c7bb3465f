"""Packed weights rearranged for ``int8_linear``, the approximate integer matmul of draft passes.

``int8_linear`` quantizes x to int8 per block of 32 inputs and takes integer dot products with
the weight codes (AVX-512 VNNI, 16 weight rows in the 16 int32 lanes of a vector). It reads the
codes of ``packed_weights`` in another order: per group of 16 weight rows and block of 32
inputs, the 16 scales, the 16 offsets, then the codes in 64-byte chunks, each holding 4 bytes of
every row (see csrc/int8_linear_cpu.cpp). Same codes, same scales, same bytes per weight; only
the order differs, so a model holds both copies (the exact one for verify passes, this one for
drafts) at 1.5 bytes per weight together, against float32's 4.

Layout, uint8 [ceil(N / 16), K / 32, 384 | 640] (4- | 8-bit codes); 8-bit codes are stored
plus 128 (unsigned, as VNNI's byte operand wants). Rows past N are zero.
"""

from __future__ import annotations

import torch

from .packed_weights import BLOCK, HEADER, bits_of

GROUP = 16
GROUP_BLOCK_BYTES = {4: 2 * GROUP * 4 + GROUP * 16, 8: 2 * GROUP * 4 + GROUP * 32}


def from_packed(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/32, 24 | 40] (``packed_weights.pack``) -> uint8 [ceil(N/16), K/32, 384 | 640]."""
    bits = bits_of(packed)
    N, B = packed.shape[:2]
    G = -(-N // GROUP)
    padded = torch.zeros((G * GROUP, B, packed.shape[2]), dtype=torch.uint8)
    padded[:N] = packed
    by_group = padded.view(G, GROUP, B, -1).transpose(1, 2)  # [G, B, 16, bytes]
    scales = by_group[..., 0:4].reshape(G, B, GROUP * 4)
    offsets = by_group[..., 4:8].reshape(G, B, GROUP * 4)
    codes = by_group[..., HEADER:]  # [G, B, 16, 16 | 32]
    if bits == 8:
        codes = codes ^ 0x80  # signed code -> code + 128
    chunks = codes.reshape(G, B, GROUP, -1, 4).transpose(2, 3)  # [G, B, chunk, 16 rows, 4]
    return torch.cat([scales, offsets, chunks.reshape(G, B, -1)], -1).contiguous()


def bits_of_int8(weights: torch.Tensor) -> int:
    """4 or 8: the code width of an int8_linear weight."""
    for bits, size in GROUP_BLOCK_BYTES.items():
        if weights.shape[-1] == size:
            return bits
    raise ValueError(f"not an int8_linear weight: last dimension {weights.shape[-1]}, expected 384 or 640")


def unpack_int8(weights: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weights uint8 [G, K/32, 384 | 640] -> (scale float32 [n, K/32], offset float32 [n, K/32],
    codes int32 [n, K/32, 32] in input order: 0..15 (4-bit) or -128..127 (8-bit))."""
    bits = bits_of_int8(weights)
    G, B = weights.shape[:2]
    scale = weights[..., : GROUP * 4].contiguous().view(torch.float32)  # [G, B, 16]
    offset = weights[..., GROUP * 4: GROUP * 8].contiguous().view(torch.float32)
    chunks = weights[..., GROUP * 8:].reshape(G, B, -1, GROUP, 4).transpose(2, 3)  # [G, B, 16, chunk, 4]
    body = chunks.reshape(G, B, GROUP, -1).to(torch.int32)  # [G, B, 16, 16 | 32]
    codes = torch.cat([body & 0xF, body >> 4], -1) if bits == 4 else body - 128  # [G, B, 16, 32]

    def rows(t):  # [G, B, 16, ...] -> [n, B, ...]
        return t.transpose(1, 2).reshape(G * GROUP, B, *t.shape[3:])[:n]

    return rows(scale), rows(offset), rows(codes)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [..., K] -> (q int32 [..., K/32, 32] in [-127, 127], s float32 [..., K/32]):
    per block of 32, s = max|x| / 127 and q = round-half-even(x / s), 0 where s = 0."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    s = blocks.abs().amax(-1) / 127.0
    q = torch.where(s.unsqueeze(-1) > 0, torch.round(blocks / s.unsqueeze(-1)), 0.0).clamp(-127, 127)
    return q.to(torch.int32), s


class Int8Set:
    """``from_packed`` of every slot of a ``packed_weights.PackedSet``, kept current: a slot whose
    packed copy was replaced (its weight changed in place) is converted again before the list is
    handed out. ``Int8Set(packed_set)``; ``slots()`` -> list aligned with the packed set's."""

    def __init__(self, packed_set):
        self.packed_set = packed_set
        self._sources: list = []
        self._slots: list = []

    def slots(self) -> list:
        packed = self.packed_set.slots()
        if len(self._sources) != len(packed):
            self._sources, self._slots = [None] * len(packed), [None] * len(packed)
        for i, p in enumerate(packed):
            if p is not self._sources[i]:
                self._sources[i] = p
                self._slots[i] = from_packed(p) if p is not None else None
        return self._slots
