"""PNG plots of benchmark rows: ``plot_routine(name, rows) -> path`` (bench/results/<name>.png).

matplotlib is an optional extra (``pip install swiftkern[bench]``): it is imported only when a
plot is made, so the benchmarks and the tests run without it.
"""

from __future__ import annotations

import os

from bench.common import RESULTS_DIR

# preferred y value per routine kind: the first column present in the rows
METRICS = (("ratio_vs_hf", "speed vs HF generate greedy (x)"), ("replay_ratio_vs_ar", "replayed speed vs ar (x)"),
           ("gb_s", "GB/s"), ("tflop_s", "TFLOP/s"),
           ("median_ms", "median time (ms)"))


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def metric(rows: list[dict]) -> tuple[str, str]:
    """(column, axis label) the plot shows for these rows."""
    for key, label in METRICS:
        if any(_number(r.get(key)) is not None for r in rows):
            return key, label
    raise ValueError("rows have none of the columns " + ", ".join(k for k, _ in METRICS))


def plot_routine(name: str, rows: list[dict], path: str | None = None) -> str:
    """Grouped bars: one group per prompt kind (or shape), one bar per provider, y = the routine's
    metric (ratio to HF for generate, else GB/s, TFLOP/s or ms). The title names the machine and
    commit of the rows. -> the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, label = metric(rows)
    group_key = "prompt_kind" if any(r.get("prompt_kind") for r in rows) else "shape"
    lengths = {r.get("new_tokens", "") for r in rows}

    routine_groups = {r.get("group", "") for r in rows}

    def group(r):  # "story", or "story 256" when the rows hold several generation lengths; a
        # routine's own groups (determinism's throughput / windows / arrivals) name their bars too
        return (str(r.get(group_key, "")) + (f" {r.get('new_tokens')}" if len(lengths) > 1 else "")
                + (f" {r.get('group')}" if len(routine_groups) > 1 else ""))

    groups = list(dict.fromkeys(group(r) for r in rows))
    providers = list(dict.fromkeys(str(r["provider"]) for r in rows))
    value = {(group(r), str(r["provider"])): _number(r.get(key)) for r in rows}
    width = 0.8 / max(1, len(providers))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 0.3 * len(providers)), 4.2))
    for i, prov in enumerate(providers):
        xs = [g + (i - (len(providers) - 1) / 2) * width for g in range(len(groups))]
        ys = [value.get((grp, prov)) or 0.0 for grp in groups]
        ax.bar(xs, ys, width, label=prov)
    if key == "ratio_vs_hf":
        ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20 if max(len(g) for g in groups) > 10 else 0, fontsize=8)
    ax.set_ylabel(label)
    first = rows[0]
    ax.set_title(f"{name}: {first.get('device', '?')}, commit {first.get('commit', '?')}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = path or os.path.join(RESULTS_DIR, f"{name}.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
