"""``gguf.dequantize`` for Q4_1 and Q8_0 (SmolLM2's types) in a few whole-tensor torch ops.

gguf's numpy dequantizer works through a tensor 16 rows at a time (~12.8k calls for SmolLM2,
~1.4 s of its load on the 2-thread Xeon); the same arithmetic over the whole tensor at once
gives the same floats: Q4_1 ``d * q + m`` and Q8_0 ``q * d`` in float32, each product and sum
rounded once, as numpy does (torch's CPU kernels make no fused multiply-add of the two ops).
Only a NaN's payload may differ (torch widens every float16 NaN to one NaN; numpy keeps it).
Every other type goes to gguf's own function. ``gguf_once.gguf_parsed_once`` hands this one
out as ``gguf.dequantize`` while a model loads; ``tests/test_gguf_dequant.py`` checks it
against gguf's, bit for bit (NaNs aside).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

Q4_1_BYTES = 20  # float16 d, float16 m, 16 bytes of 4-bit codes (low nibbles first)
Q8_0_BYTES = 34  # float16 d, 32 signed 8-bit codes
BLOCK = 32


def _blocks(data: np.ndarray, block_bytes: int) -> torch.Tensor:
    """uint8 [..., n * block_bytes] -> uint8 [rows * n, block_bytes] (no copy when contiguous).
    A read-only file map is only read here, so torch's warning about it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, block_bytes)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start + 2) of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """uint8 [..., bytes] of Q4_1 blocks -> float32 [..., bytes / 20 * 32]: d * q + m."""
    blocks = _blocks(data, Q4_1_BYTES)  # [n, 20]
    d, m, qs = _half(blocks, 0), _half(blocks, 2), blocks[:, 4:]  # [n, 1], [n, 1], [n, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], 1).float()  # [n, 32]
    out = d * q
    out += m
    return out.numpy().reshape(*data.shape[:-1], data.shape[-1] // Q4_1_BYTES * BLOCK)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """uint8 [..., bytes] of Q8_0 blocks -> float32 [..., bytes / 34 * 32]: q * d."""
    blocks = _blocks(data, Q8_0_BYTES)  # [n, 34]
    d = _half(blocks, 0)  # [n, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return (q * d).numpy().reshape(*data.shape[:-1], data.shape[-1] // Q8_0_BYTES * BLOCK)


def fast_dequantize(original):
    """``original`` (``gguf.dequantize``) with Q4_1 and Q8_0 taken by the functions above."""
    from gguf import GGMLQuantizationType as Q

    ours = {Q.Q4_1: (dequantize_q4_1, Q4_1_BYTES), Q.Q8_0: (dequantize_q8_0, Q8_0_BYTES)}

    def dequantize(data: np.ndarray, qtype):
        fast = ours.get(qtype)
        if (fast is None or not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim == 0
                or data.shape[-1] % fast[1]):
            return original(data, qtype)
        return fast[0](data)

    return dequantize
