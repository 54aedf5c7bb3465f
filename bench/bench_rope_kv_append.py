"""rope_kv_append (rotary q/k + the KV-cache write at each row's positions) vs the torch reference.

    python -m bench --routine rope_kv_append [--device cuda] [--providers reference,triton]
                    [--dtype bfloat16] [--refcheck] [--smoke] [--reps N]

Rows at different cache positions (the scatter path of the reference), heads as SmolLM2 (9/3,
D 64) and Llama-3-8B (32/8, D 128); decode (T = 1, B = 1, 8, 64), verification (B = 8, T = 9)
and prefill (B = 1, T = 4096). q, k, v are transposed views of [B, T, H, D] projections, as
the model passes them. Bytes per call: read q, k, v, cos, sin; write rotated q and k, v into
the cache.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, default_dtype, run_cases, standalone  # noqa: E402, F401

ROUTINE = "rope_kv_append"
HEADS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def cases(args) -> list[Case]:
    dtype = default_dtype(args)
    if args.smoke:
        grid = [("smollm2", 1, 1), ("smollm2", 4, 9)]
    elif args.device.startswith("cuda"):
        grid = [(m, b, t) for m in HEADS for b, t in ((1, 1), (8, 1), (64, 1), (8, 9), (1, 4096))]
    else:
        grid = [(m, b, t) for m in HEADS for b, t in ((1, 1), (8, 1), (8, 9), (1, 512))]
    out = []
    for model, B, T in grid:
        Hq, Hkv, D = HEADS[model]
        S = 8192 if T < 4096 else 2 * T

        def make(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, S=S):
            g = torch.Generator().manual_seed(B * T)
            dev = args.device
            q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(dev).transpose(1, 2)
            k = torch.randn(B, T, Hkv, D, generator=g).to(dtype).to(dev).transpose(1, 2)
            v = torch.randn(B, T, Hkv, D, generator=g).to(dtype).to(dev).transpose(1, 2)
            cos, sin = (torch.rand(B, T, D, generator=g).to(dtype).to(dev) for _ in range(2))
            k_cache = torch.zeros(B, Hkv, S, D, dtype=dtype, device=dev)
            v_cache = torch.zeros_like(k_cache)
            starts = torch.randint(0, S - T, (B, 1), generator=g)  # every row at its own position
            positions = (starts + torch.arange(T)).to(dev)
            return q, k, v, cos, sin, k_cache, v_cache, positions
        moved = (B * T * D * (2 * Hq + 4 * Hkv) + 2 * B * T * D) * dtype.itemsize
        out.append(Case(f"{model} B={B} T={T}", make, bytes_moved=moved))
    return out


def run(args) -> list[dict]:
    return run_cases(ROUTINE, ROUTINE, cases(args), args)


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
