"""The deterministic replay's fast-path policy (``replay_policy.FastPathPolicy``): its choices
against the closed-form rates they should maximize, and, end to end, that whatever it chooses
the verifier's output stays the same bits."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.drafter_policy import LOOKUP_PRIORS
from swiftkern.replay_policy import (LOOKUP_MARGIN, PRIOR_DRAFT_COST, PRIOR_VERIFY_SLOPE, PRIORS, TRIAL_TOKENS,
                                     FastPathPolicy)

W = 8  # window


def E(a: float, n: int) -> float:
    """Tokens committed from n proposals of agreement a (the verifier's own token included)."""
    return sum(a ** i for i in range(n + 1))


def rate(a: float, n: int, c_fast: float, c_verify: float) -> float:
    return E(a, n) / (n * c_fast + c_verify)


def timed_policy(full=10.0, draft=4.0, verify=20.0) -> FastPathPolicy:
    p = FastPathPolicy(window=W, verify_batch=1)
    p.record_fast("full", full, 1)
    p.record_fast("draft", draft, 1)
    p.record_verify(verify, 1)
    return p


def test_kind_is_the_larger_closed_form_rate():
    p = timed_policy()
    want = max(("full", "draft"), key=lambda k: rate(PRIORS[k], W - 1, {"full": 10.0, "draft": 4.0}[k], 20.0))
    assert want == "full" and p.kind([0]) == "full"  # priors: the draft agrees too little to pay
    for _ in range(20):  # row 1's drafts turn out to agree every time: 7 of 7
        p.observe(1, "draft", 7, 0, 7, 0)
    a = p.agreements.get(1, "draft").rate
    assert a > 0.95 and rate(a, 7, 4.0, 20.0) > rate(PRIORS["full"], 7, 10.0, 20.0)
    assert p.kind([1]) == "draft"
    prior = {k: rate(PRIORS[k], 7, {"full": 10.0, "draft": 4.0}[k], 20.0) for k in PRIORS}
    row1 = {"full": prior["full"], "draft": rate(p.agreements.get(1, "draft").rate, 7, 4.0, 20.0)}
    for others in (2, 8):  # the batch's sum decides: one row's good drafts, or many rows at their priors
        want = max(PRIORS, key=lambda k: row1[k] + others * prior[k])
        assert p.kind([1, *range(10, 10 + others)]) == want
    assert want == "full"


def test_lookup_is_taken_when_it_beats_the_fast_path_by_the_margin():
    p = timed_policy()
    fast = rate(PRIORS["full"], W - 1, 10.0, 20.0)
    for ngram, prior in zip((1, 2, 3, 4), LOOKUP_PRIORS):
        at_start = E(prior, 7) / 20.0  # no fast tokens yet: the match alone for a verify pass
        assert p.take(0, "full", 0, 7, ngram) == (at_start > LOOKUP_MARGIN * fast)
    assert (p.taken, p.declined) == (3, 1)  # on these costs only the 1-token matches do not pay
    # midway through a cycle: u fast tokens are committed first, then the match's
    u, prior = 4, LOOKUP_PRIORS[1]
    a = PRIORS["full"]
    mid = (E(a, u) + a ** u * (E(prior, 3) - 1)) / (u * 10.0 + 20.0)
    assert p.take(5, "full", u, 3, 2) == (mid > LOOKUP_MARGIN * fast)


def test_nothing_is_taken_before_a_fast_forward_is_timed():
    p = FastPathPolicy(window=W, verify_batch=1)
    assert p.kind([0]) == "draft"  # as the user asked, until something is measured
    assert not p.take(0, "draft", 0, 7, 4)


def test_fixed_costs_ignore_timings():
    p = FastPathPolicy(window=W, verify_batch=1, measure=False)
    p.record_fast("full", 99.0, 1)
    p.record_verify(99.0, 1)
    assert p.fast_cost == {"full": 1.0, "draft": 0.5} and p.verify_cost is None
    assert p.kind([0]) == max(PRIORS, key=lambda k: rate(PRIORS[k], W - 1, p.fast_cost[k], 1 + 0.15 * (W - 1)))


def test_agreement_is_attributed_to_fast_and_lookup_tokens():
    p = timed_policy()
    p.observe(0, "full", 3, 4, 2, ngram=2)  # a fast token missed: the lookup tokens were not tested
    fast, look = p.agreements.get(0, "full"), p.agreements.get(0, ("lookup", 2))
    assert look.rate == LOOKUP_PRIORS[1] and fast.misses > (1 - PRIORS["full"]) * 2 * 0.9
    before = look.accepted
    p.observe(0, "full", 3, 4, 5, ngram=2)  # all 3 fast tokens agreed, then 2 of 4 lookup tokens
    assert look.accepted == pytest.approx(0.9 * before + 2)


def test_a_declined_lookup_class_is_tried_again():
    p = timed_policy()
    for _ in range(6):  # 4-token matches that never agree: declined from then on
        p.observe(0, None, 0, 7, 0, ngram=4)
    assert not p.take(0, "full", 0, 7, 4)
    for _ in range(p.explore_every - 1):
        assert not p.take(0, "full", 0, 7, 4)
    low = p.agreements.get(0, ("lookup", 4)).rate
    assert not p.take(0, "full", 0, 7, 4, wait=3)  # due, but its row would wait for its pass
    assert p.take(0, "full", 0, 7, 4)  # a trial, whatever its estimate
    assert p.agreements.get(0, ("lookup", 4)).rate == low  # kept for the trial's outcome
    p.observe(0, None, 0, 7, 0, ngram=4)  # the trial's verify pass: no token agreed again
    assert not p.take(0, "full", 0, 7, 4) and p.agreements.trials == 1


def test_a_losing_kind_is_tried_for_one_cycle_then_chosen_by_what_it_showed():
    """At their priors the draft loses (test above); left out explore_every steps it runs until
    the row's verify pass, and the agreement that pass measured decides from then on."""
    for agreed, want in ((7, "draft"), (0, "full")):
        p = timed_policy()
        for _ in range(p.explore_every):
            assert p.kind([0]) == "full"
        assert [p.kind([0]) for _ in range(3)] == ["draft"] * 3  # the trial: one cycle of drafts
        for _ in range(3):  # the row's verify passes: 7 of 7 drafts agreed, or none
            p.observe(0, "draft", 7, 0, agreed, 0)
        a = p.agreements.get(0, "draft").rate
        assert want == max(("full", "draft"), key=lambda k: rate(
            {"full": PRIORS["full"], "draft": a}[k], W - 1, {"full": 10.0, "draft": 4.0}[k], 20.0))
        assert p.kind([0]) == want and p.agreements.trials == 1


def test_a_trial_is_short_and_leaves_the_kinds_cycle_length_alone():
    """The untimed first cycle is a draft trial, and so is a due one: its rows go to their verify
    pass after TRIAL_TOKENS fast tokens (a whole window of a losing kind was mostly rolled
    back), and the cut cycle does not count as the kind's cycle length (W - 1 until a real
    cycle is seen)."""
    fresh = FastPathPolicy(window=W, verify_batch=1)
    assert fresh.kind([0, 1]) == "draft" and fresh.trial_tokens(0) == fresh.trial_tokens(1) == TRIAL_TOKENS
    p = timed_policy()
    for _ in range(p.explore_every):
        assert p.kind([0]) == "full" and p.trial_tokens(0) is None
    assert p.kind([0]) == "draft" and p.trial_tokens(0) == TRIAL_TOKENS < W - 1
    p.observe(0, "draft", TRIAL_TOKENS, 0, 2, 0)
    a = p.agreements.get(0, "draft").rate
    assert p.trial_tokens(0) is None
    assert p._rate(0, "draft") == pytest.approx(rate(a, W - 1, 4.0, 20.0))
    p.observe(0, "draft", 3, 0, 3, 0)  # a real cycle of 3 (confidence stopped it) sets it
    assert p._rate(0, "draft") == pytest.approx(rate(p.agreements.get(0, "draft").rate, 3, 4.0, 20.0))


class _Reference:
    """What FastPathPolicy's docstrings say its inputs are, from what it was fed: agreement the
    decayed accepted / (accepted + misses) of the fast tokens (and, once they all agreed, of the
    lookup tokens), starting from the priors (weight 2, decay 0.9); a cycle's fast tokens the
    mean (decay 0.8) of the cycles no lookup cut short, W - 1 before any; a kind not timed costs
    the other's times (draft) or over (full) PRIOR_DRAFT_COST; an untimed verify pass
    c_full (1 + PRIOR_VERIFY_SLOPE (B W - 1)) / B a row."""

    def __init__(self, window, batch, fast, verify):
        self.window, self.batch, self.fast, self.verify = window, batch, fast, verify
        self.counts, self.runs = {}, {}

    def agreement(self, request, what):
        prior = PRIORS[what] if isinstance(what, str) else LOOKUP_PRIORS[what[1] - 1]
        acc, miss = self.counts.get((request, what), (2 * prior, 2 * (1 - prior)))
        return acc / (acc + miss)

    def _update(self, request, what, n, m):
        prior = PRIORS[what] if isinstance(what, str) else LOOKUP_PRIORS[what[1] - 1]
        acc, miss = self.counts.get((request, what), (2 * prior, 2 * (1 - prior)))
        self.counts[(request, what)] = (0.9 * acc + m, 0.9 * miss + (m < n))

    def observe(self, request, kind, fast, lookup, matched, ngram):
        if fast and kind is not None:
            self._update(request, kind, fast, min(matched, fast))
            if not lookup:
                old = self.runs.get((request, kind))
                self.runs[(request, kind)] = fast if old is None else 0.8 * old + 0.2 * fast
        if lookup and matched >= fast:
            self._update(request, ("lookup", min(max(ngram, 1), 4)), lookup, matched - fast)

    def cost(self, kind):
        if kind in self.fast:
            return self.fast[kind]
        return self.fast["full"] * PRIOR_DRAFT_COST if kind == "draft" else self.fast["draft"] / PRIOR_DRAFT_COST

    def verify_share(self):
        if self.verify is not None:
            return self.verify
        return self.cost("full") * (1 + PRIOR_VERIFY_SLOPE * (self.batch * self.window - 1)) / self.batch

    def rate(self, request, kind):
        n = max(1, round(self.runs.get((request, kind), self.window - 1)))
        return E(self.agreement(request, kind), n) / (n * self.cost(kind) + self.verify_share())

    def take_rate(self, request, kind, unverified, match_len, ngram, wait):
        a_k, a_l = self.agreement(request, kind), self.agreement(request, ("lookup", min(ngram, 4)))
        tokens = E(a_k, unverified) + a_k ** unverified * (E(a_l, match_len) - 1)
        return tokens / ((unverified + wait) * self.cost(kind) + self.verify_share())


def _clear(x, y):
    """x and y too far apart for rounding to order them differently."""
    return abs(x - y) > 1e-9 * max(abs(x), abs(y))


def test_choices_follow_a_reference_model_of_the_rates():
    """Random timings (either kind or both timed, the verify pass timed or not), window, verify
    batch and verified cycles (fast tokens, lookup tokens, how many agreed): ``kind`` picks the
    larger sum over the rows of E(a_k, n_k) / (n_k c_k + c_V), and ``take`` takes a match iff
    (E(a_k, u) + a_k^u (E(a_L, m) - 1)) / ((u + w) c_k + c_V) > LOOKUP_MARGIN R_k, with every
    input computed by ``_Reference`` from what the policy was fed (no trials: explore_every is
    out of reach)."""
    rng = random.Random(7)
    kinds, takes = [], []
    for trial in range(400):
        window, batch = rng.choice([4, 8]), rng.choice([1, 2, 4])
        p = FastPathPolicy(window, batch, explore_every=10 ** 6)
        timed = rng.choice([("full",), ("draft",), ("full", "draft")])
        fast = {}
        for kind in timed:
            seconds, rows = rng.uniform(1, 10), rng.randint(1, 4)
            p.record_fast(kind, seconds, rows)
            fast[kind] = seconds / rows
        verify = None
        if rng.random() < 0.5:
            seconds, rows = rng.uniform(5, 40), rng.randint(1, 4)
            p.record_verify(seconds, rows)
            verify = seconds / rows
        ref = _Reference(window, batch, fast, verify)
        requests = list(range(rng.randint(1, 3)))
        for _ in range(rng.randint(0, 12)):
            request, kind = rng.choice(requests), rng.choice(["full", "draft"])
            n_fast = rng.randint(0, window - 1)
            lookup = rng.choice([0, 0, rng.randint(1, window - n_fast)])
            matched, ngram = rng.randint(0, n_fast + lookup), rng.randint(1, 6)
            for who in (p, ref):
                who.observe(request, kind if n_fast else None, n_fast, lookup, matched, ngram)
        sums = {k: sum(ref.rate(r, k) for r in requests) for k in ("full", "draft")}
        got = p.kind(requests)
        if _clear(sums["full"], sums["draft"]):
            assert got == max(sums, key=sums.get), trial
            kinds.append(got)
        request, kind = rng.choice(requests), rng.choice(["full", "draft"])
        u, m, ngram, wait = rng.randint(0, window - 1), rng.randint(1, window), rng.randint(1, 6), rng.randint(0, 3)
        rate, fast_rate = ref.take_rate(request, kind, u, m, ngram, wait), LOOKUP_MARGIN * ref.rate(request, kind)
        got = p.take(request, kind, u, m, ngram, wait)
        if _clear(rate, fast_rate):
            assert got == (rate > fast_rate), trial
            takes.append(got)
    assert len(kinds) > 380 and len(takes) > 380
    assert min(kinds.count("full"), kinds.count("draft"), takes.count(True), takes.count(False)) > 50  # both ways


def test_a_kind_is_tried_only_once_every_row_of_the_step_is_due():
    """Row 1 joins row 0's batch 5 steps after it began: no trial of the draft starts while row
    0 alone is due (row 1's estimate is not stale), nor on the first step both are due, which
    is not fresh (a row holds unverified tokens); it starts on the next, for both rows at once."""
    p = timed_policy()
    assert p.kind([0]) == "full"  # priors: the draft loses (test above)
    for _ in range(4):
        p.kind([0])
    steps = 0  # steps of the two rows before the trial
    while p.kind([0, 1], fresh=steps != p.explore_every) == "full":
        steps += 1
        assert steps <= p.explore_every + 1
    assert steps == p.explore_every + 1 and p.agreements.trials == 2


@pytest.mark.parametrize("adaptive", [True, False])
def test_poor_drafts_hand_the_fast_path_to_the_full_model(adaptive):
    """A layer set that skips most of a tiny model drafts badly: the adaptive policy takes
    full-model fast steps (rolling back little); either way the verifier's tokens and logprobs are those of the
    replay with the regular fast path."""
    model = SkipModel(tiny_model("llama", seed=5))
    prompts = [[5, 6, 7], list(range(30, 45))]
    kw = dict(max_new_tokens=40, eos_token_id=[])
    plain = Generator(model, mode="deterministic", window=6, replay="always").generate(prompts, **kw)
    gen = Generator(model, mode="deterministic", window=6, replay="always", drafter="self-spec",
                    layer_set="attn:1,2|mlp:1,2", eps=0.0, draft_vocab=None)
    import swiftkern.deterministic as deterministic
    import swiftkern.generate as generate_module

    original, policy = generate_module.FastPath, deterministic.FastPathPolicy
    generate_module.FastPath = lambda *a, **k: original(*a, **k, adaptive=adaptive)
    # the fixed cost model: the choices follow the drafts' agreement, not this machine's load
    deterministic.FastPathPolicy = lambda *a, **k: policy(*a, **k, measure=False)
    try:
        spec = gen.generate(prompts, **kw)
    finally:
        generate_module.FastPath, deterministic.FastPathPolicy = original, policy
    assert spec.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(spec.logprobs, plain.logprobs))
    s = spec.stats
    if adaptive:
        assert s["fast_kinds"]["full"] > s["fast_kinds"]["draft"]
        assert sum(s["fast_kinds"].values()) == s["fast_steps"]  # the forwards that ran, by kind
        assert s["rollback_fraction"] < 0.5
    else:
        assert "fast_kinds" not in s and s["rollback_fraction"] > 0.5
