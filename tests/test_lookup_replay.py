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
