"""top_p.top_p_removed (a value sort, no argsort) against top_p_removed_by_sort (HF's rule through
torch.sort), mask for mask: random rows with ties, -inf (top-k's), NaN, +inf and signed zeros,
top_p on a row's exact cumulative edges, 0 to 9 rows; and where each way is taken. The C++
``top_p_cut`` against its twin ``reference.top_p_cut`` on the same rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swiftkern import SwiftkernError, ops, reference
from swiftkern import top_p as top_p_module
from swiftkern.top_p import top_p_removed, top_p_removed_by_sort

SPECIALS = [float("-inf"), float("inf"), float("nan"), -0.0, 0.0]


def edges(row: torch.Tensor) -> list[float]:
    """top_p values whose 1 - top_p is exactly one of the row's sorted cumulative sums."""
    cum = row.sort().values.softmax(-1).cumsum(-1)
    return [1.0 - float(c) for c in cum[::max(1, len(cum) // 5)] if 0.0 < 1.0 - float(c) <= 1.0]


@st.composite
def rows(draw):
    n = draw(st.integers(0, 9))
    v = draw(st.sampled_from([1, 2, 3, 7, 50, 257, 1000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["normal", "ties", "specials"]))
    if kind == "ties":  # few distinct values: cuts inside ties
        x = torch.randint(-3, 3, (n, v), generator=g).float()
    else:
        x = torch.randn(n, v, generator=g) * draw(st.sampled_from([0.1, 3.0, 30.0]))
    if kind == "specials" and n * v:
        hits = torch.randint(0, n * v, (draw(st.integers(1, 4)),), generator=g)
        x.view(-1)[hits] = torch.tensor([draw(st.sampled_from(SPECIALS)) for _ in hits])
    if draw(st.booleans()) and v > 2:  # top-k's -inf before top-p
        x[:, : v // 2] = float("-inf")
    return x


@settings(max_examples=300, deadline=None)
@given(x=rows(), data=st.data())
def test_mask_is_the_sorts(x, data):
    candidates = [0.9, 0.5, 1e-9, 0.999999] + (edges(x[0]) if x.shape[0] and x.shape[1] else [])
    top_p = data.draw(st.sampled_from(candidates))
    got = top_p_removed(x, top_p)
    want = top_p_removed_by_sort(x, top_p)
    assert got.dtype == torch.bool and got.shape == x.shape
    assert torch.equal(got, want), (x, top_p)


def _count_sorts(monkeypatch) -> list:
    calls = []
    real = top_p_module.top_p_removed_by_sort
    monkeypatch.setattr(top_p_module, "top_p_removed_by_sort", lambda *a: calls.append(1) or real(*a))
    return calls


def test_real_logits_take_no_argsort(monkeypatch):
    """SmolLM2-sized rows of distinct logits: the value sort alone, the reference's mask."""
    calls = _count_sorts(monkeypatch)
    x = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3)) * 4
    for top_p in (0.5, 0.9, 0.95):
        assert torch.equal(top_p_removed(x, top_p), top_p_removed_by_sort(x, top_p))
        assert 0 < int(top_p_removed(x, top_p).sum()) < x.numel()
    assert calls == []  # no call went to the sort


def test_cut_inside_a_tie_takes_the_sort(monkeypatch):
    """Four equal logits below one large one, the cut after two of them: which two torch.sort
    puts first is its own (unstable) order, so the call goes to the reference."""
    calls = _count_sorts(monkeypatch)
    x = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0]])
    p = x.sort().values.softmax(-1).cumsum(-1)[0]
    top_p = 1.0 - float(p[1] + p[2]) / 2  # between two tied positions' sums
    got = top_p_removed(x, top_p)
    assert calls == [1] and int(got.sum()) == 2
    assert torch.equal(got, top_p_removed_by_sort(x, top_p))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: other devices take the sort itself")
def test_cuda_takes_the_sort():
    x = torch.randn(3, 1000, device="cuda")
    assert torch.equal(top_p_removed(x, 0.9), top_p_removed_by_sort(x, 0.9))


def test_logits_that_require_grad():
    """A caller's logits with autograd on (filter_logits outside inference mode): the same mask."""
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert torch.equal(top_p_removed(x, 0.9), top_p_removed_by_sort(x.detach(), 0.9))


# ---------------------------------------------------------------- the cut op

def sorted_and_probs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.sort(dim=-1).values  # [N, V]
    return s, s.softmax(dim=-1)


@pytest.mark.skipif(ops.registry.COMPILED["top_p_cut"]["cpu"] != "cpp", reason="the C++ extension is not built")
@settings(max_examples=300, deadline=None)
@given(x=rows(), data=st.data())
def test_cpp_cut_is_the_references(x, data):
    """The C++ kernel's cut per row equals ``reference.top_p_cut``'s (torch's cumsum and masks),
    -1 rows included, on the same rows as above and top_p on their exact cumulative edges."""
    candidates = [1.0, 0.9, 0.5, 1e-9, 0.999999] + (edges(x[0]) if x.shape[0] and x.shape[1] else [])
    top_p = data.draw(st.sampled_from(candidates))
    s, p = sorted_and_probs(x)
    got = torch.ops.swiftkern.top_p_cut(s, p, top_p)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, reference.top_p_cut(s, p, top_p)), (x, top_p)


def test_cut_says_where_the_values_do_not_decide():
    """At top_p 0.99 (removed: cumulative <= 0.01): a cut inside a tie and a cut that is not a
    prefix (a negative term) give -1, a clean cut its count, a NaN row 0 (nothing is <= after
    it), on both implementations."""
    s = torch.tensor([[0.0, 0.0, 0.0, 5.0], [1.0, 2.0, 3.0, 9.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    p = s.softmax(-1)  # row 0: 0.0066 each below 5.0, so the cut falls after the first of three zeros
    p[2] = torch.tensor([0.02, -0.015, 0.3, 0.695])  # cumulative 0.02 (kept), then 0.005 (removed)
    p[3, 0] = float("nan")
    for cut in (ops.top_p_cut, reference.top_p_cut):
        assert cut(s, p, 0.99).tolist() == [-1, 3, -1, 0], cut
        assert cut(s[1:2], p[1:2], 1.0).tolist() == [0], cut


def test_cut_refuses_what_it_cannot_read():
    s = torch.zeros(2, 5)
    for args, msg in [((s, torch.zeros(2, 4), 0.9), "one shape"), ((s[0], s[0], 0.9), "one shape"),
                      ((s, s.double(), 0.9), "float32"), ((s, s, 0.0), "top_p"), ((s, s, 1.5), "top_p")]:
        with pytest.raises(SwiftkernError, match=msg):
            ops.top_p_cut(*args)


def test_opcheck_of_the_cut():
    s, p = sorted_and_probs(torch.randn(3, 17, generator=torch.Generator().manual_seed(0)))
    torch.library.opcheck(torch.ops.swiftkern.top_p_cut, (s, p, 0.9))
