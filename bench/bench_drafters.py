"""Drafters of self-spec vs plain decoding per prompt kind: ar, layer-skip, lookup, auto, SWIFT.

    python -m bench --routine drafters [--model smollm2] [--max-new-tokens 128] [--reps 2]
                    [--providers ar,layer-skip,lookup,auto,auto-cold,swift] [--batch 8] [--smoke]

Batch 1 (``--batch B``: one batch of B requests, the prompts cycled, prompt_kind "mixed"), greedy, exactly --max-new-tokens new tokens, the prompts of bench/prompts.jsonl
(summarize, code, story, math, factual) through the chat template; providers timed
interleaved per prompt:

    ar          swiftkern mode ar: the baseline of every ratio
    layer-skip  self-spec, layer-skip drafter, layer set searched while generating (auto ratio)
    lookup      self-spec, prompt-lookup drafter
    auto        self-spec defaults: drafter policy over lookup / layer-skip / none, layer set
                searched while generating
    auto-cold   auto with a new Generator for every call: the search starts over each time
    swift       SWIFT's published schedule: layer-skip drafter, skip ratio 0.45, search until
                its stop rules (no time cap), eps 0.8, k_max 25

Search time is included in every time. Each provider keeps one Generator for all prompts and
repetitions, so what its layer-set search found carries over from call to call (SWIFT optimizes
on a task's first inputs and drafts with the result on the rest): the warm-up call of the first
prompt pays the first search; ``auto-cold`` pays it in every call.

Columns: tok_s, ratio_vs_ar (same prompt, same run),
mean_accepted (drafts accepted per verify), share_lookup / share_layer_skip / share_none (of
row steps), search_s, tokens_equal_ar.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import encode, load_prompts, tiny_model  # noqa: E402

ROUTINE = "drafters"
PRINT_KEYS = ("prompt_kind", "provider", "tok_s", "ratio_vs_ar", "mean_accepted", "share_lookup", "share_layer_skip",
              "share_none", "search_s", "tokens_equal_ar")
PROVIDERS = {
    "ar": dict(mode="ar"),
    "layer-skip": dict(mode="self-spec", drafter="layer-skip", layer_set="auto"),
    "lookup": dict(mode="self-spec", drafter="lookup", layer_set=None),
    "auto": dict(mode="self-spec", drafter="auto", layer_set="auto"),
    "auto-cold": dict(mode="self-spec", drafter="auto", layer_set="auto"),
    "swift": dict(mode="self-spec", drafter="layer-skip", layer_set="auto", skip_ratio=0.45,
                  search_options=dict(time_fraction=1e9)),
}


def run(args) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.smoke:
        model, tok, name = swiftkern.SkipModel.from_hf(tiny_model()), None, "tiny-llama"
    else:
        model, tok = swiftkern.load_model(args.model, device=args.device)
        name = args.model
    n = 8 if args.smoke else args.max_new_tokens
    reps = args.reps or (1 if args.smoke else 2)
    wanted = [p for p in PROVIDERS if not args.providers or p in args.providers or p == "ar"]
    gens = {p: swiftkern.Generator(model, tok, **PROVIDERS[p]) for p in wanted}
    rows = []
    batch = getattr(args, "batch", None) or 1
    encoded = [(p["kind"], encode(tok, p["text"], model.vocab_size)) for p in load_prompts()]
    calls = [(kind, [ids]) for kind, ids in encoded] if batch == 1 else [
        ("mixed", [encoded[i % len(encoded)][1] for i in range(batch)])]
    for kind, prompts in calls:
        last = {}

        def call(p):
            def fn():
                gen = swiftkern.Generator(model, tok, **PROVIDERS[p]) if p.endswith("-cold") else gens[p]
                last[p] = gen.generate(prompts, max_new_tokens=n, eos_token_id=[])
            return fn

        times = common.time_fn({p: call(p) for p in gens}, args.device, warmup=1, reps=reps)
        ar_tok_s = batch * n / (times["ar"]["median_ms"] * 1e-3)
        for p, timing in times.items():
            out = last[p]
            s = out.stats
            steps = s.get("drafter_steps", {})
            total = sum(steps.values()) or 1
            tok_s = batch * n / (timing["median_ms"] * 1e-3)
            rows.append(common.row(
                ROUTINE, p, args.device, model.dtype, f"B={batch} T={max(map(len, prompts))} N={n}", timing,
                model=name, prompt_kind=kind, batch=batch, new_tokens=n, reps=reps, tok_s=round(tok_s, 2),
                ratio_vs_ar=round(tok_s / ar_tok_s, 3), mean_accepted=round(s.get("mean_accepted", 0.0), 3),
                share_lookup=round(steps.get("lookup", 0) / total, 3),
                share_layer_skip=round(steps.get("layer-skip", 0) / total, 3),
                share_none=round(steps.get("none", 0) / total, 3) if steps else 1.0,
                search_s=round(s.get("search_s", 0.0), 3), layer_set=s.get("searched_layer_set", ""),
                tokens_equal_ar=out.tokens == last["ar"].tokens))
    _summary(rows)
    return rows


def _summary(rows: list[dict]) -> None:
    print(f"\n{rows[0]['device']}, {rows[0]['model']}, {rows[0]['new_tokens']} new tokens, batch {rows[0]['batch']}, "
          "greedy:")
    for p in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == p]
        ratios = [r["ratio_vs_ar"] for r in mine]
        print(f"  {p:11s} x{statistics.mean(ratios):.2f} vs ar on average (min x{min(ratios):.2f}), accepted/verify "
              f"{statistics.mean(r['mean_accepted'] for r in mine):.2f}, all equal ar: "
              f"{all(r['tokens_equal_ar'] for r in mine)}")


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
