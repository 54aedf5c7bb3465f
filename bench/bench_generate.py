"""swiftkern `ar` and `self-spec` vs HF `generate`, greedy, same prompts, one run.

    python bench/bench_generate.py [--model smollm2] [--max-new-tokens 128] [--repeats 3]
                                   [--skip-ratios 0.2,0.3,0.4,0.5] [--layer-set SPEC] [--lookup]

Runs the providers interleaved (A B C ... A B C) so drift on a noisy machine hits all alike,
reports medians of tokens/s, the ratio to HF generate and to swiftkern ar, the mean accepted
drafts per verify for self-spec, and whether the tokens equal HF's. Self-spec uses
``LayerSet.random(L, ratio, seed=0)`` per skip ratio (no search: that is the layer-set search
issue) and/or ``--layer-set``. Rows are appended to bench/results/generate.csv with the
machine, versions and commit.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from swiftkern.info import collect_info  # noqa: E402

PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(arr):",
    "Write a short note to a friend about a trip to the mountains.",
]
RESULTS = os.path.join(os.path.dirname(__file__), "results", "generate.csv")


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hf_run(hf, ids, n):
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t


def ours_run(gen, ids, n):
    t = time.perf_counter()
    out = gen.generate([ids[0].tolist()], max_new_tokens=n, eos_token_id=[])
    return out.tokens[0], time.perf_counter() - t, out.stats


def providers(model, tok, args):
    """name -> (Generator, layer set string or '')"""
    out = {"ar": (swiftkern.Generator(model, tok), "")}
    sets = [(f"self-spec r={r}", swiftkern.LayerSet.random(model.num_layers, float(r), seed=0))
            for r in filter(None, args.skip_ratios.split(","))]
    if args.layer_set:
        sets.append(("self-spec", swiftkern.LayerSet.parse(args.layer_set, model.num_layers)))
    for name, ls in sets:
        out[name] = (swiftkern.Generator(model, tok, mode="self-spec", layer_set=ls, eps=args.eps, k_max=args.k_max,
                                         adaptive_eps=args.adaptive_eps), str(ls))
    if args.lookup:
        out["lookup"] = (swiftkern.Generator(model, tok, mode="self-spec", drafter="lookup", k_max=args.k_max), "")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, a local HF folder or a .gguf file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and provider")
    ap.add_argument("--skip-ratios", default="0.2,0.3,0.4,0.5", help="self-spec with random layer sets ('' for none)")
    ap.add_argument("--layer-set", default=None, help="also run self-spec with this layer set")
    ap.add_argument("--eps", type=float, default=0.8, help="self-spec draft confidence threshold")
    ap.add_argument("--k-max", type=int, default=25, help="self-spec: most drafts per step")
    ap.add_argument("--adaptive-eps", action="store_true", help="self-spec: Self-SD's adaptive threshold")
    ap.add_argument("--lookup", action="store_true", help="also run self-spec with the prompt-lookup drafter")
    args = ap.parse_args(argv)

    model, tok = swiftkern.load_model(args.model)
    hf = model.hf_model
    hf.generation_config.eos_token_id = None  # fixed-length runs for every provider
    gens = providers(model, tok, args)
    info = collect_info()
    device = info["device"]
    n = args.max_new_tokens
    rows = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        hf_run(hf, ids, 8)  # warm-up
        for gen, _ in gens.values():
            ours_run(gen, ids, 8)
        times = {name: [] for name in ["hf", *gens]}
        tokens, stats = {}, {}
        for _ in range(args.repeats):
            tokens["hf"], t = hf_run(hf, ids, n)
            times["hf"].append(t)
            for name, (gen, _) in gens.items():
                tokens[name], t, stats[name] = ours_run(gen, ids, n)
                times[name].append(t)
        tps = {name: n / statistics.median(ts) for name, ts in times.items()}
        for name in gens:
            s = stats[name]
            rows.append(dict(
                date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(), device=device,
                machine=platform.machine(), torch=torch.__version__, transformers=info["transformers"],
                model=args.model, prompt=prompt[:40], provider=name, layer_set=gens[name][1], batch=1,
                new_tokens=n, repeats=args.repeats, hf_tok_s=round(tps["hf"], 2), tok_s=round(tps[name], 2),
                ratio_vs_hf=round(tps[name] / tps["hf"], 3), ratio_vs_ar=round(tps[name] / tps["ar"], 3),
                eps=args.eps if name.startswith("self-spec") else "", k_max=args.k_max if name != "ar" else "",
                mean_accepted=round(s.get("mean_accepted", 0.0), 3), tokens_equal_hf=tokens[name] == tokens["hf"]))
            r = rows[-1]
            print(f"{prompt[:30]:32s} {name:16s} {r['tok_s']:6.1f} tok/s | x{r['ratio_vs_hf']:.2f} vs HF "
                  f"({tps['hf']:.1f}) | x{r['ratio_vs_ar']:.2f} vs ar | accepted/verify {r['mean_accepted']:.2f} "
                  f"| equal HF: {r['tokens_equal_hf']}", flush=True)
    print(f"\ndevice: {device}; medians over prompts:")
    for name in gens:
        mine = [r for r in rows if r["provider"] == name]
        med = lambda key: statistics.median(r[key] for r in mine)
        print(f"  {name:16s} x{med('ratio_vs_hf'):.2f} vs HF generate, x{med('ratio_vs_ar'):.2f} vs ar, "
              f"accepted/verify {med('mean_accepted'):.2f}, all equal HF: {all(r['tokens_equal_hf'] for r in mine)}")
    new_file = not os.path.exists(RESULTS)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new_file:
            w.writeheader()
        w.writerows(rows)
    print(f"appended {len(rows)} rows to {os.path.relpath(RESULTS)}")


if __name__ == "__main__":
    main()
