"""greedy_accept (argmax over the vocabulary fused with the accept walk) vs the torch reference.

    python -m bench --routine greedy_accept [--device cuda] [--providers reference,cpp,cuda,triton]
                    [--dtype bfloat16] [--refcheck] [--smoke] [--reps N]

B rows of K = 8 drafts over V = 49152 (SmolLM2) and 128256 (Llama 3) logits. `acc=all`: every
draft matches its target, so every kernel must scan all K+1 positions (the worst case for the
CPU kernel, which stops scanning a row at its first mismatch); `acc=0`: the first draft is
wrong. Bytes per call: the logits a kernel must read when every position is needed. On a GPU,
``triton-pps<n>`` rows time the Triton kernel with its vocabulary split aimed at n programs per
SM (its plan aims at 2): the data for choosing that count; the ``cuda`` row times the CUDA
kernel as built (its vocabulary split on, the default since an H200 ran it) and a
``cuda-no-split`` row with it off (SWIFTKERN_CUDA_GREEDY_SPLIT=0). Rows of commit 5a2ef78 and
before name them ``cuda-split`` and ``cuda`` (the split off, then the default).
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.kernel_bench import PRINT_KEYS, Case, default_dtype, run_cases, standalone  # noqa: E402, F401

ROUTINE = "greedy_accept"
ROWS_AND_VOCAB = lambda draft, logits, num_draft: (logits.shape[0] * logits.shape[1], logits.shape[2])  # noqa: E731


def cases(args) -> list[Case]:
    dtype = default_dtype(args)
    K = 8
    if args.smoke:
        grid = [(1, 4096, "all"), (4, 4096, "0")]
    elif args.device.startswith("cuda"):
        grid = [(b, v, a) for v in (49152, 128256) for b in (1, 8, 64, 256) for a in ("all", "0")]
    else:
        grid = [(1, 49152, "all"), (8, 49152, "all"), (8, 49152, "0"), (64, 49152, "all")]
    out = []
    for B, V, acc in grid:
        def make(B=B, V=V, acc=acc):
            g = torch.Generator().manual_seed(B + V)
            logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
            draft = logits[:, :K].float().argmax(-1)
            if acc == "0":
                draft[:, 0] = (draft[:, 0] + 1) % V
            num_draft = torch.full((B,), K, dtype=torch.int32)
            dev = args.device
            return draft.to(dev), logits.to(dev), num_draft.to(dev)
        out.append(Case(f"B={B} K={K} V={V} acc={acc}", make, bytes_moved=B * (K + 1) * V * dtype.itemsize))
    return out


def cuda_no_split(*args):
    """The CUDA kernel with SWIFTKERN_CUDA_GREEDY_SPLIT=0 while it launches (a graph captured
    here replays the unsplit launches). Its eager time includes patching os.environ."""
    with mock.patch.dict(os.environ, {"SWIFTKERN_CUDA_GREEDY_SPLIT": "0"}):
        return torch.ops.swiftkern.greedy_accept(*args)


def run(args) -> list[dict]:
    from swiftkern.ops import registry
    cuda_built = args.device.startswith("cuda") and registry.COMPILED[ROUTINE]["cuda"] == "cuda"
    extra = {"cuda-no-split": cuda_no_split} if cuda_built else {}
    return run_cases(ROUTINE, ROUTINE, cases(args), args, extra=extra, split_sweep=ROWS_AND_VOCAB)


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
