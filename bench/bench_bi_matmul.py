"""bi_matmul (the deterministic verifier's batch-invariant matmul) vs the batch-variant matmul
the fast path runs.

    python -m bench --routine bi_matmul [--device cuda] [--providers reference,triton]
                    [--dtype float32] [--refcheck] [--smoke] [--reps N]

Here ``reference`` is ``a @ b`` (torch.matmul: cuBLAS on a GPU, the CPU's BLAS), the speed a
verify pass competes with; ``reference.bi_matmul`` (the fixed-order twin the tests hold the
kernels to) is a loop of elementwise ops, too slow to be the bar. Other providers: ``cpp``
(``ops.bi_matmul`` on the CPU: the C++ fixed-order kernel) and, on a GPU, ``triton`` (the
dtype's plan, ``PLANS``) and ``triton-<plan>`` for each of ``CANDIDATES`` (tiles, warps,
stages, float32 dot precision, K chunks), so that one run shows which plan to fix, and
``triton-skinny`` (the Triton ``skinny_linear``: ``ops.linear``'s float32 matmul at 2-32 rows on CUDA)
(``--dtype bfloat16``: SmolLM2's cases in bf16, for bf16's plan; ``bench/pick_plan.py`` picks).

Cases: rows M (on a GPU 8: a decode step at batch 8 through the invariant set, replay never;
32: one slot of a window of 32; 128: a verify pass of four slots) times SmolLM2's weights (q/o 576x576, k/v 192x576,
gate/up 1536x576, down 576x1536, the LM head 49152x576) in float32 (the verifier's dtype with
a float32 model), and Llama-3-8B's q, gate and down at M = 128 in bfloat16. The weight is
passed as the model passes it, a [N, K] tensor's transposed view. On a GPU also the grouped
launches the verifier makes (``bi_matmul_group``: a layer's q, k and v, or gate and up, in one
launch; its bar the separate cuBLAS matmuls). Row ``tflop_s``: 2 M N K per call;
``pct_of_ceiling``: of a matmul measured in the same run (``common.matmul_tflops``: bf16 8192^3
with cuBLAS on a GPU; float32 1024^3 torch.matmul on the CPU, which the C++ kernel can beat:
over 100 % there).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402
from bench.kernel_bench import Case, run_cases, standalone  # noqa: E402
from swiftkern import ops  # noqa: E402

ROUTINE = "bi_matmul"
PRINT_KEYS = ("provider", "dtype", "shape", "timed_as", "median_ms", "tflop_s", "x_vs_reference", "eager_ms")
SMOLLM2 = {"q": (576, 576), "k": (192, 576), "gate": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LLAMA3_8B = {"q": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336)}
# a decode step of 8 rows (replay never: every step through bi_matmul), a replay slot's window of
# 32, a verify pass of four such slots
GPU_ROWS = (8, 32, 128)


def _grid(args) -> list[tuple[str, int, int, int, torch.dtype]]:
    """(label, M, N, K, dtype) of every case."""
    f32 = getattr(torch, args.dtype) if args.dtype else torch.float32
    if args.smoke:
        return [("smollm2 k", 7, 192, 576, f32)]
    rows = GPU_ROWS if args.device.startswith("cuda") else (32, 128)
    grid = [(f"smollm2 {name}", m, n, k, f32) for m in rows for name, (n, k) in SMOLLM2.items()]
    if args.device.startswith("cuda"):
        b16 = getattr(torch, args.dtype) if args.dtype else torch.bfloat16
        grid += [(f"llama3-8b {name}", 128, n, k, b16) for name, (n, k) in LLAMA3_8B.items()]
    return grid


def cases(args) -> list[Case]:
    out = []
    for label, M, N, K, dtype in _grid(args):
        def make(M=M, N=N, K=K, dtype=dtype):
            g = torch.Generator().manual_seed(M + N + K)
            a = torch.randn(M, K, generator=g).to(dtype).to(args.device)
            weight = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(args.device)  # [N, K]
            return a, weight.t()
        out.append(Case(f"{label} M={M} N={N} K={K}", make, bytes_moved=None, flops=2.0 * M * N * K))
    return out


def group_cases(args) -> list[Case]:
    """A layer's q, k and v (and gate and up) as one ``bi_matmul_group`` call, SmolLM2 float32."""
    if args.smoke or not args.device.startswith("cuda"):
        return []
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32
    out = []
    for M in GPU_ROWS:
        for label, names in (("qkv", ("q", "k", "k")), ("gate+up", ("gate", "gate"))):
            K = SMOLLM2[names[0]][1]
            widths = [SMOLLM2[n][0] for n in names]

            def make(M=M, K=K, widths=widths):
                g = torch.Generator().manual_seed(M + K + len(widths))
                a = torch.randn(M, K, generator=g).to(dtype).to(args.device)
                return a, [(torch.randn(n, K, generator=g) * K ** -0.5).to(dtype).to(args.device).t() for n in widths]
            out.append(Case(f"smollm2 {label} M={M} N={'+'.join(map(str, widths))} K={K}", make, bytes_moved=None,
                            flops=2.0 * M * sum(widths) * K))
    return out


