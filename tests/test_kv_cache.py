import pytest
import torch

from swiftkern import KVCache, SwiftkernError


def make(batch=3, max_len=10):
    return KVCache(num_layers=2, batch=batch, num_kv_heads=2, max_len=max_len, head_dim=4,
                   dtype=torch.float32, device="cpu")


def test_shapes_and_positions():
    c = make()
    assert c.k.shape == (2, 3, 2, 10, 4)
    c.advance(4)
    c.rollback([4, 1, 0])
    assert c.positions_for(2).tolist() == [[4, 5], [1, 2], [0, 1]]
    assert c.lengths.tolist() == [4, 1, 0] and c.host_lengths == [4, 1, 0]


def test_overflow_is_an_error_not_a_wrap():
    c = make(max_len=5)
    c.advance(4)
    with pytest.raises(SwiftkernError, match="overflow"):
        c.positions_for(2)


def test_rollback_never_grows_and_checks_batch():
    c = make()
    c.advance(3)
    with pytest.raises(SwiftkernError, match="outside"):
        c.rollback([4, 0, 0])
    with pytest.raises(SwiftkernError, match="lengths for a batch"):
        c.rollback([1, 1])
    c.rollback(torch.tensor([3, 2, 0]))
    assert c.host_lengths == [3, 2, 0]
