import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from swiftkern import KVCache, SwiftkernError
from swiftkern.requests import fill_freed_rows


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


def test_a_row_may_fill_the_cache_exactly():
    """The last position is usable: a row at length 3 of 5 takes 2 more tokens, not 3."""
    c = make(max_len=5)
    c.advance(3)
    assert c.positions_for(2).tolist() == [[3, 4]] * 3
    with pytest.raises(SwiftkernError, match="overflow"):
        c.positions_for(3)
    c.advance(2)
    assert c.host_lengths == [5, 5, 5] and c.positions_for(0).shape == (3, 0)


def test_rollback_never_grows_and_checks_batch():
    c = make()
    c.advance(3)
    with pytest.raises(SwiftkernError, match="outside"):
        c.rollback([4, 0, 0])
    with pytest.raises(SwiftkernError, match="lengths for a batch"):
        c.rollback([1, 1])
    c.rollback(torch.tensor([3, 2, 0]))
    assert c.host_lengths == [3, 2, 0]


def fill(c: KVCache, rows: list[int], lengths: list[int], seed: int) -> None:
    """Write random keys/values into ``rows`` up to ``lengths`` and mark them valid."""
    g = torch.Generator().manual_seed(seed)
    for b, n in zip(rows, lengths):
        c.k[:, b, :, :n] = torch.randn(c.k[:, b, :, :n].shape, generator=g)
        c.v[:, b, :, :n] = torch.randn(c.v[:, b, :, :n].shape, generator=g)
        c.set_row_length(b, n)


def valid_rows(c: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's valid keys and values, copied: what the cache means, whatever its storage."""
    return [(c.k[:, b, :, :n].clone(), c.v[:, b, :, :n].clone()) for b, n in enumerate(c.host_lengths)]


def assert_same_rows(got, want):
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_select_rows_moves_kept_rows_down_in_place():
    c = make(batch=5)
    fill(c, range(5), [3, 7, 0, 10, 1], seed=0)
    before, address = valid_rows(c), c.k.data_ptr()
    c.select_rows([1, 2, 4])
    assert c.k.data_ptr() == address and c.k.shape == (2, 3, 2, 10, 4) and c.capacity == 5
    assert c.host_lengths == [7, 0, 1] and c.lengths.tolist() == [7, 0, 1]
    assert_same_rows(valid_rows(c), [before[1], before[2], before[4]])
    for layer in range(2):  # each layer's rows stay one contiguous block, as the kernels take them
        assert c.k[layer].is_contiguous() and c.v[layer].is_contiguous()
    before = valid_rows(c)
    c.select_rows([2, 0])  # row 0 is written (with row 2) before it is read: copied through a snapshot
    assert_same_rows(valid_rows(c), [before[2], before[0]])
    with pytest.raises(SwiftkernError, match="distinct"):
        c.select_rows([0, 0])


def test_row_view_is_row_b_and_writes_land_there():
    """A one-row view (what a per-row prefill writes through) starts at row b's length and keys,
    and what is written through it is row b's after set_row_length; other rows keep theirs."""
    c = make(batch=3)
    fill(c, range(3), [2, 5, 3], seed=4)
    before = valid_rows(c)
    view = c.row_view(1)
    assert view.batch == 1 and view.host_lengths == [5] and view.lengths.tolist() == [5]
    assert view.positions_for(2).tolist() == [[5, 6]]
    assert torch.equal(view.k[:, 0, :, :5], before[1][0]) and torch.equal(view.v[:, 0, :, :5], before[1][1])
    new_k, new_v = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)  # [L, H, 2 positions, D]
    view.k[:, 0, :, 5:7], view.v[:, 0, :, 5:7] = new_k, new_v
    view.advance(2)
    c.set_row_length(1, view.host_lengths[0])
    assert c.host_lengths == [2, 7, 3] and c.lengths.tolist() == [2, 7, 3]
    assert torch.equal(c.k[:, 1, :, :7], torch.cat([before[1][0], new_k], dim=2))
    assert torch.equal(c.v[:, 1, :, :7], torch.cat([before[1][1], new_v], dim=2))
    assert_same_rows([valid_rows(c)[0], valid_rows(c)[2]], [before[0], before[2]])


