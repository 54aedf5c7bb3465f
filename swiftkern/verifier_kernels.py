"""The per-row ops of the deterministic verifier's pass, in two sets with one contract: a row's
(a token's) result depends on that row alone, whatever the pass's other rows, its width or
where a chunk starts. The matmuls are ``batch_invariant.bi_linear`` in both.

  portable  ``batch_invariant``'s torch compositions (``tree_sum`` norms, ``bi_exp`` SwiGLU,
            attention in fixed key blocks, RoPE): any device, invariant op by op, and many small
            ops: ~150 kernel launches a layer on a GPU (counted by ``python -m bench --routine
            verifier_pass``), which bound a verify pass by the host there;
  fused     one kernel per op: on the CPU the C++ kernels of ``SkipModel.batch_invariant``
            (per-row norms with the residual add, per-element SwiGLU from bi_exp and RoPE,
            ``verify_attention_invariant``); on CUDA the Triton norms, SwiGLU and RoPE (launch
            plans fixed by the row width, or elementwise) and ``verify_attention_invariant``
            (one fixed plan): ~20 launches a layer.
``auto`` is fused on the device types of FUSED_BY_DEFAULT (where its invariance is tested) when
it runs there, portable elsewhere: the CPU with the C++ kernels (float32, bf16, fp16) and CUDA
with Triton take fused. On an H100 the fused set passed ``tests/test_deterministic_gpu.py``
(the tiny needles against ``ar`` and HF's logprobs, decode = prefill, the SmolLM2 needle) and
``tests/test_verifier_model_shapes.py``, and its SmolLM2 generations equalled ``ar``'s eagerly
and through CUDA graphs; a verify pass took 31 ms against the portable set's 75 ms there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import ops, reference
from .batch_invariant import KEY_BLOCK, bi_attention, bi_rms_norm, bi_silu_linear_triton, bi_silu_mul
from .errors import SwiftkernError
from .layer_kernels import invariant_backend

CHOICES = ("auto", "portable", "fused")
# the device types where "auto" takes the fused set: those where its invariance has been tested
FUSED_BY_DEFAULT = ("cpu", "cuda")


@dataclass(frozen=True)
class VerifierKernels:
    """name: "portable" or "fused (cpp)" / "fused (triton)"; the callables:

    rms_norm(x [..., H], weight [H], eps) -> [..., H]
    add_rms_norm(x [..., H], residual [..., H], weight [H], eps) -> (rms_norm(residual + x), residual + x)
    silu_mul(gate [..., I], up [..., I]) -> [..., I]
    rope(q [R, Hq, T, D], k, v [R, Hkv, T, D], cos, sin [R, T, D]) -> (q, k) rotated, v (or a copy)
    attention(q [R, Hq, T, D], keys, values [R, Hkv, S, D], starts, ends int64 [R], scale) -> [R, Hq, T, D]:
        causal, query t of row r at absolute position starts[r] + t sees keys 0..starts[r] + t;
        ends = starts + T (given too, computed once a pass: the fused kernel takes it);
        S a multiple of KEY_BLOCK and >= ends[r] for every row.
    silu_linear(gate, up [..., I], weight [N, I], bias) -> the bits of the verifier's matmul of
        silu_mul(gate, up) in one launch (the Triton set: ``bi_matmul_swiglu``), or None.
    """

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    silu_mul: Callable
    rope: Callable
    attention: Callable
    silu_linear: Callable | None = None


def _rope_portable(q, k, v, cos, sin):
    return reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin), v


def _add_rms_norm_portable(x, residual, weight, eps):
    new_residual = residual + x
    return bi_rms_norm(new_residual, weight, eps), new_residual


def _attention_portable(q, keys, values, starts, ends, scale):
    return bi_attention(q, keys, values, starts, scale)


PORTABLE = VerifierKernels("portable", bi_rms_norm, _add_rms_norm_portable, bi_silu_mul, _rope_portable,
                           _attention_portable)


def rope_from_append(kernel: Callable) -> Callable:
    """A ``rope_kv_append`` kernel as the verifier's rope: one launch that rotates q and writes
    the rotated k (and v) into [R, Hkv, T, D] buffers at positions 0..T-1 of each row, instead
    of ~12 elementwise ops (each element's arithmetic is the same wherever it sits).

    The positions are made in every call (one small launch), inside the pass: a table kept here
    lived as long as the Verifier that made it, and a CUDA graph of the pass, which outlives that
    Verifier in the model's runner, went on reading its freed memory (an H100 rolled back 94-97 %
    of the tokens; ``tests/test_cuda_graphs.py`` now catches it on the CPU)."""
    def rope(q, k, v, cos, sin):
        R, Hkv, T, D = k.shape
        positions = torch.arange(T, device=k.device).expand(R, T)  # [R, T], stride 0 over rows
        k_out = torch.empty((R, Hkv, T, D), dtype=k.dtype, device=k.device)
        v_out = torch.empty_like(k_out)
        return kernel(q, k, v, cos, sin, k_out, v_out, positions), k_out, v_out
    return rope


def _fused_backend(device_type: str, dtype: torch.dtype) -> str | None:
    """'cpp' or 'triton' where the fused set runs, else None: the backend of the invariant layer
    set (``layer_kernels.invariant_backend``). A backend forced to anything else (reference, or
    cuda: no CUDA kernel for the attention) runs no fused set."""
    return invariant_backend(device_type, dtype)


def attention_from_cache_lens(kernel: Callable) -> Callable:
    """A ``verify_attention``-style kernel (cache_lens counting the T new tokens: the pass's
    ``ends``) in the verifier's signature."""
    def attention(q, keys, values, starts, ends, scale):
        return kernel(q, keys, values, ends, float(scale))
    return attention


