"""Whether this Triton's interpreter (TRITON_INTERPRET=1) can run swiftkern's kernels at all.

Triton 3.6 and older turn a loop bound held at run time (``range(lo, hi, BLOCK)``: bi_matmul's K
chunk, verify_attention's keys, the vocabulary chunks of greedy_accept, rejection_sample and
bi_exp_sum) into an int with ``int(array)`` on the interpreter's 1-element array, which NumPy
2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172). Every launch of those kernels
then fails with "only 0-dimensional arrays can be converted to Python scalars": with triton
3.6.0 and numpy 2.4 the suite had 168 such failures, with numpy 2.3.5 none. conftest.py asks
``runtime_loop_bound_problem`` once and stops the run with its message, instead of a wall of
failures that blame the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(out_ptr, n, CAP: tl.constexpr):
    total = 0
    for _ in range(0, tl.minimum(n, CAP), 1):  # a bound known only at run time, as in the kernels
        total += 1
    tl.store(out_ptr, total)


def count_below(n: int, cap: int = 8) -> int:
    """min(n, cap), counted by a Triton loop whose bound is a run-time value."""
    out = torch.zeros(1, dtype=torch.int32)
    _count_kernel[(1,)](out, n, CAP=cap)
    return int(out.item())


def runtime_loop_bound_problem() -> str | None:
    """None when the interpreter runs a loop with a run-time bound; else what to do about it."""
    import numpy

    try:
        count_below(5)
    except Exception as e:  # the interpreter wraps the TypeError in its own InterpreterError
        if "0-dimensional" not in str(e):
            raise
        return (f"Triton {triton.__version__}'s interpreter cannot run a loop with a run-time bound under "
                f"NumPy {numpy.__version__} (triton-lang/triton#9171): every CPU run of the Triton kernels "
                "would fail. Install numpy<2.4 (pip install 'numpy<2.4') or a Triton that has the fix "
                "(the latest; `make setup` installs it).")
    return None
