"""bench/pick_plan.py: the plan picked from a sweep's rows is the one with the least geometric
mean over cuBLAS's time of a SmolLM2 pass, computed here by hand on made-up rows."""

from __future__ import annotations

import csv
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import pick_plan  # noqa: E402

SHAPES = {"qkv": "N=576+192+192 K=576", "q": "N=576 K=576", "gate+up": "N=1536+1536 K=576",
          "down": "N=576 K=1536", "lm_head": "N=49152 K=576"}


def _rows(provider, ms_by_size, dtype="float32", date="2026-11-27T02:30:00", skip=()):
    """One row per SmolLM2 shape and size; every shape of size M costs ms_by_size[M]."""
    return [dict(date=date, provider=provider, dtype=dtype, shape=f"smollm2 {w} M={M} {SHAPES[w]}",
                 median_ms=str(ms)) for M, ms in ms_by_size.items() for w in SHAPES if (w, M) not in skip]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_pass_time_and_the_pick(tmp_path, capsys):
    ref = {8: 0.01, 32: 0.02, 128: 0.04}
    fast_small = {8: 0.005, 32: 0.02, 128: 0.08}   # geometric mean (0.5 * 1 * 2) ** (1/3) = 1.0
    steady = {8: 0.009, 32: 0.018, 128: 0.036}    # 0.9 at every size
    rows = (_rows("reference", ref) + _rows("triton-A", fast_small) + _rows("triton-B", steady)
            + _rows("triton-C", {8: 0.001, 32: 0.001, 128: 0.001}, skip={("down", 32)})  # a shape missing: out
            + _rows("triton-D", {8: 0.001, 32: 0.001, 128: 0.001}, dtype="bfloat16")  # another dtype: out
            + _rows("triton-E", {8: 0.001, 32: 0.001, 128: 0.001}, date="2026-11-26T10:00:00"))  # older sweep
    _write(tmp_path / "bi_matmul-gpu.csv", rows)
    totals = pick_plan.pass_times(rows, "float32")
    assert set(totals) == {"reference", "triton-A", "triton-B"}
    assert math.isclose(totals["reference"][0], 30 * 4 * 0.01 + 0.01)  # 30 layers x 4 launches + the head
    picks = pick_plan.ranked(totals)
    assert [p for _, p in picks] == ["B", "A"] and math.isclose(picks[0][0], 0.9) and math.isclose(picks[1][0], 1.0)
    out = tmp_path / "plan.txt"
    assert pick_plan.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text() == "B" and "fastest float32 plan: B (0.90x cuBLAS)" in capsys.readouterr().out


def test_bf16_pick_names_its_dtype_and_no_rows_fail(tmp_path):
    ref = {8: 0.01, 32: 0.02, 128: 0.04}
    _write(tmp_path / "bi_matmul-gpu.csv", _rows("reference", ref, dtype="bfloat16")
           + _rows("triton-X", {8: 0.02, 32: 0.02, 128: 0.02}, dtype="bfloat16"))
    out = tmp_path / "plan.txt"
    assert pick_plan.main(["--results", str(tmp_path), "--dtype", "bfloat16", "--out", str(out)]) == 0
    assert out.read_text() == "bfloat16:X"
    assert pick_plan.main(["--results", str(tmp_path), "--dtype", "float16"]) == 1
