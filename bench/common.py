"""What every benchmark shares: timing, the machine's measured ceilings, one CSV row format.

A benchmark routine is a module ``bench/bench_<name>.py`` with

    ROUTINE = "<name>"
    def run(args) -> list[dict]      # args: the driver's argparse namespace (see bench/__main__.py)

that times its providers with ``time_fn`` (interleaved, so drift hits all alike), builds rows
with ``row(...)`` and returns them; the driver appends them to ``bench/results/<name>.csv``.
Each file also runs alone: ``python bench/bench_<name>.py --smoke``.
"""

from __future__ import annotations

import csv
import datetime
import functools
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
# what a row's commit covers: the code that runs, not tests or results
CODE_PATHS = (":/swiftkern", ":/triton_kernels", ":/csrc", ":/bench", ":/setup.py", ":!/bench/results")


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """The short hash of HEAD, with "+dirty" when the code that runs (the package, kernels and
    benchmarks; not tests or results) differs from it: a copy of a working tree, as the GPU
    machine gets, can carry an older .git, and the hash alone would lie. There (the device tool's
    copy holds the last landed .git, not this session's commits), the command that starts the
    bench names the commit it copied in SWIFTKERN_BENCH_COMMIT, which this returns as given."""
    named = os.environ.get("SWIFTKERN_BENCH_COMMIT", "").strip()
    if named:
        return named
    here = os.path.dirname(__file__)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
                                 capture_output=True, text=True, cwd=here, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


class KeepRowsOnInterrupt:
    """``with KeepRowsOnInterrupt(rows, "cases"):`` around a routine's loop over its cases or
    groups: an interrupt (Ctrl-C, or ``timeout -s INT`` on a GPU lease) ends the loop, and the
    routine returns the rows of the items it finished, which the driver then writes. What was
    timed to completion is worth keeping when a device's minutes run out; an item cut short
    adds no row (its rows are appended only after all of its providers were timed). After one,
    ``interrupted()`` is true: a routine with several loops, and the driver, run no more."""

    seen = False

    def __init__(self, rows: list, what: str):
        self.rows, self.what = rows, what

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not KeyboardInterrupt:
            return False
        KeepRowsOnInterrupt.seen = True
        print(f"\ninterrupted: keeping the {len(self.rows)} rows of the {self.what} timed to completion",
              file=sys.stderr, flush=True)
        return True


def interrupted() -> bool:
    """True once a ``KeepRowsOnInterrupt`` loop was interrupted in this process."""
    return KeepRowsOnInterrupt.seen


@functools.lru_cache(maxsize=None)
def device_name(device: str) -> str:
    """'NVIDIA H200' or 'cpu: <model> (N threads)', with ', no AVX-512' on an x86 CPU without it
    (machines of one model name came with and without it, and the C++ kernels differ)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    from swiftkern.cpu_id import cpu_flags
    from swiftkern.info import cpu_name
    flags = cpu_flags()
    narrower = ", no AVX-512" if flags and "avx2" in flags and "avx512f" not in flags else ""
    return f"cpu: {cpu_name()} ({torch.get_num_threads()} threads{narrower})"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cuda_graphed(fn, calls: int):
    """fn called ``calls`` times, captured as one CUDA graph -> its replay (a callable), or None
    when fn cannot be captured (it syncs with the host, or runs CPU work the graph would drop)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compiles, allocator pools
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001 - any capture failure means: time it eagerly
        torch.cuda.synchronize()
        return None
    torch.cuda.synchronize()
    return graph.replay


