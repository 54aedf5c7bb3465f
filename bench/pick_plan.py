"""Pick bi_matmul's plan for a dtype from a plan sweep's rows (``--routine bi_matmul`` on a GPU):

    python bench/pick_plan.py [--dtype float32] [--results bench/results] [--out /tmp/plan.txt]

Each candidate's SmolLM2 pass of M rows, as the verifier launches it: 30 layers x (q/k/v in one
grouped launch, o (q's shape), gate/up grouped, down) plus the LM head, summed from the rows of
the latest sweep (its hour) in that dtype, at M = 8 (a decode step at batch 8 with replay never),
32 (a window of 32) and 128 (a pass of four). The pick: the ``triton-<plan>`` with the least
geometric mean of its time over cuBLAS's (``reference``) across the sizes; one plan serves every
size, since a decode step and a verify pass must give a token the same bits. Prints the table
and writes ``[<dtype>:]<plan>`` (what SWIFTKERN_BI_MATMUL_PLAN takes) to --out; exits 1 when no
candidate has rows at every size.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import math
import os
import sys

MIX = {"qkv": 1, "q": 1, "gate+up": 1, "down": 1}  # launches a layer makes of each shape
LAYERS = 30
SIZES = (8, 32, 128)


def pass_times(rows: list[dict], dtype: str) -> dict[str, list[float]]:
    """{provider: [ms of one SmolLM2 pass at each of SIZES]} from the latest sweep's rows in dtype
    (providers missing a shape at some size left out)."""
    rows = [r for r in rows if r["dtype"] == dtype and r["shape"].startswith("smollm2 ")]
    if not rows:
        return {}
    last = max(r["date"] for r in rows)[:13]  # the latest run's hour
    ms = collections.defaultdict(dict)
    for r in rows:
        if r["date"].startswith(last):
            ms[r["provider"]][r["shape"]] = float(r["median_ms"])
    totals = {}
    for provider, times in ms.items():
        per_size = []
        for M in SIZES:
            got = {w: [v for s, v in times.items() if s.startswith(f"smollm2 {w} M={M} ")] for w in (*MIX, "lm_head")}
            if not all(got.values()):
                break
            per_size.append(LAYERS * sum(n * got[w][0] for w, n in MIX.items()) + got["lm_head"][0])
        if len(per_size) == len(SIZES):
            totals[provider] = per_size
    return totals


def ranked(totals: dict[str, list[float]]) -> list[tuple[float, str]]:
    """[(geometric mean of time / cuBLAS's over SIZES, plan name)], fastest first."""
    ref = totals.get("reference")
    if not ref:
        return []
    return sorted((math.prod(v / r for v, r in zip(t, ref)) ** (1 / len(ref)), p.removeprefix("triton-"))
                  for p, t in totals.items() if p.startswith("triton-"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"),
                    help="folder of bi_matmul-<device>.csv files")
    ap.add_argument("--out", default=None, help="write the pick here ([<dtype>:]<plan>)")
    args = ap.parse_args(argv)
    rows = []
    for path in sorted(glob.glob(os.path.join(args.results, "bi_matmul-*.csv"))):
        with open(path, newline="") as f:
            rows += csv.DictReader(f)
    totals = pass_times(rows, args.dtype)
    for provider, t in sorted(totals.items()):
        print(f"  {provider:42s} " + "  ".join(f"M={M} {v:8.3f} ms" for M, v in zip(SIZES, t)))
    picks = ranked(totals)
    for slowdown, plan in picks:
        print(f"  {plan:42s} {slowdown:6.2f}x cuBLAS's time (geometric mean over {SIZES} rows)")
    if not picks:
        print(f"no triton-<plan> and reference rows in {args.dtype} at all of {SIZES} rows: no plan picked",
              file=sys.stderr)
        return 1
    slowdown, plan = picks[0]
    pick = plan if args.dtype == "float32" else f"{args.dtype}:{plan}"
    print(f"fastest {args.dtype} plan: {plan} ({slowdown:.2f}x cuBLAS)")
    if args.out:
        with open(args.out, "w") as f:
            f.write(pick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
