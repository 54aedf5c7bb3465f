"""rejection_sample: exact tiny cases, invariants on random inputs, and the output distribution.

Every check runs on ops.rejection_sample (the registered kernel) and the reference twin.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swiftkern import ops, reference

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
