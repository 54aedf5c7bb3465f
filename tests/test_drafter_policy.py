"""The drafter policy: its cost/acceptance models against closed forms and simulation, its
choice in constructed cases with a known answer, and lossless output for every drafter."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from swiftkern import Generator, SwiftkernError
from swiftkern.drafter_policy import LOOKUP_PRIORS, Acceptance, Choice, DrafterPolicy, expected_tokens
from swiftkern.forward_costs import COOLDOWN_STEPS, ForwardCosts

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [200]]


@pytest.mark.parametrize("a,k", [(0.0, 3), (0.5, 1), (0.7, 4), (0.95, 10), (1.0, 6)])
def test_expected_tokens_matches_simulation(a, k):
    rng = random.Random(0)
    n, total = 20000, 0
    for _ in range(n):
        m = 0
        while m < k and rng.random() < a:
            m += 1
        total += m + 1  # accepted drafts + the corrected / bonus token
    assert expected_tokens(a, k) == pytest.approx(total / n, rel=0.02)
    assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))


def test_acceptance_estimate_recovers_a_geometric_rate():
    rng = random.Random(1)
    est = Acceptance(prior=0.5, decay=0.999)
    for _ in range(4000):
        k = rng.randint(1, 6)
        m = 0
        while m < k and rng.random() < 0.7:
            m += 1
        est.update(k, m)
    assert est.rate == pytest.approx(0.7, abs=0.03)


def test_forward_costs_interpolate_and_extrapolate():
    c = ForwardCosts(decay=0.0)
    with pytest.raises(ValueError):
        c.verify(1)
    c.add_verify(1, 2.0)
    assert c.verify(1) == 2.0 and c.verify(3) == pytest.approx(2.0 * (1 + 0.15 * 2))
    c.add_verify(5, 4.0)
    assert c.verify(3) == pytest.approx(3.0) and c.verify(9) == pytest.approx(6.0)
    c.add_verify(1, 1.0)  # decay 0: the newest sample replaces the mean
    assert c.verify(1) == 1.0


def test_forward_costs_never_fall_with_width():
    """A wider pass timed cheaper (noise) reads as no cheaper, and the line beyond it stays flat
    instead of falling toward zero; a pass narrower than any timed costs no less a token."""
    c = ForwardCosts(decay=0.0)
    c.add_verify(1, 1.0)
    c.add_verify(2, 0.9)
    assert c.verify(2) == 1.0 and c.verify(25) == pytest.approx(1.0)
    c.add_verify(4, 1.3)
    assert c.verify(3) == pytest.approx(1.15) and c.verify(8) == pytest.approx(1.9)
    d = ForwardCosts(decay=0.0)
    d.add_verify(4, 1.0)
    d.add_verify(8, 3.0)  # the line would give verify(1) = -0.5
    assert d.verify(1) == pytest.approx(0.25) and d.verify(2) == pytest.approx(0.5)
    assert d.widest() == 8 and ForwardCosts(shape=d).widest() == 8 and ForwardCosts().widest() == 0


def test_a_wide_pass_costs_at_least_the_widest_timed_grown_by_the_prior_slope():
    """Under load the running max makes the timed widths alike ({1, 2, 4, 8, 16}: 0.1 s each, as
    seen on the Xeon), and verify() extends that flat line: 128 tokens for the price of 16. The
    floor grows the widest timed pass by the prior slope instead; it is 0 where nothing is timed
    or the pass is no wider, and below a well-measured line it changes nothing."""
    c = ForwardCosts(decay=0.0)
    assert c.wide_pass_floor(128) == 0.0
    for t in (1, 2, 4, 8, 16):
        c.add_verify(t, 0.1)
    assert c.verify(128) == pytest.approx(0.1)
    assert c.wide_pass_floor(128) == pytest.approx(0.1 * (1 + 0.15 * 127) / (1 + 0.15 * 15))
    assert c.wide_pass_floor(16) == 0.0 and c.wide_pass_floor(8) == 0.0
    steep = ForwardCosts(decay=0.0)
    steep.add_verify(1, 0.01)
    steep.add_verify(2, 0.02)  # a token more costs a whole verify(1): the line is above the floor
    assert steep.verify(128) == pytest.approx(1.28)
    assert steep.wide_pass_floor(128) < steep.verify(128)


def test_one_timed_width_follows_the_borrowed_shape_or_the_prior_slope():
    """With one pass width timed (T = 3, not 1) a pass of T tokens costs the timed one times
    shape.verify(T) / shape.verify(3) (another batch size's growth), or without a shape the
    line 1 + 0.15 (T - 1) through it; a draft forward not timed here costs the shape's draft
    times this verify(1) / the shape's, else half a verify(1) (closed forms)."""
    shape = ForwardCosts(decay=0.0)
    shape.add_verify(1, 8.0)
    shape.add_verify(5, 40.0)  # shape.verify(3) = 24
    shape.add_draft(4.0)
    c = ForwardCosts(decay=0.0, shape=shape)
    c.add_verify(3, 6.0)
    assert c.verify(1) == pytest.approx(6.0 * 8 / 24) and c.verify(5) == pytest.approx(6.0 * 40 / 24)
    assert c.draft_cost() == pytest.approx(4.0 * c.verify(1) / 8.0)
    c.add_draft(0.3)
    assert c.draft_cost() == 0.3  # timed here: its own
    d = ForwardCosts(decay=0.0)
    d.add_verify(3, 6.0)
    assert d.verify(1) == pytest.approx(6.0 / 1.3) and d.verify(5) == pytest.approx(6.0 / 1.3 * 1.6)
    assert d.draft_cost() == pytest.approx(0.5 * 6.0 / 1.3)


def test_a_wide_pass_is_charged_for_the_plain_steps_it_slows():
    """(The CPU machine: 5.4 ms a decode step in a row of them; the four after an 8-token pass
    took about 1.2, 0.9, 0.7, 0.4 ms more.) The pass is recorded with each plain step's time
    over the verify(1) before it once its COOLDOWN_STEPS plain steps are done, and a wide pass
    that comes sooner records the one before with the excess so far."""
    assert COOLDOWN_STEPS == 4
    c = ForwardCosts(decay=0.5)
    c.time_step(1, 5.0)
    c.time_step(8, 13.5)
    assert 8 not in c._verify  # its cool-down is still running
    for t in (7.0, 6.0, 5.5, 5.25):  # verify(1) before each: 5.0, 6.0, 6.0, 5.75
        c.time_step(1, t)
    assert c.verify(8) == pytest.approx(13.5 + 2.0 + 0.0 - 0.5 - 0.5) and c.verify(1) == 5.5
    c.time_step(4, 7.0)
    c.time_step(1, 6.0)
    c.time_step(2, 6.0)  # another wide pass: the 4-token one is recorded with its one plain step
    assert c.verify(4) == pytest.approx(7.5)
    c.time_step(4, 7.0)
    assert c.verify(2) == pytest.approx(6.0)


def test_the_steps_after_a_prefill_are_not_timed():
    p = DrafterPolicy(("lookup", "none"), 8)
    p.prefilled()
    for _ in range(COOLDOWN_STEPS):
        p.record_draft(4.0)
        p.record_verify(1, 9.0)  # a cold step
    assert not p.costs.known() and p.costs.draft is None
    p.record_verify(1, 5.0)
    assert p.costs.verify(1) == 5.0


def test_drafts_are_valued_only_near_the_widths_timed():
    """With passes of 1 and 2 tokens timed (the second cheaper: noise), a 25-token lookup of
    acceptance 0.35 looked free and was taken whole (a 26-token pass, ~4 decode steps on a CPU);
    now a step is valued at most at twice the widest timed pass, and each wider pass timed
    widens that."""
    p = _policy(("lookup", "none"), verify=(1.0, 0.98))
    _train(p, 0, "lookup", 0.35, steps=5, k=1)
    assert p.choose(0, lookup_len=25, budget=25).k <= 3
    p.costs.add_verify(4, 1.0)
    assert p.choose(0, lookup_len=25, budget=25).k == 7
    # the fixed cost model (measure=False, only verify(1) known) is not limited
    best = max(range(1, 9), key=lambda k: expected_tokens(0.8, k) / (1 + 0.15 * k))
    assert best > 1 and DrafterPolicy(("lookup", "none"), 8, measure=False).choose(0, 25, 25, lookup_ngram=4).k == best


def test_a_lookup_trial_drafts_what_its_prior_would_take():
    """A lookup class due for a trial is tried with the drafts its prior is worth, not all the
    match brings: one-token matches (prior 0.3) at verify(T) = 1 + 0.1 (T - 1) are worth one."""
    p = _policy(("lookup", "none"), k_max=25)
    p.costs.add_verify(16, 2.5)
    _train(p, 0, "lookup", 0.0, steps=30, k=1)
    for _ in range(p.explore_every):
        assert p.choose(0, lookup_len=25, budget=25).drafter == "none"
        p.observe(0, "none", 0, 0)
    trial = p.choose(0, lookup_len=25, budget=25)
    assert (trial.drafter, trial.k, p.agreements.trials) == ("lookup", 1, 1)
    assert max(range(1, 26), key=lambda k: expected_tokens(0.3, k) / p.costs.verify(k + 1)) == 1


def _policy(allowed, verify=(1.0, 1.1), draft=None, k_max=8):
    p = DrafterPolicy(allowed, k_max)
    p.costs.add_verify(1, verify[0])
    p.costs.add_verify(2, verify[1])
    if draft is not None:
        p.costs.add_draft(draft)
    return p


def _train(p, row, drafter, rate, steps=200, k=4, seed=0):
    rng = random.Random(seed)
    for _ in range(steps):
        m = 0
        while m < k and rng.random() < rate:
            m += 1
        p.observe(row, drafter, k, m)


def test_first_step_measures_a_plain_step():
    p = DrafterPolicy(("lookup", "none"), 8)
    assert p.choose(0, lookup_len=5, budget=8).drafter == "none"


def test_good_lookup_is_taken_and_bad_lookup_is_not():
    p = _policy(("lookup", "none"))
    _train(p, 0, "lookup", 0.9)
    c = p.choose(0, lookup_len=6, budget=20)
    assert c.drafter == "lookup" and c.k >= 3
    assert p.choose(0, lookup_len=0, budget=20).drafter == "none"  # no match: nothing to draft
    _train(p, 1, "lookup", 0.02)
    assert p.choose(1, lookup_len=6, budget=20).drafter == "none"  # each draft costs 0.1 and is rejected


def test_lookup_acceptance_is_kept_per_match_length():
    """One-token matches that miss do not stop drafting from long matches that hit."""
    p = _policy(("lookup", "none"))
    p.costs.add_verify(4, 1.3)  # on the line of verify(1), verify(2): drafts of up to 7 are valued
    for _ in range(100):
        p.observe(0, "lookup", 4, 0, lookup_ngram=1)
        p.observe(0, "lookup", 4, 4, lookup_ngram=6)
    assert p.choose(0, lookup_len=6, budget=20, lookup_ngram=1).drafter == "none"
    long_match = p.choose(0, lookup_len=6, budget=20, lookup_ngram=5)
    assert long_match.drafter == "lookup" and long_match.k == 6
    assert p.acceptance(0, "lookup", 4).rate > 0.95 and p.acceptance(0, "lookup", 1).rate < 0.05


@pytest.mark.parametrize("ngram", range(1, 9))
def test_each_match_length_class_starts_at_its_own_prior(ngram):
    """Matches of 1, 2, 3 and 4+ tokens are four classes: misses observed in every other class
    leave this one at its prior (LOOKUP_PRIORS), and it drafts the k maximizing
    E(prior, k) / verify(k + 1) at the fixed costs verify(T) = 1 + 0.15 (T - 1) (brute force)."""
    prior = LOOKUP_PRIORS[min(ngram, 4) - 1]
    p = DrafterPolicy(("lookup", "none"), 8, measure=False)
    for other in range(1, 9):
        if min(other, 4) != min(ngram, 4):
            p.observe(0, "lookup", 4, 0, lookup_ngram=other)
    best = max(range(9), key=lambda k: expected_tokens(prior, k) / (1 + 0.15 * k))
    c = p.choose(0, lookup_len=8, budget=8, lookup_ngram=ngram)
    assert (c.drafter, c.k) == ("lookup", best) and c.acceptance == pytest.approx(prior)


def test_a_lookup_class_that_wins_again_waits_explore_every_for_its_next_trial():
    """A 5-token-match class that keeps missing is tried after explore_every plain steps; the
    trial doubles the wait, but once the class wins on its estimate the next trial (after it
    misses again) comes explore_every steps later again (acceptance.Agreements' schedule)."""
    p = DrafterPolicy(("lookup", "none"), 8, explore_every=3)
    p.costs.add_verify(1, 1.0)
    p.costs.add_verify(2, 1.1)

    def miss():  # until its estimate loses to plain decoding
        for _ in range(60):
            p.observe(0, "lookup", 4, 0, lookup_ngram=5)

    def plain_steps_before_a_trial():
        steps = 0
        while p.choose(0, lookup_len=4, budget=8, lookup_ngram=5).drafter == "none":
            p.observe(0, "none", 0, 0)
            steps += 1
            assert steps <= 20
        return steps

    miss()
    assert plain_steps_before_a_trial() == 3 and p.agreements.trials == 1
    for _ in range(10):
        p.observe(0, "lookup", 4, 4, lookup_ngram=5)
    assert p.choose(0, lookup_len=4, budget=8, lookup_ngram=5).drafter == "lookup"  # wins on its estimate
    miss()
    assert plain_steps_before_a_trial() == 3 and p.agreements.trials == 2


def test_layer_skip_is_valued_at_the_drafts_its_runs_yield():
    """Confidence stops layer-skip runs early: after runs that each yielded 3 drafts (2 accepted)
    a step is valued at the best k <= 3 (brute force over E(a, k) / (k c_d + verify(k + 1)),
    which without that cap would draft more), yet it may draft min(budget, k_max), for
    confidence to stop it."""
    p = _policy(("layer-skip", "none"), verify=(1.0, 1.02), draft=0.05)
    p.costs.add_verify(8, 1.14)  # on the same line: drafts of up to 15 are valued
    for _ in range(30):
        p.observe(0, "layer-skip", 3, 2)
    a = p.acceptance(0, "layer-skip").rate

    def best(most):  # a run confidence stops pays one forward past its drafts (the waste's prior)
        return max(range(most + 1), key=lambda k: expected_tokens(a, k) / (0.05 * (k + 1) + 1 + 0.02 * k if k else 1))

    assert best(3) == 3 < best(8)
    c = p.choose(0, lookup_len=0, budget=20)
    assert (c.drafter, c.k, c.expected_drafts, c.acceptance) == ("layer-skip", 8, 3, a)
    assert p.choose(0, lookup_len=0, budget=5).k == 5


def _simulated_skip_rate(a, k, empty, waste, draft, verify, runs=40000, seed=5):
    """Tokens per unit of time of layer-skip steps, simulated: a run is empty with probability
    ``empty`` (one draft forward, then a pass of one token), else it drafts k tokens accepted
    left to right with probability a, paying k + waste forwards and a pass of k + 1 tokens."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(runs):
        if rng.random() < empty:
            tokens, seconds = tokens + 1, seconds + draft + verify(1)
            continue
        m = 0
        while m < k and rng.random() < a:
            m += 1
        tokens, seconds = tokens + m + 1, seconds + (k + waste) * draft + verify(k + 1)
    return tokens / seconds


@pytest.mark.parametrize("empty,waste", [(0.0, 1.0), (0.3, 1.0), (0.5, 0.5), (0.0, 0.0)])
def test_layer_skip_rate_counts_empty_runs_and_wasted_forwards(empty, waste):
    """The rate choose() values a layer-skip step at, against a simulation of runs with that share
    of empty runs and wasted forwards (no formula shared with the policy): within 2 %."""
    p = _policy(("layer-skip", "none"), verify=(1.0, 1.01), draft=0.05, k_max=4)
    p.costs.add_verify(8, 1.07)
    p._skip_empty[0], p._skip_waste[0], p._draft_len[0] = empty, waste, 4.0
    p.acceptance(0, "layer-skip").accepted, p.acceptance(0, "layer-skip").misses = 9.0, 1.0  # a = 0.9
    c = p.choose(0, lookup_len=0, budget=4)
    assert (c.drafter, c.expected_drafts, c.waste) == ("layer-skip", 4, waste)
    sim = _simulated_skip_rate(0.9, 4, empty, waste, 0.05, p.costs.verify)
    assert c.tokens_per_s == pytest.approx(sim, rel=0.02)


def test_empty_layer_skip_runs_are_paid_for():
    """Runs whose drafts are all accepted (3 of 3) but which mostly draft nothing (confidence
    refuses the first draft in 3 runs of 4, each costing a forward of 0.5 steps): the policy sees
    the empty runs (observed as layer-skip with 0 drafts) and stops drafting, (0.75 + 0.25 E(1, 3))
    / (0.75 (0.5 + 1) + 0.25 (4 * 0.5 + verify(4))) = 1.75 / 1.95 < 1 token a step; the same
    drafting runs without the empty ones win, 4 / 3.3 > 1. Before, an empty run counted as plain
    decoding, so the mostly empty runs were valued as the second case."""
    def trained(empty_runs):
        p = _policy(("layer-skip", "none"), verify=(1.0, 1.1), draft=0.5)
        for i in range(40):
            if empty_runs and i % 4:
                p.observe(0, "layer-skip", 0, 0, forwards=1)
            else:
                p.observe(0, "layer-skip", 3, 3, forwards=4)
        return p
    assert trained(empty_runs=False).choose(0, lookup_len=0, budget=8).drafter == "layer-skip"
    assert trained(empty_runs=True).choose(0, lookup_len=0, budget=8).drafter == "none"
    assert (0.75 + 0.25 * 4) / (0.75 * 1.5 + 0.25 * (4 * 0.5 + 1.3)) < 1 < 4 / (4 * 0.5 + 1.3)


def test_the_loop_reports_every_layer_skip_run_and_its_forwards(monkeypatch):
    """At batch 1, with every step drafting with the layer-skipped model (choose() patched to
    pick it), the runs the loop reports (empty ones included, each with its forwards: its drafts,
    plus one where confidence stopped it short of its budget) add up to the draft forwards it
    ran, and the output is still ar's. The random model's top-1 probabilities are low: at eps 0.1
    confidence refuses most first drafts and takes some (runs of 0, 1 and 2 drafts, and 1 of a
    budget of 1 at the end)."""
    hf = tiny_model("llama", num_hidden_layers=5)
    seen = []
    observe = DrafterPolicy.observe

    def spy(self, row, drafter, num_draft, num_accepted, lookup_ngram=1, forwards=None):
        if drafter == "layer-skip":
            seen.append((num_draft, forwards))
        return observe(self, row, drafter, num_draft, num_accepted, lookup_ngram, forwards)

    monkeypatch.setattr(DrafterPolicy, "observe", spy)
    budgets = []

    def choose(self, row, lookup_len, budget, layer_skip=True, lookup_ngram=1):
        budgets.append(min(3, budget))
        return Choice("layer-skip", budgets[-1], 1.0, 0.5, budgets[-1])

    monkeypatch.setattr(DrafterPolicy, "choose", choose)
    runs = []
    for prompt in PROMPTS:
        ar = Generator(hf).generate([prompt], max_new_tokens=40, eos_token_id=[]).tokens
        seen.clear(), budgets.clear()
        out = Generator(hf, mode="self-spec", drafter="auto", layer_set="attn:2", k_max=4, eps=0.1).generate(
            [prompt], max_new_tokens=40, eos_token_id=[])
        assert out.tokens == ar
        assert len(seen) == out.stats["verify_steps"]
        assert sum(f for _, f in seen) == out.stats["draft_steps"]
        assert all(f == (n if n == k else n + 1) for (n, f), k in zip(seen, budgets))
        runs += seen
    assert any(n == 0 for n, _ in runs) and any(n > 0 for n, _ in runs)  # both kinds of run were seen


def test_expensive_layer_skip_loses_to_plain_decoding():
    # a draft forward costs 0.9 of a full step (a small model): even 60 % acceptance loses
    p = _policy(("layer-skip", "none"), draft=0.9)
    _train(p, 0, "layer-skip", 0.6)
    assert p.choose(0, lookup_len=0, budget=20).drafter == "none"
    # a cheap draft (a big model with redundant layers) with the same acceptance wins
    p = _policy(("layer-skip", "none"), draft=0.1)
    _train(p, 0, "layer-skip", 0.6)
    assert p.choose(0, lookup_len=0, budget=20).drafter == "layer-skip"


def test_free_lookup_beats_an_equally_accurate_layer_skip():
    p = _policy(("lookup", "layer-skip", "none"), draft=0.3)
    for seed in range(20):  # interleaved, so neither estimate goes stale
        _train(p, 0, "lookup", 0.8, steps=10, seed=seed)
        _train(p, 0, "layer-skip", 0.8, steps=10, seed=seed)
    assert p.choose(0, lookup_len=8, budget=20).drafter == "lookup"
    assert p.choose(0, lookup_len=0, budget=20).drafter == "layer-skip"


def test_budget_and_stale_estimates():
    p = DrafterPolicy(("lookup", "none"), 8, explore_every=3)
    p.costs.add_verify(1, 1.0)
    p.costs.add_verify(2, 1.05)
    _train(p, 0, "lookup", 0.0, steps=50)
    assert p.choose(0, lookup_len=4, budget=10).drafter == "none"
    for _ in range(3):
        p.observe(0, "none", 0, 0)  # lookup unused for 3 steps: back to its prior, tried again
    assert p.choose(0, lookup_len=4, budget=10).drafter == "lookup"
    assert p.choose(0, lookup_len=4, budget=0).drafter == "none"
    assert p.choose(0, lookup_len=4, budget=2).k <= 2


@pytest.mark.parametrize("drafter", ["auto", "none", "lookup"])
def test_every_drafter_is_greedy_identical_to_ar(drafter):
    hf = tiny_model("llama", num_hidden_layers=5)
    ar = Generator(hf).generate(PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens
    layer_sets = (None, "attn:2|mlp:1,3") if drafter == "auto" else (None,)
    for layer_set in layer_sets:
        out = Generator(hf, mode="self-spec", drafter=drafter, layer_set=layer_set, k_max=6).generate(
            PROMPTS, max_new_tokens=30, eos_token_id=[])
        assert out.tokens == ar
        steps = out.stats["drafter_steps"]
        assert sum(steps.values()) == out.stats["row_verifies"]
        if drafter == "none":
            assert out.stats["drafted"] == 0 and steps["none"] == out.stats["row_verifies"]
    if drafter != "auto":  # a drafter that drafts no layer-skipped tokens refuses a layer set it would ignore
        with pytest.raises(SwiftkernError, match="would ignore layer_set"):
            Generator(hf, mode="self-spec", drafter=drafter, layer_set="attn:2|mlp:1,3")


def test_auto_sampling_is_seeded():
    """Seeded sampling: choices come from acceptance alone (no timings), so a seed and a batch fix
    the tokens. Not the batch alone: the batch's pass width decides which drafts a row verifies,
    and rejection sampling draws from them (mode deterministic keeps a row's tokens its own)."""
    hf = tiny_model("llama", num_hidden_layers=5)
    gen = Generator(hf, mode="self-spec", drafter="auto", layer_set="attn:2", k_max=4)
    # a low temperature keeps the random model in the loops greedy decoding falls into: lookup matches
    kw = dict(max_new_tokens=24, do_sample=True, temperature=0.1, eos_token_id=[])
    a = gen.generate(PROMPTS, seed=[1, 2, 3, 4], **kw)
    assert gen.generate(PROMPTS, seed=[1, 2, 3, 4], **kw).tokens == a.tokens
    assert gen.generate(PROMPTS, seed=[1, 2, 5, 4], **kw).tokens[2] != a.tokens[2]
    alone = gen.generate([PROMPTS[2]], seed=3, **kw).tokens[0]
    assert gen.generate([PROMPTS[2]], seed=3, **kw).tokens[0] == alone
    assert a.stats["drafter_steps"]["lookup"] + a.stats["drafter_steps"]["layer-skip"] > 0


def test_unmeasured_policy_has_fixed_costs():
    p = DrafterPolicy(("lookup", "none"), 8, measure=False)
    p.record_verify(1, 123.0)
    p.record_draft(9.0)
    assert p.costs.verify(1) == 1.0 and p.costs.draft == 0.5


@pytest.mark.parametrize("accepts,want", [(True, "layer-skip"), (False, "none")])
def test_a_losing_layer_skip_is_tried_again_and_kept_only_when_it_pays(accepts, want):
    """At its prior a draft of 0.6 forwards loses to plain decoding (sum_i 0.6^i / (0.6 k + 1 +
    0.1 k) < 1 for every k); left out explore_every steps it is tried once, with one draft (what
    its prior is worth, at least one), and what the trial shows decides: the draft accepted
    pays, refused it does not."""
    p = _policy(("layer-skip", "none"), draft=0.6)
    assert all(expected_tokens(0.6, k) / (0.7 * k + 1.0) < 1.0 for k in range(1, 9))
    for _ in range(p.explore_every):
        assert p.choose(0, lookup_len=0, budget=20).drafter == "none"
        p.observe(0, "none", 0, 0)
    trial = p.choose(0, lookup_len=0, budget=20)
    assert (trial.drafter, trial.k, p.agreements.trials) == ("layer-skip", 1, 1)
    for _ in range(3):  # one forward each: the budget of 1, not confidence, stopped the run
        p.observe(0, "layer-skip", 1, 1 if accepts else 0, forwards=1)
    assert p.choose(0, lookup_len=0, budget=20).drafter == want
    p.observe(0, want, 1 if want == "layer-skip" else 0, 1 if accepts else 0)
    assert p.agreements.trials == 1  # not due again for explore_every steps


def test_a_layer_skip_trial_drafts_what_its_prior_is_worth_at_its_cost():
    """A dear draft (0.8 of a step) is tried with one draft, not the k_max a confident run can
    reach (SmolLM2 on a CPU: 24 forwards to verify 5); a cheap one (0.1) with the drafts its
    prior 0.6 is worth there, by brute force over E(0.6, k) / (0.1 k + verify(k + 1))."""
    for draft, k_want in ((0.8, 1), (0.1, None)):
        p = _policy(("layer-skip", "none"), draft=draft, k_max=25)
        p.costs.add_verify(16, 2.5)  # verify(T) = 1 + 0.1 (T - 1)
        _train(p, 0, "layer-skip", 0.0, steps=30, k=1)
        while (trial := p.choose(0, lookup_len=0, budget=25)).drafter == "none":
            p.observe(0, "none", 0, 0)
        if k_want is None:
            k_want = max(range(1, 16), key=lambda k: expected_tokens(0.6, k) / (0.1 * k + p.costs.verify(k + 1)))
            assert k_want > 1
        assert (trial.drafter, trial.k, p.agreements.trials) == ("layer-skip", k_want, 1)


def _costed(verify_slope: float, draft: float = 0.5) -> DrafterPolicy:
    """A policy whose verify pass of T tokens a row costs 1 + verify_slope (T - 1)."""
    p = DrafterPolicy(("lookup", "layer-skip", "none"), 8)
    p.costs.add_verify(1, 1.0)
    p.costs.add_verify(2, 1.0 + verify_slope)
    p.costs.add_draft(draft)
    return p


def test_one_pass_width_for_the_batch():
    """Eight rows, one with an 8-token lookup draft of acceptance 0.9. Where a pass's cost grows
    with its width (compute-bound: verify(T) = T), widening it for one row slows the other seven
    more than that row gains: (7 + E(0.9, 8)) / 9 = 1.46 tokens per unit against 8 / 1 for plain
    decoding, so no row drafts. Where it is nearly flat (verify(T) = 1 + 0.01 (T - 1)): 13.13 /
    1.08 = 12.2 > 8, so the row keeps its drafts."""
    drafting = Choice("lookup", 8, 0.0, 0.9, 8)
    choices = [drafting] + [Choice("none", 0, 0.0)] * 7
    assert (7 + expected_tokens(0.9, 8)) / 9 < 8 < (7 + expected_tokens(0.9, 8)) / 1.08
    assert [c.k for c in _costed(1.0).fit_pass(choices)] == [0] * 8
    assert _costed(0.01).fit_pass(choices) == choices
    assert _costed(1.0).fit_pass([drafting]) == [drafting]  # one row: choose() already weighed it


def test_pass_width_is_the_best_over_every_width():
    """Rows with different draft lengths and acceptances: the width fit_pass cuts to makes, in a
    simulation of the steps (each row's drafts accepted one after another with its acceptance,
    the same draws for every width), within 1 % of the most tokens per unit of time any width
    makes. The simulation shares no formula with the policy: a step costs its layer-skip draft
    forwards (the longest such draft, with its wasted forward where confidence stops it short of
    K) and a verify pass of K + 1 tokens."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for trial in range(50):
        p = _costed(rng.choice([0.02, 0.1, 0.3, 1.0]), draft=rng.choice([0.1, 0.5]))
        choices = [Choice(d, n, 0.0, rng.random(), n, rng.choice([0.0, 1.0]) if d == "layer-skip" else 0.0)
                   if (n := rng.randint(0, 8)) and (d := rng.choice(["lookup", "layer-skip"]))
                   else Choice("none", 0, 0.0) for _ in range(rng.randint(2, 8))]
        steps = 20000
        accept = torch.tensor([c.acceptance for c in choices], dtype=torch.float64)  # [R]
        draws = torch.rand(steps, len(choices), 8, generator=gen, dtype=torch.float64) < accept[None, :, None]
        run = draws.int().cumprod(-1).sum(-1)  # [steps, R]: drafts accepted before the first rejection
        drafts = torch.tensor([c.expected_drafts for c in choices])  # [R]

        def simulated_rate(K):
            tokens = (torch.minimum(run, drafts.clamp(max=K)) + 1).sum(-1).double().mean()  # a step's tokens
            # a row confidence stops short of K pays its wasted forward; one K stops pays none
            forwards = max([min(c.expected_drafts, K) + (c.waste if c.expected_drafts < K else 0)
                            for c in choices if c.drafter == "layer-skip"], default=0)
            return float(tokens) / (forwards * p.costs.draft_cost() + p.costs.verify(K + 1))

        fitted = p.fit_pass(choices)
        width = max(c.k for c in fitted)
        assert simulated_rate(width) >= 0.99 * max(simulated_rate(K) for K in range(9)), trial
        assert all(f.k == min(c.k, width) and (f.k == 0 or f.drafter == c.drafter) for f, c in zip(fitted, choices))


def test_the_loop_drafts_what_the_pass_width_leaves(monkeypatch):
    """At batch 4 the speculative loop drafts exactly the lookup tokens fit_pass leaves each row
    (their sum is the run's drafted count) and still gives ar's tokens."""
    hf = tiny_model("llama", num_hidden_layers=5)
    prompts = [p * 3 for p in PROMPTS]
    ar = Generator(hf).generate(prompts, max_new_tokens=30, eos_token_id=[]).tokens
    fitted, fit_pass = [], DrafterPolicy.fit_pass

    def spy(self, choices):
        out = fit_pass(self, choices)
        fitted.append(out)
        return out

    monkeypatch.setattr(DrafterPolicy, "fit_pass", spy)
    out = Generator(hf, mode="self-spec", drafter="lookup").generate(prompts, max_new_tokens=30, eos_token_id=[])
    assert out.tokens == ar
    assert len(fitted) == out.stats["verify_steps"] and out.stats["drafted"] > 0
    assert sum(c.k for step in fitted for c in step) == out.stats["drafted"]


def test_costs_are_kept_per_batch_size():
    """A pass's growth with its width differs by batch size: verify costs timed at batch 8
    (near proportional to T) are not used at batch 1, which measures its own (near flat) and,
    until it has two, borrows batch 8's growth relative to its own verify(1)."""
    p = DrafterPolicy(("lookup", "none"), 8)
    p.set_batch(8)
    p.costs.add_verify(1, 8.0)
    p.costs.add_verify(5, 40.0)
    assert p.choose(0, lookup_len=4, budget=8).drafter == "none"  # 0.6 acceptance cannot pay for 5x
    p.set_batch(1)
    assert not p.costs.known()  # nothing timed at batch 1: a plain step times it
    assert p.choose(0, lookup_len=4, budget=8).drafter == "none"
    p.costs.add_verify(1, 2.0)
    assert p.costs.verify(5) == pytest.approx(2.0 * 40.0 / 8.0)  # batch 8's shape
    p.costs.add_verify(5, 2.2)
    for _ in range(10):
        p.observe(0, "lookup", 4, 4, lookup_ngram=1)
    assert p.choose(0, lookup_len=4, budget=8).drafter == "lookup"
    p.set_batch(8)
    assert p.costs.verify(5) == 40.0


def test_an_untimed_batch_size_borrows_the_nearest_timed_one():
    """Batch sizes 2 (near flat) and 8 (near proportional) timed: a batch size with only
    verify(1) timed follows the growth of the nearest of them (the smaller at equal distance),
    relative to its own verify(1): verify(5) = verify(1) x that size's verify(5) / verify(1)."""
    p = DrafterPolicy(("lookup", "none"), 8)
    for batch, v5 in ((2, 1.2), (8, 5.0)):
        p.set_batch(batch)
        p.costs.add_verify(1, 1.0)
        p.costs.add_verify(5, v5)
    for batch, v5 in ((1, 1.2), (3, 1.2), (5, 1.2), (6, 5.0), (16, 5.0)):
        p.set_batch(batch)
        p.costs.add_verify(1, 2.0)
        assert p.costs.verify(5) == pytest.approx(2.0 * v5), batch


def test_the_loop_tells_the_policy_its_batch_size(monkeypatch):
    hf = tiny_model("llama", num_hidden_layers=5)
    seen = []
    monkeypatch.setattr(DrafterPolicy, "set_batch", lambda self, b: seen.append(b) or setattr(self, "batch", b))
    out = Generator(hf, mode="self-spec", drafter="auto").generate(
        PROMPTS[:3], max_new_tokens=12, eos_token_id=[], arrive_at=[0, 0, 5])
    # two rows, then the arrival makes three, then the late one finishes alone
    assert len(seen) == out.stats["verify_steps"] and (seen[0], max(seen), seen[-1]) == (2, 3, 1)


def test_a_generator_keeps_its_timed_costs_across_calls(monkeypatch):
    """What a pass costs is the machine's and the model's: a Generator's second call starts
    from the costs its first timed (its first step need not be a plain one that times verify(1))."""
    hf = tiny_model("llama", num_hidden_layers=5)
    gen = Generator(hf, mode="self-spec", drafter="auto")
    known_at_start = []
    choose = DrafterPolicy.choose

    def spy(self, row, *args, **kwargs):
        if not known_at_start or known_at_start[-1][0] is not self:
            known_at_start.append((self, self.costs.known()))
        return choose(self, row, *args, **kwargs)

    monkeypatch.setattr(DrafterPolicy, "choose", spy)
    for _ in range(2):
        gen.generate(PROMPTS[:2], max_new_tokens=16, eos_token_id=[])
    assert [known for _, known in known_at_start] == [False, True]
    assert 2 in gen._drafter_costs and gen._drafter_costs[2].known()
    seeded = Generator(hf, mode="self-spec", drafter="auto")
    seeded.generate(PROMPTS[:2], max_new_tokens=16, eos_token_id=[], do_sample=True, seed=1)
    assert seeded._drafter_costs == {}  # sampling with a seed: fixed costs, nothing timed or kept


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 32), st.floats(1e-4, 1.0), min_size=1, max_size=6),
       st.dictionaries(st.integers(1, 32), st.floats(1e-4, 1.0), max_size=4))