def test_a_departure_moves_the_last_rows_into_the_freed_ones():
    assert fill_freed_rows([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]  # rows 1 and 4 left: 5 and 6 move in
    assert fill_freed_rows([1, 2]) == [2, 1] and fill_freed_rows([3]) == [3]
    assert fill_freed_rows([0, 1, 2]) == [0, 1, 2]


def test_add_rows_reuses_free_rows_then_grows_once():
    c = make(batch=4)
    fill(c, range(4), [2, 5, 1, 4], seed=1)
    c.select_rows([0, 3])
    before, address = valid_rows(c), c.k.data_ptr()
    assert c.add_rows(2) == [2, 3]  # the two freed rows: no allocation
    assert c.k.data_ptr() == address and c.host_lengths == [2, 4, 0, 0] and c.lengths.tolist() == [2, 4, 0, 0]
    assert_same_rows(valid_rows(c)[:2], before)
    assert c.add_rows(3, reserve=8) == [4, 5, 6]  # past capacity 4: 2 x 4 = 8 rows, within the reserve
    assert c.capacity == 8 and c.batch == 7
    assert_same_rows(valid_rows(c)[:2], before)
    assert c.add_rows(2, reserve=2) == [7, 8]  # 16 would pass the reserve, which is below what is needed
    assert c.capacity == 16
    c.select_rows([0])
    assert c.add_rows(3, replace=True) == [0, 1, 2] and c.host_lengths == [0, 0, 0]


def test_reset_reuses_the_storage():
    c = make(batch=2)
    c.advance(3)
    c.select_rows([1])
    address = c.k.data_ptr()
    c.reset(2)
    assert c.k.data_ptr() == address and c.host_lengths == [0, 0] and c.lengths.tolist() == [0, 0]
    with pytest.raises(SwiftkernError, match="capacity"):
        c.reset(3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4), st.integers(0, 2 ** 16)), min_size=1, max_size=12))
def test_joins_and_departures_match_a_list_of_rows(events):
    """Any sequence of requests joining (add_rows) and leaving or reordered (select_rows) leaves each request
    with the keys and values it wrote: against a plain list of per-request tensors."""
    c = make(batch=1, max_len=6)
    fill(c, [0], [3], seed=0)
    model = valid_rows(c)
    for join, n, seed in events:
        if join or c.batch == 1:
            rows = c.add_rows(n, reserve=c.batch + n + 1)
            lengths = [(seed >> (3 * i)) % 7 for i in range(n)]
            fill(c, rows, lengths, seed)
            model += [(c.k[:, b, :, :m].clone(), c.v[:, b, :, :m].clone()) for b, m in zip(rows, lengths)]
        else:
            keep = torch.randperm(c.batch, generator=torch.Generator().manual_seed(seed))[:max(1, c.batch - n)].tolist()
            if seed % 2:  # as a departure does it; else any order
                keep = fill_freed_rows(sorted(keep))
            c.select_rows(keep)
            model = [model[i] for i in keep]
        assert_same_rows(valid_rows(c), model)
        assert c.lengths.tolist() == c.host_lengths and c.batch <= c.capacity


def test_a_cache_made_or_grown_in_inference_mode_takes_updates_outside_it():
    """Its storage is never an inference tensor: a cache kept across calls (a CUDA graph runner's)
    is grown by deterministic decoding inside inference mode and reset by the next call outside."""
    with torch.inference_mode():
        cache = KVCache(2, 1, 1, 8, 4, torch.float32, "cpu")
        cache.add_rows(2)  # past capacity: reallocated here
    assert not any(t.is_inference() for t in (cache.k, cache.v, cache.lengths))
    cache.reset(3)
    cache.advance(2)
    assert cache.lengths.tolist() == [2, 2, 2] and cache.host_lengths == [2, 2, 2]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_cache_writes_its_own_lengths_and_rows(how):
    """On the CPU lengths are written through a NumPy view of their memory (set_lengths,
    set_row_length): a copy's view is made again over the copy's storage, so a rollback of the
    copy moves its own lengths (device side included) and never the original's, and its k / v
    rows are views of its own storage."""
    import copy
    import pickle

    c = make()
    c.advance(5)
    d = copy.deepcopy(c) if how == "deepcopy" else pickle.loads(pickle.dumps(c))
    d.rollback([2, 3, 4])
    d.set_row_length(0, 1)
    assert d.lengths.tolist() == [1, 3, 4] and d.host_lengths == [1, 3, 4]
    assert c.lengths.tolist() == [5, 5, 5] and c.host_lengths == [5, 5, 5]
    d.k[0, 1, 0, 0, 0] = 7.0
    assert d._k_rows[0, 1, 0, 0, 0] == 7.0 and c.k[0, 1, 0, 0, 0] == 0.0


