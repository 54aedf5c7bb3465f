"""kv_compact (move each row's kept cache entries into one contiguous run, all layers) vs the reference.

    python -m bench --routine kv_compact [--device cuda] [--providers reference,cpp,cuda,triton]
                    [--dtype bfloat16] [--refcheck] [--smoke] [--reps N]

The whole KVCache [L, B, H, S, D] of SmolLM2 (30 layers, 3 kv heads, D 64) and of Llama-3-8B
(32 layers, 8 kv heads, D 128); each row keeps up to M = 9 scattered entries (K + 1 of a
verification) and moves them to its own start position; on a GPU also one row of 32768 positions
keeping up to 12288 (past the 8192 entries one Triton program moves: its two-launch staged path).
Bytes per call: every kept entry read and written once, in both caches. --refcheck compares the
caches (the op returns nothing).
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, default_dtype, providers, run_cases, standalone  # noqa: E402, F401

ROUTINE = "kv_compact"
MODELS = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}


def cases(args) -> list[Case]:
    dtype = default_dtype(args)
    M = 9
    if args.smoke:
        grid = [("smollm2", 2, 64, M)]
    elif args.device.startswith("cuda"):
        grid = [(m, b, 2048, M) for m in MODELS for b in (1, 8, 32)]  # llama3-8b B=32: 4.3 GB a cache
        # a long context's compaction, past the 8192 entries one Triton program moves (its staged path)
        grid += [(m, 1, 32768, 12288) for m in MODELS]
    else:
        grid = [("smollm2", 1, 512, M), ("smollm2", 8, 512, M), ("llama3-8b", 8, 256, M)]
    out = []
    for model, B, S, M in grid:
        L, H, D = MODELS[model]
        g = torch.Generator().manual_seed(B * S)
        counts = torch.randint(1, M + 1, (B,), generator=g, dtype=torch.int32)

        def make(L=L, H=H, D=D, B=B, S=S, M=M, counts=counts):
            dev = args.device
            gd = torch.Generator(device=dev).manual_seed(B * S + 1)  # drawn where they live: GBs on a GPU
            k = torch.randn(L, B, H, S, D, generator=gd, device=dev, dtype=dtype)
            v = torch.randn(L, B, H, S, D, generator=gd, device=dev, dtype=dtype)
            g = torch.Generator().manual_seed(B * S + 2)
            starts = torch.randint(0, S - 2 * M, (B,), generator=g)
            src = starts.unsqueeze(1) + torch.sort(torch.randperm(2 * M, generator=g)[:M]).values  # scattered, ahead
            return k, v, src.to(dev), starts.to(dev), counts.to(dev)
        moved = 2 * 2 * L * H * int(counts.sum()) * D * dtype.itemsize
        out.append(Case(f"{model} B={B} S={S} M={M}", make, bytes_moved=moved))
    return out


def refcheck(cases_: list[Case], args) -> None:
    """Every provider leaves the same caches as the reference (a pure move: bit-exact)."""
    for case in cases_:
        k, v, *rest = case.make_args()
        want_k, want_v = k.clone(), v.clone()
        providers(ROUTINE, args.device)["reference"](want_k, want_v, *rest)
        for name, fn in providers(ROUTINE, args.device, wanted=args.providers).items():
            got_k, got_v = k.clone(), v.clone()
            fn(got_k, got_v, *rest)
            if not (torch.equal(got_k, want_k) and torch.equal(got_v, want_v)):
                raise AssertionError(f"kv_compact/{name}: caches differ from the reference on {case.shape}")
    print(f"refcheck: every provider's caches equal the reference's on {len(cases_)} cases")


def run(args) -> list[dict]:
    cs = cases(args)
    if args.refcheck:
        refcheck(cs, args)
        args = copy.copy(args)
        args.refcheck = False  # run_cases would compare the (empty) return values only
    return run_cases(ROUTINE, ROUTINE, cs, args)


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
