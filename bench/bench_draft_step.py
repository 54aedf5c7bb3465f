"""Cost of one draft step (a T = 1 forward) vs a full decode step: layer skip x pruned head.

    python -m bench --routine draft_step [--model smollm2] [--reps 30] [--interleave-verify] [--smoke]

Providers, timed interleaved on one cache of a 200-token context, batch 1:

    full                 the full model, full LM head: a plain decode step (the baseline)
    skip-<r>             a layer set skipping round(r * 2L) sub-layers, full LM head
    skip-<r>+head        the same with the pruned draft head (DEFAULT_DRAFT_VOCAB frequent
                         tokens + the context's), what --drafter layer-skip runs
    <p>~verify           with --interleave-verify (and --smoke): provider p, each of its calls
                         followed by an untimed forward of 4 tokens (a verify pass), as in the
                         speculative loop, where the verify pass's weights and the draft's share
                         the cache

Column ratio_vs_full: median time / the full step's median, same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import skip_model  # noqa: E402
from swiftkern.draft_head import DEFAULT_DRAFT_VOCAB, DraftHead  # noqa: E402

ROUTINE = "draft_step"
PRINT_KEYS = ("provider", "median_ms", "p20_ms", "p80_ms", "ratio_vs_full", "head_rows")
RATIOS = (0.0, 0.2, 0.45)


def run(args) -> list[dict]:
    model, name = skip_model(args)
    context = torch.randint(0, model.vocab_size, (1, 200 if not args.smoke else 20), device=model.device)
    cache = model.new_cache(1, context.shape[1] + 4)  # room for the interleaved verify pass
    model.forward(context, cache)
    head = DraftHead.for_model(model, min(DEFAULT_DRAFT_VOCAB, model.vocab_size // 2), context[0].tolist())
    token, verify_tokens = context[:, -1:], context[:, -4:]
    base = list(cache.host_lengths)

    def step(layer_set, pruned):
        def fn():
            model.forward(token, cache, layer_set=layer_set, head=head.head if pruned else None).argmax(-1)
            cache.rollback(base)
        return fn

    def verify():
        model.forward(verify_tokens, cache)
        cache.rollback(base)

    fns = {"full": step(None, False)}
    for r in RATIOS:
        ls = swiftkern.LayerSet.random(model.num_layers, r, seed=0)
        if r > 0:
            fns[f"skip-{r}"] = step(ls, False)
        fns[f"skip-{r}+head"] = step(ls, True)
    if args.providers:
        fns = {k: v for k, v in fns.items() if k in args.providers or k == "full"}
    reps = args.reps or (3 if args.smoke else 30)
    times = common.time_fn(fns, args.device, warmup=2, reps=reps)
    if args.interleave_verify or args.smoke:
        times.update(common.time_fn({f"{p}~verify": fn for p, fn in fns.items()}, args.device, warmup=2, reps=reps,
                                    between=verify))

    def full(p):  # the baseline timed the same way as p
        return times["full~verify" if p.endswith("~verify") else "full"]["median_ms"]

    return [common.row(ROUTINE, p, args.device, model.dtype, f"B=1 T=1 ctx={context.shape[1]}", t, model=name,
                       ratio_vs_full=round(t["median_ms"] / full(p), 3),
                       head_rows=len(head) if "+head" in p else model.vocab_size)
            for p, t in times.items()]


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
