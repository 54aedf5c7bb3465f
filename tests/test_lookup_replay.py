"""The lookup replay (bench/bench_lookup_replay.py) reproduces what a real greedy lookup
generation drafts and accepts, given the same verify costs."""

import os
import sys

import pytest

from conftest import tiny_model
from swiftkern import Generator, generate
from swiftkern.drafter_policy import DrafterPolicy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_lookup_replay import K_MAX, replay  # noqa: E402

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 9, 8, 7, 9, 8]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_replay_matches_a_generation_with_the_same_costs(prompt, monkeypatch):
    # the generation's policy at fixed costs (1 + 0.15 (T - 1), measure=False) instead of timings
    monkeypatch.setattr(generate, "DrafterPolicy",
                        lambda allowed, k_max, measure=True, costs=None, **kw: DrafterPolicy(allowed, k_max,
                                                                                             measure=False, **kw))
    hf = tiny_model("llama", num_hidden_layers=3)
    out = Generator(hf, mode="self-spec", drafter="lookup").generate([prompt], max_new_tokens=40, eos_token_id=[])
    ar = Generator(hf).generate([prompt], max_new_tokens=40, eos_token_id=[]).tokens[0]
    assert out.tokens[0] == ar
    costs = {T: 1 + 0.15 * (T - 1) for T in range(1, K_MAX + 2)}
    r = replay(prompt, ar, vote=True, costs=costs)
    s = out.stats
    assert s["drafted"] > 0
    assert (r["steps"], r["drafted"], r["accepted"]) == (s["verify_steps"], s["drafted"], s["accepted"])


def test_spread_draws_follow_the_step_spread():
    """spread_draw's quantiles are STEP_SPREAD's (20000 draws, within sampling error)."""
    import random

    from bench.bench_lookup_replay import STEP_SPREAD, spread_draw

    rng = random.Random(0)
    draws = sorted(spread_draw(rng) for _ in range(20000))
    for q, x in STEP_SPREAD[1:-1]:
        assert draws[int(q * len(draws))] == pytest.approx(x, rel=0.03)
    assert STEP_SPREAD[0][1] <= draws[0] and draws[-1] <= STEP_SPREAD[-1][1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_replay_without_spread_is_the_plain_replay(seed, monkeypatch):
    """Told every step's exact cost (a spread of one point), the policy chooses as with the
    costs given once. Told half of the steps at 3x their cost, on text where lookup drafts are
    mostly wrong (4 random tokens), a policy whose running means take every sample as it is
    overrates drafts as the timed CPU runs did (a slow plain step lifts verify(1), and the
    running max lifts the wider passes with it): it drafts more and its steps cost more than
    without the noise. Clipping the spikes (ForwardCosts.spike, 1.5) gives back part of it."""
    import functools
    import random

    import bench.bench_lookup_replay as lr
    from swiftkern import drafter_policy
    from swiftkern.forward_costs import ForwardCosts

    draw = random.Random(seed)
    out = [draw.randrange(4) for _ in range(80)]
    costs = {T: 1 + 0.15 * (T - 1) for T in range(1, K_MAX + 2)}
    plain = replay(out[:8], out, vote=True, costs=costs)
    monkeypatch.setattr(lr, "STEP_SPREAD", ((0.0, 1.0), (1.0, 1.0)))
    assert replay(out[:8], out, vote=True, costs=costs, noise=random.Random(1)) == plain
    monkeypatch.setattr(lr, "STEP_SPREAD", ((0.0, 3.0), (0.5, 3.0), (0.5, 1.0), (1.0, 1.0)))
    clipped = replay(out[:8], out, vote=True, costs=costs, noise=random.Random(1))
    monkeypatch.setattr(drafter_policy, "ForwardCosts", functools.partial(ForwardCosts, spike=float("inf")))
    unclipped = replay(out[:8], out, vote=True, costs=costs, noise=random.Random(1))
    assert unclipped["drafted"] > 1.5 * plain["drafted"] and unclipped["cost"] > 1.1 * plain["cost"]
    assert plain["cost"] < clipped["cost"] < unclipped["cost"]
