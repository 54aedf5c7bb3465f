"""The decoder-layer ops the model runner is made of: the norms, the SwiGLU activation, the
rotary embedding with the KV-cache write, attention against a cache of per-row lengths, and
the compaction of kept cache entries."""

from __future__ import annotations

import torch

from .. import reference
from ..arg_checks import real
from ..errors import SwiftkernError
from .backends import resolve, run
from .checks import (check_cache_layout, check_float, check_float_tensors, check_range, check_same_dtype,
                     check_shape, check_tensors, checking_values, one_device)


def _norm_args(op: str, x, weight, eps, residual=None) -> None:
    tensors = {"x": x, "weight": weight} if residual is None else {"x": x, "residual": residual, "weight": weight}
    check_float_tensors(op, **tensors)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise SwiftkernError(f"{op}: x must be [..., H] with H >= 1, got shape {tuple(x.shape)}")
    check_shape(op, "weight", weight, (x.shape[-1],), f"[H] = [{x.shape[-1]}]")
    if residual is not None and residual.shape != x.shape:
        raise SwiftkernError(f"{op}: residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise SwiftkernError(f"{op}: eps must be a float >= 0, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).

    Args:
        x: float32 | bfloat16 | float16 [..., H], H >= 1.
        weight: [H], the dtype of x.
        eps: float >= 0.

    Returns [..., H] in x's dtype. The mean of squares is taken in float32 and the normalized
    row is rounded to x's dtype before the weight multiplies it (``reference.rms_norm``).
    Runs the backend of ``backend_for("rms_norm", x.device)``.
    """
    _norm_args("rms_norm", x, weight, eps)
    return run("rms_norm", x.device, x, weight, float(eps))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm of the next sub-layer in one pass.

    Args:
        x: float32 | bfloat16 | float16 [..., H], a sub-layer's output.
        residual: [..., H], the residual stream (same dtype); not modified.
        weight: [H], the next sub-layer's norm weight; eps: float >= 0.

    Returns (normed, new_residual), both [..., H]: new_residual = residual + x rounded to the
    dtype, normed = rms_norm(new_residual, weight, eps). The model runner uses it to fold the
    add of every kept sub-layer into the norm of the next kept one, so skipped sub-layers cost
    no pass over the hidden state. Runs ``backend_for("fused_add_rms_norm", x.device)``.
    """
    _norm_args("fused_add_rms_norm", x, weight, eps, residual)
    return run("fused_add_rms_norm", x.device, x, residual, weight, float(eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation silu(gate) * up.

    gate, up: float32 | bfloat16 | float16 [..., I], one shape, dtype and device -> [..., I].
    silu(gate) is rounded to the dtype before the product (``reference.silu_mul``).
    Runs ``backend_for("silu_mul", gate.device)``.
    """
    op = "silu_mul"
    check_float_tensors(op, gate=gate, up=up)
    if gate.shape != up.shape:
        raise SwiftkernError(f"{op}: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return run(op, gate.device, gate, up)


def rope_kv_append(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, uniform_start: int | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Rotary embedding of q and k (HF rotate-half convention), and k, v written into the cache.

    Args:
        q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; cos, sin: [B, T, D]; all one float dtype, D even.
            Any strides (the model passes transposed views of the projections).
        k_cache, v_cache: [B, Hkv, S, D], a float dtype; written in place: row b's token t goes
            to position positions[b, t].
        positions: int64 [B, T], each in [0, S).
        uniform_start: host-side hint that every row's positions are uniform_start + [0, T)
            (then only uniform_start is range-checked, without a device sync; the reference
            writes a slice).
        max_len: host-side hint that every position is < max_len (e.g. the longest row after
            the append, as ``KVCache.positions_for`` guarantees); then only max_len <= S is
            checked, without a device sync.

    Returns the rotated q [B, Hq, T, D]. Runs ``backend_for("rope_kv_append", q.device)``.
    """
    op = "rope_kv_append"
    tensors = dict(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, positions=positions)
    check_tensors(op, **tensors)
    device = one_device(op, **tensors)
    check_shape(op, "q", q, (None, None, None, None), "4-D [B, Hq, T, D]")
    B, Hq, T, D = q.shape
    check_shape(op, "k", k, (B, None, T, D), f"[B, Hkv, T, D] = [{B}, Hkv, {T}, {D}]")
    Hkv = k.shape[1]
    check_shape(op, "v", v, (B, Hkv, T, D), f"[B, Hkv, T, D] = [{B}, {Hkv}, {T}, {D}]")
    for name in ("cos", "sin"):
        check_shape(op, name, tensors[name], (B, T, D), f"[B, T, D] = [{B}, {T}, {D}]")
    check_shape(op, "k_cache", k_cache, (B, Hkv, None, D), f"[B, Hkv, S, D] = [{B}, {Hkv}, S, {D}]")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
    check_shape(op, "positions", positions, (B, T), f"int64 [B, T] = [{B}, {T}]")
    if D % 2:
        raise SwiftkernError(f"{op}: head_dim must be even for the rotate-half rotary embedding, got {D}")
    check_float(op, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    check_same_dtype(op, q=q, k=k, v=v, cos=cos, sin=sin)
    check_same_dtype(op, k_cache=k_cache, v_cache=v_cache)
    if positions.dtype != torch.int64:
        raise SwiftkernError(f"{op}: positions must be int64, got {positions.dtype}")
    check_cache_layout(op, k_cache, v_cache, one_layout=False)
    S = k_cache.shape[2]
    if uniform_start is not None:
        if not 0 <= uniform_start <= S - T:
            raise SwiftkernError(f"{op}: uniform_start {uniform_start} + T = {T} new tokens must fit in the "
                                 f"cache of S = {S} positions")
    elif max_len is not None:
        if max_len > S:
            raise SwiftkernError(f"{op}: max_len {max_len} is beyond the cache of S = {S} positions")
    else:
        check_range(op, "positions", positions, 0, S - 1, f"positions of a cache of S = {S}")
    backend = resolve(op, device.type)
    if backend == "reference":
        return reference.rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions, uniform_start)
    if backend in ("cpp", "cuda") and k_cache.dtype != q.dtype:  # the kernel's own check raised a RuntimeError
        raise SwiftkernError(f"{op}: the {backend} kernel writes the cache in q's dtype ({q.dtype}), got caches of "
                             f"{k_cache.dtype}: convert one side, or run the reference or Triton backend "
                             "(SWIFTKERN_BACKEND)")
    ns = torch.ops.swiftkern_triton if backend == "triton" else torch.ops.swiftkern
    return ns.rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions)


def keys_in_use(k_cache: torch.Tensor, v_cache: torch.Tensor, max_len: int | None):
    """The caches [B, Hkv, S, D] cut to their first max_len positions (views): the attention
    kernels never need keys past max_len. None: all S."""
    if max_len is not None and max_len < k_cache.shape[2]:
        return k_cache[:, :, :max_len], v_cache[:, :, :max_len]
    return k_cache, v_cache


def _check_attention(op: str, q, k_cache, v_cache, cache_lens, max_len) -> torch.device:
    """verify_attention's input checks (shapes, dtypes, lengths) -> the device."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_lens=cache_lens)
    check_tensors(op, **tensors)
    device = one_device(op, **tensors)
    check_shape(op, "q", q, (None, None, None, None), "4-D [B, Hq, T, D]")
    B, Hq, T, D = q.shape
    check_shape(op, "k_cache", k_cache, (B, None, None, D), f"[B, Hkv, S, D] = [{B}, Hkv, S, {D}]")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
    check_shape(op, "cache_lens", cache_lens, (B,), f"int64 [B] = [{B}]")
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise SwiftkernError(f"{op}: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    check_float(op, q=q, k_cache=k_cache, v_cache=v_cache)
    check_same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if cache_lens.dtype != torch.int64:
        raise SwiftkernError(f"{op}: cache_lens must be int64, got {cache_lens.dtype}")
    check_cache_layout(op, k_cache, v_cache, one_layout=True)
    if max_len is not None:
        if not T <= max_len <= S:
            raise SwiftkernError(f"{op}: max_len {max_len} must be in [T = {T}, S = {S}]")
    else:
        check_range(op, "cache_lens", cache_lens, T, S, f"each row holds its T = {T} new tokens in a cache of S = {S}")
    return device


def verify_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor, scale: float,
    max_len: int | None = None, mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of T new tokens per row against a KV cache with per-row lengths.

    Args:
        q: [B, Hq, T, D], the T newest tokens of each row (any strides).
        k_cache, v_cache: [B, Hkv, S, D], q's dtype; Hq a multiple of Hkv (GQA: query head h
            reads kv head h // (Hq // Hkv)).
        cache_lens: int64 [B], each row's length including its T new tokens, in [T, S].
        scale: the softmax scale (head_dim ** -0.5 for LLaMA).
        max_len: host-side hint, max(cache_lens) (no device sync to range-check then; only
            keys below it are read).
        mask: hint for the reference backend only, ``attention_mask(cache_lens, T, max_len)``
            or its ``reference.grouped_attention_bias`` computed once for all layers, or False
            when no key is masked.

    Query i of row b sees keys j < cache_lens[b] - T + i + 1 (causal within the new tokens).
    T = 1 is decode, T = k + 1 verification; every row has its own length, in one launch.
    Returns [B, Hq, T, D] in q's dtype (the Triton kernel returns a transposed view of a
    [B, T, Hq, D] buffer, so merging heads is free). Runs ``backend_for("verify_attention", q.device)``.
    """
    op = "verify_attention"
    device = _check_attention(op, q, k_cache, v_cache, cache_lens, max_len)
    scale = real(f"{op}: scale", scale)
    backend = resolve(op, device.type)
    if backend == "reference":
        return reference.verify_attention(q, k_cache, v_cache, cache_lens, scale, max_len, mask)
    k_cache, v_cache = keys_in_use(k_cache, v_cache, max_len)
    ns = torch.ops.swiftkern_triton if backend == "triton" else torch.ops.swiftkern
    return ns.verify_attention(q, k_cache, v_cache, cache_lens, scale)


def verify_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``verify_attention`` (same arguments and result) with every query in one fixed order of
    operations, whatever T, the GQA group and the other rows: a query's bits depend on its own
    q and keys alone, so decoding token by token, verifying k + 1 tokens and prefilling a whole
    prompt give the same bits. The C++ CPU kernel (``invariant_kernels_available``); on CUDA
    the Triton kernel in its fixed launch plan (``triton_kernels/verify_attention.py``); the
    reference (torch's SDPA) has no such guarantee."""
    op = "verify_attention_invariant"
    _check_attention(op, q, k_cache, v_cache, cache_lens, None)
    scale = real(f"{op}: scale", scale)
    return run(op, q.device, q, k_cache, v_cache, cache_lens, scale)


def kv_compact(k_cache: torch.Tensor, v_cache: torch.Tensor, src_positions: torch.Tensor,
               dst_start: torch.Tensor, counts: torch.Tensor) -> None:
    """Move each row's kept cache entries into one contiguous run, in place (all layers).

    Args:
        k_cache, v_cache: [L, B, H, S, D] (``KVCache.k`` / ``.v``), one float dtype and layout.
        src_positions: int64 [B, M]; row b keeps its first counts[b] entries, each in [0, S).
        dst_start: int64 [B], each >= 0, with dst_start[b] + counts[b] <= S.
        counts: int32 [B] (int64 is converted), each in [0, M].

    Entry i of row b (every layer and head) moves from src_positions[b, i] to dst_start[b] + i.
    Every source is read before any destination is written, so they may overlap. Values are
    range-checked on the host (one sync), except while torch.compile traces.
    Runs ``backend_for("kv_compact", k_cache.device)``.
    """
    op = "kv_compact"
    tensors = dict(k_cache=k_cache, v_cache=v_cache, src_positions=src_positions, dst_start=dst_start, counts=counts)
    check_tensors(op, **tensors)
    device = one_device(op, **tensors)
    check_shape(op, "k_cache", k_cache, (None,) * 5, "5-D [L, B, H, S, D]")
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
    check_float(op, k_cache=k_cache, v_cache=v_cache)
    check_same_dtype(op, k_cache=k_cache, v_cache=v_cache)
    check_cache_layout(op, k_cache, v_cache, one_layout=True)
    L, B, H, S, D = k_cache.shape
    check_shape(op, "src_positions", src_positions, (B, None), f"int64 [B, M] with B = {B}")
    check_shape(op, "dst_start", dst_start, (B,), f"int64 [B] = [{B}]")
    check_shape(op, "counts", counts, (B,), f"int32 [B] = [{B}]")
    if src_positions.dtype != torch.int64 or dst_start.dtype != torch.int64:
        raise SwiftkernError(f"{op}: src_positions and dst_start must be int64, got {src_positions.dtype}, "
                             f"{dst_start.dtype}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise SwiftkernError(f"{op}: counts must be int32 (or int64), got {counts.dtype}")
    M = src_positions.shape[1]
    check_range(op, "counts", counts, 0, M, f"entries kept of the M = {M} given")
    check_range(op, "dst_start", dst_start, 0, S, f"a position of the cache of S = {S}")
    if checking_values() and B:
        if bool((dst_start + counts > S).any()):
            raise SwiftkernError(f"{op}: dst_start[b] + counts[b] must be <= S = {S} for every row")
        used = torch.arange(M, device=device) < counts.unsqueeze(1)  # [B, M]
        if bool((used & ((src_positions < 0) | (src_positions >= S))).any()):
            raise SwiftkernError(f"{op}: the used src_positions must be in [0, S = {S})")
    counts = counts.to(torch.int32)
    run(op, device, k_cache, v_cache, src_positions, dst_start, counts)