def test_rollback_writes_the_device_lengths_the_kernels_read():
    """set_lengths / set_row_length through the NumPy view land in ``lengths`` (the tensor the
    kernels read) for the rows in use, in a row view too, and leave freed rows alone."""
    c = make(batch=3)
    c.advance(6)
    c.select_rows([0, 2])  # two rows in use of three allocated
    c.rollback([4, 2])
    assert c.lengths.tolist() == [4, 2] and c._length_rows.tolist()[:2] == [4, 2]
    view = c.row_view(1)
    view.rollback([1])
    assert view.lengths.tolist() == [1]
    c.set_row_length(1, view.host_lengths[0])
    assert c.lengths.tolist() == [4, 1]


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", -1, "num_layers must be >= 1"), ("num_kv_heads", 0, "num_kv_heads must be >= 1"),
    ("head_dim", 0, "head_dim must be >= 1"), ("max_len", 2.0, "max_len must be an integer"),
    ("batch", True, "batch must be an integer"), ("dtype", torch.int64, "floating-point"),
    ("dtype", "float32", "floating-point"),
])
def test_a_cache_of_a_shape_or_dtype_it_cannot_hold_is_refused_by_name(field, value, message):
    """Before: -1 layers failed inside torch.zeros, 0 heads made an empty cache, int64 a cache
    no forward can write."""
    args = dict(num_layers=2, batch=1, num_kv_heads=2, max_len=8, head_dim=4, dtype=torch.float32, device="cpu")
    with pytest.raises(SwiftkernError, match=message):
        KVCache(**{**args, field: value})


def test_a_row_counted_from_the_end_or_past_the_batch_is_refused():
    """set_row_length(-1, n) set the last row's length; row_view(True) took row 1."""
    c = make(batch=2)
    c.advance(3)
    for call in (lambda: c.set_row_length(-1, 1), lambda: c.set_row_length(2, 1),
                 lambda: c.set_row_length(0, 11), lambda: c.row_view(-1), lambda: c.row_view(True),
                 lambda: c.add_rows(1.5), lambda: c.add_rows(0), lambda: c.add_rows(1, reserve=-2)):
        with pytest.raises(SwiftkernError, match="must be"):
            call()
    assert c.host_lengths == [3, 3] and c.lengths.tolist() == [3, 3] and c.batch == 2
    c.set_row_length(1, 1)
    assert c.host_lengths == [3, 1] and c.lengths.tolist() == [3, 1]


def test_a_cache_past_memory_is_refused_saying_what_to_lower():
    """Before: torch's "DefaultCPUAllocator: can't allocate memory: you tried to allocate ...
    bytes". 262 TB a tensor: past any x86-64 process's address space, whatever the overcommit."""
    with pytest.raises(SwiftkernError, match=r"the KV cache does not fit in cpu memory: 2048 rows x 500000000 "
                                             r"positions x 4 layers x 2 KV heads x 16 .* lower max_new_tokens"):
        KVCache(4, 2048, 2, 500_000_000, 16, torch.float32, "cpu")
    cache = KVCache(4, 2, 2, 8, 16, torch.float32, "cpu")
    with pytest.raises(SwiftkernError, match="does not fit in cpu memory: 256000000000 rows x 8 positions"):
        cache._grow(256 * 10**9, 2)  # the rows requests joining would add
    assert cache.k.shape == (4, 2, 2, 8, 16)  # left as it was


def test_the_generator_refuses_a_batch_whose_cache_cannot_be_allocated():
    from conftest import tiny_model
    from swiftkern import Generator

    gen = Generator(tiny_model("llama", max_position_embeddings=10**9))
    with pytest.raises(SwiftkernError, match="does not fit in cpu memory: 2048 rows"):
        gen.generate([[5, 6, 7]] * 2048, max_new_tokens=5 * 10**8, eos_token_id=[])
