"""`python -m bench --routine all --smoke` runs every routine (whoever added it) and each prints rows."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args, timeout=900):
    # one thread: the CI machine has 2 cores shared with other jobs, where OpenMP oversubscription
    # makes tiny smoke workloads ~10x slower; smoke numbers are not measurements
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_every_routine_prints_rows_in_smoke_mode():
    listed = _bench("--list")
    assert listed.returncode == 0, listed.stderr
    routines = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert "generate" in routines
    run = _bench("--routine", "all", "--smoke", "--no-csv")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    counts = dict(re.findall(r"^== (\S+): (\d+) rows", run.stdout, flags=re.M))
    missing = [r for r in routines if int(counts.get(r, 0)) == 0]
    assert not missing, f"routines without rows: {missing}\n{run.stdout[-3000:]}"


def test_smoke_rows_are_not_appended_to_the_results():
    results = os.path.join(ROOT, "bench", "results", "kv_compact.csv")
    before = read(results)
    run = _bench("--routine", "kv_compact", "--smoke", timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^== kv_compact: [1-9]\d* rows$", run.stdout, flags=re.M), run.stdout[-2000:]
    assert read(results) == before


def test_unknown_routine_exits_2():
    run = _bench("--routine", "no-such-routine", timeout=120)
    assert run.returncode == 2 and "unknown routine" in run.stderr


def test_counts_below_one_exit_2_and_write_nothing():
    """--reps 0 timed nothing and still appended rows to bench/results; it is refused now."""
    results = os.path.join(ROOT, "bench", "results", "silu_mul.csv")
    before = read(results)
    for flag in ("--reps", "--max-new-tokens", "--batch"):
        run = _bench("--routine", "silu_mul", flag, "0", timeout=120)
        assert run.returncode == 2 and f"argument {flag}: must be >= 1" in run.stderr, run.stderr[-500:]
    assert read(results) == before


def _write_csv(path, rows):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _generate_row(device, commit, provider, kind, tok_s, ratio):
    return dict(date="2026-11-22T01:00:00", commit=commit, device=device, machine="x86_64", torch="2.13",
                transformers="5.23", routine="generate", provider=provider, dtype="float32", shape="B=1",
                median_ms=1.0, p20_ms=1.0, p80_ms=1.0, model="smollm2", prompt_kind=kind, new_tokens=128, reps=3,
                tok_s=tok_s, ratio_vs_hf=ratio, mean_accepted=0.5, tokens_equal_hf=True)


def test_report_tables_take_each_machines_latest_run(tmp_path):
    sys.path.insert(0, ROOT)
    from bench import report

    results = tmp_path / "results"
    results.mkdir()
    rows = [_generate_row("cpu: A", "old1", "ar", "story", 11.0, 1.1),  # superseded by commit new1
            _generate_row("cpu: A", "new1", "hf-greedy", "story", 20.0, 1.0),
            _generate_row("cpu: A", "new1", "ar", "story", 40.0, 2.0),
            _generate_row("cpu: A", "new1", "ar", "math", 44.0, 2.2),
            _generate_row("NVIDIA H100", "gpu1", "ar", "story", 300.0, 3.0)]
    _write_csv(results / "generate.csv", rows)
    _write_csv(results / "rms_norm.csv", [dict(date="2026-11-22T02:00:00", commit="c3", device="cpu: A",
                                               machine="x86_64", provider="cpp", dtype="float32", shape="4x576",
                                               median_ms=0.0123, p20_ms=0.012, p80_ms=0.013, gb_s=3.5,
                                               tflop_s="", pct_of_ceiling=20.1)])
    body, notes = report.render(str(results), plot=False, repo_root=str(tmp_path))
    assert "**generate** on **cpu: A**" in body and "**generate** on **NVIDIA H100**" in body
    assert "`new1`" in body and "old1" not in body and "11.0" not in body
    ar_line = next(line for line in body.splitlines() if line.startswith("| ar | 40.0 | 44.0"))
    assert "2.10×" in ar_line  # median of 2.0 and 2.2
    assert "| cpp | float32 | 4x576 | 0.0123 |" in body and "**rms_norm** on **cpu: A**" in body
    assert len(notes) == 2
    # a later run in bfloat16 gets a table of its own; the float32 run stays
    _write_csv(results / "generate.csv", rows + [dict(_generate_row("cpu: A", "bf1", "ar", "story", 30.0, 2.5),
                                                      dtype="bfloat16")])
    body, _ = report.render(str(results), plot=False, repo_root=str(tmp_path))
    assert "`new1`" in body and "| ar | 40.0 | 44.0" in body
    assert "commit `bf1`" in body and "bfloat16" in body and "| ar | 30.0 |" in body

    readme = tmp_path / "RESULTS.md"
    readme.write_text(f"# title\n\n{report.BEGIN}\nstale\n{report.END}\n\nafter\n")
    args = ["--page", str(readme), "--results", str(results)]
    assert report.main([*args, "--check"]) == 1
    assert report.main([*args, "--no-plot"]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\n") and text.endswith(f"{report.END}\n\nafter\n") and "stale" not in text
    assert report.main([*args, "--check"]) == 0


def test_report_keeps_every_group_of_a_routine_and_every_model_apart(tmp_path):
    """determinism's throughput, windows and arrivals groups all time `ar` at the same shape: the
    report kept one row per (provider, shape), so later groups overwrote the throughput rows (24
    rows, 20 shown). Two models at one commit shared one table under one model's name."""
    sys.path.insert(0, ROOT)
    from bench import report

    results = tmp_path / "results"
    results.mkdir()
    base = dict(date="2026-11-22T01:00:00", commit="c1", device="cpu: A", machine="x86_64", dtype="float32",
                shape="B=8 N=64", median_ms=1.0, model="smollm2", batch=8)
    rows = [dict(base, provider="ar", group="throughput", tok_s=100.0),
            dict(base, provider="deterministic", group="throughput", tok_s=95.0),
            dict(base, provider="ar", group="arrivals", tok_s=111.0),
            dict(base, provider="ar", group="windows", tok_s=122.0),
            dict(base, provider="ar", group="throughput", tok_s=55.0, model="tiny")]
    _write_csv(results / "determinism.csv", rows)
    body, _ = report.render(str(results), plot=False, repo_root=str(tmp_path))
    for tok_s in ("100.000", "111.000", "122.000", "95.000", "55.000"):
        assert f"| {tok_s} |" in body, tok_s
    assert "| ar | throughput | 8 |" in body and "| ar | arrivals | 8 |" in body
    assert body.count("**determinism** on **cpu: A**") == 2 and "model tiny" in body and "model smollm2" in body
    png = results / "determinism.png"
    png.write_bytes(b"png")  # the plot beside the CSVs given, not bench/results'
    body, _ = report.render(str(results), plot=False, repo_root=str(tmp_path))
    assert "](results/determinism.png)" in body


