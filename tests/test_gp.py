"""The GP surrogate against closed forms, and Bayesian optimization against random search."""

import math

import numpy as np
import pytest
import torch

from swiftkern.gp import (GaussianProcess, LENGTH_SCALES, NOISE_VARIANCES, SIGNAL_VARIANCES, expected_improvement,
                          matern52, upper_confidence_bound)
from swiftkern.layer_set import LayerSet
from swiftkern.search import LayerSetSearch, SearchConfig


def _np_matern(a, b, ls, sv):
    r = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) / ls
    return sv * (1 + math.sqrt(5) * r + 5 * r ** 2 / 3) * np.exp(-math.sqrt(5) * r)


def _np_posterior(x, y, xs, ls, sv, nv):
    mu, sd = y.mean(), y.std(ddof=1)
    yn = (y - mu) / sd
    K = _np_matern(x, x, ls, sv) + nv * np.eye(len(x))
    ks = _np_matern(x, xs, ls, sv)
    mean = ks.T @ np.linalg.solve(K, yn)
    var = sv - np.einsum("ij,ij->j", ks, np.linalg.solve(K, ks))
    return mean * sd + mu, np.sqrt(var) * sd


def test_matern_closed_form_values():
    a = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    k = matern52(a, b, 2.0, 1.5)
    r = 2.5 * math.sqrt(5)
    assert k[0, 0].item() == pytest.approx(1.5 * (1 + r + r * r / 3) * math.exp(-r))
    assert k[0, 1].item() == pytest.approx(1.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_posterior_equals_the_closed_form(seed):
    g = np.random.default_rng(seed)
    x, y, xs = g.random((7, 3)), g.normal(size=7), g.random((5, 3))
    gp = GaussianProcess(length_scale=0.7, signal_var=1.3, noise_var=0.05).fit(torch.tensor(x), torch.tensor(y))
    mean, std = gp.predict(torch.tensor(xs))
    m_ref, s_ref = _np_posterior(x, y, xs, 0.7, 1.3, 0.05)
    np.testing.assert_allclose(mean.numpy(), m_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(std.numpy(), s_ref, rtol=1e-9, atol=1e-9)


def test_fitted_hyperparameters_maximize_the_marginal_likelihood():
    g = np.random.default_rng(3)
    x = g.random((12, 2))
    y = np.sin(3 * x[:, 0]) + 0.05 * g.normal(size=12)
    gp = GaussianProcess().fit(torch.tensor(x), torch.tensor(y))
    yn = (y - y.mean()) / y.std(ddof=1)

    def lml(ls, sv, nv):
        K = _np_matern(x, x, ls, sv) + nv * np.eye(len(x))
        _, logdet = np.linalg.slogdet(K)
        return -0.5 * yn @ np.linalg.solve(K, yn) - 0.5 * logdet - 0.5 * len(x) * math.log(2 * math.pi)

    best = max(lml(ls, sv, nv) for ls in LENGTH_SCALES for sv in SIGNAL_VARIANCES for nv in NOISE_VARIANCES)
    assert gp.log_marginal_likelihood == pytest.approx(best, rel=1e-8)
    assert lml(*gp.hyper) == pytest.approx(best, rel=1e-8)


def test_acquisitions_closed_form():
    mean, std = torch.tensor([0.5, 1.0], dtype=torch.float64), torch.tensor([0.2, 0.0001], dtype=torch.float64)
    assert upper_confidence_bound(mean, std, 2.5).tolist() == pytest.approx([1.0, 1.00025])
    ei = expected_improvement(mean, std, best=0.5)
    assert ei[0].item() == pytest.approx(0.2 / math.sqrt(2 * math.pi))  # z = 0: std * phi(0)
    assert ei[1].item() == pytest.approx(0.5, rel=1e-6)  # certain improvement of 0.5


def _evaluations_to_hit(acquisition, seed, budget=400):
    """Synthetic objective over 6-of-16 bitmasks: overlap with a hidden optimum (+ noise)."""
    L = 10
    cfg = SearchConfig(skip_ratio=0.3, bo_every=1, acquisition=acquisition, seed=seed, target=2.0, pool=256)
    search = LayerSetSearch(L, cfg)
    target = set(random_target(search, seed))
    noise = np.random.default_rng(seed)
    for n in range(1, budget + 1):
        cand = search.propose(1)[0]
        on = {i for i, b in enumerate(cand.to_bits()) if b}
        if on == target:
            return n
        search.observe(cand, len(on & target) / search.k + 0.01 * noise.normal())
    return budget


def random_target(search, seed):
    import random as _r
    return _r.Random(1000 + seed).sample(search.coords, search.k)


@pytest.mark.parametrize("acquisition", ["ucb", "ei"])
def test_bo_finds_the_optimum_faster_than_random_search(acquisition):
    search = LayerSetSearch(10, SearchConfig(skip_ratio=0.3))
    n_sets = math.comb(len(search.coords), search.k)  # 8008 candidate sets
    random_mean = (n_sets + 1) / 2  # expected draws to hit one set, sampling without replacement
    evals = [_evaluations_to_hit(acquisition, seed) for seed in range(3)]
    assert np.mean(evals) < random_mean / 50, evals  # measured: 8-21 evaluations


def test_search_stop_rules_and_rescore():
    s = LayerSetSearch(6, SearchConfig(skip_ratio=0.3, target=0.9, patience=3, max_steps=10))
    first = s.propose(1)[0]
    assert str(first) == "attn:1,3|mlp:1,3"  # SWIFT's odd-layer start, k = round(0.3 * 12) = 4
    s.observe(first, 0.5)
    for cand in s.propose(3):
        assert isinstance(cand, LayerSet) and cand.num_skipped == s.k
        assert 0 not in cand.skip_attn and 5 not in cand.skip_mlp  # first and last kept
        s.observe(cand, 0.1)
    assert s.done() == "patience" and s.best == first
    s.rescore(0.95)
    assert s.done() == "target"
