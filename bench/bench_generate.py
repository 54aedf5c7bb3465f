"""swiftkern `ar` vs HF `generate`, greedy, same prompts, tokens/s and their ratio in one run.

    python bench/bench_generate.py [--model smollm2] [--max-new-tokens 128] [--repeats 3]

Runs the two providers interleaved (ABAB...) so drift on a noisy machine hits both alike,
reports medians, checks that the tokens agree, and appends rows to
bench/results/generate.csv with the machine, versions and commit.
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
    return out.tokens[0], time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, a local HF folder or a .gguf file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and provider")
    args = ap.parse_args(argv)

    model, tok = swiftkern.load_model(args.model)
    gen = swiftkern.Generator(model, tok)
    hf = model.hf_model
    hf.generation_config.eos_token_id = None  # fixed-length runs for both providers
    info = collect_info()
    device = info["device"]
    rows = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        hf_tokens, _ = hf_run(hf, ids, 8)  # warm-up
        ours_run(gen, ids, 8)
        hf_t, ours_t = [], []
        for _ in range(args.repeats):
            hf_tokens, t = hf_run(hf, ids, args.max_new_tokens)
            hf_t.append(t)
            our_tokens, t = ours_run(gen, ids, args.max_new_tokens)
            ours_t.append(t)
        n = args.max_new_tokens
        hf_tps, our_tps = n / statistics.median(hf_t), n / statistics.median(ours_t)
        rows.append(dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(), device=device,
            machine=platform.machine(), torch=torch.__version__, transformers=info["transformers"],
            model=args.model, prompt=prompt[:40], batch=1, new_tokens=n, repeats=args.repeats,
            hf_tok_s=round(hf_tps, 2), swiftkern_ar_tok_s=round(our_tps, 2),
            ratio=round(our_tps / hf_tps, 3), tokens_equal=our_tokens == hf_tokens))
        print(f"{prompt[:40]:42s} HF {hf_tps:6.1f} tok/s | swiftkern ar {our_tps:6.1f} tok/s | "
              f"x{our_tps / hf_tps:.2f} | tokens equal: {our_tokens == hf_tokens}", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"device: {device}; median ratio swiftkern ar / HF generate: x{statistics.median(ratios):.2f}")
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