def verifier_kernels(choice: str, device_type: str, dtype: torch.dtype) -> VerifierKernels:
    """The set ``choice`` ("auto" | "portable" | "fused") names for a model on ``device_type``
    in ``dtype``. Raises SwiftkernError for an unknown choice, or "fused" where it cannot run."""
    if choice not in CHOICES:
        raise SwiftkernError(f"verifier kernels must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "portable":
        return PORTABLE
    backend = _fused_backend(device_type, dtype) if choice == "fused" or device_type in FUSED_BY_DEFAULT else None
    if backend is None:
        if choice == "auto":
            return PORTABLE
        raise SwiftkernError(f"the fused verifier kernels run on CUDA (Triton) or on the CPU with swiftkern's "
                             f"C++ kernels (float32, bfloat16 or float16), with SWIFTKERN_BACKEND auto "
                             f"(here: {device_type}, {dtype}, "
                             f"SWIFTKERN_BACKEND={ops.backends.current_backend()}); use verifier kernels 'portable' (or 'auto')")
    if backend == "cpp":
        cpp = torch.ops.swiftkern
        return VerifierKernels("fused (cpp)", cpp.rms_norm, cpp.fused_add_rms_norm, cpp.silu_mul,
                               rope_from_append(cpp.rope_kv_append),
                               attention_from_cache_lens(cpp.verify_attention_invariant))
    from .triton_kernels import KERNELS
    return VerifierKernels("fused (triton)", KERNELS["rms_norm"][0], KERNELS["fused_add_rms_norm"][0],
                           KERNELS["silu_mul"][0],
                           rope_from_append(KERNELS["rope_kv_append"][0]),
                           attention_from_cache_lens(KERNELS["verify_attention_invariant"][0]),
                           silu_linear=bi_silu_linear_triton)


__all__ = ["CHOICES", "FUSED_BY_DEFAULT", "KEY_BLOCK", "PORTABLE", "VerifierKernels", "attention_from_cache_lens",
           "verifier_kernels"]
