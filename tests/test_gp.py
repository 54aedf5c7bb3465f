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


def test_rescore_replaces_the_best_score_even_when_lower_and_feeds_the_gp():
    """Scores of old windows are not trusted: a re-score on new context replaces the best's score
    (lower too) and joins the GP's data as a point of its own; a later set beating the new score
    becomes the best."""
    s = LayerSetSearch(6, SearchConfig(skip_ratio=0.3, target=0.9))
    a, b = s.propose(2)
    s.observe(a, 0.8)
    s.observe(b, 0.6)
    s.rescore(0.5)
    assert s.best == a and s.best_score == 0.5
    assert s.x == [a.to_bits(), b.to_bits(), a.to_bits()] and s.y == [0.8, 0.6, 0.5]
    c = s.propose(1)[0]
    s.observe(c, 0.55)
    assert s.best == c and s.best_score == 0.55 and s.since_improvement == 0


def test_max_steps_stops_the_search():
    """Neither target nor patience reached: the search stops after exactly max_steps candidates."""
    s = LayerSetSearch(8, SearchConfig(skip_ratio=0.3, target=2.0, patience=100, max_steps=7))
    for n in range(1, 8):
        assert s.done() is None
        s.observe(s.propose(1)[0], n / 10)  # always improving: patience never fires
    assert s.steps == 7 and s.done() == "max_steps"


@pytest.mark.parametrize("L,ratio", [(6, 0.3), (8, 0.3), (12, 0.4)])
def test_proposals_are_new_k_subsets_of_the_inner_sub_layers(L, ratio):
    """40 proposals (random, and BO every 10th): each skips k = round(ratio * 2L) sub-layers,
    never of layer 0 or L - 1 (attention or MLP), none repeats an earlier one (at least 70 sets
    exist), and together they cover every inner sub-layer."""
    import itertools

    s = LayerSetSearch(L, SearchConfig(skip_ratio=ratio, bo_every=10, target=2.0, seed=1))
    k = round(ratio * 2 * L)
    covered, sets = set(), set()
    for n in range(40):
        (cand,) = s.propose(1)
        assert cand.num_skipped == s.k == k
        subs = {("attn", i) for i in cand.skip_attn} | {("mlp", i) for i in cand.skip_mlp}
        assert all(0 < i < L - 1 for _, i in subs), cand
        assert str(cand) not in sets, (n, cand)
        sets.add(str(cand))
        covered |= subs
        s.observe(cand, float(np.sin(n)))
    assert covered == set(itertools.product(("attn", "mlp"), range(1, L - 1)))


def test_the_odd_layer_start_skips_k_sub_layers_too():
    """L = 12, r = 0.45: k = round(10.8) = 11 but only 10 odd inner sub-layers (layers 1-9);
    the first candidate must skip k like every other one (it is that ratio's set)."""
    s = LayerSetSearch(12, SearchConfig(skip_ratio=0.45))
    assert s.propose(1)[0].num_skipped == s.k == 11


def _np_acquisition(kind, mean, sd, best, kappa):
    if kind == "ucb":
        return mean + kappa * sd
    z = (mean - best) / sd
    cdf = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in z])
    return (mean - best) * cdf + sd * np.exp(-z * z / 2) / math.sqrt(2 * math.pi)


SCORED = {"attn:2-3|mlp:": 0.2, "attn:1|mlp:1": -0.61, "attn:2|mlp:2": 0.61, "attn:|mlp:2-3": 0.49,
          "attn:3|mlp:1": -0.12}


@pytest.mark.parametrize("acquisition,kappa", [("ucb", 2.5), ("ei", 2.5), ("ucb", 0.0)])
def test_bo_proposal_maximizes_the_acquisition_over_every_unseen_set(acquisition, kappa):
    """L = 5, k = 2: 15 sets in all, so the proposal pool holds every unseen one. After 5 scored
    sets, the BO proposal must be the unseen set of highest acquisition under the numpy
    closed-form posterior (UCB, or EI over the best score seen). The scores are chosen so that
    the highest mean, the lowest acquisition, UCB with -kappa and EI over the worst score each
    pick another set; with kappa 0 a set scored before has the highest acquisition of all, and
    must not be proposed again."""
    import itertools

    scored = [LayerSet.parse(s, 5) for s in SCORED]
    search = LayerSetSearch(5, SearchConfig(skip_ratio=0.2, bo_every=1, acquisition=acquisition, kappa=kappa,
                                            seed=0), initial=scored[0])
    assert search.propose(1) == scored[:1]
    for ls in scored:
        search.observe(ls, SCORED[str(ls)])
    x, y = np.array(search.x, dtype=float), np.array(search.y)
    hyper = GaussianProcess().fit(torch.tensor(x), torch.tensor(y)).hyper  # the grid: checked above
    unseen = [[int(i in pair) for i in range(10)] for pair in itertools.combinations(search.coords, search.k)]
    unseen = [bits for bits in unseen if tuple(bits) not in search.seen]
    mean, sd = _np_posterior(x, y, np.array(unseen, dtype=float), *hyper)
    acq = _np_acquisition(acquisition, mean, sd, y.max(), kappa)
    wrong = [-acq]
    if acquisition == "ei":
        wrong += [mean, _np_acquisition("ei", mean, sd, y.min(), 0)]
    elif kappa:
        wrong += [mean, mean - kappa * sd]
    else:
        assert max(SCORED.values()) > acq.max()  # a pool with the scored sets in it would pick one
    for w in wrong:  # the check tells the right rule from these wrong ones
        assert acq[np.argmax(w)] < acq.max() - 0.05 * np.ptp(acq)
    proposal = search.propose(1)[0].to_bits()
    assert acq[unseen.index(proposal)] == pytest.approx(acq.max(), rel=1e-9)


def test_a_fixed_noise_variance_of_zero_is_kept():
    """GaussianProcess(noise_var=0.0) took 0.0 for "not given" and searched the grid."""
    x, y = torch.tensor([[0.0], [0.5], [1.0]], dtype=torch.float64), torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    gp = GaussianProcess(length_scale=0.7, signal_var=1.3, noise_var=0.0).fit(x, y)
    assert gp.hyper == (0.7, 1.3, 0.0)
    mean, _ = gp.predict(x)
    torch.testing.assert_close(mean, y)  # no noise: the posterior mean interpolates the data
