"""A CPU forward in one C++ call (decoder_forward) against its ops called one by one from Python.

    python -m bench --routine forward_host [--model smollm2] [--reps 400] [--smoke]

Providers, timed interleaved (every call alternates with the others) on one cache of a
100-token context, batch 1, T = 1 (a decode step) and T = 4 (a verify pass of 3 drafts):

    <set>-one-call    the regular or invariant kernel set, LayerKernels.forward: the embedding,
                      the RoPE rows, decoder_stack, the cache advance and the final norm in one call
    <set>-op-by-op    the same set inside layer_kernels.op_by_op_forward(): those ops one by one
                      (the twin; the same bits, checked before timing)

Column ratio_vs_op_by_op: the op-by-op median / this provider's median, the same set and T, the
same run (above 1: the one-call forward is faster). Each call goes through ``SkipModel.forward``
and rolls the cache back, with the LM head, as a decode step does. Blocks of calls swung by
10-20 % on the 2-core AMD EPYC, so only interleaved single calls are compared. On a GPU
machine it still times the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from bench.bench_generate import skip_model  # noqa: E402
from swiftkern import layer_kernels  # noqa: E402

ROUTINE = "forward_host"
PRINT_KEYS = ("provider", "shape", "median_ms", "p20_ms", "p80_ms", "ratio_vs_op_by_op")


def run(args) -> list[dict]:
    args = copy.copy(args)
    args.device = "cpu"  # the one-call forward is the CPU's: timed there whatever --device says
    model, name = skip_model(args)
    if layer_kernels.LayerKernels.for_device("cpu").forward is None:
        raise SystemExit("forward_host: the C++ extension (decoder_forward) is not built here; run make setup")
    context = torch.randint(0, model.vocab_size, (1, 100 if not args.smoke else 12),
                            generator=torch.Generator().manual_seed(0))
    reps = args.reps or (3 if args.smoke else 400)
    rows = []
    for T in (1, 4):
        tokens = context[:, -T:]
        for kernel_set in ("regular", "invariant"):
            invariant = kernel_set == "invariant"
            with model.batch_invariant() if invariant else contextlib.nullcontext():
                cache = model.new_cache(1, context.shape[1] + T)
                model.forward(context, cache)
                base = list(cache.host_lengths)

                def step(op_by_op: bool):
                    def fn():
                        with layer_kernels.op_by_op_forward() if op_by_op else contextlib.nullcontext():
                            logits = model.forward(tokens, cache)
                        cache.rollback(base)
                        return logits
                    return fn
                fns = {f"{kernel_set}-one-call": step(False), f"{kernel_set}-op-by-op": step(True)}
                one, twin = (fn() for fn in fns.values())
                if not torch.equal(one, twin):
                    raise SystemExit(f"forward_host: {kernel_set} T={T}: the one-call forward's logits differ from "
                                     "the op-by-op ones (a bug: they must be the same bits)")
                times = common.time_fn(fns, "cpu", warmup=3, reps=reps)
            rows += common.rows_against(ROUTINE, times, f"{kernel_set}-op-by-op", "ratio_vs_op_by_op", model.dtype,
                                        f"B=1 T={T} ctx={context.shape[1]}", model=name)
    return rows


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
