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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, run_cases, standalone  # noqa: E402, F401
from swiftkern import ops  # noqa: E402

ROUTINE = "bi_max_exp_sum"


def three_calls(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top = x.amax(dim=-1, keepdim=True)  # [N, 1]
    return top, ops.bi_exp_sum(x - top)


def cases(args) -> list[Case]:
    if args.smoke:
        grid = [(1, 1000), (9, 1000)]
    elif args.device.startswith("cuda"):
        grid = [(n, v) for v in (49152, 128256) for n in (1, 9, 32, 528)]
    else:
        grid = [(n, v) for v in (49152, 128256) for n in (1, 9, 32)]
    out = []
    for n, v in grid:
        def make(n=n, v=v):
            g = torch.Generator().manual_seed(n + v)
            return ((torch.randn(n, v, generator=g) * 4).to(args.device),)
        out.append(Case(f"N={n} V={v}", make, bytes_moved=n * v * 4))
    return out


def run(args) -> list[dict]:
    return run_cases(ROUTINE, ROUTINE, cases(args), args, extra={"three-calls": three_calls}, tol=(0.0, 0.0))


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
