"""verify_attention (T new tokens per row against a cache with per-row lengths) vs torch.

    python -m bench --routine verify_attention [--device cuda] [--providers reference,sdpa,triton]
                    [--dtype bfloat16] [--refcheck] [--smoke] [--reps N]

Providers besides the standard ones: ``sdpa``, torch.nn.functional.scaled_dot_product_attention
on the same padded shapes (q [B, Hq, T, D] against the cache sliced to the longest row, a
boolean mask for the per-row lengths and the causal chunk, enable_gqa) — the bar the Triton
kernel must meet; on the CPU ``cpp-invariant``, the C++ ``verify_attention_invariant`` (every
query in the order decode uses: the batch-invariant set's kernel, deterministic mode's prefill).
Cases: decode (T = 1) and verification (T = 9) at batch 1, 8 and 32 with rows of unequal length
around L = 512, 4096 and 32768 keys; heads as SmolLM2 (9/3, D 64) and Llama-3-8B (32/8, D 128);
on the CPU also a 2048-token prompt prefilled (T = L = 2048). Bytes
per call: the keys and values each row reads plus q and the output; FLOPs 4 * Hq * D per
(query, key) pair a query sees (causal within the T new tokens).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, default_dtype, run_cases, standalone  # noqa: E402, F401
from swiftkern import ops, reference  # noqa: E402

ROUTINE = "verify_attention"
HEADS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def sdpa(q, k_cache, v_cache, cache_lens, scale):
    """torch SDPA on the padded shapes: keys up to the longest row, a [B, 1, T, L] mask."""
    T = q.shape[2]
    max_len = int(cache_lens.max())
    mask = reference.attention_mask(cache_lens, T, max_len).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k_cache[:, :, :max_len], v_cache[:, :, :max_len], attn_mask=mask,
                                          scale=scale, enable_gqa=True)


def cases(args) -> list[Case]:
    dtype = default_dtype(args)
    if args.smoke:
        grid = [("smollm2", 2, 1, 64), ("smollm2", 2, 9, 256)]
    elif args.device.startswith("cuda"):
        grid = [(m, b, t, L) for m in HEADS for L in (512, 4096, 32768) for b in (1, 8, 32) for t in (1, 9)
                if b * L <= 32 * 4096 or m == "smollm2"]
    else:  # and a 2048-token prompt prefilled (T = L: each query sees the keys up to its own)
        grid = [(m, b, t, L) for m in HEADS for L in (512, 4096) for b in (1, 8) for t in (1, 9)]
        grid.append(("smollm2", 1, 2048, 2048))
    out = []
    for model, B, T, L in grid:
        Hq, Hkv, D = HEADS[model]
        g = torch.Generator().manual_seed(B * T + L)
        lens = torch.randint(L // 2, L + 1, (B,), generator=g).clamp_min(T)  # rows of unequal length
        lens[0] = L

        def make(B=B, T=T, L=L, Hq=Hq, Hkv=Hkv, D=D, lens=lens):
            dev = args.device
            q = torch.randn(B, T, Hq, D, generator=g).to(dtype).to(dev).transpose(1, 2)
            k_cache = torch.randn(B, Hkv, L, D, generator=g).to(dtype).to(dev)
            v_cache = torch.randn(B, Hkv, L, D, generator=g).to(dtype).to(dev)
            return q, k_cache, v_cache, lens.to(dev), D ** -0.5
        keys = int(lens.sum())
        seen = int((T * (lens - T)).sum()) + B * T * (T + 1) // 2  # (query, key) pairs: causal within T
        moved = (2 * keys * Hkv * D + 2 * B * T * Hq * D) * dtype.itemsize
        out.append(Case(f"{model} B={B} T={T} L={L}", make, bytes_moved=moved, flops=4.0 * seen * Hq * D))
    return out


def run(args) -> list[dict]:
    extra = {"sdpa": sdpa}
    if not args.device.startswith("cuda") and "cpp" in ops.backend_info()["kernels"][ROUTINE]["cpu"]:
        extra["cpp-invariant"] = torch.ops.swiftkern.verify_attention_invariant
    return run_cases(ROUTINE, ROUTINE, cases(args), args, extra=extra, tol=(3e-2, 3e-2))


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
