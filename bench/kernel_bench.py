"""What the per-op kernel benchmarks share: the providers of an op on a device, the reference
check, and the timing loop that turns cases into rows.

Providers (those that can run on the device; ``--providers`` picks some):

    reference   swiftkern/reference.py, plain torch (the baseline of ``x_vs_reference``)
    cpp         torch.ops.swiftkern.<op> when swiftkern._C has a C++ CPU kernel for it (CPU)
    cuda        torch.ops.swiftkern.<op> when swiftkern._C has a CUDA kernel for it (GPU)
    triton      torch.ops.swiftkern_triton.<op> (GPU; the CPU interpreter is not timed)

plus any a routine adds (e.g. ``sdpa`` for attention). Every row carries the median time,
achieved GB/s and its % of the copy bandwidth measured in the same run, and
``x_vs_reference``: the reference's median over this provider's, same case, same run.

On a GPU, ``median_ms`` is the device time of one call, from replays of a CUDA graph of
``GRAPH_CALLS`` calls (``timed_as`` = graph; a provider that cannot be captured is timed eagerly,
``timed_as`` = eager), and ``eager_ms`` / ``x_vs_reference_eager`` are the same calls made one by
one from Python, launch and wrapper overhead included: at decode sizes the two differ by
10-100x, and both matter (a CUDA-graphed decode loop pays the first, a Python loop the second).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from bench import common
from swiftkern import ops, reference


PRINT_KEYS = ("provider", "dtype", "shape", "timed_as", "median_ms", "gb_s", "pct_of_ceiling", "x_vs_reference",
              "eager_ms", "x_vs_reference_eager")
GRAPH_CALLS = 10  # calls per captured CUDA graph when timing on a GPU


@dataclass
class Case:
    """One size of one op: a label, a builder of the arguments, the bytes one call must move."""
    shape: str
    make_args: Callable[[], tuple]
    bytes_moved: float
    flops: float | None = None
    extra: dict = field(default_factory=dict)


def default_dtype(args) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def providers(op: str, device: str, extra: dict | None = None, wanted=None) -> dict:
    """{name: fn(*args)} of the implementations of ``op`` that run on ``device``."""
    kernels = ops.backend_info()["kernels"].get(op, {"cpu": [], "cuda": []})  # ops outside the table: extra only
    dev = "cuda" if device.startswith("cuda") else "cpu"
    found = {"reference": getattr(reference, op)}
    if dev == "cpu" and "cpp" in kernels["cpu"]:
        found["cpp"] = getattr(torch.ops.swiftkern, op)
    if dev == "cuda" and "cuda" in kernels["cuda"]:
        found["cuda"] = getattr(torch.ops.swiftkern, op)
    if dev == "cuda" and "triton" in kernels["cuda"]:
        found["triton"] = getattr(torch.ops.swiftkern_triton, op)
    found.update(extra or {})
    if wanted:
        for name in wanted:
            if name not in found:
                print(f"note: provider {name} does not run {op} on {device} here (built: {kernels[dev]})")
        found = {k: v for k, v in found.items() if k in wanted or k == "reference"}
    return found


SPLIT_SWEEP = (4, 8, 16)  # programs per SM tried beside the plan's own (launch.VOCAB_PROGRAMS_PER_SM)


def vocab_split_sweep(op: str, device: str, rows_and_vocab: Callable) -> dict:
    """On a GPU, providers ``triton-pps<n>``: the Triton kernel of ``op`` with its vocabulary
    split forced to aim at n programs per SM instead of its plan's, so that one run shows which
    count streams the logits fastest. ``rows_and_vocab(*args)`` -> (reductions, V) of a call."""
    if not device.startswith("cuda"):
        return {}
    try:
        from swiftkern.triton_kernels import KERNELS
        from swiftkern.triton_kernels.launch import vocab_plan
    except ImportError as e:
        print(f"note: no triton-pps rows for {op}: swiftkern.triton_kernels cannot be imported ({e})")
        return {}
    launcher = KERNELS[op][0]

    def forced(n: int):
        def fn(*args):
            rows, vocab = rows_and_vocab(*args)
            plan = vocab_plan(rows, vocab, torch.device(device), programs_per_sm=n)
            return launcher(*args, num_splits=plan.splits)
        return fn
    return {f"triton-pps{n}": forced(n) for n in SPLIT_SWEEP}


def _as_list(out) -> list:
    if out is None:
        return []
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check(op: str, name: str, got, want, atol: float, rtol: float) -> None:
    """Raise AssertionError unless every output of a provider is close to the reference's."""
    for g, w in zip(_as_list(got), _as_list(want)):
        if g.is_floating_point():
            torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol,
                                       msg=lambda m: f"{op}/{name}: {m}")
        elif not torch.equal(g.cpu(), w.cpu()):
            raise AssertionError(f"{op}/{name}: integer outputs differ from the reference")


