"""The deterministic replay's fast-path policy (``replay_policy.FastPathPolicy``): its choices
against the closed-form rates they should maximize, and, end to end, that whatever it chooses
the verifier's output stays the same bits."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.drafter_policy import LOOKUP_PRIORS
from swiftkern.replay_policy import LOOKUP_MARGIN, PRIORS, FastPathPolicy

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