def test_report_gives_each_generation_length_its_own_table(tmp_path):
    sys.path.insert(0, ROOT)
    from bench import report

    results = tmp_path / "results"
    results.mkdir()
    rows = [_generate_row("cpu: A", "c1", "ar", "story", 40.0, 2.0),
            dict(_generate_row("cpu: A", "c1", "ar", "story", 50.0, 2.5), new_tokens=256)]
    _write_csv(results / "generate.csv", rows)
    body, _ = report.render(str(results), plot=False, repo_root=str(tmp_path))
    tables = [line for line in body.splitlines() if line.startswith("| ar |")]
    assert len(tables) == 2 and "40.0" in tables[0] and "50.0" in tables[1]
    assert "128 new tokens per prompt" in body and "256 new tokens per prompt" in body


def test_gpu_rows_go_to_a_file_of_their_own(tmp_path, monkeypatch):
    sys.path.insert(0, ROOT)
    from bench import common

    assert common.results_name("greedy_accept", "cpu: Intel(R) Xeon(R) (2 threads)") == "greedy_accept"
    assert common.results_name("greedy_accept", "NVIDIA H100 80GB HBM3") == "greedy_accept-nvidia-h100-80gb-hbm3"
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    row = dict(device="NVIDIA H100 80GB HBM3", provider="cuda", median_ms=0.01)
    path = common.append_csv("greedy_accept", [row])
    assert os.path.basename(path) == "greedy_accept-nvidia-h100-80gb-hbm3.csv"
    cpu = common.append_csv("greedy_accept", [dict(row, device="cpu: A")])
    assert os.path.basename(cpu) == "greedy_accept.csv" and sorted(os.listdir(tmp_path)) == [
        "greedy_accept-nvidia-h100-80gb-hbm3.csv", "greedy_accept.csv"]


