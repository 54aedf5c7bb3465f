"""bi_exp_sum (the deterministic verifier's softmax denominator: the logprobs of mode
deterministic) vs the torch reference.

    python -m bench --routine bi_exp_sum [--device cuda] [--providers reference,triton,cpp]
                    [--refcheck] [--smoke] [--reps N]

Rows N x vocabulary V: a decode step's logprob (N = 1), a verify step's (9), a batch's (32),
a replay pass (16 x 33 = 528), V = 49152 (SmolLM2) and 128256 (Llama-3). float32 (the op's
dtype). Bytes per call: read the row once. On a GPU the reference is 44 torch launches a call
(536 at V = 128256) and the Triton kernel one (same bits); on the CPU the C++ kernel (cpp) beside the reference.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, run_cases, standalone  # noqa: E402, F401

ROUTINE = "bi_exp_sum"


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
    return run_cases(ROUTINE, ROUTINE, cases(args), args, tol=(0.0, 0.0))


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