def plan_sweep(device: str, dtype: torch.dtype = torch.float32) -> dict:
    """On a GPU, ``triton-<plan>`` providers: the Triton kernel in each candidate plan (a list
    of weights: one grouped launch). A 16-bit dtype's dots ignore the plan's precision, so of
    candidates alike but for it the first alone is timed."""
    if not device.startswith("cuda"):
        return {}
    from dataclasses import replace

    from swiftkern.triton_kernels import bi_matmul as kernel

    plans, seen = [], set()
    for plan in kernel.CANDIDATES:
        key = plan if dtype == torch.float32 else replace(plan, precision="ieee")
        if key not in seen:
            seen.add(key)
            plans.append(plan)
    return {f"triton-{plan.name}": (lambda a, b, plan=plan: kernel.launch(a, b, plan)) for plan in plans}


def run(args) -> list[dict]:
    extra = {"reference": torch.matmul, **plan_sweep(args.device, getattr(torch, args.dtype or "float32"))}
    if args.device.startswith("cpu"):
        extra["cpp"] = ops.bi_matmul
    else:
        extra["triton"] = torch.ops.swiftkern_triton.bi_matmul
        # the regular path's matmul at 2-32 rows (ops.linear's CUDA_SKINNY_ROWS): b is weight.t()
        extra["triton-skinny"] = lambda a, b: torch.ops.swiftkern_triton.skinny_linear(a, b.t(), None)
    # what picks a plan first (SmolLM2's matmuls and groups), Llama-3-8B's last: a lease's
    # timeout may cut the run short (the rows of finished cases are kept)
    every = cases(args)
    rows = run_cases(ROUTINE, ROUTINE, [c for c in every if c.shape.startswith("smollm2")], args, extra=extra,
                     tol=(1e-3, 1e-3))
    groups = group_cases(args)
    if groups and not common.interrupted():  # the bar: the separate cuBLAS matmuls, concatenated
        group_extra = dict(extra, reference=lambda a, bs: torch.cat([a @ b for b in bs], dim=1),
                           triton=torch.ops.swiftkern_triton.bi_matmul_group)
        group_extra.pop("triton-skinny", None)  # one weight a call
        rows += run_cases(ROUTINE, ROUTINE, groups, args, extra=group_extra, tol=(1e-3, 1e-3))
    rest = [c for c in every if not c.shape.startswith("smollm2")]
    if rest and not common.interrupted():
        rows += run_cases(ROUTINE, ROUTINE, rest, args, extra=extra, tol=(1e-3, 1e-3))
    return rows


if __name__ == "__main__":
    sys.exit(standalone(ROUTINE))
