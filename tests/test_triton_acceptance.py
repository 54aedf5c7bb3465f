"""Triton greedy_accept and rejection_sample: token-identical to reference.py.

Tier 1: exact tiny cases. Tier 2: hypothesis-drawn shapes (vocab 1 to 49152, K = 0, rows with
num_draft 0, forced vocabulary splits), ties, NaN, zero-probability tokens, unused draft slots
holding out-of-vocabulary garbage. Tier 3: opcheck and the wrappers with SWIFTKERN_BACKEND=triton.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swiftkern import ops, reference
from swiftkern.triton_kernels.greedy_accept import greedy_accept as greedy_launch
from swiftkern.triton_kernels.rejection_sample import rejection_sample as rejection_launch
from triton_cases import DEVICE, FEW, backend, opcheck, poisoned, triton_op

VOCABS = [1, 7, 1000, 49152]


def on(*ts):
    return tuple(t.to(DEVICE) if t is not None else None for t in ts)


def assert_same(got, want):
    (out, acc), (want_out, want_acc) = got, want
    assert out.dtype == torch.int64 and acc.dtype == torch.int32
    assert torch.equal(out.cpu(), want_out.cpu()), (out, want_out)
    assert torch.equal(acc.cpu(), want_acc.cpu()), (acc, want_acc)


# ---------------------------------------------------------------- greedy_accept

def test_greedy_exact_rows():
    logits = torch.full((3, 4, 5), -1.0)
    for b, targets in enumerate([[2, 4, 1, 3], [0, 0, 0, 0], [1, 2, 3, 4]]):
        logits[b, torch.arange(4), torch.tensor(targets)] = 1.0
    draft = torch.tensor([[2, 4, 1], [0, 1, 0], [1, 2, 3]])
    nd = torch.tensor([3, 3, 1], dtype=torch.int32)
    with poisoned():
        out, acc = triton_op("greedy_accept")(*on(draft, logits, nd))
    assert out.cpu().tolist() == [[2, 4, 1, 3], [0, 0, -1, -1], [1, 2, -1, -1]] and acc.cpu().tolist() == [3, 1, 1]


@FEW
@given(B=st.integers(1, 4), K=st.integers(0, 6), V=st.sampled_from(VOCABS), splits=st.sampled_from([None, 1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_greedy_matches_reference(B, K, V, splits, dtype, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    logits = torch.randn(B, K + 1, V, generator=g)
    if data.draw(st.booleans()):  # ties (few distinct values) and a NaN somewhere
        logits = logits.round()
        logits.view(-1)[data.draw(st.integers(0, logits.numel() - 1))] = float("nan")
    logits = logits.to(dtype)
    target = logits.float().argmax(-1)
    draft = target[:, :K].clone()
    flip = torch.rand(B, K, generator=g) < 0.3  # some mismatches
    draft[flip] = (draft[flip] + 1) % V
    nd = torch.tensor(data.draw(st.lists(st.integers(0, K), min_size=B, max_size=B)), dtype=torch.int32)
    unused = torch.arange(K) >= nd.unsqueeze(1).long()
    draft[unused] = -5  # never read
    with poisoned():
        got = greedy_launch(*on(draft, logits, nd), num_splits=splits)
    assert_same(got, reference.greedy_accept(draft, logits, nd))


@pytest.mark.parametrize("B,K,V,splits,accept_all", [
    (3, 0, 7, None, False), (2, 0, 1000, 3, False), (2, 0, 49152, None, False),  # K = 0 with V > 1
    (0, 3, 1000, None, False),  # an empty batch
    (2, 4, 49152, 3, True), (3, 5, 49152, 6, True), (3, 5, 49152, 6, False),  # split vocabularies
])
def test_greedy_structural_cases(B, K, V, splits, accept_all):
    """Shapes hypothesis rarely draws (it pairs K = 0 with V = 1, splits with small V), pinned."""
    g = torch.Generator().manual_seed(B * 100 + K * 10 + V)
    logits = torch.randn(B, K + 1, V, generator=g)
    draft = logits.argmax(-1)[:, :K].clone()
    if not accept_all and K:
        draft[:, K // 2] = (draft[:, K // 2] + 1) % V  # a mismatch midway
    nd = torch.full((B,), K, dtype=torch.int32)
    with poisoned():
        got = greedy_launch(*on(draft, logits, nd), num_splits=splits)
    want = reference.greedy_accept(draft, logits, nd)
    assert_same(got, want)
    if accept_all and B:
        assert want[1].tolist() == [K] * B


@pytest.mark.parametrize("splits", [1, 2])
def test_greedy_ties_and_nans_within_a_lane(splits):
    """A program's lane sees elements BLOCK apart (1024 on a GPU, 8192 under the interpreter):
    repeats of the maximum or of NaN at such strides must leave the lane its first, and the
    row its lowest index; a row of -inf gives 0."""
    V = 3 * 8192 + 5
    logits = torch.zeros(5, 1, V)
    logits[0, 0, [700, 700 + 1024, 700 + 8192, 700 + 2 * 8192]] = 1.0  # one lane's repeats
    logits[1, 0, [8192 + 3, 5, 5 + 1024, 5 + 8192]] = 1.0  # the lowest is in another lane
    logits[2, 0, [40, 40 + 1024, 40 + 8192]] = float("nan")
    logits[2, 0, [7, 7 + 8192]] = 2.0
    logits[3] = float("-inf")
    logits[4, 0, [9000, 9000 + 8192]] = float("nan")
    logits[4, 0, [30, 30 + 1024]] = float("-nan")
    draft, nd = torch.zeros(5, 0, dtype=torch.int64), torch.zeros(5, dtype=torch.int32)
    with poisoned():
        got = greedy_launch(*on(draft, logits, nd), num_splits=splits)
    want = reference.greedy_accept(draft, logits, nd)
    assert want[0][:, 0].tolist() == [700, 5, 40, 0, 30]
    assert_same(got, want)


def test_greedy_registered_op_and_wrapper():
    logits = torch.randn(2, 4, 1000)
    draft, nd = logits.argmax(-1)[:, :3].contiguous(), torch.tensor([3, 1], dtype=torch.int32)
    want = reference.greedy_accept(draft, logits, nd)
    opcheck(triton_op("greedy_accept"), on(draft, logits, nd))
    with backend("triton"):
        assert_same(ops.greedy_accept(*on(draft, logits, nd.long())), want)
        assert_same(ops.greedy_accept(*on(draft, logits[:, :, ::2].contiguous()[:, :, :500], nd)),
                    reference.greedy_accept(draft, logits[:, :, ::2].contiguous()[:, :, :500], nd))


# ---------------------------------------------------------------- rejection_sample

def probs(shape, g, zeros=False, temperature=1.0):
    p = torch.softmax(torch.randn(shape, generator=g) * 3 / temperature, dim=-1)
    if zeros and shape[-1] > 2:  # a top-k-like support: most tokens impossible
        keep = torch.rand(shape, generator=g) < 0.3
        p = torch.where(keep, p, 0.0)
        p[..., 0] += 1e-3  # every row keeps some mass
        p = p / p.sum(-1, keepdim=True)
    return p


@FEW
@given(B=st.integers(1, 4), K=st.integers(0, 5), V=st.sampled_from(VOCABS), splits=st.sampled_from([None, 1, 3]),
       with_q=st.booleans(), zeros=st.booleans(), data=st.data())
def test_rejection_matches_reference(B, K, V, splits, with_q, zeros, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    target = probs((B, K + 1, V), g, zeros)
    draft_probs = probs((B, K, V), g, zeros, temperature=2.0) if with_q else None
    if with_q and K and data.draw(st.booleans()):
        draft_probs[0, 0] = target[0, 0]  # p == q: acceptance 1, an all-zero residual if rejected
    source = draft_probs if with_q else target[:, :K]
    draft = torch.multinomial(source.reshape(-1, V), 1, generator=g).view(B, K) if K else torch.zeros(B, 0).long()
    nd = torch.tensor(data.draw(st.lists(st.integers(0, K), min_size=B, max_size=B)), dtype=torch.int32)
    draft[torch.arange(K) >= nd.unsqueeze(1).long()] = V + 3  # unused slots: never read
    u_accept, u_sample = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    u_sample[0, -1] = 0.9999999  # the far end of the inverse CDF
    args = (draft, draft_probs, target, nd, u_accept, u_sample)
    with poisoned():
        got = rejection_launch(*on(*args), num_splits=splits)
    assert_same(got, reference.rejection_sample(*args))


@pytest.mark.parametrize("B,K,V,splits,with_q", [
    (3, 0, 7, None, True), (2, 0, 1000, 3, False), (2, 0, 49152, None, True),  # K = 0 with V > 1
    (0, 3, 1000, None, True),  # an empty batch
    (2, 4, 49152, 3, True), (3, 5, 49152, 6, True), (3, 5, 49152, 6, False),  # split vocabularies
])
def test_rejection_structural_cases(B, K, V, splits, with_q):
    """Shapes hypothesis rarely draws, pinned: K = 0 (only the bonus token), B = 0, and the
    vocabulary split over several programs (under the interpreter only V = 49152 splits) with
    drafts rejected and accepted."""
    g = torch.Generator().manual_seed(B * 100 + K * 10 + V)
    target = probs((B, K + 1, V), g)
    draft_probs = probs((B, K, V), g, temperature=2.0) if with_q else None
    source = draft_probs if with_q else target[:, :K]
    draft = torch.multinomial(source.reshape(-1, V), 1, generator=g).view(B, K) if K and B else torch.zeros(B, K).long()
    nd = torch.tensor([K - b % 2 if K else 0 for b in range(B)], dtype=torch.int32)
    u_accept, u_sample = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    args = (draft, draft_probs, target, nd, u_accept, u_sample)
    with poisoned():
        got = rejection_launch(*on(*args), num_splits=splits)
    want = reference.rejection_sample(*args)
    assert_same(got, want)


def test_rejection_exact_cases():
    # V = 4: draft token 1 with q = 1 (greedy draft), p(1) = 0.25 -> accepted iff u * 1 < 0.25
    p = torch.tensor([[[0.25, 0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    draft, nd = torch.tensor([[1]]), torch.tensor([1], dtype=torch.int32)
    # accepted (u = 0.2), then the bonus token from p_1: token 3
    out, acc = triton_op("rejection_sample")(*on(draft, None, p, nd, torch.tensor([[0.2]]), torch.tensor([[0.5, 0.5]])))
    assert out.cpu().tolist() == [[1, 3]] and acc.cpu().tolist() == [1]
    # rejected (u = 0.3): residual max(0, p - onehot(1)) = [0.25, 0, 0.5, 0]; u = 0.5 of 0.75 -> token 2
    out, acc = triton_op("rejection_sample")(*on(draft, None, p, nd, torch.tensor([[0.3]]), torch.tensor([[0.5, 0.5]])))
    assert out.cpu().tolist() == [[2, -1]] and acc.cpu().tolist() == [0]
    # u = 0.3 of 0.75 = 0.225 < 0.25 -> token 0
    out, _ = triton_op("rejection_sample")(*on(draft, None, p, nd, torch.tensor([[0.3]]), torch.tensor([[0.3, 0.5]])))
    assert out.cpu().tolist() == [[0, -1]]


@pytest.mark.parametrize("sms", [None, 132], ids=["this-device", "h100-plan"])
def test_rejection_never_draws_a_token_of_weight_zero(sms):
    """The draw compared a block's in-order scan with its tree-summed total (and the chunk's):
    when the two rounded to either side of the threshold, no token of that block crossed, and
    the next block's first token was taken at weight 0. Row: p[0] = 1, p[2] = p[3] = 2^-53,
    p[BLOCK + 1] = 1, u = 0.5 (the reference's sequential sums: token BLOCK + 1)."""
    import contextlib

    from swiftkern.triton_kernels.launch import gpu_launch_plans, vocab_plan

    V = 49152
    with gpu_launch_plans(sms) if sms else contextlib.nullcontext():
        block = vocab_plan(1, V, torch.device(DEVICE)).block
        p = torch.zeros(1, 1, V)
        p[0, 0, 0] = p[0, 0, block + 1] = 1.0
        p[0, 0, 2] = p[0, 0, 3] = 2.0 ** -53
        args = (torch.zeros(1, 0, dtype=torch.int64), None, p, torch.zeros(1, dtype=torch.int32), torch.zeros(1, 0),
                torch.tensor([[0.5]]))
        out, _ = rejection_launch(*on(*args))
    assert out.cpu().tolist() == reference.rejection_sample(*args)[0].tolist() == [[block + 1]]


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_keeps_a_nan_of_the_residual_as_the_reference(with_q):
    """A NaN probability at the rejected position: max(p - q, 0) dropped it (maxnum) and drew
    from the rest; the reference's clamp keeps it, the residual's sum is NaN, and the draw falls
    back to p (whose NaN leaves no crossing: token V - 1), as the C++ kernel does."""
    V = 8
    p = torch.full((1, 2, V), 1.0 / V)
    p[0, 0, 5] = float("nan")
    q = torch.full((1, 1, V), 0.1 / 7)
    q[0, 0, 3] = 0.9
    args = (torch.tensor([[3]]), q if with_q else None, p, torch.tensor([1], dtype=torch.int32),
            torch.tensor([[0.99]]), torch.tensor([[0.0, 0.0]]))
    out, acc = rejection_launch(*on(*args))
    want, want_acc = reference.rejection_sample(*args)
    assert out.cpu().tolist() == want.tolist() and acc.cpu().tolist() == want_acc.tolist()


def test_rejection_registered_op_and_wrapper():
    g = torch.Generator().manual_seed(5)
    target, q = probs((3, 4, 1000), g), probs((3, 3, 1000), g)
    draft = torch.multinomial(q.view(-1, 1000), 1, generator=g).view(3, 3)
    nd = torch.tensor([3, 2, 0], dtype=torch.int32)
    ua, us = torch.rand(3, 3, generator=g), torch.rand(3, 4, generator=g)
    opcheck(triton_op("rejection_sample"), on(draft, q, target, nd, ua, us))
    opcheck(triton_op("rejection_sample"), on(draft, None, target, nd, ua, us))
    with backend("triton"):
        assert_same(ops.rejection_sample(*on(draft, q.bfloat16(), target, nd, ua, us)),
                    reference.rejection_sample(draft, q.bfloat16().float(), target, nd, ua, us))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as t in a non-contiguous layout: every other entry of a wider tensor,
    with the first axis last in memory (t.dim() <= 2)."""
    wide = torch.stack([t, torch.zeros_like(t)], dim=-1).select(-1, 0)  # last axis stride 2
    return wide.t().contiguous().t() if t.dim() == 2 else wide


def test_strided_per_row_inputs_match_reference():
    """draft_tokens, num_draft and the uniforms as non-contiguous views give the reference's
    tokens from the same values, in both ops."""
    g = torch.Generator().manual_seed(8)
    B, K, V = 3, 4, 1000
    target, q = probs((B, K + 1, V), g), probs((B, K, V), g, temperature=2.0)
    draft = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    draft[1, 1] = torch.multinomial(target[1, 1], 1, generator=g)[0]  # an accepted draft or two
    nd = torch.tensor([4, 3, 1], dtype=torch.int32)
    ua, us = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    strided = [_strided(t) for t in (draft, nd, ua, us)]
    assert not any(t.is_contiguous() for t in strided)
    sd, snd, sua, sus = on(*strided)
    assert_same(greedy_launch(sd, on(target)[0].log(), snd), reference.greedy_accept(draft, target.log(), nd))
    assert_same(rejection_launch(sd, on(q)[0], on(target)[0], snd, sua, sus),
                reference.rejection_sample(draft, q, target, nd, ua, us))
