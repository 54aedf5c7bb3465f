"""The decoder-layer ops bound to their backends for one device type, without per-call checks.

The model runner calls ~10 ops per layer per step. Through the public ``ops`` wrappers each
call re-validates shapes, dtypes and devices and re-resolves its backend, which is most of the
host time of a decode step when the model is small or the device is fast (a 30-layer model of
hidden size 64 on the CPU: 5.1 ms a step, a third of it in the checks). The runner's tensors are
valid by construction (its own weights, cache and activations), so it binds each op once per
forward to the callable the wrapper would have run (``ops.unchecked``) and calls that: the same
kernels, the same arguments, the same bits.

``LayerKernels.for_device(device_type)`` is cached per device type and ``SWIFTKERN_BACKEND``
state; ``ops.set_backend`` takes effect at the next forward.

``LayerKernels.for_device(device_type, invariant=True)`` is the batch- and length-invariant set
(``invariant_backend``): every op computes a row's (a token's) result in an order fixed by that
row alone, so decode, verify and prefill of the same tokens give the same bits in any batch.
On the CPU it is the C++ kernels and costs little there: the C++ matmul, norms and SwiGLU
already are, and the attention takes its one-query path for every query. On CUDA it is the
deterministic verifier's Triton kernels (``bi_matmul`` in its fixed plan, the per-row norms,
SwiGLU, RoPE, ``verify_attention_invariant``), which the regular set does not use: cuBLAS's
matmul is faster and batch-variant there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from . import ops, reference
from .launch_log import opaque_call

_CACHE: dict = {}


@dataclass(frozen=True)
class LayerKernels:
    """Unchecked callables for one device type, with the signatures of the ``ops`` wrappers:

    linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]
    rms_norm(x [..., H], weight [H], eps) -> [..., H]
    fused_add_rms_norm(x, residual [..., H], weight [H], eps) -> (normed, new_residual)
    silu_mul(gate, up [..., I]) -> [..., I]
    rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions, uniform_start, max_len) -> q rotated
    verify_attention(q, k_cache, v_cache, cache_lens, scale, max_len, mask) -> [B, Hq, T, D]

    and ``backends``: {op: the backend name} as ``ops.backend_for`` reports it. ``linears``:
    (x [..., K], weights (1-3 of [N_i, K]), biases) -> [..., N_i] each, the bits of ``linear`` per
    weight in one launch where it can (a layer's q, k, v; gate, up), or None (``linear`` per weight). ``silu_linear``:
    (gate, up [..., I], weight [N, I], bias) -> ``linear(silu_mul(gate, up), weight, bias)``'s bits in
    one launch (the Triton invariant set; the regular set's Triton skinny kernel), or None (the two ops). ``stack``: where
    every layer op is a C++ CPU kernel, the whole layer loop in one C++ call (float32, bf16, fp16; see
    ``_stack_for``), else None. ``forward``: with ``stack``, a whole forward in one C++ call
    (embedding, the stack, the final norm, the LM head; ``_forward_for``), else None."""

    linear: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_mul: Callable
    rope_kv_append: Callable
    verify_attention: Callable
    backends: dict
    stack: Callable | None = None
    forward: Callable | None = None
    linears: Callable | None = None
    silu_linear: Callable | None = None

    @staticmethod
    def for_device(device_type: str, invariant: bool = False) -> "LayerKernels":
        key = (device_type, ops.backends.current_backend(), invariant, _OP_BY_OP, _UNGROUPED)
        hit = _CACHE.get(key)
        if hit is None:
            hit = _bind_invariant(device_type) if invariant else _bind(device_type)
            hit = dataclasses.replace(hit, forward=None) if _OP_BY_OP else hit
            _CACHE[key] = hit = dataclasses.replace(hit, linears=None, silu_linear=None) if (
                _UNGROUPED and not invariant) else hit
        return hit


_OP_BY_OP = False  # inside op_by_op_forward()
_UNGROUPED = False  # inside ungrouped_projections()


@contextlib.contextmanager
def ungrouped_projections():
    """Within this context the regular set is bound without ``linears`` and ``silu_linear``: each
    projection and the SwiGLU its own launch (the grouped launches' twin, the same bits; for
    tests and ``python -m bench --routine verify_cost``'s ``-ungrouped`` providers)."""
    global _UNGROUPED
    before, _UNGROUPED = _UNGROUPED, True
    try:
        yield
    finally:
        _UNGROUPED = before


@contextlib.contextmanager
def op_by_op_forward():
    """Within this context the kernels are bound without ``forward``: a CPU forward calls the
    embedding, RoPE rows, ``stack``, cache advance and final norm one by one from Python (the
    one-call forward's twin, the same bits; for tests and ``python -m bench --routine forward_host``)."""
    global _OP_BY_OP
    before, _OP_BY_OP = _OP_BY_OP, True
    try:
        yield
    finally:
        _OP_BY_OP = before


INVARIANT_CPU_OPS = ("skinny_linear", "rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append",
                     "verify_attention_invariant")


INVARIANT_TRITON_OPS = ("bi_matmul", "rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append",
                        "verify_attention_invariant")


def invariant_kernels_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the C++ batch- and length-invariant kernel set runs here: float32, bfloat16 or
    float16 on the CPU with the C++ kernels built and allowed (SWIFTKERN_BACKEND auto or cpp).
    There it costs nothing measurable, so the Generator decodes through it by default."""
    return (dtype in ops.SKINNY_DTYPES
            and all(ops.backends.cpu_kernel(op, device_type) for op in INVARIANT_CPU_OPS))


def invariant_backend(device_type: str, dtype: torch.dtype) -> str | None:
    """Which batch- and length-invariant kernel set runs here: "cpp" (``invariant_kernels_available``),
    "triton" (CUDA with SWIFTKERN_BACKEND auto or triton, or CPU tensors under TRITON_INTERPRET=1
    with SWIFTKERN_BACKEND=triton: the tests; float32, bfloat16 or float16, the Triton kernels
    importable), or None. The deterministic verifier's fused set and ``SkipModel.batch_invariant`` both run it."""
    backend = ops.backends.current_backend()
    if (device_type == "cuda" and backend in ("auto", "triton")) or (device_type == "cpu" and backend == "triton"):
        ready = dtype in ops.SKINNY_DTYPES and set(INVARIANT_TRITON_OPS) <= ops.backends.triton_ops(device_type)
        return "triton" if ready else None
    return "cpp" if invariant_kernels_available(device_type, dtype) else None


def _bind_invariant(device_type: str) -> LayerKernels:
    """Every op with a row's bits fixed by the row (``invariant_backend``'s set)."""
    backend = invariant_backend(device_type, torch.float32)
    if backend == "triton":
        return _bind_invariant_triton()
    if backend != "cpp":
        raise RuntimeError("no invariant kernel set runs here (see invariant_backend)")
    return _bind_invariant_cpp(device_type)


def _bind_invariant_triton() -> LayerKernels:
    """The Triton set: ``bi_matmul`` (fixed tiles, K in its plan's order; q/k/v and gate/up
    grouped in one launch each, as the verifier does; the down projection with the SwiGLU in
    its load, ``bi_matmul_swiglu``, as the verifier does too), per-row norms,
    elementwise SwiGLU and RoPE, and ``verify_attention_invariant`` given whole key blocks, as
    the verifier gives them (a row's bits never depend on how many keys the pass spans; one
    binary for every span)."""
    from .batch_invariant import KEY_BLOCK, bi_linear, bi_linears, bi_silu_linear_triton
    from .triton_kernels import KERNELS

    k = {name: fn for name, (fn, _) in KERNELS.items()}
    verify_attention = _kernel_attention(k["verify_attention_invariant"], key_block=KEY_BLOCK)
    backends = {op: "triton" for op in ("rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append",
                                        "verify_attention")}
    return LayerKernels(linear=bi_linear, rms_norm=k["rms_norm"], fused_add_rms_norm=k["fused_add_rms_norm"],
                        silu_mul=k["silu_mul"], rope_kv_append=_kernel_rope(k["rope_kv_append"]),
                        verify_attention=verify_attention, backends=backends, linears=bi_linears,
                        silu_linear=bi_silu_linear_triton)


def _bind_invariant_cpp(device_type: str) -> LayerKernels:
    """The C++ fixed-order matmul at any number of rows, the C++ per-row norms, per-element
    SwiGLU (bi_exp) and RoPE, and the attention that takes the one-query path for every query."""
    cpp = torch.ops.swiftkern
    backends = {op: "cpp" for op in ("rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append",
                                     "verify_attention")}
    return LayerKernels(linear=cpp.skinny_linear, rms_norm=cpp.rms_norm, fused_add_rms_norm=cpp.fused_add_rms_norm,
                        silu_mul=cpp.silu_mul, rope_kv_append=_kernel_rope(cpp.rope_kv_append),
                        verify_attention=_kernel_attention(cpp.verify_attention_invariant), backends=backends,
                        stack=_stack_for(invariant=True), forward=_forward_for(invariant=True))


def _row_rules(invariant: bool, dtype: torch.dtype) -> tuple[int, int]:
    """The rules of ops.linear at this call (a prefill's, this CPU's), as the Python loop reads
    them, for the C++ stack: rows up to which the fixed-order kernel runs, and up to which packed
    weights are read (skinny_linear's bits, fewer bytes); -1: any number (the invariant set)."""
    if invariant:
        return -1, -1
    return ops.skinny_max_rows(dtype), ops.packed_max_rows()


def _stack_for(invariant: bool) -> Callable | None:
    """``_C.decoder_stack`` (csrc/decoder_stack_cpu.cpp) in the runner's terms: every kept
    sub-layer in one C++ call, through the same CPU kernels in the same order as the Python
    loop (the same bits), without its ~15 Python-level op calls per layer (on SmolLM2 a few ms
    of a ~24 ms decode step). Matmuls as ``linear`` here: the C++ kernel up to
    ops.skinny_max_rows(dtype) rows (at any number in the invariant set), torch's past that.

    stack(hidden [B, T, H], weights (18 per layer, _Layer's fields), skip (per layer: 1 attention
    skipped, 2 MLP skipped), k_cache, v_cache [L, B, Hkv, S, D], cos, sin [B, T, D], positions
    [B, T], cache_lens [B], max_len, num_heads, num_kv_heads, head_dim, eps, scale, packed
    (empty, or the packed weight or None per weight slot: packed_weights.PackedSet.slots(), read
    up to ops.packed_max_rows() rows, at any number in the invariant set; the same bits), row_path
    (on raw rows where it applies, float32 / bf16 / fp16, csrc/decoder_stack_rows.cpp; False: op by op, the same
    bits)) -> (hidden, pending or None)."""
    run = getattr(ops.registry.extension, "decoder_stack", None)
    if run is None:
        return None
    def stack(hidden, weights, skip, k_cache, v_cache, cos, sin, positions, cache_lens, max_len, num_heads,
              num_kv_heads, head_dim, eps, scale, packed, row_path=True):
        rows, packed_rows = _row_rules(invariant, hidden.dtype)
        return opaque_call("decoder_stack", run, hidden, weights, skip, k_cache, v_cache, cos, sin, positions,
                           cache_lens, max_len, num_heads, num_kv_heads, head_dim, eps, scale, rows, invariant,
                           packed, packed_rows, row_path)
    return stack


def _forward_for(invariant: bool) -> Callable | None:
    """``_C.decoder_forward`` (csrc/decoder_forward_cpu.cpp): the embedding, ``stack``, the final
    norm and the LM head in one C++ call, where the stack runs; the same bits as those ops one by
    one. On an AMD EPYC (2 threads) the ~10 small ops around the stack took ~0.6 ms of a ~7 ms
    SmolLM2 decode step, each run with its code evicted by the weights the stack streamed.

    forward(tokens [B, T], embed [V, H], cos, sin (tables [P, D] when rope_table, else [B, T, D]),
    rope_table, positions [B, T] or None (the cache lengths + t), cache_lens [B] (advanced by T in
    place), final_norm [H], weights, skip, k_cache, v_cache, max_len, num_heads, num_kv_heads,
    head_dim, eps, scale, packed (as ``stack``'s), head (weight [V, H], bias [V] or None, the
    weight packed or None) -> the logits [B, T, V] through ``head`` by ops.linear's rule (the
    packed weight where the stack reads packed ones); a token id or position out of range raises
    RuntimeError before anything is written."""
    run = getattr(ops.registry.extension, "decoder_forward", None)
    if run is None:
        return None
    def forward(tokens, embed, cos, sin, rope_table, positions, cache_lens, final_norm, weights, skip, k_cache,
                v_cache, max_len, num_heads, num_kv_heads, head_dim, eps, scale, packed, head):
        rows, packed_rows = _row_rules(invariant, embed.dtype)
        return opaque_call("decoder_forward", run, tokens, embed, cos, sin, rope_table, positions, cache_lens,
                           final_norm, weights, skip, k_cache, v_cache, max_len, num_heads, num_kv_heads, head_dim,
                           eps, scale, rows, invariant, packed, packed_rows, *head)
    return forward


def _bind(device_type: str) -> LayerKernels:
    names = ("rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append", "verify_attention")
    backends = {op: ops.backend_for(op, device_type) for op in names}
    run = {op: ops.unchecked(op, device_type) for op in names}

    if backends["rope_kv_append"] == "reference":
        def rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions, uniform_start, max_len):
            return reference.rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions, uniform_start)
    else:
        rope_kv_append = _kernel_rope(run["rope_kv_append"])
    if backends["verify_attention"] == "reference":
        verify_attention = reference.verify_attention
    else:
        verify_attention = _kernel_attention(run["verify_attention"])

    all_cpp = ops.backends.cpu_kernel("skinny_linear", device_type) and all(b == "cpp" for b in backends.values())
    linear = _linear_for(device_type)
    linears, silu_linear = _skinny_groups_for(device_type, linear, run["silu_mul"], backends["silu_mul"])
    return LayerKernels(linear=linear, rms_norm=run["rms_norm"],
                        fused_add_rms_norm=run["fused_add_rms_norm"], silu_mul=run["silu_mul"],
                        rope_kv_append=rope_kv_append, verify_attention=verify_attention, backends=backends,
                        stack=_stack_for(invariant=False) if all_cpp else None,
                        forward=_forward_for(invariant=False) if all_cpp else None,
                        linears=linears, silu_linear=silu_linear)


def _skinny_groups_for(device_type: str, linear: Callable, silu_mul: Callable,
                       silu_backend: str) -> tuple[Callable | None, Callable | None]:
    """(linears, silu_linear) of the regular set: where ``linear`` takes the Triton skinny kernel
    (CUDA, float32 at 2-32 rows), a layer's q/k/v or gate/up in one launch
    (``skinny_linear_group``) and its down projection with the SwiGLU in the A tile's load
    (``skinny_silu_linear``, when ``silu_mul`` is the Triton kernel whose bits it makes), each
    output the bits ``linear`` and ``silu_mul`` give it; elsewhere those ops one by one. (None,
    None) where the Triton skinny kernel never runs."""
    if not ops.triton_skinny_here(device_type):
        return None, None
    from .triton_kernels.skinny_linear import skinny_linear_group, skinny_silu_linear

    fits = ops.triton_skinny_fits

    def linears(x, weights, biases):
        if all(fits(x, w) for w in weights):
            return skinny_linear_group(x, list(weights), list(biases)).split([w.shape[0] for w in weights], dim=-1)
        return [linear(x, w, b) for w, b in zip(weights, biases)]

    def silu_linear(gate, up, weight, bias=None):
        if silu_backend == "triton" and fits(gate, weight):
            return skinny_silu_linear(gate, up, weight, bias)
        return linear(silu_mul(gate, up), weight, bias)
    return linears, silu_linear


def _kernel_rope(rope: Callable) -> Callable:
    """A compiled rope_kv_append in the runner's signature (the hints are the reference's)."""
    def rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions, uniform_start, max_len):
        return rope(q, k, v, cos, sin, k_cache, v_cache, positions)
    return rope_kv_append


