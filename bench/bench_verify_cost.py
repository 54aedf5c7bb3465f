"""Cost of one full-model forward of T tokens (a verify pass of T - 1 drafts) vs a decode step.

    python -m bench --routine verify_cost [--model smollm2] [--reps 20] [--smoke] [--cuda-graphs]

What every drafter pays per step is k draft costs + verify(k + 1); speculation pays only
when verify(T) stays close to verify(1). Providers, on one cache holding a 200-token context,
batch 1, timed interleaved within their family (one weight format), one family after another:

    T<t>             a forward of t tokens with the kernels swiftkern picks (SWIFTKERN_BACKEND
                     as set; on the CPU the C++ skinny_linear kernel, reading packed weights
                     where the model has them: a GGUF model on an AVX2 or AVX-512 CPU)
    T<t>-float32     the same reading the float32 weights (only when the model has packed ones)
    T<t>-reference   the same with every op forced to the plain torch reference (MKL matmuls)
    T<t>-ungrouped   where the regular set groups its projections (CUDA: the Triton skinny
                     kernel's q/k/v, gate/up and SwiGLU + down launches), each one its own launch
                     (``layer_kernels.ungrouped_projections``; the same bits); with --cuda-graphs
                     also T<t>-ungrouped+graphs
    T<t>+graphs      with --cuda-graphs (a GPU): T<t> replayed from a CUDA graph (GraphRunner;
                     the warm-up calls are its first sight and its capture)
    T<t>-invariant   the same inside ``SkipModel.batch_invariant()`` (the batch-invariant set:
                     the C++ kernels on the CPU, the Triton ones with bi_matmul on CUDA: every
                     step of deterministic mode with ``replay="never"``), where one runs; with
                     --cuda-graphs also T<t>-invariant+graphs

Column ratio_vs_T1: median time / the same provider family's T = 1 median, same run. Each
invariant provider's time over the regular one's at the same T is printed after the rows (the
families are timed one after the other in one run, not interleaved), and each ungrouped
provider's over its grouped twin's (timed interleaved with it).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from bench.bench_generate import skip_model  # noqa: E402
from swiftkern import layer_kernels, ops  # noqa: E402
from swiftkern.layer_kernels import invariant_backend  # noqa: E402

ROUTINE = "verify_cost"
PRINT_KEYS = ("provider", "median_ms", "p20_ms", "p80_ms", "ratio_vs_T1")
TOKENS = (1, 2, 4, 8, 12, 16)


def _forced(backend: str | None, fn):
    """fn run under ops.set_backend(backend) (None: the backend in use)."""
    def run():
        old = ops.backends.current_backend()
        ops.set_backend(backend or old)
        try:
            fn()
        finally:
            ops.set_backend(old)
    return run


def _unpacked(model, fn):
    """fn run with the model reading its float32 weights (``SkipModel.packed`` set aside)."""
    def run():
        packed, model.packed = model.packed, None
        try:
            fn()
        finally:
            model.packed = packed
    return run


def _invariant(model, fn):
    """fn run inside ``model.batch_invariant()``."""
    def run():
        with model.batch_invariant():
            fn()
    return run


def _ungrouped(fn):
    """fn run inside ``layer_kernels.ungrouped_projections()``."""
    def run():
        with layer_kernels.ungrouped_projections():
            fn()
    return run


def _graphed(runner, fn):
    """fn run with the model's forwards going through ``runner`` (CUDA graphs)."""
    def run():
        with runner.model.cuda_graphs(runner):
            fn()
    return run


def forward_steps(model, context_len: int, max_T: int):
    """step(T) -> a callable running one forward of T tokens (batch 1) on a cache holding a
    random context of context_len tokens, then rolling the cache back: repeatable timings."""
    context = torch.randint(0, model.vocab_size, (1, context_len), device=model.device)
    cache = model.new_cache(1, context_len + max_T)
    model.forward(context, cache)
    base = list(cache.host_lengths)
    tokens = context[:, -max_T:]

    def step(T):
        def fn():
            model.forward(tokens[:, :T], cache)
            cache.rollback(base)
        return fn
    return step


def _tokens(provider: str) -> int:
    return int(provider[1:].split("-")[0].split("+")[0])


def _family(provider: str) -> str:
    """"", "-reference", "-float32", "-ungrouped", "+graphs", ...: the provider's name after T<t>."""
    return provider[len(f"T{_tokens(provider)}"):]


def _timed_with(provider: str) -> str:
    """The family a provider is timed with (interleaved): its own, the ungrouped providers their
    grouped twins' (one weight format; their ratio is the comparison)."""
    return _family(provider).replace("-ungrouped", "")


def run(args) -> list[dict]:
    model, name = skip_model(args)
    ctx = 20 if args.smoke else 200
    step = forward_steps(model, ctx, max(TOKENS))
    fns = {}
    for T in TOKENS:
        fns[f"T{T}"] = _forced(None, step(T))
        fns[f"T{T}-reference"] = _forced("reference", step(T))
        if model.packed is not None:
            fns[f"T{T}-float32"] = _unpacked(model, step(T))
    grouped = layer_kernels.LayerKernels.for_device(model.device.type).linears is not None
    if grouped:
        fns.update({f"T{T}-ungrouped": _ungrouped(step(T)) for T in TOKENS})
    invariant = invariant_backend(model.device.type, model.dtype) is not None
    if invariant:
        fns.update({f"T{T}-invariant": _invariant(model, step(T)) for T in TOKENS})
    if getattr(args, "cuda_graphs", False):
        from swiftkern.cuda_graphs import GraphRunner

        runner = GraphRunner(model)
        fns.update({f"T{T}+graphs": _graphed(runner, step(T)) for T in TOKENS})
        if grouped:
            ungrouped_runner = GraphRunner(model)  # its own graphs: a grouped capture is not replayed
            fns.update({f"T{T}-ungrouped+graphs": _graphed(ungrouped_runner, _ungrouped(step(T))) for T in TOKENS})
        if invariant:
            fns.update({f"T{T}-invariant+graphs": _graphed(runner, _invariant(model, step(T))) for T in TOKENS})
    if args.providers:
        families = {_family(p) for p in args.providers if p in fns}  # a name of no provider here selects nothing
        fns = {k: v for k, v in fns.items() if k in args.providers or (_tokens(k) == 1 and _family(k) in families)}
    # one family at a time (interleaved within it): a family reading the 538 MB of float32
    # weights would evict the packed family's 115 MB from a large L3 (480 MiB on the CPU
    # machine), where a generation reading only packed weights keeps them
    times = {}  # a provider's timing, one row each
    with common.KeepRowsOnInterrupt(times, "weight families"):
        for family in dict.fromkeys(map(_timed_with, fns)):
            group = {p: fn for p, fn in fns.items() if _timed_with(p) == family}
            times.update(common.time_fn(group, args.device, warmup=2, reps=args.reps or (3 if args.smoke else 20)))
    rows = []
    for p, t in times.items():
        T = _tokens(p)
        one = times["T1" + _family(p)]["median_ms"]
        backend = "reference" if p.endswith("-reference") else ops.backends.current_backend()
        rows.append(common.row(ROUTINE, p, args.device, model.dtype, f"B=1 T={T} ctx={ctx}", t, model=name,
                               backend=backend, ratio_vs_T1=round(t["median_ms"] / one, 3)))
        for variant in ("-invariant", "-ungrouped"):
            regular = times.get(p.replace(variant, "")) if variant in p else None
            if regular:
                print(f"  {p} / {p.replace(variant, '')}: {t['median_ms'] / regular['median_ms']:.3f}x the time")
    return rows


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
