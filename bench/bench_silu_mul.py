"""silu_mul (the SwiGLU activation) vs the torch reference.

    python -m bench --routine silu_mul [--device cuda] [--providers reference,triton] [--dtype bfloat16]
                    [--refcheck] [--smoke] [--reps N]

Rows N (tokens) x intermediate I from decode (N = 1, 8) through verification (64) to prefill
(4096, 16384), I = 1536 (SmolLM2) and 11008 (7B-class). Bytes per call: read gate and up,
write the product.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, default_dtype, run_cases, standalone  # noqa: E402, F401

ROUTINE = "silu_mul"


def cases(args) -> list[Case]:
    dtype = default_dtype(args)
    if args.smoke:
        grid = [(1, 1536), (64, 1536)]
    elif args.device.startswith("cuda"):
        grid = [(n, i) for i in (1536, 11008) for n in (1, 8, 64, 4096, 16384)]
    else:
        grid = [(n, i) for i in (1536, 11008) for n in (1, 8, 64, 512)]
    out = []
    for n, i in grid:
        def make(n=n, i=i):
            g = torch.Generator().manual_seed(n + i)
            return tuple(torch.randn(n, i, generator=g).to(dtype).to(args.device) for _ in range(2))
        out.append(Case(f"N={n} I={i}", make, bytes_moved=3 * n * i * dtype.itemsize))
    return out


def run(args) -> list[dict]:
    return run_cases(ROUTINE, ROUTINE, cases(args), args)


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
