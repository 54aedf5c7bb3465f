"""gguf_dequant: Q4_1 and Q8_0 dequantized in whole-tensor torch ops give gguf's own numpy
dequantizer's floats bit for bit, NaN payloads aside (random bytes, so every float16 scale including infinities and
NaNs; real quantized weights; 1-, 2- and 3-D tensors; read-only file maps); other types and
inputs it does not take go to gguf's function."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from hypothesis import HealthCheck, given, settings, strategies as st

from swiftkern.gguf_dequant import Q4_1_BYTES, Q8_0_BYTES, fast_dequantize

BYTES = {Q.Q4_1: Q4_1_BYTES, Q.Q8_0: Q8_0_BYTES}
dequantize = fast_dequantize(quants.dequantize)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """The same shape and float32 bits, a NaN's payload aside (NaN + NaN keeps either operand's,
    as the vector unit pleases; numpy and torch differ there)."""
    if a.shape != b.shape or a.dtype != np.float32 or b.dtype != np.float32:
        return False
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([Q.Q4_1, Q.Q8_0]), st.lists(st.integers(1, 7), min_size=0, max_size=2),
       st.integers(1, 19), st.integers(0, 2**32 - 1))
def test_random_bytes_give_ggufs_floats(qtype, lead, blocks_per_row, seed):
    data = np.random.default_rng(seed).integers(0, 256, (*lead, blocks_per_row * BYTES[qtype]), dtype=np.uint8)
    assert same_bits(dequantize(data, qtype), quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_quantized_weights_read_only_give_ggufs_floats(qtype):
    w = (np.random.default_rng(1).standard_normal((97, 576)) * 0.05).astype(np.float32)
    data = quants.quantize(w, qtype)
    data.flags.writeable = False  # as a read-only file map
    ours = dequantize(data, qtype)
    assert same_bits(ours, quants.dequantize(data, qtype))
    assert np.abs(ours - w).max() < 0.05  # and it is the weight, roughly


def test_other_types_and_inputs_go_to_ggufs_function():
    calls = []

    def original(data, qtype):
        calls.append(qtype)
        return "gguf's"

    ours = fast_dequantize(original)
    assert ours(np.zeros((2, 64), np.uint8), Q.Q4_0) == "gguf's"  # a type it does not take
    assert ours(np.zeros((2, 8), np.float32), Q.F32) == "gguf's"
    assert ours(np.zeros((2, 21), np.uint8), Q.Q4_1) == "gguf's"  # not whole blocks: gguf says why
    assert ours(np.zeros((2, 40), np.int8), Q.Q4_1) == "gguf's"  # not bytes
    assert calls == [Q.Q4_0, Q.F32, Q.Q4_1, Q.Q4_1]
    assert ours(np.zeros((2, 40), np.uint8), Q.Q4_1).shape == (2, 64) and len(calls) == 4
