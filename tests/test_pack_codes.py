"""The C++ pack_codes (csrc/pack_codes_cpu.cpp) against its torch twin packed_weights._pack_codes:
the same packed bytes, or None from both, on gguf's own Q4_1 / Q8_0 weights, on blocks that
only fit at a neighbouring float16 scale, and on weights that must not pack (a nudged weight,
infinities, NaN, zeros of both signs, a non-float16 offset, too few blocks of the format)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import gguf_weight
from swiftkern import packed_weights
from swiftkern.ops import registry
from swiftkern.packed_weights import _pack_codes, pack, unpack

native = getattr(registry.extension, "pack_codes", None)
needs_cpp = pytest.mark.skipif(native is None, reason="the C++ extension (pack_codes) was not built")
TINY = 2.0 ** -24  # the float16 subnormal step


def same_answer(w: torch.Tensor, bits: int):
    """The twin's answer for w at `bits`, after checking that the C++ one is the same."""
    mine, twin = native(w, bits), _pack_codes(w, bits)
    assert (mine is None) == (twin is None), (bits, mine is None, twin is None)
    if twin is not None:
        assert mine.dtype == torch.uint8 and mine.shape == twin.shape and torch.equal(mine, twin)
    return twin


def neighbour_scale_blocks(n: int, bits: int, seed: int) -> torch.Tensor:
    """n blocks [n, 32] at float16-subnormal scales k * 2^-24 whose codes stop one short of the
    top code (4-bit: 0..14; 8-bit: -128..126, -128 present): the estimate (max - min) / 15 or
    max|w| / 127 then rounds to a neighbouring float16 (k = 8: 7.47 -> 7, the fit is one step
    up; 8-bit k = 100: 100.8 -> 101, one step down), so only the later scale steps find them."""
    g = torch.Generator().manual_seed(seed)
    # 4-bit: 14k/15 is 1-2 float16 steps below k for k in 8..37; 8-bit: 128k/127 is 1 above
    # for k in 64..190
    k = torch.randint(8, 38, (n, 1), generator=g).float() if bits == 4 else \
        torch.randint(64, 191, (n, 1), generator=g).float()
    if bits == 4:
        codes = torch.randint(0, 15, (n, 32), generator=g).float()
        codes[:, 0], codes[:, 1] = 0, 14
        offset = -torch.randint(0, 1024, (n, 1), generator=g).float() * TINY  # float16 subnormals
    else:
        codes = torch.randint(-128, 127, (n, 32), generator=g).float()
        codes[:, 0] = -128
        offset = torch.zeros(n, 1)
    return k * TINY * codes + offset


@needs_cpp
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 41), st.sampled_from([32, 96, 576]), st.sampled_from([Q.Q4_1, Q.Q8_0]),
       st.integers(0, 2**31 - 1))
def test_the_same_bytes_as_the_twin_on_gguf_weights(N, K, qtype, seed):
    w = gguf_weight(N, K, qtype, seed)
    own = 4 if qtype == Q.Q4_1 else 8
    for bits in (4, 8):
        packed = same_answer(w, bits)
        if bits == own:
            assert packed is not None and torch.equal(unpack(packed), w)
    assert same_answer(torch.randn(N, K), 4) is None and same_answer(torch.randn(N, K), 8) is None


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_found_only_at_a_neighbouring_scale(bits, monkeypatch):
    qtype = Q.Q4_1 if bits == 4 else Q.Q8_0
    plain = gguf_weight(9, 96, qtype, 3)  # 27 blocks that fit at the first scale
    odd = neighbour_scale_blocks(18, bits, 4).reshape(3, 192)  # 18 that need a later one
    w = torch.cat([plain.reshape(-1, 32), odd.reshape(-1, 32)]).reshape(15, 96)
    packed = same_answer(w, bits)
    assert packed is not None and torch.equal(unpack(packed), w)
    monkeypatch.setattr(packed_weights, "_SCALE_STEPS", (0,))  # the first scale alone: not all fit
    assert _pack_codes(w, bits) is None
    # fewer than half the blocks fitting at the first scale: not this format, in both
    mostly_odd = torch.cat([plain.reshape(-1, 32)[:8], odd.reshape(-1, 32)[:10]]).reshape(3, 192)
    monkeypatch.undo()
    assert same_answer(mostly_odd, bits) is None


