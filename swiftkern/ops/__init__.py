"""The kernels of swiftkern, one function per op; the only package that imports kernels.

Every op exists in two custom-op namespaces, each with a fake (meta) impl for torch.compile:
``torch.ops.swiftkern.<op>`` runs the compiled kernel of ``swiftkern._C`` when the extension
has one for the device (``cpp`` on CPU, ``cuda`` on GPU) and otherwise the function of the same
name in ``swiftkern/reference.py``; ``torch.ops.swiftkern_triton.<op>`` runs the Triton kernel
of ``swiftkern.triton_kernels`` (CUDA; also CPU tensors under ``TRITON_INTERPRET=1``), and is
imported lazily, so ``import swiftkern`` never imports triton.

The public wrappers validate their inputs (SwiftkernError saying what is wrong) and run
the backend chosen by ``SWIFTKERN_BACKEND`` (read at import; ``set_backend`` changes it):

  auto       CPU: cpp when built for the op, else reference. CUDA: cuda when built for the op,
             else triton when available for the op, else reference.
  reference  the reference functions, everywhere.
  cpp | triton | cuda   that backend for every op and device; an op or device it does not
             cover raises SwiftkernError (never a silent fallback).

``backend_info()`` (and ``swiftkern info``) shows per op and device what runs and what is built.

Modules: registry (schemas, the extension, the registration), backends (the choice above),
checks (input checks), acceptance (greedy_accept, greedy_tokens, rejection_sample), layer (norms, silu_mul,
rope_kv_append, verify_attention, kv_compact), projections (linear, packed_linear), invariant
(bi_exp, bi_exp_sum, bi_matmul, bi_matmul_group), top_p_cut (the CPU's top-p cut).
"""

from __future__ import annotations

from .. import reference
from .acceptance import greedy_accept, greedy_tokens, greedy_verify_here, rejection_sample
from .backends import backend_for, backend_info, set_backend, unchecked
from .invariant import bi_exp, bi_exp_sum, bi_matmul, bi_matmul_group, bi_max_exp_sum
from .layer import (fused_add_rms_norm, keys_in_use, kv_compact, rms_norm, rope_kv_append, silu_mul,
                    verify_attention, verify_attention_invariant)
from .projections import (CUDA_SKINNY_ROWS, PACKED_MAX_ROWS, SKINNY_DTYPES, SKINNY_MAX_ROWS, cpu_matmul_isa, linear,
                          mkl_lags_here,
                          packed_kernels_here, packed_linear, packed_linear_fast, packed_max_rows, prefill_projections,
                          skinny_fits,
                          skinny_max_rows, torch_bf16_matmul_native, triton_skinny_fits, triton_skinny_here)
from .top_p_cut import top_p_cut

apply_rope = reference.apply_rope
attention_mask = reference.attention_mask
info = backend_info

__all__ = ["bi_exp", "bi_exp_sum", "bi_matmul", "bi_matmul_group", "bi_max_exp_sum", "greedy_accept", "greedy_tokens", "linear", "rejection_sample", "rms_norm",
           "fused_add_rms_norm", "silu_mul", "apply_rope", "rope_kv_append", "attention_mask", "verify_attention",
           "verify_attention_invariant", "kv_compact", "packed_linear", "top_p_cut", "backend_info",
           "backend_for", "info", "set_backend", "unchecked"]
