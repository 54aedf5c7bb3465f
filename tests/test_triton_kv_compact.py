"""Triton kv_compact against reference.py (interpreter on CPU, native on GPU)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, FEW, backend, check_move_ending_at_the_last_position, opcheck, triton_op


def cache(L, B, H, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, B, H, S, D, generator=g).to(dtype).to(DEVICE),
            torch.randn(L, B, H, S, D, generator=g).to(dtype).to(DEVICE))


@FEW
@given(B=st.integers(1, 4), H=st.sampled_from([1, 3]), D=st.sampled_from([8, 64, 80]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_matches_reference(B, H, D, dtype, data):
    S, M = 20, 6
    src, dst, counts = [], [], []
    for _ in range(B):  # kept entries anywhere (overlapping the destination too), any count incl. 0
        n = data.draw(st.integers(0, M))
        src.append(data.draw(st.lists(st.integers(0, S - 1), min_size=M, max_size=M, unique=True)))
        dst.append(data.draw(st.integers(0, S - n)))
        counts.append(n)
    src, dst = torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)
    counts = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    k, v = cache(2, B, H, S, D, dtype, data.draw(st.integers(0, 99)))
    want_k, want_v = k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts)
    triton_op("kv_compact")(k, v, src, dst, counts)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)  # a pure move: bit-exact


def test_wrapper_on_the_model_cache_layout():
    k, v = cache(3, 2, 3, 16, 64, torch.float32, 1)
    src = torch.tensor([[2, 5, 6, 9], [7, 8, 0, 0]], device=DEVICE)
    dst = torch.tensor([2, 3], device=DEVICE)
    counts = torch.tensor([4, 2], device=DEVICE)  # int64 is accepted
    before_k, want_k, want_v = k.clone(), k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts.int())
    with backend("triton"):
        ops.kv_compact(k, v, src, dst, counts)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # closed form: row 0's entries 2, 5, 6, 9 now sit at 2..5; row 1's 7, 8 at 3, 4; the rest kept
    assert torch.equal(k[:, 0, :, 2:6], before_k[:, 0, :, [2, 5, 6, 9]])
    assert torch.equal(k[:, 1, :, 3:5], before_k[:, 1, :, [7, 8]])
    assert torch.equal(k[:, 1, :, 5:], before_k[:, 1, :, 5:]) and torch.equal(k[:, 0, :, :2], before_k[:, 0, :, :2])


def test_a_move_may_end_at_the_last_position():
    with backend("triton"):
        check_move_ending_at_the_last_position(DEVICE)


def test_strided_index_tensors_match_reference():
    """src_positions, dst_start and counts as non-contiguous views (as an [M, B] tensor's transpose
    or every other entry of a longer one) move what the reference moves from the same values."""
    k, v = cache(1, 2, 1, 10, 4, torch.float32, 5)
    src = torch.tensor([[3, 8], [7, 5], [1, 2]], device=DEVICE).t()  # [B, M] with strides (1, B)
    dst = torch.tensor([0, 9, 1, 9], device=DEVICE)[::2]
    counts = torch.tensor([3, 0, 2, 0], dtype=torch.int32, device=DEVICE)[::2]
    want_k, want_v = k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts)
    triton_op("kv_compact")(k, v, src, dst, counts)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_opcheck():
    k, v = cache(2, 2, 3, 8, 64, torch.bfloat16, 2)
    args = (torch.tensor([[3, 4], [1, 0]], device=DEVICE), torch.tensor([1, 0], device=DEVICE),
            torch.tensor([2, 1], dtype=torch.int32, device=DEVICE))
    opcheck(triton_op("kv_compact"), (k, v, *args))
    opcheck(torch.ops.swiftkern.kv_compact, (k.cpu(), v.cpu(), *(a.cpu() for a in args)))


def test_bad_input_is_refused():
    k, v = cache(2, 2, 3, 8, 64, torch.float32, 3)
    src, dst, counts = (torch.tensor([[3, 4], [1, 0]], device=DEVICE), torch.tensor([1, 0], device=DEVICE),
                        torch.tensor([2, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(SwiftkernError, match=r"counts must be in \[0, 2\]"):
        ops.kv_compact(k, v, src, dst, counts + 1)
    with pytest.raises(SwiftkernError, match="dst_start\\[b\\] \\+ counts\\[b\\] must be <= S = 8"):
        ops.kv_compact(k, v, src, dst + 6, counts)
    with pytest.raises(SwiftkernError, match="src_positions must be in"):
        ops.kv_compact(k, v, src + 6, dst, counts)
    with pytest.raises(SwiftkernError, match="5-D"):
        ops.kv_compact(k[0], v[0], src, dst, counts)
    with pytest.raises(SwiftkernError, match="int64"):
        ops.kv_compact(k, v, src.int(), dst, counts)


def move_and_compare(M, D, dst, counts, seed):
    """Row b keeps counts[b] of a random permutation of its M + 5 positions (overlapping the
    destination) and moves them to dst[b]: the Triton op must leave the reference's caches."""
    k, v = cache(1, len(dst), 1, M + 5, D, torch.float32, seed)
    g = torch.Generator().manual_seed(seed)
    src = torch.stack([torch.randperm(M + 5, generator=g)[:M] for _ in dst]).to(DEVICE)
    dst, counts = torch.tensor(dst, device=DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    want_k, want_v = k.clone(), v.clone()
    reference.kv_compact(want_k, want_v, src, dst, counts)
    triton_op("kv_compact")(k, v, src, dst, counts)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_the_most_entries_one_program_moves_match_reference():
    """compact_plan's limit: MAX_COMPACT_ENTRIES entries a row (two head-dim elements a program
    at that tile, 32 warps) move as the reference moves them, in one launch."""
    from swiftkern.triton_kernels.launch import MAX_COMPACT_ENTRIES, MAX_COMPACT_TILE, compact_plan

    M, D = MAX_COMPACT_ENTRIES, 3
    plan = compact_plan("kv_compact", M, D)
    assert (plan.block_m, plan.block_d, plan.d_blocks, plan.m_blocks) == (M, MAX_COMPACT_TILE // M, 2, 1)
    assert not plan.staged and compact_plan("kv_compact", M + 1, D).staged
    move_and_compare(M, D, [5, 0], [M, M - 3], 7)


@pytest.mark.parametrize("extra, D", [(1, 3), (70, 130)])
def test_more_entries_than_one_program_holds_move_through_the_workspace(extra, D):
    """Past MAX_COMPACT_ENTRIES: the staged path's two launches (out to a workspace, then into
    place) as the reference, with tiles cut in the entries (a partial last one) and, at D = 130,
    in the head dimension; a row moving fewer entries than M, and one moving none."""
    from swiftkern.triton_kernels import kv_compact as module
    from swiftkern.triton_kernels.launch import MAX_COMPACT_ENTRIES, STAGED_COMPACT_ENTRIES, compact_plan

    M = MAX_COMPACT_ENTRIES + extra
    plan = compact_plan("kv_compact", M, D)
    assert plan.staged and plan.m_blocks == -(-M // STAGED_COMPACT_ENTRIES) and plan.d_blocks == (2 if D > 128 else 1)
    launches = []
    real = module._kv_compact_staged_kernel

    class Counting:  # the two launches, in order: out, then in
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((tuple(grid), kwargs["TO_WORKSPACE"]))
                return real[grid](*args, **kwargs)
            return launch

    module._kv_compact_staged_kernel = Counting()
    try:
        move_and_compare(M, D, [5, 0, 2], [M, M - 40, 0], 11)
    finally:
        module._kv_compact_staged_kernel = real
    grid = (3, plan.d_blocks, plan.m_blocks)
    assert launches == [(grid, True), (grid, False)]


def test_more_entries_than_the_staged_grid_holds_are_refused():
    """The staged path's grid has at most 65535 tiles of entries (CUDA's limit on axes 1 and 2):
    one entry more is refused, before anything is allocated, with what to do."""
    from swiftkern.triton_kernels.launch import MAX_GRID_Y_Z, STAGED_COMPACT_ENTRIES

    M = MAX_GRID_Y_Z * STAGED_COMPACT_ENTRIES + 1
    k, v = cache(1, 1, 1, 4, 2, torch.float32, 3)
    src, dst = torch.zeros(1, M, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(SwiftkernError, match=f"{M} entries per row is more than the {M - 1}.*several calls"):
        triton_op("kv_compact")(k, v, src, dst, torch.zeros(1, dtype=torch.int32, device=DEVICE))