def _kernel_attention(attend: Callable, key_block: int = 1) -> Callable:
    """A compiled attention op in the runner's signature: the caches cut to max_len keys rounded
    up to a whole ``key_block`` (at most the cache), the mask (a reference-only hint) dropped."""
    def verify_attention(q, k_cache, v_cache, cache_lens, scale, max_len, mask):
        if max_len is not None:
            max_len = -(-max_len // key_block) * key_block
        return attend(q, *ops.keys_in_use(k_cache, v_cache, max_len), cache_lens, float(scale))
    return verify_attention


def _linear_for(device_type: str) -> Callable:
    """ops.linear's choice, made once: the C++ skinny kernel on the CPU (when built and allowed)
    where ops.skinny_fits, the Triton one on CUDA where ops.triton_skinny_fits, torch's matmul
    otherwise."""
    if ops.triton_skinny_here(device_type):
        from .triton_kernels import KERNELS

        triton_skinny, triton_fits = KERNELS["skinny_linear"][0], ops.triton_skinny_fits

        def linear(x, weight, bias=None):
            return triton_skinny(x, weight, bias) if triton_fits(x, weight) else reference.skinny_linear(x, weight, bias)
        return linear
    if not ops.backends.cpu_kernel("skinny_linear", device_type):
        return reference.skinny_linear
    skinny, fits = torch.ops.swiftkern.skinny_linear, ops.skinny_fits

    def linear(x, weight, bias=None):
        return skinny(x, weight, bias) if fits(x, weight) else reference.skinny_linear(x, weight, bias)
    return linear
