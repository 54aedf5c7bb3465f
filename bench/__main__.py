"""The one benchmark driver: ``python -m bench --routine <name>[,<name>...] [options]``.

Routines are the modules bench/bench_<name>.py (see bench/common.py for their contract);
``python -m bench --list`` names them. Each routine's rows are printed and appended to
bench/results/<name>.csv (<name>-<gpu>.csv on a GPU) with device, versions and commit.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pkgutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from swiftkern.cli import positive_int  # noqa: E402


def routines() -> dict:
    """{routine name: module} for every bench/bench_*.py that defines ROUTINE and run()."""
    out = {}
    for m in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if m.name.startswith("bench_"):
            mod = importlib.import_module(f"bench.{m.name}")
            if hasattr(mod, "ROUTINE") and hasattr(mod, "run"):
                out[mod.ROUTINE] = mod
    return out


def parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routine", default=None,
                    help="comma-separated routine names (see --list), or 'all'")
    ap.add_argument("--list", action="store_true", help="list the routines and exit")
    ap.add_argument("--providers", default=None,
                    help="comma-separated providers to run (e.g. reference,cpp,triton,cuda); default: all available")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the routine's)")
    ap.add_argument("--refcheck", action="store_true",
                    help="check every provider's output against the reference before timing")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes and few repetitions (seconds; for CI); its numbers are not measurements, "
                         "so nothing is appended to bench/results")
    ap.add_argument("--reps", type=positive_int, default=None, help="timed repetitions per provider")
    ap.add_argument("--no-csv", action="store_true", help="print only, do not append to bench/results")
    ap.add_argument("--plot", action="store_true", help="also write bench/results/<routine>.png (matplotlib)")
    ap.add_argument("--model", default="smollm2", help="model for end-to-end routines")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128, help="end-to-end routines: tokens per prompt")
    ap.add_argument("--context-tokens", type=positive_int, default=None,
                    help="long_context: the document before each prompt, in tokens (default 2000)")
    ap.add_argument("--batch", type=positive_int, default=None, help="drafters: requests per batch (the prompts cycled; "
                    "default 1, each prompt on its own)")
    ap.add_argument("--interleave-verify", action="store_true",
                    help="draft_step: also time every provider with a verify pass run between its calls")
    ap.add_argument("--host-profile", default=None, metavar="FILE",
                    help="determinism: after timing, run each provider's timed calls once more under cProfile "
                         "and again (1 s at least) under a stack sampler, and write the top functions by own time "
                         "and by time inside them to FILE (where a token's host time goes; the sampler's view holds "
                         "on CPython 3.12+, whose cProfile loses frames around pybind11 methods)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="on a GPU: determinism runs every Generator with cuda_graphs=True; generate adds "
                         "<provider>+graphs next to each swiftkern provider; verify_cost adds T<t>+graphs; "
                         "verifier_pass adds <set>+graphs")
    return ap


def main(argv=None, prog: str = "python -m bench") -> int:
    import torch

    args = parser(prog).parse_args(argv)
    found = routines()
    if args.list or not args.routine:
        for name, mod in sorted(found.items()):
            print(f"{name:20s} {(mod.__doc__ or '').strip().splitlines()[0] if mod.__doc__ else ''}")
        return 0 if args.list else 2
    names = sorted(found) if args.routine == "all" else args.routine.split(",")
    unknown = [n for n in names if n not in found]
    if unknown:
        print(f"{prog}: unknown routine(s) {', '.join(unknown)}; known: {', '.join(sorted(found))}",
              file=sys.stderr)
        return 2
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from swiftkern.errors import SwiftkernError
    from swiftkern.loading import check_device

    try:
        check_device(args.device)
    except SwiftkernError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    args.providers = args.providers.split(",") if args.providers else None
    if args.cuda_graphs and not args.device.startswith("cuda"):
        print(f"{prog}: --cuda-graphs needs a CUDA device (--device cuda)", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # refused before the run, not after it
        print(f"{prog}: --plot needs matplotlib, which swiftkern does not install: pip install matplotlib, "
              "or leave --plot out", file=sys.stderr)
        return 2
    for name in names:
        print(f"== {name} on {common.device_name(args.device)}", flush=True)
        rows = found[name].run(args)
        if args.providers:  # a name no row carries: a typo, or a provider that does not run here
            ran = {common.provider_base(str(r.get("provider", ""))) for r in rows}
            missing = [p for p in args.providers if common.provider_base(p) not in ran]
            if missing:
                print(f"{prog}: --providers {','.join(missing)}: no rows from {name} (not one of its providers, or "
                      "not run on this machine; see the routine's docstring)", file=sys.stderr)
            if not rows or len(missing) == len(args.providers):
                return 2
        keys = getattr(found[name], "PRINT_KEYS", None)  # a routine may name the columns worth printing
        common.print_rows(rows, **({"keys": keys} if keys else {}))
        keep = rows and not args.no_csv and not args.smoke
        where = f", appended to {os.path.relpath(common.append_csv(name, rows))}" if keep else ""
        print(f"== {name}: {len(rows)} rows{where}", flush=True)
        if args.plot and rows:
            from bench import plot
            print(f"wrote {os.path.relpath(plot.plot_routine(common.results_name(name, rows[0]['device']), rows))}")
        if common.interrupted():  # the rows of what finished are written; the rest is not run
            print(f"{prog}: interrupted in {name}; the routines after it did not run", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
