"""The float32 dot the kernels run under TRITON_INTERPRET=1 (no GPU) instead of ``tl.dot``.

There ``tl.dot`` is numpy's matmul, and OpenBLAS's kernels give a row other bits at another
place in the tile or in a tile of another height on some CPUs (the Haswell kernels an AMD EPYC
gets; the AVX-512 kernels of an Intel Xeon happened not to). A GPU's MMA sums each output in
an order that does not depend on the row's place, which is what the batch- and length-invariant
kernels rely on, so the interpreter must not break it. Here each output is one product over K
summed in order: the same bits for a row wherever it sits. Only kernels' INTERPRET branches call
this; on a GPU the branch is compiled out.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def interpreter_dot(a, b):
    """a [M, K] @ b [K, N] -> float32 [M, N], each element summed over K in order from its own
    row of a and column of b alone."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
