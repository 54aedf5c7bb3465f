"""Sampling's contract, checked draw by draw: the token at absolute position p of a request
with seed s is the inverse-CDF draw of ``keyed_uniform(s, p)`` from HF's own filtered
distribution after the tokens before it. The chi-square tests check the first token's
distribution; this pins every later draw to its key too (a draw keyed on the position of the
token before it reuses that token's uniform: each marginal stays right, the draws correlate)."""

import pytest
import torch

from swiftkern import Generator
from swiftkern.sampling import keyed_uniform

from conftest import expected_probs, tiny_model

V = 64
PROMPTS = [[5, 9, 11], [3, 1, 4, 1, 5, 9, 2], [7]]
SEEDS = [11, 2024, 7]
KW = dict(temperature=0.8, top_k=20, top_p=0.9)
NEAR = 1e-5  # a uniform this close to a CDF step may fall either side of it under float rounding


def _drawable(probs: torch.Tensor, u: float) -> set[int]:
    """The tokens an inverse-CDF draw with uniform u from probs [V] (float64) can give once the
    rounding of the logits and of the sum moves each step of the CDF by up to NEAR."""
    cdf = probs.cumsum(0)
    lo, hi = ((u + d) * cdf[-1] for d in (-NEAR, NEAR))
    first = int(torch.searchsorted(cdf, lo.reshape(1), right=True))
    last = int(torch.searchsorted(cdf, hi.reshape(1), right=True))
    return {t for t in range(first, min(last, V - 1) + 1) if probs[t] > 0}


def _spread_model():
    """A tiny Llama whose next-token distribution is spread out: draws differ from greedy's."""
    hf = tiny_model("llama", vocab_size=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.1)
    return hf


def _next_probs(hf, context: list[int]) -> torch.Tensor:
    """HF's filtered next-token distribution after ``context``: float64 [V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0, -1]  # [V]
    return expected_probs(logits, **KW)


def _assert_keyed(hf, prompt: list[int], seed: int, tokens: list[int]) -> None:
    for j, token in enumerate(tokens):
        context = prompt + tokens[:j]
        u = keyed_uniform(seed, len(context))  # the new token's absolute position
        allowed = _drawable(_next_probs(hf, context), u)
        assert token in allowed, f"token {j} (position {len(context)}): drew {token}, the keyed draw gives {allowed}"


REPLAY = dict(mode="deterministic", replay="always", window=4, verify_batch=2)


@pytest.mark.parametrize("config,call", [
    (dict(mode="ar"), {}),
    (dict(mode="deterministic"), {}),
    (REPLAY, {}),
    # requests that skip verification keep the fast path's own draws: keyed alike
    (REPLAY, dict(deterministic=[False, True, False])),
], ids=["ar", "deterministic", "deterministic-replay", "deterministic-replay-unverified"])
def test_every_sampled_token_is_its_positions_keyed_draw(config, call):
    hf = _spread_model()
    out = Generator(hf, **config).generate(PROMPTS, max_new_tokens=10, do_sample=True, seed=SEEDS,
                                            eos_token_id=[], **KW, **call)
    assert all(len(t) == 10 for t in out.tokens)
    for prompt, seed, tokens in zip(PROMPTS, SEEDS, out.tokens):
        _assert_keyed(hf, prompt, seed, tokens)
    assert len({tuple(t[1:]) for t in out.tokens}) > 1  # not one fixed sequence


def test_the_check_tells_a_draw_keyed_one_position_early():
    """The negative control: tokens drawn with each uniform keyed on the position before are
    refused by the same check (so a passing test means the keys, not a loose tolerance)."""
    hf = _spread_model()
    prompt, seed, tokens = PROMPTS[1], SEEDS[1], []
    for _ in range(10):
        context = prompt + tokens
        probs = _next_probs(hf, context)
        u = keyed_uniform(seed, len(context) - 1)
        tokens.append(int(torch.searchsorted(probs.cumsum(0), (u * probs.sum()).reshape(1), right=True)))
    with pytest.raises(AssertionError, match="the keyed draw gives"):
        _assert_keyed(hf, prompt, seed, tokens)
