"""A CPU speculative step's tail in one C++ call (greedy_verify) against its torch ops.

    python -m bench --routine step_tail [--model smollm2] [--reps 400] [--smoke]

Each timed call is one whole greedy verify step, ``verify_step.verify_and_accept`` on a cache of a
100-token context, batch 1, 3 drafts (4 tokens), then the cache rolled back: the tail after the
forward runs with its code evicted by the weights the forward streamed, as in decoding (alone and
warm its ops take a few microseconds each). Providers, interleaved call by call:

    one-call    the CPU's way: the forward, then ``greedy_verify`` (csrc/greedy_verify_cpu.cpp): the
                acceptance, the next pending tokens, the host rows and (with logprobs) the kept
                tokens' log-probabilities in one call
    torch-ops   the same step with ``ops.greedy_verify_here`` off (a GPU's way): greedy_accept, a
                conversion, a gather, a concat, the read, then (with logprobs) ``bi_token_logprob``
                of the kept tokens, as the loop's commit asks for them (``Verified.logprobs``)

Shapes: ``accepted=1`` (the first draft kept, a corrected token) or ``accepted=3`` (all kept, a bonus
token), ``logprobs`` on (mode deterministic) or off. The two ways' rows, counts and logprobs are
checked equal before timing. Column ratio_vs_torch_ops: torch-ops' median / this provider's, the
same shape and run (above 1: the one call is faster). On a GPU machine it still times the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from bench.bench_generate import skip_model  # noqa: E402
from swiftkern import ops, verify_step  # noqa: E402
from swiftkern.sampling import SamplingParams  # noqa: E402

ROUTINE = "step_tail"
PRINT_KEYS = ("provider", "shape", "median_ms", "p20_ms", "p80_ms", "ratio_vs_torch_ops")
DRAFTS = 3


def _greedy_continuation(model, cache, pending: int, n: int) -> list[int]:
    """The model's next n greedy tokens after ``pending`` (the cache rolled back after)."""
    base, out, token = list(cache.host_lengths), [], pending
    for _ in range(n):
        token = int(model.forward(torch.tensor([[token]]), cache)[0, -1].argmax())
        out.append(token)
    cache.rollback(base)
    return out


def run(args) -> list[dict]:
    args = copy.copy(args)
    args.device = "cpu"  # greedy_verify is the CPU's: timed there whatever --device says
    if ops.greedy_verify_here("cpu") is None:
        raise SystemExit("step_tail: the C++ extension (greedy_verify) is not built here; run make setup")
    model, name = skip_model(args)
    context = torch.randint(0, model.vocab_size, (1, 100 if not args.smoke else 12),
                            generator=torch.Generator().manual_seed(0))
    reps = args.reps or (3 if args.smoke else 400)
    cache = model.new_cache(1, context.shape[1] + DRAFTS + 2)
    pending = int(model.forward(context, cache)[0, -1].argmax())
    base = list(cache.host_lengths)
    chain = _greedy_continuation(model, cache, pending, DRAFTS)
    wrong = [(t + 1) % model.vocab_size for t in chain]
    params, rows = SamplingParams(), []
    for accepted, drafts in ((1, chain[:1] + wrong[1:]), (DRAFTS, chain)):
        for logprobs in (False, True):
            def step(torch_ops: bool):
                def fn():
                    with mock.patch.object(ops, "greedy_verify_here", lambda device_type: None) if torch_ops \
                            else contextlib.nullcontext():
                        v = verify_step.verify_and_accept(model, cache, torch.tensor([pending]), [drafts], None,
                                                          params, [0], logprobs=logprobs)
                        if logprobs:  # what the loop's commit asks for: computed there on the torch path
                            v.logprobs(0, v.num_accepted[0] + 1)
                    cache.rollback(base)
                    return v
                return fn
            fns = {"one-call": step(False), "torch-ops": step(True)}
            one, twin = (fn() for fn in fns.values())
            kept = one.num_accepted[0] + 1
            if (one.rows, one.num_accepted) != (twin.rows, twin.num_accepted) or one.num_accepted[0] != accepted or (
                    logprobs and not torch.equal(one.logprobs(0, kept), twin.logprobs(0, kept))):
                raise SystemExit(f"step_tail: accepted={accepted} logprobs={logprobs}: the one call's result differs "
                                 "from the torch ops' (a bug: they must be the same)")
            times = common.time_fn(fns, "cpu", warmup=3, reps=reps)
            shape = f"B=1 K={DRAFTS} accepted={accepted} logprobs={'on' if logprobs else 'off'} ctx={context.shape[1]}"
            rows += common.rows_against(ROUTINE, times, "torch-ops", "ratio_vs_torch_ops", model.dtype, shape,
                                        model=name)
    return rows


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