@needs_cpp
def test_weights_rounded_off_the_grid_are_found_by_rounding_to_nearest():
    """Blocks at a float16 offset near -1 and a scale near 1e-6: s * code + offset rounds in
    float32, so (w - offset) / s is no integer (6.9999.., 7.0000..1) and only rounding it to
    the nearest recovers each code (truncating it does not)."""
    g = torch.Generator().manual_seed(2)
    n = 64
    scale = (torch.rand(n, 1, generator=g) * 9e-6 + 1e-6).half().float()
    offset = -(torch.rand(n, 1, generator=g) + 0.5).half().float()
    codes = torch.randint(0, 16, (n, 32), generator=g).float()
    codes[:, 0], codes[:, 1] = 0, 15
    w = (scale * codes + offset).reshape(16, 128)
    quotients = (w.reshape(n, 32) - offset) / scale
    assert (quotients != quotients.round()).any(dim=1).sum() > n // 8
    packed = same_answer(w, 4)
    assert packed is not None and torch.equal(unpack(packed), w)


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_what_must_not_pack_packs_in_neither(bits):
    w = gguf_weight(6, 64, Q.Q4_1 if bits == 4 else Q.Q8_0, 7)
    assert same_answer(w, bits) is not None
    spoiled = []
    for value in (float("inf"), float("-inf"), float("nan")):
        x = w.clone()
        x[2, 40] = value
        spoiled.append(x)
    nudged = w.clone()
    nudged[5, 3] = torch.nextafter(nudged[5, 3], torch.tensor(1.0))
    spoiled.append(nudged)
    both_zeros = w.clone()
    both_zeros[1, :32] = 0.0
    both_zeros[1, 5] = -0.0  # a block of +0 and -0: no offset rebuilds both
    spoiled.append(both_zeros)
    for x in spoiled:
        assert same_answer(x, bits) is None
    if bits == 4:
        off = w.clone()
        off[0, :32] += 1e-4 + 2.0 ** -20  # the block's min is no float16 any more
        assert same_answer(off, bits) is None


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_one_weight_one_ulp_off_anywhere_in_a_block_packs_in_neither(bits):
    """Every place of a block is checked (the first and the last code, both nibbles of a 4-bit
    byte): each weight of two rows of two blocks nudged one ulp in turn, no longer rebuilt exactly."""
    w = gguf_weight(2, 64, Q.Q4_1 if bits == 4 else Q.Q8_0, 5)
    assert same_answer(w, bits) is not None
    for k in range(64):
        x = w.clone()
        x[1, k] = torch.nextafter(x[1, k], torch.tensor(float("inf")))
        assert same_answer(x, bits) is None, k


@needs_cpp
def test_an_exact_block_at_an_offset_that_is_no_float16_packs_in_neither():
    """A 4-bit block that does rebuild exactly (scale * code + offset, every weight) at an offset,
    its min, that is no float16 value: GGUF's Q4_1 stores a float16 min, so the twin refuses it,
    and so must the C++ (its offset check, not the rebuild, refuses it). The same codes at the
    float16 nearest that offset pack."""
    codes = (torch.arange(64) % 16).float().reshape(2, 32)  # every block: 0..15 twice
    scale = 2.0 ** -6
    for offset, packs in ((0.1, False), (float(torch.tensor(0.1).half()), True)):
        w = scale * codes + torch.tensor(offset, dtype=torch.float32)
        assert float(w.min()) == float(torch.tensor(offset, dtype=torch.float32))
        assert (same_answer(w, 4) is not None) == packs, offset


@needs_cpp
def test_zero_and_constant_blocks_and_large_magnitudes():
    w = gguf_weight(4, 128, Q.Q4_1, 11)
    w[0, :32] = 0.0  # scale 0: every code 0, offset 0
    w[1, 32:64] = -0.75  # a constant block at a float16 offset
    w[2, 64:96] = torch.arange(32).remainder(16).float() * 4096.0 - 60000.0  # large float16s
    for bits in (4, 8):
        same_answer(w, bits)
    packed = same_answer(w, 4)
    assert packed is not None and torch.equal(unpack(packed), w)
    g = torch.Generator().manual_seed(0)
    for scale in (1e30, 3e38):  # (max - min) / 15 overflowing float16 and float32
        x = torch.randn(3, 64, generator=g) * scale
        same_answer(x, 4), same_answer(x, 8)


@needs_cpp
def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        native(torch.zeros(2, 32), 6)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native(torch.zeros(2, 33), 4)
    with pytest.raises(RuntimeError, match="float32"):
        native(torch.zeros(2, 32, dtype=torch.float64), 4)
    with pytest.raises(RuntimeError, match=r"\[N, K\]"):
        native(torch.zeros(32), 4)


@needs_cpp
def test_pack_uses_it_and_a_strided_weight_packs_the_same():
    w = gguf_weight(12, 96, Q.Q4_1, 5)
    wide = torch.cat([w, torch.zeros(12, 32)], 1)[:, :96]  # the same values, rows strided
    assert not wide.is_contiguous()
    assert torch.equal(native(wide, 4), native(w, 4))
    assert torch.equal(pack(w), _pack_codes(w, 4))
    assert np.array_equal(pack(wide).numpy(), pack(w).numpy())


@pytest.mark.parametrize("N, K, seed", [(1, 32, 0), (7, 96, 1), (33, 576, 2)])
def test_packed_blocks_are_ggufs_own_bytes(N, K, seed):
    """What pack finds again is what gguf's quantizer wrote, byte for byte: an 8-bit block is
    Q8_0's block (float16 scale, 32 signed codes), a 4-bit block Q4_1's (float16 scale and
    minimum, 16 code bytes). A scale other than gguf's that rebuilds the same weights, or a code
    order of its own, would fail here."""
    from gguf import quants

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) / K ** 0.5).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    for qtype, bits in ((Q.Q8_0, 8), (Q.Q4_1, 4)):
        raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(w, qtype))).reshape(N, K // 32, -1)
        weight = torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(w, qtype), qtype)))
        packers = [_pack_codes] + ([native] if native is not None else [])
        for packer in packers:
            packed = packer(weight, bits)
            assert packed is not None and packed.shape == (N, K // 32, packed_weights.BLOCK_BYTES[bits])
            assert torch.equal(packed, raw)
            assert torch.equal(unpack(packed), weight)
