"""rejection_sample: exact tiny cases, invariants on random inputs, and the output distribution.

Every check runs on ops.rejection_sample (the registered kernel) and the reference twin.
"""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

OP = torch.ops.swiftkern.rejection_sample

IMPLS = [pytest.param(ops.rejection_sample, id="ops"), pytest.param(reference.rejection_sample, id="reference")]


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_tiny_cases(impl):
    draft = t([[1, 2]], torch.int64)
    q = t([[[0.2, 0.8, 0.0], [0.1, 0.1, 0.8]]])
    p = t([[[0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.0, 0.0, 1.0]]])
    nd = t([2], torch.int32)
    # draft 0 (token 1): accept iff u * 0.8 < 0.4 -> u < 0.5. draft 1 (token 2): u * 0.8 < 0.4.
    out, acc = impl(draft, q, p, nd, t([[0.49, 0.49]]), t([[0.0, 0.0, 0.5]]))
    assert out.tolist() == [[1, 2, 2]] and acc.tolist() == [2]  # bonus from p[2] = one-hot 2
    # reject draft 0: residual max(0, p - q) = [0.3, 0, 0.1] -> cdf [0.3, 0.3, 0.4]
    out, acc = impl(draft, q, p, nd, t([[0.5, 0.0]]), t([[0.74, 0.0, 0.0]]))
    assert out.tolist() == [[0, -1, -1]] and acc.tolist() == [0]  # 0.74 * 0.4 = 0.296 < 0.3
    out, _ = impl(draft, q, p, nd, t([[0.5, 0.0]]), t([[0.76, 0.0, 0.0]]))
    assert out.tolist() == [[2, -1, -1]]
    # num_draft 0: only the bonus token, drawn from p[0]: cdf [0.5, 0.9, 1.0]
    out, acc = impl(draft, q, p, t([0], torch.int32), t([[0.0, 0.0]]), t([[0.95, 0.0, 0.0]]))
    assert out.tolist() == [[2, -1, -1]] and acc.tolist() == [0]
    # a one-hot (greedy) draft: accept iff u < p(x); the residual is p with x removed
    out, acc = impl(draft, None, p, nd, t([[0.39, 0.41]]), t([[0.0, 0.99, 0.0]]))
    assert out.tolist() == [[1, 1, -1]] and acc.tolist() == [1]  # p[1] minus token 2: cdf [.3, .6, .6]
    # a draw is the smallest i with cumsum > u * sum: a token of weight 0 is never drawn, even at
    # u = 0, and a u that lands on a cdf step takes the next token: cdf [0, 0.5, 1.0]
    p0 = p.clone()
    p0[0, 0] = t([0.0, 0.5, 0.5])
    for u, want in ((0.0, 1), (0.5, 2), (0.49, 1)):
        out, _ = impl(draft, q, p0, t([0], torch.int32), t([[0.0, 0.0]]), t([[u, 0.0, 0.0]]))
        assert out.tolist() == [[want, -1, -1]], u


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), K=st.integers(0, 5), V=st.sampled_from([1, 2, 7, 111]), greedy_draft=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_equals_reference_and_invariants(B, K, V, greedy_draft, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(B, K + 1, V, generator=g) ** 4
    p /= p.sum(-1, keepdim=True)
    q = None
    if not greedy_draft:
        q = torch.rand(B, K, V, generator=g) ** 4
        q /= q.sum(-1, keepdim=True)
    draft = torch.randint(0, V, (B, K), generator=g)
    nd = torch.randint(0, K + 1, (B,), generator=g).to(torch.int32)
    u_a, u_s = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    out, acc = ops.rejection_sample(draft, q, p, nd, u_a, u_s)
    ref_out, ref_acc = reference.rejection_sample(draft, q, p, nd, u_a, u_s)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    for b in range(B):
        n = int(acc[b])
        assert 0 <= n <= int(nd[b])
        assert out[b, :n].tolist() == draft[b, :n].tolist()
        assert 0 <= int(out[b, n]) < V
        assert (out[b, n + 1:] == -1).all()


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_output_is_distributed_as_the_target(greedy_draft):
    """Seeded chi-square: the first emitted token is distributed as p[0] for random p, q."""
    V, n = 12, 20000
    g = torch.Generator().manual_seed(1)
    p0 = torch.rand(V, generator=g) ** 2
    p0 /= p0.sum()
    q0 = torch.rand(V, generator=g) ** 2
    q0 /= q0.sum()
    draft = torch.multinomial(q0 if not greedy_draft else torch.full((V,), 1.0 / V), n, replacement=True,
                              generator=g).view(n, 1)
    p = p0.expand(n, 2, V).contiguous()
    q = None if greedy_draft else q0.expand(n, 1, V).contiguous()
    out, _ = ops.rejection_sample(draft, q, p, torch.ones(n, dtype=torch.int32),
                                  torch.rand(n, 1, generator=g), torch.rand(n, 2, generator=g))
    counts = torch.bincount(out[:, 0], minlength=V).double()
    exp = p0.double() * n
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert chi2 < 45.0, chi2  # dof 11: P(chi2 > 45) < 1e-5


def random_case(B, K, V, seed, greedy_draft=False, dtype=torch.float32):
    """(draft_tokens, draft_probs, target_probs, num_draft, u_accept, u_sample) with drafts
    sampled from q, so that a good share of them is accepted."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    draft = torch.multinomial(q.reshape(B * K, V), 1, generator=g).view(B, K) if K else torch.empty(B, 0).long()
    nd = torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)
    q = None if greedy_draft else q.to(dtype)
    return draft, q, p.to(dtype), nd, torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)


def assert_same_as_reference(args):
    out, acc = ops.rejection_sample(*args)
    ref_out, ref_acc = reference.rejection_sample(*args)
    assert out.dtype == torch.int64 and acc.dtype == torch.int32
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    return out, acc


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_large_vocab_kernel_equals_reference(greedy_draft):
    out, acc = assert_same_as_reference(random_case(3, 4, 49152, seed=7, greedy_draft=greedy_draft))
    assert out.shape == (3, 5) and acc.shape == (3,)


def test_k0_b0_half_precision_and_backend_knob():
    # K = 0 with an empty u_accept built on the CPU, as swiftkern.verify_step does
    p = torch.softmax(torch.randn(2, 1, 9), -1)
    out, acc = ops.rejection_sample(torch.empty(2, 0, dtype=torch.int64), None, p, torch.zeros(2, dtype=torch.int32),
                                    torch.zeros(2, 0), torch.rand(2, 1))
    assert out.shape == (2, 1) and acc.tolist() == [0, 0] and ((out >= 0) & (out < 9)).all()
    out, acc = ops.rejection_sample(torch.empty(0, 3, dtype=torch.int64), None, torch.rand(0, 4, 5),
                                    torch.zeros(0, dtype=torch.int32), torch.rand(0, 3), torch.rand(0, 4))
    assert out.shape == (0, 4) and acc.shape == (0,)
    # bfloat16 / float16 probabilities are converted to float32 first; int64 num_draft too
    for dtype in (torch.bfloat16, torch.float16):
        d, q, p, nd, ua, us = random_case(4, 3, 300, seed=3, dtype=dtype)
        out, acc = ops.rejection_sample(d, q, p, nd.long(), ua, us)
        want = reference.rejection_sample(d, q.float(), p.float(), nd, ua, us)
        assert torch.equal(out, want[0]) and torch.equal(acc, want[1])
    args = random_case(4, 3, 300, seed=4)
    want = OP(*args)
    try:
        ops.set_backend("reference")
        got = ops.rejection_sample(*args)
    finally:
        ops.set_backend("auto")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("args", [random_case(3, 4, 111, 0), random_case(3, 4, 111, 1, greedy_draft=True),
                                  random_case(2, 0, 7, 2), random_case(5, 2, 1, 3)],
                         ids=["probs", "one-hot", "k0", "v1"])
def test_opcheck(args):
    torch.library.opcheck(OP, args)


def _good():
    return random_case(2, 3, 10, seed=5)


def _with(i, value):
    def patch(*args):
        args = list(args)
        args[i] = value(args[i]) if callable(value) else value
        return args
    return patch


@pytest.mark.parametrize(
    "patch, message",
    [
        (_with(0, lambda d: d[0]), "draft_tokens must be 2-D"),
        (_with(1, lambda q: q[0]), "draft_probs must be 3-D"),
        (_with(2, lambda p: p[0]), "target_probs must be 3-D"),
        (_with(3, lambda n: n[None]), "num_draft must be 1-D"),
        (_with(4, lambda u: u[0]), "u_accept must be 2-D"),
        (_with(5, lambda u: u[0]), "u_sample must be 2-D"),
        (_with(2, lambda p: p[:, :3]), r"target_probs must have shape \[2, 4, 10\]"),
        (_with(1, lambda q: q[:, :, :9]), r"draft_probs must have shape \[2, 3, 10\]"),
        (_with(1, lambda q: q[:1]), r"draft_probs must have shape \[2, 3, 10\]"),
        (_with(3, lambda n: n[:1]), r"num_draft must have shape \[2\]"),
        (_with(4, lambda u: u[:, :2]), r"u_accept must have shape \[2, 3\]"),
        (_with(5, lambda u: u[:, :3]), r"u_sample must have shape \[2, 4\]"),
        (lambda d, q, p, n, ua, us: (d, q[..., :0], p[..., :0], n, ua, us), "V = 0"),
        (_with(0, lambda d: d.int()), "draft_tokens must be int64"),
        (_with(1, lambda q: q.double()), "draft_probs must be float32, bfloat16 or float16"),
        (_with(2, lambda p: p.double()), "target_probs must be float32, bfloat16 or float16"),
        (_with(3, lambda n: n.float()), "num_draft must be int32"),
        (_with(4, lambda u: u.double()), "u_accept must be float32"),
        (_with(5, lambda u: u.half()), "u_sample must be float32"),
        (_with(3, torch.tensor([1, 4], dtype=torch.int32)), r"\[0, K = 3\].*max 4"),
        (_with(3, torch.tensor([-1, 0])), r"\[0, K = 3\].*min -1"),
        (_with(0, torch.tensor([[1, 2, 0], [0, 10, 0]])), r"draft_tokens\[1, 1\] = 10 is outside"),
        (_with(0, torch.tensor([[1, 2, 0], [-1, 0, 0]])), r"draft_tokens\[1, 0\] = -1 is outside"),
        (_with(4, lambda u: u.index_fill(1, torch.tensor([2]), 1.0)), r"u_accept\[0, 2\] = 1.0 is not a uniform in"),
        (_with(5, lambda u: u.index_fill(0, torch.tensor([1]), -0.5)), r"u_sample\[1, 0\] = -0.5 is not a uniform"),
        (_with(5, lambda u: u.index_fill(1, torch.tensor([3]), float("nan"))), r"u_sample\[0, 3\] = nan is not"),
        (_with(2, lambda p: p.to("meta")), "one device"),
        (_with(1, lambda q: q.tolist()), "draft_probs must be a torch.Tensor or None"),
        (_with(5, lambda u: u.tolist()), "u_sample must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_swiftkern_error(patch, message):
    d, q, p, _, ua, us = _good()
    with pytest.raises(SwiftkernError, match=message):
        ops.rejection_sample(*patch(d, q, p, torch.tensor([1, 3], dtype=torch.int32), ua, us))


def test_drafts_past_num_draft_may_be_anything():
    d, q, p, _, ua, us = _good()
    d[0, 2] = -5  # ignored: num_draft[0] = 2
    assert_same_as_reference((d, q, p, torch.tensor([2, 3], dtype=torch.int32), ua, us))


def test_backend_info_reports_cpp_kernel_when_built():
    if os.environ.get("SWIFTKERN_BUILD_EXT") == "0" or ops.registry.extension is None:
        pytest.skip("the extension was not built")
    assert ops.backend_info()["ops"]["rejection_sample"]["cpu"] == "cpp"
    d, q, p, n, ua, us = _good()  # the raw C++ op checks its inputs too
    with pytest.raises(RuntimeError, match="must be float32"):
        OP(d, q, p.bfloat16(), n, ua, us)
    with pytest.raises(RuntimeError, match="contiguous along V"):
        OP(d, q, p.transpose(1, 2).contiguous().transpose(1, 2), n, ua, us)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        OP(d.fill_(10), q, p, torch.tensor([1, 3], dtype=torch.int32), ua, us)
