"""Prompt-lookup drafting rules replayed on recorded greedy outputs: accepted drafts and speedup
without timing noise.

    python -m bench --routine lookup_replay [--model smollm2] [--max-new-tokens 128] [--smoke]

Greedy self-spec emits exactly the ``ar`` tokens, so how a lookup rule and the drafter policy
would have done on a prompt follows from the ``ar`` output alone: each step drafts what the
rule proposes from prompt + output so far, the policy picks the draft length, the drafts that
equal the next output tokens are accepted. Each step is charged the verify cost of its length,
verify(T) / verify(1), measured in the same run (a forward of T tokens on a 200-token context,
median of --reps). Providers (the lookup rule):

    latest   the continuation of the latest earlier occurrence of the longest matched suffix
    vote     the continuation whose next token followed that suffix most often (latest of equals)
    oracle   vote's proposals, each step drafting exactly the tokens that will be accepted (when
             that pays): the ceiling of any policy over these proposals
    noisy    vote, its policy told each step's time as a timed run would tell it: the step's
             cost times a draw from the spread of the loop's plain steps on the CPU machine
             (``STEP_SPREAD``), mean over ``NOISY_SEEDS`` seeded replays; every step is still
             charged its cost. Against vote: what the policy loses to timing noise, without the
             noise of a timed run in the measurement

Columns: mean_accepted (drafts accepted per verify), share_lookup (steps that drafted),
replay_ratio_vs_ar ((N - 1) tokens / the summed step costs; ar pays 1 per token; prefill and
the loop's own overhead are not counted, so a timed run lands a few % lower), median_ms (the
recorded ar generation), verify_cost_T2_T4_T8 (the measured costs it used).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import encode, load_prompts, skip_model  # noqa: E402
from bench.bench_verify_cost import forward_steps  # noqa: E402
from swiftkern.drafter_policy import DrafterPolicy  # noqa: E402
from swiftkern.drafters import lookup_match  # noqa: E402

ROUTINE = "lookup_replay"
PRINT_KEYS = ("prompt_kind", "provider", "mean_accepted", "share_lookup", "replay_ratio_vs_ar")
RULES = {"latest": dict(vote=False), "vote": dict(vote=True), "oracle": dict(vote=True, oracle=True),
         "noisy": dict(vote=True, noisy=True)}
K_MAX = 25  # the Generator's default k_max
# a plain step's time over its median, at quantiles 0, 0.1, 0.5, 0.9, 0.99, 1: the speculative loop's
# 355 plain steps on the Intel Xeon (story prompt, 4 calls; 2026-11-28: p10 8.95, p50 9.74, p90
# 12.03, p99 29.77, max 46.07 ms)
STEP_SPREAD = ((0.0, 0.85), (0.1, 0.919), (0.5, 1.0), (0.9, 1.235), (0.99, 3.057), (1.0, 4.73))
NOISY_SEEDS = 8


def spread_draw(rng: random.Random) -> float:
    """One draw of STEP_SPREAD (its quantiles joined by straight lines)."""
    u = rng.random()
    for (q0, x0), (q1, x1) in zip(STEP_SPREAD, STEP_SPREAD[1:]):
        if u <= q1:
            return x0 + (x1 - x0) * (u - q0) / (q1 - q0)
    return STEP_SPREAD[-1][1]


def verify_costs(model, context_len: int, max_T: int, reps: int) -> dict[int, float]:
    """{T: median seconds of a forward of T tokens / that of one token} on a random context."""
    step = forward_steps(model, context_len, max_T)
    times = common.time_fn({T: step(T) for T in range(1, max_T + 1)}, str(model.device), warmup=1, reps=reps)
    return {T: t["median_ms"] / times[1]["median_ms"] for T, t in times.items()}


def _accepted(drafts: list[int], out: list[int], j: int) -> int:
    """How many leading drafts equal the output from position j on (greedy acceptance)."""
    a = 0
    while a < len(drafts) and drafts[a] == out[j + a]:
        a += 1
    return a


def replay(prompt: list[int], out: list[int], vote: bool, costs: dict[int, float], oracle: bool = False,
           noise: random.Random | None = None) -> dict:
    """One greedy generation of ``out`` replayed with lookup drafts (rule ``vote``) and the
    drafter policy over lookup / no draft (``oracle``: drafting exactly the tokens that will be
    accepted, when more tokens per cost than a plain step). ``noise``: the policy is also told
    each step's time as its cost times a ``spread_draw`` (the costs are still what each step is
    charged). -> steps, drafted, accepted, cost (in decode steps), drafting (steps that drafted)."""
    policy = DrafterPolicy(("lookup",), K_MAX)
    for T, c in costs.items():
        policy.record_verify(T, c)
    def step_cost(drafts: int) -> float:  # verify of the pending token + the drafts
        return costs[min(drafts + 1, max(costs))]

    j, steps, drafted, accepted, cost, drafting = 1, 0, 0, 0, 0.0, 0  # out[:j] committed
    while j < len(out):
        budget = min(K_MAX, len(out) - j)
        match = lookup_match(prompt + out[:j], budget, vote=vote)
        choice = policy.choose(0, len(match.tokens), budget, layer_skip=False, lookup_ngram=match.ngram)
        drafts = match.tokens[:choice.k] if choice.drafter == "lookup" else []
        if oracle:
            right = _accepted(match.tokens, out, j)
            drafts = match.tokens[:right] if right and (right + 1) / step_cost(right) > 1 else []
        a = _accepted(drafts, out, j)
        policy.observe(0, "lookup" if drafts else "none", len(drafts), a, lookup_ngram=match.ngram)
        steps, drafted, accepted, drafting = steps + 1, drafted + len(drafts), accepted + a, drafting + bool(drafts)
        cost += step_cost(len(drafts))
        if noise is not None:
            policy.record_verify(len(drafts) + 1, step_cost(len(drafts)) * spread_draw(noise))
        j += a + 1
    return dict(steps=steps, drafted=drafted, accepted=accepted, cost=cost, drafting=drafting)


def run(args) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.smoke:
        model, tok = skip_model(args)[0], None
        name = "tiny-llama"
    else:
        model, tok = swiftkern.load_model(args.model, device=args.device)
        name = args.model
    n = 8 if args.smoke else args.max_new_tokens
    costs = verify_costs(model, 20 if args.smoke else 200, K_MAX + 1, args.reps or (2 if args.smoke else 5))
    gen = swiftkern.Generator(model, tok, mode="ar")
    rows = []
    for prompt in load_prompts():
        ids = encode(tok, prompt["text"], model.vocab_size)
        t0 = time.perf_counter()
        out = gen.generate([ids], max_new_tokens=n, eos_token_id=[]).tokens[0]
        ms = (time.perf_counter() - t0) * 1e3
        timing = dict(median_ms=ms, p20_ms=ms, p80_ms=ms)
        for rule, how in RULES.items():
            if args.providers and rule not in args.providers:
                continue
            how = dict(how)
            noises = [random.Random(seed) for seed in range(NOISY_SEEDS)] if how.pop("noisy", False) else [None]
            runs = [replay(ids, out, costs=costs, noise=noise, **how) for noise in noises]
            r = {key: statistics.mean(x[key] for x in runs) for key in runs[0]}
            rows.append(common.row(
                ROUTINE, rule, args.device, model.dtype, f"B=1 T={len(ids)} N={n}", timing, model=name,
                prompt_kind=prompt["kind"], new_tokens=n, reps=1,
                mean_accepted=round(r["accepted"] / r["steps"], 3), share_lookup=round(r["drafting"] / r["steps"], 3),
                replay_ratio_vs_ar=round((n - 1) / r["cost"], 3),
                verify_cost_T2_T4_T8=f"{costs[2]:.3f}/{costs[4]:.3f}/{costs[8]:.3f}"))
    for rule in dict.fromkeys(r["provider"] for r in rows):
        mine = [r["replay_ratio_vs_ar"] for r in rows if r["provider"] == rule]
        print(f"  {rule:7s} replayed x{statistics.mean(mine):.3f} vs ar on average (min x{min(mine):.3f})")
    return rows


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
