"""One pass of the deterministic verifier (``verify_batch x window`` tokens) with each kernel set.

    python -m bench --routine verifier_pass [--model smollm2] [--reps 10] [--smoke] [--cuda-graphs]

Providers (``verifier_kernels``), timed interleaved on one cache holding a 200-token context
per row (with room past the pass, as in the middle of a generation), verify batch 4, window 32:

    portable   the batch_invariant torch compositions (tree_sum norms, bi_exp SwiGLU, blocked
               attention) around the bi_linear matmuls
    fused      one kernel per op (the C++ kernels on the CPU, Triton on CUDA)
    <set>+graphs  with --cuda-graphs (a GPU): the same pass replayed from a CUDA graph, as the
               deterministic loop runs it inside ``cuda_graphs`` (the LM head on the pass's
               logits stays eager there too): the pass's device time plus one replay's host time

Columns: ops_per_pass, the torch ops one pass dispatches here (views and other metadata-only
ops left out; a custom op counts once), and ops_as_on_cuda, the same count with the ops that
the CPU runs as one C++ kernel and CUDA as a torch composition counted as CUDA dispatches them
(portable: ``bi_exp`` is the reference's ~20 elementwise ops there, ``bi_matmul`` one Triton
launch): on a GPU each is a kernel launch, ~5-15 us of host time in eager mode.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from bench.bench_generate import skip_model  # noqa: E402
from swiftkern import ops, reference  # noqa: E402
from swiftkern.verifier import KEY_BLOCK, Slot, Verifier  # noqa: E402

ROUTINE = "verifier_pass"
PRINT_KEYS = ("provider", "median_ms", "p20_ms", "p80_ms", "ops_per_pass", "ops_as_on_cuda", "ratio_vs_portable")
KERNEL_SETS = ("portable", "fused")
METADATA_OPS = {"view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "t", "expand", "slice", "select",
                "unsqueeze", "squeeze", "alias", "detach", "permute", "as_strided", "unbind", "split", "empty",
                "empty_like", "empty_strided", "lift_fresh", "to"}


class _OpCount(TorchDispatchMode):
    """Counts the torch ops dispatched inside it, metadata-only ones left out."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket).split(".")[-1] not in METADATA_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _as_on_cuda():
    """The ops the CPU runs as one C++ kernel and CUDA as torch ops (or one Triton launch),
    patched to what CUDA dispatches, for counting only."""
    def one_matmul(a, b):
        return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(a.dtype)
    return mock.patch.multiple(ops, bi_exp=reference.bi_exp, bi_exp_sum=reference.bi_exp_sum, bi_matmul=one_matmul)


def verify_pass(verifier: Verifier, model, context: int):
    """-> a callable running one full verify pass over verify_batch rows of ``context`` cached
    tokens each (the cache is reset after it: every call does the same work)."""
    R, W = verifier.verify_batch, verifier.window
    cache = model.new_cache(R, context + W + KEY_BLOCK)  # room past the pass, as mid-generation
    verifier.prefill(cache, [[(7 * r + 3 * j) % (model.vocab_size - 3) + 3 for j in range(context)] for r in range(R)])
    base = list(cache.host_lengths)
    slots = [Slot(r, context, [(11 * r + j) % (model.vocab_size - 3) + 3 for j in range(W)], list(range(W)))
             for r in range(R)]

    def fn():
        verifier.forward(cache, slots)
        cache.set_lengths(base)
    return fn


def _graphed(runner, fn):
    """fn with the model's passes going through ``runner`` (CUDA graphs)."""
    def run():
        with runner.model.cuda_graphs(runner):
            fn()
    return run


def _count(fn) -> int:
    counter = _OpCount()
    with counter:
        fn()
    return counter.count


def run(args) -> list[dict]:
    model, name = skip_model(args)
    context, R, W = (20, 2, 8) if args.smoke else (200, 4, 32)
    fns, counts, names = {}, {}, {}
    for kernels in KERNEL_SETS:
        if args.providers and kernels not in args.providers:
            continue
        verifier = Verifier(model, W, R, kernels=kernels)
        names[kernels] = verifier.kernels.name
        fn = verify_pass(verifier, model, context)
        fn()
        here = _count(fn)
        cuda_like = here
        if model.device.type == "cpu":
            with _as_on_cuda():
                cuda_like = _count(fn)
        fns[kernels], counts[kernels] = fn, (here, cuda_like)
        if getattr(args, "cuda_graphs", False):
            from swiftkern.cuda_graphs import GraphRunner

            graphed = _graphed(GraphRunner(model), fn)
            graphed()  # the first sight runs eagerly, the second captures: the timed calls replay
            graphed()
            fns[kernels + "+graphs"], counts[kernels + "+graphs"] = graphed, (here, cuda_like)
            names[kernels + "+graphs"] = names[kernels]
    times = common.time_fn(fns, args.device, warmup=1, reps=args.reps or (2 if args.smoke else 10))
    base = times.get("portable", {}).get("median_ms")
    return [common.row(ROUTINE, p, args.device, model.dtype, f"R={R} W={W} ctx={context}", t, model=name,
                       kernel_set=names[p], ops_per_pass=counts[p][0], ops_as_on_cuda=counts[p][1],
                       ratio_vs_portable=round(t["median_ms"] / base, 3) if base else "")
            for p, t in times.items()]


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