def run_cases(routine: str, op: str, cases: list[Case], args, extra: dict | None = None,
              tol: tuple[float, float] = (2e-2, 2e-2), split_sweep: Callable | None = None) -> list[dict]:
    """Time every provider on every case (interleaved) -> rows for bench/results/<routine>.csv.
    Prints the device's measured copy bandwidth first (the ceiling of memory-bound ops).
    ``split_sweep``: an op with a vocabulary split also gets ``vocab_split_sweep``'s providers,
    given its (reductions, V) of a call."""
    print(f"copy bandwidth on {common.device_name(args.device)}: {common.copy_bandwidth_gbs(args.device):.1f} GB/s")
    if split_sweep is not None:
        extra = dict(extra or {}, **vocab_split_sweep(op, args.device, split_sweep))
    fns_of = providers(op, args.device, extra, args.providers)
    reps = args.reps or (3 if args.smoke else 20)
    rows = []
    with common.KeepRowsOnInterrupt(rows, "cases"):
        for case in cases:
            inputs = case.make_args()
            if args.refcheck:
                want = fns_of["reference"](*[t.clone() if torch.is_tensor(t) else t for t in inputs])
                for name, fn in fns_of.items():
                    check(op, name, fn(*[t.clone() if torch.is_tensor(t) else t for t in inputs]), want, *tol)
            fns = {name: (lambda fn=fn: fn(*inputs)) for name, fn in fns_of.items()}
            warmup = 1 if args.smoke else 3
            times = common.time_fn(dict(fns), args.device, warmup=warmup, reps=reps)
            gpu = args.device.startswith("cuda")
            # on a GPU: the device time of each call from CUDA-graph replays (median_ms), and the
            # eager time with Python and launch overhead beside it (eager_ms)
            graphed = times
            if gpu:  # ops that cannot be captured (host syncs: the references of some) keep their eager times
                graphed = dict(times, **common.time_fn(dict(fns), args.device, warmup=0, reps=reps,
                                                       graph_calls=GRAPH_CALLS, graph_only=True))
            base, base_eager = graphed["reference"]["median_ms"], times["reference"]["median_ms"]
            dtype = next((t.dtype for t in inputs if torch.is_tensor(t) and t.is_floating_point()), None)
            case_rows = []  # added whole: an interrupt leaves no case half in rows
            for name, timing in graphed.items():
                eager = times[name]["median_ms"]
                on_gpu = dict(timed_as=timing["mode"], eager_ms=round(eager, 5),
                              x_vs_reference_eager=round(base_eager / eager, 2)) if gpu else {}
                case_rows.append(common.row(routine, name, args.device, dtype, case.shape, timing,
                                            bytes_moved=case.bytes_moved, flops=case.flops,
                                            x_vs_reference=round(base / timing["median_ms"], 2), reps=reps,
                                            **on_gpu, **case.extra))
            rows.extend(case_rows)
            del graphed, times, fns, inputs
            if gpu:
                torch.cuda.empty_cache()
    return rows


def standalone(routine: str) -> int:
    """``python bench/bench_<op>.py [options]``: the driver with --routine <op>."""
    import sys

    from bench.__main__ import main as driver

    return driver(["--routine", routine, *sys.argv[1:]])
