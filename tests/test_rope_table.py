"""RopeTable (the invariant set's rotary cos/sin, looked up by position from blocks of 1024)
against the model's own rotary module, across block boundaries and growth in steps."""

import pytest
import torch

from conftest import tiny_model
from swiftkern.rope_table import BLOCK, RopeTable

POSITIONS = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 1500, 2 * BLOCK - 1, 2 * BLOCK, 3000]


def _rotary(**overrides):
    return tiny_model("llama", max_position_embeddings=4096, num_hidden_layers=1, **overrides).model.rotary_emb


@pytest.mark.parametrize("scaling", [None, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=512)],
                         ids=["default", "llama3"])
def test_lookup_is_the_rotary_modules_values_in_every_block(scaling):
    rotary = _rotary(**({"rope_scaling": scaling} if scaling else {}))
    positions = torch.tensor([POSITIONS])  # [1, P]
    probe = torch.zeros((1, len(POSITIONS), 1))
    want_cos, want_sin = rotary(probe, positions)  # [1, P, D]
    cos, sin = RopeTable(rotary, torch.float32, torch.device("cpu")).lookup(positions, max(POSITIONS) + 1)
    # the same values to rounding: the table computes each block in one call of another shape
    torch.testing.assert_close(cos, want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, want_sin, atol=1e-5, rtol=0)
    assert cos.shape == (1, len(POSITIONS), rotary.inv_freq.numel() * 2)


def test_growing_in_steps_gives_the_bits_of_growing_at_once():
    rotary = _rotary()
    positions = torch.tensor([POSITIONS, POSITIONS[::-1]])  # [2, P]: a row's values do not depend on the other's
    stepped = RopeTable(rotary, torch.float32, torch.device("cpu"))
    stepped.lookup(torch.tensor([[5]]), 6)
    stepped.lookup(torch.tensor([[BLOCK + 3]]), BLOCK + 4)
    at_once = RopeTable(rotary, torch.float32, torch.device("cpu"))
    for a, b in zip(stepped.lookup(positions, 3001), at_once.lookup(positions, 3001)):
        assert torch.equal(a, b)
        assert torch.equal(a[0], a[1].flip(0))
