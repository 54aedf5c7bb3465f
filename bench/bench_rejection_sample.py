"""rejection_sample (speculative sampling: accept, then a residual or bonus draw) vs the reference.

    python -m bench --routine rejection_sample [--device cuda] [--providers reference,cpp,cuda,triton]
                    [--refcheck] [--smoke] [--reps N]

B rows of K = 8 drafts over V = 49152 (SmolLM2) and 128256 (Llama 3) float32 probabilities,
with draft probabilities (`q`) or a greedy draft (`q=none`, one-hot). Target probabilities are
a sharpened copy of the draft's, so some drafts are accepted and some rejected. Bytes per call:
the rows a kernel must read for its draws (one target row, and one draft row with q, per row).
On a GPU, ``triton-pps<n>`` rows force the Triton kernel's vocabulary split to aim at n
programs per SM (its plan aims at 2).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, run_cases, standalone  # noqa: E402, F401

ROUTINE = "rejection_sample"
ROWS_AND_VOCAB = lambda draft, q, p, *rest: (p.shape[0], p.shape[2])  # noqa: E731


def cases(args) -> list[Case]:
    K = 8
    if args.smoke:
        grid = [(1, 4096, True), (4, 4096, False)]
    elif args.device.startswith("cuda"):
        grid = [(b, v, q) for v in (49152, 128256) for b in (1, 8, 64, 256) for q in (True, False)]
    else:
        grid = [(1, 49152, True), (8, 49152, True), (8, 49152, False), (64, 49152, True)]
    out = []
    for B, V, with_q in grid:
        def make(B=B, V=V, with_q=with_q):
            g = torch.Generator().manual_seed(B + V)
            logits = torch.randn(B, K + 1, V, generator=g) * 4
            q = torch.softmax(logits[:, :K], -1)
            p = torch.softmax(logits * 1.3 + torch.randn(B, K + 1, V, generator=g), -1)
            draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
            dev = args.device
            return (draft.to(dev), q.to(dev) if with_q else None, p.to(dev),
                    torch.full((B,), K, dtype=torch.int32, device=dev), torch.rand(B, K, generator=g).to(dev),
                    torch.rand(B, K + 1, generator=g).to(dev))
        rows_read = 2 if with_q else 1
        out.append(Case(f"B={B} K={K} V={V} q={'probs' if with_q else 'none'}", make,
                        bytes_moved=B * V * 4 * rows_read))
    return out


def run(args) -> list[dict]:
    return run_cases(ROUTINE, ROUTINE, cases(args), args, split_sweep=ROWS_AND_VOCAB)


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