def test_rows_of_other_columns_go_to_the_next_file_with_theirs(tmp_path, monkeypatch):
    """A results file keeps its header: rows with other columns go to -v2, and rows with yet
    other columns to -v3 (not under -v2's header), each file's rows read back under its header."""
    import csv

    sys.path.insert(0, ROOT)
    from bench import common

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    rows = [dict(device="cpu: A", provider="ar", median_ms=1.0), dict(device="cpu: A", provider="ar", tok_s=5.0),
            dict(device="cpu: A", provider="ar", tok_s=6.0, captures=2)]
    paths = [common.append_csv("determinism", [r]) for r in rows + rows]
    assert [os.path.basename(p) for p in paths] == ["determinism.csv", "determinism-v2.csv", "determinism-v3.csv"] * 2
    for path, row in zip(paths, rows):
        with open(path, newline="") as f:
            assert list(csv.DictReader(f)) == [{k: str(v) for k, v in row.items()}] * 2


def test_vocab_split_sweep_providers_force_the_split_they_name(monkeypatch):
    """The GPU sweep providers (triton-pps<n>) run the Triton kernel with the split of an n
    programs-per-SM plan (here under the interpreter, on a stand-in SM count) and give the
    reference's tokens; on the CPU there are none."""
    import torch

    sys.path.insert(0, ROOT)
    from bench import bench_greedy_accept, bench_rejection_sample
    from bench.kernel_bench import SPLIT_SWEEP, vocab_split_sweep
    from swiftkern import reference
    from swiftkern.triton_kernels import greedy_accept as greedy_module
    from swiftkern.triton_kernels import launch, rejection_sample as rejection_module

    assert vocab_split_sweep("greedy_accept", "cpu", None) == {}
    monkeypatch.setattr(launch, "num_sms", lambda device_type, index=0: 3)
    B, K, V = 2, 3, 40 * 8192  # 40 vocabulary blocks of the interpreter's plan (8192 wide)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, V, generator=g)
    draft = logits[:, :K].argmax(-1)
    draft[1, 1] = (draft[1, 1] + 1) % V
    num_draft = torch.tensor([3, 3], dtype=torch.int32)
    probs = torch.softmax(logits * 3, -1)
    u_acc, u_smp = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    for bench, module, args, want in (
            (bench_greedy_accept, greedy_module, (draft, logits, num_draft),
             reference.greedy_accept(draft, logits, num_draft)),
            (bench_rejection_sample, rejection_module, (draft, probs[:, :K], probs, num_draft, u_acc, u_smp),
             reference.rejection_sample(draft, probs[:, :K], probs, num_draft, u_acc, u_smp))):
        seen = []
        real = module.acceptance_plan
        monkeypatch.setattr(module, "acceptance_plan", lambda *a, **k: seen.append(k.get("splits") or a[4]) or real(*a, **k))
        sweep = vocab_split_sweep(bench.ROUTINE, "cuda", bench.ROWS_AND_VOCAB)
        assert sorted(sweep) == sorted(f"triton-pps{n}" for n in SPLIT_SWEEP)
        for n in SPLIT_SWEEP:
            seen.clear()
            out = sweep[f"triton-pps{n}"](*args)
            rows = B * (K + 1) if bench is bench_greedy_accept else B
            # closed form of the plan: ceil(n * SMs / rows) splits, at most a quarter of the blocks
            assert seen == [min(-(-n * 3 // rows), 40 // 4)], (n, seen)
            assert all(torch.equal(o, w) for o, w in zip(out, want))


def test_a_named_commit_is_the_rows_commit(monkeypatch):
    """On the GPU machine the copy's .git is the last landed one: SWIFTKERN_BENCH_COMMIT names the
    commit that was copied; without it, HEAD's short hash (as git gives it)."""
    sys.path.insert(0, ROOT)
    from bench import common

    common.commit.cache_clear()
    monkeypatch.setenv("SWIFTKERN_BENCH_COMMIT", "abc1234")
    assert common.commit() == "abc1234"
    common.commit.cache_clear()
    monkeypatch.delenv("SWIFTKERN_BENCH_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip()
    assert common.commit().split("+")[0] == head
    common.commit.cache_clear()


def test_determinism_skips_the_groups_without_a_named_provider():
    """--providers deterministic keeps ar beside it but runs no group where ar would be alone
    (the windows group has no provider named 'deterministic')."""
    run = _bench("--routine", "determinism", "--smoke", "--no-csv", "--providers", "deterministic", timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = [line.split() for line in run.stdout.splitlines()
             if re.match(r"^(throughput|windows|arrivals|batch1) ", line)]
    groups = {cells[0] for cells in table}
    assert groups == {"throughput", "arrivals", "batch1"}, run.stdout[-2000:]
    assert {cells[1] for cells in table} == {"ar", "deterministic"}


def test_plot_without_matplotlib_is_refused_before_the_run():
    """--plot once ran the whole routine, appended its rows, then died on the matplotlib import."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed here: --plot runs (swiftkern's own setup does not install it)")
    results = os.path.join(ROOT, "bench", "results", "silu_mul.csv")
    before = read(results)
    run = _bench("--routine", "silu_mul", "--plot", timeout=120)
    assert run.returncode == 2 and "--plot needs matplotlib" in run.stderr, run.stderr[-500:]
    assert "== silu_mul" not in run.stdout and read(results) == before


def test_graph_warm_up_runs_until_a_call_captures_nothing():
    """bench determinism's warm-up with --cuda-graphs: at least two runs, then until one adds no
    capture and no first sight of a key (the timed reps must replay only), at most WARM_CALLS_MAX."""
    import sys
    sys.path.insert(0, ROOT)
    from bench.bench_determinism import WARM_CALLS_MAX, _until_no_capture

    class Runner:
        captures = first_sights = 0

    for new_captures, new_sights, runs in (([0, 0], [0, 0], 2), ([3, 2, 2, 0], [0] * 4, 4),
                                           ([1] * 9, [0] * 9, WARM_CALLS_MAX),
                                           ([2, 1, 0, 0], [2, 0, 1, 0], 4)):  # a key first met in run 3
        runner, plan, sights = Runner(), iter(new_captures + [0] * 9), iter(new_sights + [0] * 9)

        def fn():
            runner.captures += next(plan)
            runner.first_sights += next(sights)
        assert _until_no_capture(runner, fn) == runs


def test_an_interrupted_kernel_bench_keeps_the_cases_it_finished(monkeypatch):
    """A GPU lease's `timeout -s INT` cut a routine short and its rows were lost with it: the
    cases timed to completion are now returned (and written by the driver), none of the cut one."""
    import argparse

    import torch

    sys.path.insert(0, ROOT)
    from bench import common
    from bench.kernel_bench import Case, run_cases

    monkeypatch.setattr(common.KeepRowsOnInterrupt, "seen", False)  # restored after: other tests run on

    def interrupted():
        raise KeyboardInterrupt

    made = lambda: (torch.randn(3, 8), torch.randn(3, 8))  # noqa: E731  (gate, up)
    cases = [Case("first", made, bytes_moved=64.0), Case("cut", interrupted, bytes_moved=64.0),
             Case("never", made, bytes_moved=64.0)]
    args = argparse.Namespace(device="cpu", providers=None, reps=2, smoke=True, refcheck=False)
    rows = run_cases("silu_mul", "silu_mul", cases, args)
    assert rows and {r["shape"] for r in rows} == {"first"}
    assert {r["provider"] for r in rows} >= {"reference"}
    assert common.interrupted()  # a routine's later loops and the driver's later routines stop


def test_a_providers_typo_is_an_error_not_an_empty_run():
    """--providers tpyo ran nothing (0 rows, exit 0), or only the baseline, and in verify_cost
    raised a ValueError from parsing the name."""
    for routine in ("verify_cost", "cache_rows", "generate"):
        run = _bench("--routine", routine, "--providers", "tpyo", "--smoke", "--no-csv", timeout=300)
        assert run.returncode == 2 and "--providers tpyo: no rows from" in run.stderr, run.stderr[-2000:]
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize("plain, spec", [(True, True), (True, False), (False, False)])
def test_determinism_sets_the_other_way_beside_each_auto_provider(plain, spec):
    """Each of deterministic and self-spec+det (replay auto) has the other way beside it in its
    groups (det-replay or det-invariant; self-spec+det-replay or self-spec+det-invariant) and no
    two providers run alike: a GPU (True, False), the CPU with the C++ kernels (True, True), the
    CPU without them (False, False)."""
    from bench.bench_determinism import _setups

    def as_run(kw):  # replay auto written as the way it takes, independently of the bench's own rule
        if kw.get("mode") == "deterministic" and kw.get("replay", "auto") == "auto":
            kw = dict(kw, replay="never" if (spec if kw.get("drafter") == "self-spec" else plain) else "always")
        return sorted((k, repr(v)) for k, v in kw.items())

    for group, _, configs in _setups(False, "attn:1", 4, plain, spec):
        runs = [as_run(kw) for kw in configs.values()]
        assert all(runs.count(r) == 1 for r in runs), (group, list(configs))
        replays = [dict(r).get("replay") for r in runs]
        if "deterministic" in configs or "self-spec+det" in configs:
            assert "'never'" in replays and "'always'" in replays, (group, list(configs))
        if "deterministic" in configs:
            assert ("det-invariant" in configs) is (not plain)
        if "self-spec+det" in configs:
            assert ("self-spec+det-invariant" in configs) is (not spec)
            assert ("self-spec+det-portable" in configs) is (not spec)


def test_host_profile_lists_each_providers_own_functions(tmp_path):
    """--host-profile FILE: each provider's timed calls once more under cProfile, a section a
    provider and group; lookup's lists the verify step, ar's does not (it has none)."""
    out = tmp_path / "host.txt"
    run = _bench("--routine", "determinism", "--smoke", "--no-csv", "--providers", "lookup",
                 "--host-profile", str(out), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sections = dict(re.findall(r"^=== (batch1 B=1 \S+)\n(.*?)(?=^=== |\Z)", out.read_text(), re.S | re.M))
    assert set(sections) == {"batch1 B=1 ar", "batch1 B=1 lookup"}, list(sections)
    lookup, ar = sections["batch1 B=1 lookup"], sections["batch1 B=1 ar"]
    # the stack samples: what cProfile loses on CPython 3.12+ is there on any Python
    sampled = {k: v[v.index(" stack samples over "):] for k, v in sections.items()}
    assert "(decode_self_spec)" in sampled["batch1 B=1 lookup"] and "(decode_self_spec)" not in sampled["batch1 B=1 ar"]
    assert all("(generate)" in text for text in sampled.values())
    if cprofile_loses_inference_mode_frames():  # CPython 3.12.1, 3.13.0: said, not hidden
        assert all(text.startswith("NOTE: Generator.generate is missing") for text in sections.values())
        return
    assert "Ordered by: internal time" in lookup and "Ordered by: cumulative time" in lookup
    assert "verify_and_accept" in lookup.split(" stack samples over ")[0] and "verify_and_accept" not in ar
    assert "NOTE" not in lookup + ar


def cprofile_loses_inference_mode_frames() -> bool:
    """Whether this Python's cProfile drops a function that enters torch's inference mode."""
    import cProfile
    import pstats

    def enters():
        with torch.inference_mode():
            pass

    profile = cProfile.Profile()
    profile.runcall(enters)
    return not any(name == "enters" for _, _, name in pstats.Stats(profile).stats)
