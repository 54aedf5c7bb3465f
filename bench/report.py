"""Regenerate bench/RESULTS.md (tables, and plots when matplotlib is installed) from the CSVs.

    python bench/report.py [--page bench/RESULTS.md] [--no-plot] [--check]

For every bench/results/<routine>.csv it takes each machine's latest run per dtype (the rows
of the last commit recorded for that device and dtype; the newest row per provider and
prompt/shape) and writes one table per (routine, machine, dtype) between
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in the page, each headed by the machine,
commit, date, versions and dtype its numbers come from. With matplotlib (``pip install
swiftkern[bench]``) it also redraws bench/results/<routine>.png (from a float32 run where there
is one); without it the plots already there are linked and a note says they were not redrawn.
``--check`` writes nothing and exits 1 when the page is out of date.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import RESULTS_DIR  # noqa: E402

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
PAGE = os.path.join(os.path.dirname(__file__), "RESULTS.md")


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def latest_runs(rows: list[dict], by: tuple[str, ...] = ("device",)) -> dict[tuple, list[dict]]:
    """{(device, ...): rows of that group's last commit, newest row per (provider, routine group,
    batch, prompt/shape, dtype, new tokens)}; ``by``: the columns whose values make a group (a
    generation routine's runs at batch 1 and at batch 8, or of two models, are different runs)."""
    out = {}
    for group in dict.fromkeys(tuple(r.get(k) or "" for k in by) for r in rows):
        mine = [r for r in rows if tuple(r.get(k) or "" for k in by) == group]
        last_commit = mine[-1]["commit"]
        newest = {}
        for r in mine:
            if r["commit"] == last_commit:
                key = (r["provider"], r.get("group", ""), r.get("batch", ""), r.get("prompt_kind") or r.get("shape", ""),
                       r.get("dtype", ""), r.get("new_tokens", ""))  # group: determinism's ar runs in several
                newest[key] = r
        out[group] = list(newest.values())
    return out


def _fmt(value, digits=2) -> str:
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return str(value) if value not in (None, "") else "–"


def _fmt_ms(value) -> str:
    """Milliseconds to 4 significant digits (GPU kernels take microseconds)."""
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return _fmt(value)


def heading(routine: str, rows: list[dict]) -> str:
    r = rows[-1]
    extra = f", model {r['model']}" if r.get("model") else ""
    dtypes = ", ".join(dict.fromkeys(x["dtype"] for x in rows if x.get("dtype")))
    extra += f", {dtypes}" if dtypes else ""
    return (f"**{routine}** on **{r['device']}** ({r.get('machine', '')}), commit `{r['commit']}`, "
            f"{r['date'][:10]}, torch {r.get('torch', '?')}, transformers {r.get('transformers', '?')}{extra}")


def generate_table(rows: list[dict]) -> list[str]:
    """Providers x prompt kinds (tok/s), then the medians over prompts, against the run's own
    baseline: HF greedy (routine generate) or swiftkern ar (routine drafters)."""
    base = "hf" if "ratio_vs_hf" in rows[0] else "ar"
    baseline = {"hf": "hf-greedy", "ar": "ar"}[base]
    kinds = list(dict.fromkeys(r["prompt_kind"] for r in rows))
    lines = ["| provider | " + " | ".join(f"{k} tok/s" for k in kinds)
             + f" | median × {baseline} | accepted / verify | tokens equal {base.upper() if base == 'hf' else base} |",
             "|---|" + "---|" * len(kinds) + "---|---|---|"]
    for prov in dict.fromkeys(r["provider"] for r in rows):
        mine = {r["prompt_kind"]: r for r in rows if r["provider"] == prov}
        cells = [_fmt(mine[k]["tok_s"], 1) if k in mine else "–" for k in kinds]
        ratio = statistics.median(float(r[f"ratio_vs_{base}"]) for r in mine.values())
        acc = statistics.median(float(r["mean_accepted"]) for r in mine.values())
        equal = all(str(r[f"tokens_equal_{base}"]) == "True" for r in mine.values())
        lines.append(f"| {prov} | " + " | ".join(cells) + f" | {ratio:.2f}× | {acc:.2f} | {'yes' if equal else 'no'} |")
    r = rows[0]
    lines.append("")
    lines.append(f"{r.get('new_tokens', '?')} new tokens per prompt, batch {r.get('batch') or 1}, greedy, median of "
                 f"{r.get('reps', '?')} interleaved runs; prompts: bench/prompts.jsonl"
                 + (" (cycled through the batch)." if (r.get("batch") or "1") != "1" else "."))
    return lines


def op_table(rows: list[dict]) -> list[str]:
    cols = [c for c in ("provider", "group", "batch", "dtype", "shape", "window", "replay", "timed_as", "median_ms", "p20_ms", "p80_ms", "gb_s",
                        "tflop_s", "pct_of_ceiling", "x_vs_reference", "x_vs_sort", "eager_ms", "x_vs_reference_eager", "tok_s",
                        "decode_tok_s",
                        "ratio_vs_ar", "ratio_vs_T1", "ratio_vs_full", "ratio_vs_copy", "x_vs_baseline", "rollback_fraction", "tokens_equal_ar",
                        "prompt_kind", "new_tokens", "mean_accepted", "share_lookup", "replay_ratio_vs_ar",
                        "verify_cost_T2_T4_T8")
            if any(r.get(c) not in (None, "") for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt_ms(r.get(c)) if c.endswith("_ms")
                                      else _fmt(r.get(c), 3) if c.endswith(("_s", "_fraction"))
                                      else str(r.get(c, "")) for c in cols) + " |")
    return lines


def plot_or_note(routine: str, rows: list[dict], plot: bool, results_dir: str = RESULTS_DIR) -> tuple[str | None, str]:
    """(png path relative to the repo or None, a note for stdout); the png beside the CSVs."""
    path = os.path.join(results_dir, f"{routine}.png")
    if plot:
        from bench.plot import plot_routine  # imports matplotlib only when drawing

        try:
            plot_routine(routine, rows, path)
            return path, f"drew {os.path.relpath(path)}"
        except ModuleNotFoundError as e:
            if e.name != "matplotlib":
                raise
            note = "matplotlib is not installed (pip install swiftkern[bench]); plots not redrawn"
    else:
        note = "plots not redrawn (--no-plot)"
    return (path if os.path.exists(path) else None), note


def render(results_dir: str = RESULTS_DIR, plot: bool = True, repo_root: str | None = None) -> tuple[str, list[str]]:
    """(the Markdown between the markers, notes)."""
    repo_root = repo_root or os.path.join(os.path.dirname(__file__), "..")
    parts, notes = [], []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.csv"))):
        routine = os.path.basename(path)[:-4]
        rows = read_csv(path)
        if not rows:
            continue
        generation = "prompt_kind" in rows[0] and "tok_s" in rows[0]  # per prompt: a table per length
        by_device = latest_runs(rows, ("device", "dtype", "batch", "model") if generation else ("device", "dtype", "model"))
        for run in by_device.values():
            parts += [heading(routine, run), ""]
            if generation:
                for n in dict.fromkeys(r.get("new_tokens", "") for r in run):
                    parts += generate_table([r for r in run if r.get("new_tokens", "") == n]) + [""]
            else:
                parts += op_table(run) + [""]
        groups = [g for g in by_device if g[1] in ("", "float32")] or list(by_device)  # float32 first
        plotted = groups[-1]
        if generation:  # the per-prompt run at batch 1, where there is one
            plotted = ([g for g in groups if g[2] in ("", "1")] or [plotted])[-1]
        png, note = plot_or_note(routine, by_device[plotted], plot, results_dir)
        notes.append(f"{routine}: {note}")
        if png:
            parts += [f"![{routine}]({os.path.relpath(png, repo_root)})", ""]
    if not parts:
        parts = ["No benchmark results yet: run `python -m bench --routine <name>`.", ""]
    intro = ("Generated by `python bench/report.py` from bench/results/*.csv (the latest run per machine and "
             "dtype); "
             "every table names the machine its numbers come from.")
    return "\n".join([intro, "", *parts]).rstrip() + "\n", notes


def replace_between_markers(text: str, body: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"report: the page needs exactly one {BEGIN} ... {END} pair")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", "--readme", dest="page", default=PAGE,
                    help="the Markdown file whose bench:begin/end block is rewritten (default bench/RESULTS.md)")
    ap.add_argument("--results", default=RESULTS_DIR)
    ap.add_argument("--no-plot", action="store_true", help="do not redraw the PNG plots")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date; write nothing")
    args = ap.parse_args(argv)
    body, notes = render(args.results, plot=not (args.no_plot or args.check),
                         repo_root=os.path.dirname(os.path.abspath(args.page)))
    with open(args.page) as f:
        old = f.read()
    new = replace_between_markers(old, body)
    for note in notes:
        print(note)
    if args.check:
        print(f"{os.path.relpath(args.page)} is " + ("up to date" if new == old else "out of date: run python bench/report.py"))
        return int(new != old)
    if new != old:
        with open(args.page, "w") as f:
            f.write(new)
    print(f"{'updated' if new != old else 'unchanged'}: {os.path.relpath(args.page)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
