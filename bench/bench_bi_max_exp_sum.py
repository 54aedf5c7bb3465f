"""bi_max_exp_sum (a row's max and the bi_exp_sum of the row minus it: the logprobs of mode
deterministic, ``bi_token_logprob``) vs the torch reference and vs the three calls it replaced.

    python -m bench --routine bi_max_exp_sum [--device cuda] [--providers reference,cpp,three-calls]
                    [--refcheck] [--smoke] [--reps N]

Rows N x vocabulary V: a decode step's logprob (N = 1), a verify step's (9), a batch's (32),
V = 49152 (SmolLM2) and 128256 (Llama-3); float32 (the op's dtype). Providers: reference
(``reference.bi_max_exp_sum``: torch max, subtraction and the elementwise-op tree sum), cpp
(the C++ kernel: one call, a single row's exps over every thread), three-calls (torch max,
torch subtraction, then ``ops.bi_exp_sum``: the C++ sum on the CPU, the Triton one on CUDA;
what ``bi_token_logprob`` ran before, and what it still runs on CUDA). All give the same bits.
Bytes per call: read the rows once.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_bi_exp_sum import cases  # noqa: E402  (the same rows and vocabularies)
from bench.kernel_bench import PRINT_KEYS, run_cases, standalone  # noqa: E402, F401
from swiftkern.ops.invariant import max_then_exp_sum  # noqa: E402

ROUTINE = "bi_max_exp_sum"


def run(args) -> list[dict]:
    return run_cases(ROUTINE, ROUTINE, cases(args), args, extra={"three-calls": max_then_exp_sum}, tol=(0.0, 0.0))


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