def time_fn(fns: dict, device: str = "cpu", warmup: int = 3, reps: int = 20, min_time_s: float = 0.0,
            graph_calls: int = 0, graph_only: bool = False, between=None) -> dict:
    """Time each callable of {name: fn} interleaved -> {name: {"median_ms", "p20_ms", "p80_ms",
    "mode"}}.

    One warm-up pass per fn (warmup calls), then `reps` rounds calling every fn once per round
    in turn; on CUDA each call is bracketed by events, on the CPU by perf_counter after a sync.
    With min_time_s > 0, rounds go on until each fn has run that long in total. With
    graph_calls > 0 on CUDA, a fn that can be captured is timed as replays of a CUDA graph of
    graph_calls calls, divided by graph_calls: the device time of its kernels without the host's
    launch overhead ("mode": "graph"); the others are timed eagerly ("mode": "eager"), or left
    out of the result with graph_only (when the caller has their eager times already).
    ``between``: a callable run untimed after every timed call (what the loop does in between,
    e.g. a verify pass after a draft step)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    modes = {name: "eager" for name in fns}
    per_call = {}  # name -> calls per timed replay
    if graph_calls > 0 and device.startswith("cuda"):
        for name, fn in list(fns.items()):
            replay = cuda_graphed(fn, graph_calls)
            if replay is not None:
                fns[name], modes[name], per_call[name] = replay, "graph", graph_calls
            elif graph_only:
                del fns[name]
    times = {name: [] for name in fns}
    start = time.perf_counter()
    r = 0
    while r < reps or (min_time_s and time.perf_counter() - start < min_time_s * len(fns)):
        for name, fn in fns.items():
            if device.startswith("cuda"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1e3)
            if between is not None:
                between()
        r += 1
    out = {}
    for name, ts in times.items():
        ts = [t / per_call.get(name, 1) for t in ts]
        q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) >= 2 else [ts[0]] * 9
        out[name] = {"median_ms": statistics.median(ts), "p20_ms": q[1], "p80_ms": q[7], "mode": modes[name]}
    return out


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbs(device: str) -> float:
    """Measured device-memory copy bandwidth (read + write bytes / s) of a 256 MiB (GPU) or
    64 MiB (CPU) clone: the ceiling memory-bound ops are reported against."""
    n = (256 if device.startswith("cuda") else 64) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = time_fn({"copy": lambda: dst.copy_(src)}, device, warmup=2, reps=10)["copy"]["median_ms"]
    return 2 * n * 4 / (t * 1e-3) / 1e9


@functools.lru_cache(maxsize=None)
def matmul_tflops(device: str) -> float:
    """Measured dense matmul throughput: bf16 8192^3 on a GPU, fp32 1024^3 on the CPU."""
    n, dt = (8192, torch.bfloat16) if device.startswith("cuda") else (1024, torch.float32)
    a = torch.randn(n, n, dtype=dt, device=device)
    b = torch.randn(n, n, dtype=dt, device=device)
    t = time_fn({"mm": lambda: a @ b}, device, warmup=2, reps=5)["mm"]["median_ms"]
    return 2 * n**3 / (t * 1e-3) / 1e12


def provider_base(provider: str) -> str:
    """A row's provider as ``--providers`` names it: without the "+graphs" of CUDA-graph replays
    and the "@<plan>" of a run under SWIFTKERN_BI_MATMUL_PLAN."""
    return provider.split("@")[0].split("+graphs")[0]


def row(routine: str, provider: str, device: str, dtype, shape: str, timing: dict, *,
        bytes_moved: float | None = None, flops: float | None = None, **extra) -> dict:
    """One CSV row: when/where/what, median and p20/p80 in ms, achieved GB/s (bytes_moved) or
    TFLOP/s (flops) and its % of the measured ceiling, plus any extra columns."""
    from swiftkern.info import collect_info
    info = collect_info()
    ms = timing["median_ms"]
    r = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit(),
             device=device_name(device), machine=platform.machine(), torch=torch.__version__,
             triton=info["triton"], transformers=info["transformers"], routine=routine, provider=provider,
             dtype=str(dtype).replace("torch.", ""), shape=shape, median_ms=round(ms, 5),
             p20_ms=round(timing["p20_ms"], 5), p80_ms=round(timing["p80_ms"], 5), gb_s="", tflop_s="",
             pct_of_ceiling="")
    if bytes_moved is not None:
        r["gb_s"] = round(bytes_moved / (ms * 1e-3) / 1e9, 2)
        r["pct_of_ceiling"] = round(100 * r["gb_s"] / copy_bandwidth_gbs(device), 1)
    elif flops is not None:
        r["tflop_s"] = round(flops / (ms * 1e-3) / 1e12, 3)
        r["pct_of_ceiling"] = round(100 * r["tflop_s"] / matmul_tflops(device), 1)
    r.update(extra)
    return r


def rows_against(routine: str, times: dict, base: str, column: str, dtype, shape: str, **extra) -> list[dict]:
    """The CPU rows of one interleaved timing (``time_fn``'s result), each with ``column``: the
    ``base`` provider's median / its own (above 1: faster than ``base``), rounded to 4 places."""
    base_ms = times[base]["median_ms"]
    return [row(routine, p, "cpu", dtype, shape, t, **extra, **{column: round(base_ms / t["median_ms"], 4)})
            for p, t in times.items()]


def results_name(name: str, device: str) -> str:
    """CSV stem of a routine's rows: '<name>' on the CPU machine, '<name>-<gpu>' on a GPU
    (e.g. 'greedy_accept-nvidia-h100-80gb-hbm3'), so each machine's rows stay in their own file."""
    if device.startswith("cpu"):
        return name
    return f"{name}-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}"


def append_csv(name: str, rows: list[dict]) -> str:
    """Append rows to bench/results/<name>.csv, or <name>-<gpu>.csv for rows from a GPU
    (header from the first row when the file is new; a file with other columns is kept and the
    rows go to <stem>-v2.csv, or -v3, ...: the first with these columns or none yet) -> the path."""
    if not rows:
        return ""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    name = results_name(name, rows[0]["device"])
    fields = list(rows[0])
    for r in rows[1:]:
        fields += [k for k in r if k not in fields]
    version = 1
    path = os.path.join(RESULTS_DIR, f"{name}.csv")
    while os.path.exists(path) and _csv_header(path) != fields:
        version += 1
        path = os.path.join(RESULTS_DIR, f"{name}-v{version}.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def _csv_header(path: str) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def print_rows(rows: list[dict], keys=("provider", "dtype", "shape", "median_ms", "gb_s", "tflop_s",
                                       "pct_of_ceiling")) -> None:
    """A plain aligned table of the given columns."""
    if not rows:
        return
    keys = [k for k in keys if any(r.get(k) not in ("", None) for r in rows)]
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(str(r.get(k, "")).ljust(widths[k]) for k in keys), flush=True)
