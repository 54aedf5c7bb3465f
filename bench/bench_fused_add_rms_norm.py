"""fused_add_rms_norm (residual add + RMSNorm, one pass) vs the torch reference (add, then norm).

    python -m bench --routine fused_add_rms_norm [--device cuda] [--providers reference,triton]
                    [--dtype bfloat16] [--refcheck] [--smoke] [--reps N]

Rows N (tokens) x hidden H from decode (N = 1, 8) through verification (64) to prefill (4096,
32768), H = 576 (SmolLM2) and 4096 (7B-class). Bytes per call: read x, residual, weight; write
normed and the new residual.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, default_dtype, run_cases, standalone  # noqa: E402, F401

ROUTINE = "fused_add_rms_norm"


def cases(args) -> list[Case]:
    dtype = default_dtype(args)
    size = dtype.itemsize
    if args.smoke:
        grid = [(1, 576), (64, 576)]
    elif args.device.startswith("cuda"):
        grid = [(n, h) for h in (576, 4096) for n in (1, 8, 64, 4096, 32768)]
    else:
        grid = [(n, h) for h in (576, 4096) for n in (1, 8, 64, 1024)]
    out = []
    for n, h in grid:
        def make(n=n, h=h):
            g = torch.Generator().manual_seed(n + h)
            x, res = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
            w = 1 + torch.randn(h, generator=g) / 4
            return (x.to(dtype).to(args.device), res.to(dtype).to(args.device), w.to(dtype).to(args.device), 1e-5)
        out.append(Case(f"N={n} H={h}", make, bytes_moved=(4 * n * h + h) * size))
    return out


def run(args) -> list[dict]:
    return run_cases(ROUTINE, ROUTINE, cases(args), args)


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