def test_forward_costs_are_positive_and_never_fall_with_width(timed, other_batch):
    """Whatever was timed (noise included), at this batch size or borrowed from another, a
    verify pass is valued above zero and no cheaper than any narrower one."""
    shape = ForwardCosts(decay=0.0)
    for T, s in other_batch.items():
        shape.add_verify(T, s)
    c = ForwardCosts(decay=0.0, shape=shape if other_batch else None)
    for T, s in timed.items():
        c.add_verify(T, s)
    costs = [c.verify(T) for T in range(1, 65)]
    assert all(x > 0 for x in costs)
    assert all(b >= a * (1 - 1e-12) for a, b in zip(costs, costs[1:]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 32), st.floats(1e-4, 1.0)), min_size=1, max_size=12),
       st.integers(1, 40))
def test_the_verify_table_follows_every_timing_here_and_in_the_shape(timings, n):
    """verify_upto(n) is verify(1..n) after any sequence of timings, its own or its shape's
    (another batch size's, which it follows while it has one point): a table kept past a timing
    would value drafts at stale costs."""
    shape = ForwardCosts(decay=0.5)
    shape.add_verify(1, 0.5)
    c = ForwardCosts(decay=0.5, shape=shape)
    c.add_verify(2, 0.7)
    for in_shape, T, seconds in timings:
        (shape if in_shape else c).add_verify(T, seconds)
        assert c.verify_upto(n)[:n] == [c.verify(T) for T in range(1, n + 1)]


def test_a_spike_joins_a_running_mean_as_at_most_spike_times_it():
    """A 46 ms plain step among 9.7 ms ones (the CPU machine's loop) moves verify(1) as a
    14.55 ms one would (spike 1.5), and a plain step charged to a wide pass is clipped the same
    way; a first sample, with no mean to clip to, counts as it is."""
    c = ForwardCosts(decay=0.8)
    c.time_step(1, 9.7)
    c.time_step(1, 46.0)
    assert c.verify(1) == pytest.approx(0.8 * 9.7 + 0.2 * 1.5 * 9.7)
    c.time_step(1, 10.0)  # below the clip: as it is
    v1 = 0.8 * (0.8 * 9.7 + 0.2 * 14.55) + 0.2 * 10.0
    assert c.verify(1) == pytest.approx(v1)
    c.time_step(2, 11.0)
    c.time_step(1, 100.0)  # charged to the 2-token pass as 1.5 v1 - v1
    for _ in range(COOLDOWN_STEPS - 1):
        c.time_step(1, c.verify(1))
    assert c._verify[2] == pytest.approx(11.0 + 0.5 * v1)
    first = ForwardCosts(decay=0.8)
    first.time_step(1, 46.0)
    assert first.verify(1) == 46.0
