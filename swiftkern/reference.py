"""Plain PyTorch twins of every swiftkern op.

Each function here has the same signature as the op of the same name in ``swiftkern.ops``
and is the definition the kernels are tested against. They favour clarity over speed, but
the model runner also uses them as its CPU path, so the numerics mirror HF transformers'
LLaMA modules operation for operation (that is what keeps greedy output token-identical).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF LlamaRMSNorm: reduce in float32, scale in the input dtype.

    x: [..., H], weight: [H] -> [..., H] (dtype of weight * x.dtype promotion, as HF)
    """
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns (rms_norm(x + residual), x + residual).

    x, residual: [N, H]; weight: [H] -> normed [N, H], new_residual [N, H]
    """
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for a few rows (decode, verification). x: [..., K] (``ops.linear``
    runs the C++ kernel where ``ops.skinny_fits``); weight: [N, K]; bias: [N] or None
    -> [..., N]"""
    return torch.nn.functional.linear(x, weight, bias)


def skinny_linear_group(x: torch.Tensor, weights: list[torch.Tensor],
                        biases: list[torch.Tensor | None]) -> torch.Tensor:
    """``skinny_linear(x, w, b)`` for each weight and its bias, side by side: x: [..., K];
    weights: 1 to 3 of [N_i, K]; biases: [N_i] or None each -> [..., sum N_i] (a layer's q, k
    and v; the twin of the Triton ``skinny_linear_group``, one launch)."""
    return torch.cat([skinny_linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def skinny_silu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``skinny_linear(silu_mul(gate, up), weight, bias)``: a layer's down projection of its
    SwiGLU (the twin of the Triton ``skinny_silu_linear``, one launch). gate, up: [..., I];
    weight: [N, I]; bias: [N] or None -> [..., N]"""
    return skinny_linear(silu_mul(gate, up), weight, bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with the weight given packed (``packed_weights.pack``): x: float32
    [..., K]; packed: uint8 [N, K/32, 20 | 34]; bias: [N] or None -> [..., N]"""
    from .packed_weights import unpack

    return torch.nn.functional.linear(x, unpack(packed), bias)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: silu(gate) * up.  gate, up: [..., I] -> [..., I]"""
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF (rotate-half convention).

    x: [B, H, T, D]; cos, sin: [B, T, D] -> [B, H, T, D]
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    uniform_start: int | None = None,
) -> torch.Tensor:
    """Rotate q and k, write k and v into the cache at each row's own positions.

    q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; cos, sin: [B, T, D];
    k_cache, v_cache: [B, Hkv, S, D] (written in place); positions: int64 [B, T] (< S);
    uniform_start: host-side hint that every row starts at this position (a slice write).
    -> rotated q [B, Hq, T, D]
    """
    q_rot = apply_rope(q, cos, sin)
    k_rot = apply_rope(k, cos, sin)
    T = q.shape[2]
    if uniform_start is not None:
        k_cache[:, :, uniform_start:uniform_start + T] = k_rot
        v_cache[:, :, uniform_start:uniform_start + T] = v
        return q_rot
    rows = torch.arange(q.shape[0], device=q.device).unsqueeze(1).expand_as(positions)
    # advanced indices on dims 0 and 2 -> the indexed view has shape [B, T, Hkv, D]
    k_cache[rows, :, positions] = k_rot.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
    return q_rot


def kv_compact(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_positions: torch.Tensor,
    dst_start: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Move each row's kept cache entries into one contiguous run (in place).

    k_cache, v_cache: [L, B, H, S, D] (written in place); src_positions: int64 [B, M], the
    positions of row b's entries to keep (only the first counts[b] are used; each in [0, S));
    dst_start: int64 [B]; counts: int32 [B] in [0, M]. Entry i of row b (every layer and head)
    moves from src_positions[b, i] to dst_start[b] + i, which must be < S. Every source is read
    before any destination is written, so sources and destinations may overlap.
    """
    B, M = src_positions.shape
    for b in range(B):
        n = int(counts[b])
        if n == 0:
            continue
        src = src_positions[b, :n].to(torch.int64)
        start = int(dst_start[b])
        for cache in (k_cache, v_cache):
            kept = cache[:, b].index_select(2, src)  # [L, H, n, D], a copy
            cache[:, b, :, start:start + n] = kept


def attention_mask(cache_lens: torch.Tensor, num_new: int, max_len: int) -> torch.Tensor:
    """bool [B, T, max_len]: query i of row b sees keys j < cache_lens[b] - T + i + 1."""
    key_pos = torch.arange(max_len, device=cache_lens.device)
    limit = (cache_lens - num_new).unsqueeze(1) + torch.arange(1, num_new + 1, device=cache_lens.device)
    return key_pos.view(1, 1, max_len) < limit.unsqueeze(2)


def grouped_attention_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``attention_mask``'s bool [B, T, max_len] as the additive bias verify_attention hands to
    SDPA: float [B, 1, group * T, max_len], 0 where a key is seen and -inf where not, in the
    layout of the query heads of one kv head folded into the query axis. SDPA turns a bool
    mask into this bias itself on every call; built once it serves every layer of a forward."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.unsqueeze(1).repeat(1, 1, group, 1)


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    scale: float,
    max_len: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of T new tokens per row against a cache with per-row lengths.

    q: [B, Hq, T, D] (the T newest tokens of each row); k_cache, v_cache: [B, Hkv, S, D];
    cache_lens: int64 [B], each row's length *including* its T new tokens (>= T).
    Query i of row b attends to keys j < cache_lens[b] - T + i + 1 (causal in the chunk).
    Hq must be a multiple of Hkv (GQA: query head h reads kv head h // (Hq // Hkv)).
    Hints a caller may pass to save work: max_len, the host-side max(cache_lens); mask,
    ``attention_mask(cache_lens, T, max_len)`` or its ``grouped_attention_bias`` computed once
    for all layers, or False when no key needs masking (T = 1 and all rows of length
    max_len). -> [B, Hq, T, D]
    """
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    if max_len is None:
        max_len = int(cache_lens.max())
    if mask is None:
        mask = attention_mask(cache_lens, T, max_len)
    # fold the query heads of one kv head into the query axis: no copy of the cache
    q_grouped = q.reshape(B, Hkv, group * T, D)
    attn_mask = None
    if mask is not False:
        # [B, 1, group*T, max_len]
        attn_mask = mask if mask.dim() == 4 else grouped_attention_bias(mask, group, q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_grouped, k_cache[:, :, :max_len], v_cache[:, :, :max_len], attn_mask=attn_mask, scale=scale
    )
    return out.reshape(B, Hq, T, D)  # not .view: SDPA on CUDA returns other strides than on the CPU


def verify_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The twin of the C++ ``verify_attention_invariant``: the same attention (``verify_attention``'s
    contract) in torch's arithmetic. Equal to the kernel to float rounding only; the kernel's
    point, a query's bits independent of T and of the batch, is its own."""
    return verify_attention(q, k_cache, v_cache, cache_lens, scale)


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of drafted tokens against the full model's logits.

    draft_tokens: int64 [B, K] (row b uses its first num_draft[b]);
    target_logits: float [B, K+1, V]; num_draft: int32 [B] in [0, K].
    Returns out_tokens int64 [B, K+1]: the accepted drafts, then the target's argmax at the
    first mismatch (or the bonus token after all drafts), then -1; and num_accepted int32 [B].
    Argmax ties go to the lowest index (as torch.argmax).
    """
    B, K = draft_tokens.shape
    target = target_logits.argmax(dim=-1)  # [B, K+1]
    cols = torch.arange(K, device=draft_tokens.device)
    in_draft = cols.unsqueeze(0) < num_draft.to(torch.int64).unsqueeze(1)  # [B, K]
    match = (draft_tokens == target[:, :K]) & in_draft
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    out = torch.full((B, K + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    all_cols = torch.arange(K + 1, device=draft_tokens.device).unsqueeze(0)
    padded_draft = torch.cat([draft_tokens, out[:, :1]], dim=1)
    accepted = all_cols < num_accepted.unsqueeze(1)
    out = torch.where(accepted, padded_draft, out)
    final = target.gather(1, num_accepted.unsqueeze(1))  # [B, 1]
    out.scatter_(1, num_accepted.unsqueeze(1), final)
    return out, num_accepted.to(torch.int32)


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The smallest i with cumsum(w)[i] > u * sum(w). weights: [V] (non-negative)."""
    cdf = weights.to(torch.float64).cumsum(0)
    idx = int(torch.searchsorted(cdf, (u * cdf[-1]).unsqueeze(0), right=True))
    return min(idx, weights.shape[0] - 1)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. / Chen et al.): the output follows target_probs.

    draft_tokens: int64 [B, K]; draft_probs: float [B, K, V] or None (a deterministic draft:
    q is one-hot at the drafted token); target_probs: float [B, K+1, V]; num_draft: int32 [B];
    u_accept: float32 [B, K], u_sample: float32 [B, K+1], uniforms in [0, 1).
    Draft j of row b is accepted while u_accept[b, j] * q(x) < p(x). At the first rejection j
    the token is drawn from normalize(max(0, p_j - q_j)) with u_sample[b, j] (from p_j if that
    residual is all zero, which only rounding can cause); after all num_draft[b] drafts the
    bonus token is drawn from target_probs[b, num_draft[b]] with u_sample[b, num_draft[b]].
    A draw from weights w is the smallest i with cumsum(w)[i] > u * sum(w).
    Returns out_tokens int64 [B, K+1] (accepted drafts, the drawn token, then -1) and
    num_accepted int32 [B].
    """
    B, K = draft_tokens.shape
    out = torch.full((B, K + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    num_accepted = torch.zeros(B, dtype=torch.int32, device=draft_tokens.device)
    for b in range(B):
        n = int(num_draft[b])
        j = 0
        while j < n:
            x = int(draft_tokens[b, j])
            p = float(target_probs[b, j, x])
            q = 1.0 if draft_probs is None else float(draft_probs[b, j, x])
            if not float(u_accept[b, j]) * q < p:
                break
            out[b, j] = x
            j += 1
        num_accepted[b] = j
        p_row = target_probs[b, j].to(torch.float64)
        if j < n:  # rejected: draw from the residual
            if draft_probs is None:
                q_row = torch.zeros_like(p_row)
                q_row[int(draft_tokens[b, j])] = 1.0
            else:
                q_row = draft_probs[b, j].to(torch.float64)
            residual = (p_row - q_row).clamp_min(0.0)
            weights = residual if float(residual.sum()) > 0 else p_row
        else:
            weights = p_row
        out[b, j] = _inverse_cdf(weights, float(u_sample[b, j]))
    return out, num_accepted


BI_LANES = 16  # partial sums per output of the fixed-order dot product (as csrc/skinny_linear_cpu.cpp)


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batch-invariant matmul: a @ b accumulated in float32, each row of the result independent
    of the other rows and of M. a: [M, K], b: [K, N] -> [M, N] in a's dtype.

    Invariant by construction, with no library reduction: K is cut into BI_LANES lanes (lane l
    sums a[m, k] * b[k, n] for k = l mod BI_LANES in increasing k, one elementwise multiply and
    add per step), then the lanes are summed by halving. Every element goes through the same
    elementwise ops whatever M, N or the row's place (a GEMM library may pick its kernel, and
    with it the order of the sum, by M: MKL did on one of our CPUs). The C++ kernel
    (``ops.bi_matmul`` on the CPU) follows the same order with fused multiply-adds.
    """
    M, K = a.shape
    N = b.shape[1]
    pad = -K % BI_LANES
    C = (K + pad) // BI_LANES
    a3 = torch.nn.functional.pad(a.to(torch.float32), (0, pad)).view(M, C, BI_LANES)  # [M, C, L]
    w3 = torch.nn.functional.pad(b.t().to(torch.float32), (0, pad)).view(N, C, BI_LANES)  # [N, C, L]
    out = torch.empty((M, N), dtype=torch.float32, device=a.device)
    rows = max(1, (1 << 22) // max(N * BI_LANES, 1))  # bound the [rows, N, L] partial sums
    for m0 in range(0, M, rows):
        xa = a3[m0:m0 + rows]
        acc = torch.zeros((xa.shape[0], N, BI_LANES), dtype=torch.float32, device=a.device)
        for c in range(a3.shape[1]):
            acc = acc + xa[:, None, c] * w3[None, :, c]
        width = BI_LANES
        while width > 1:
            width //= 2
            acc = acc[..., :width] + acc[..., width:2 * width]
        out[m0:m0 + rows] = acc[..., 0]
    return out.to(a.dtype)


def bi_matmul_swiglu(gate: torch.Tensor, up: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``bi_matmul(silu_mul(gate, up), b)``: a layer's down projection of its SwiGLU, the twin of
    the Triton ``bi_matmul_swiglu`` (one launch). gate, up: [M, K]; b: [K, N] -> [M, N]"""
    return bi_matmul(silu_mul(gate, up), b)


def bi_matmul_group(a: torch.Tensor, bs: list[torch.Tensor]) -> torch.Tensor:
    """``bi_matmul(a, b)`` for each b of bs, side by side: a: [M, K], bs: weights [K, N_i] ->
    [M, sum N_i] in a's dtype (a layer's q, k and v in one op; each column's bits are those
    of its own ``bi_matmul``)."""
    return torch.cat([bi_matmul(a, b) for b in bs], dim=1)


_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.4286068203094172e-06  # ln 2 = hi + lo, hi exact in 16 bits
_EXP_TAYLOR = [1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0]  # degree 7, Horner order


def bi_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32 from single IEEE operations only: the same bits for an element
    whatever the tensor's size, layout, SIMD path or threads (a library exp need not give
    them: torch.exp on the CPU once did not). x: any shape -> float32.

    x = n ln2 + r with n = round(x log2 e) and |r| <= ln2 / 2 (ln 2 split in two so n ln2 is
    exact); exp(r) by its degree-7 Taylor polynomial (truncation < 3e-9 relative); 2^n built
    from its exponent bits. Relative error a few float32 ulps; below -87 (and -inf) -> 0,
    above 88 saturates at exp(88) (the callers subtract a maximum first: never positive).
    """
    x = x.to(torch.float32)
    tiny = x < -87.0  # exp < 1.7e-38: flushed to 0 (as exp(-inf))
    x = torch.clamp(x, min=-87.0, max=88.0)
    n = torch.round(torch.mul(x, _LOG2E))
    r = torch.sub(torch.sub(x, torch.mul(n, _LN2_HI)), torch.mul(n, _LN2_LO))
    p = torch.full_like(r, _EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        p = torch.add(torch.mul(p, r), c)
    scale = torch.bitwise_left_shift(n.to(torch.int32) + 127, 23).view(torch.float32)  # 2^n
    return torch.mul(p, scale).masked_fill(tiny, 0.0)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in an order fixed by its length alone: [..., N] -> float32 [..., 1].

    The axis is zero-padded to a multiple of 64, halved with elementwise adds while its length
    is even, and the odd rest (at most a few columns) is added column after column. Every step
    is elementwise, so the order of additions depends on N only, never on the other rows or on
    the tensor's layout.
    """
    x = x.to(torch.float32)
    n = x.shape[-1]
    if n % 64:
        x = torch.nn.functional.pad(x, (0, 64 - n % 64))
    while x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., :1]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j:j + 1]
    return total


def bi_exp_sum(x: torch.Tensor) -> torch.Tensor:
    """tree_sum(bi_exp(x)): the softmax denominator of the deterministic verifier, in an order
    fixed by the row length alone. x: float32 [..., V], V >= 1 -> float32 [..., 1]"""
    return tree_sum(bi_exp(x))


def bi_max_exp_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax's shift and denominator of each row: (top, bi_exp_sum(x - top)) with top =
    x.amax(-1) (NaN where the row holds one). x: float32 [..., V], V >= 1 -> (float32 [..., 1],
    float32 [..., 1])"""
    x = x.to(torch.float32)
    top = x.amax(dim=-1, keepdim=True)
    return top, bi_exp_sum(x - top)


def top_p_cut(sorted_values: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Where HF's top-p rule cuts each row, from the row sorted ascending and its softmax:
    the number m of sorted positions whose cumulative probability (``cumsum``) is <= 1 - top_p
    (never the last), where those are exactly the first m and the m-th sorted value is below the
    (m+1)-th; else -1 (the cut is not a prefix, or it splits a tie, so which copy goes depends on
    the sort's order). sorted_values, probs: float32 [N, V], V >= 1 -> int64 [N]"""
    removed = probs.cumsum(dim=-1) <= (1 - top_p)  # [N, V]
    removed[..., -1] = False
    cut = removed.sum(dim=-1)  # [N]
    first_kept = removed.view(torch.uint8).argmin(dim=-1)  # [N] (the last is kept)
    smallest_kept = sorted_values.gather(-1, cut.unsqueeze(-1)).squeeze(-1)  # [N]
    largest_removed = sorted_values.gather(-1, (cut - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [N]
    exact = (first_kept == cut) & ((cut == 0) | (largest_removed < smallest_kept))
    return torch.where(exact, cut, torch.full_like(cut, -1))
