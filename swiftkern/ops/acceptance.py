"""The acceptance ops: which drafted tokens the full model keeps, greedy and by rejection
sampling (DESIGN.md section 3). Their contracts are public: other frameworks call them."""

from __future__ import annotations

import torch

from ..errors import SwiftkernError
from . import registry
from .backends import cpu_kernel, resolve, run
from .checks import FLOAT_DTYPES, check_num_draft, check_tensors, one_device


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor, *, max_draft: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of drafted tokens against the full model's logits (lossless).

    Args:
        draft_tokens: int64 [B, K]. Drafted tokens; row b uses only its first num_draft[b].
        target_logits: float32 | bfloat16 | float16 [B, K+1, V], V >= 1. The full model's
            logits at the K+1 verified positions: position j scores the token after draft j-1
            (position 0 follows the last committed token).
        num_draft: int32 [B] (int64 is accepted and converted), each in [0, K].
        max_draft: max(num_draft) when the caller knows it on the host (it built num_draft from
            a list): num_draft is then not read back from the device to be checked, so the call
            does not wait for the GPU (a speculative loop's one read a step stays its own). It is
            trusted: only max_draft itself is checked against K, so a num_draft above it is the
            caller's error, unreported.

    Returns:
        out_tokens: int64 [B, K+1]. Row b: its accepted drafts, then one target token (the
            corrected token at the first mismatch, or the bonus token when all num_draft[b]
            drafts were accepted), then -1 padding.
        num_accepted: int32 [B], in [0, num_draft[b]]; row b emits num_accepted[b] + 1 tokens.

    Target tokens are argmax(target_logits[b, j]) computed in fp32, ties to the lowest index,
    NaN counting as the maximum (as torch.argmax). Draft j is accepted while every draft
    before it was accepted, j < num_draft[b] and draft_tokens[b, j] equals the target token
    at position j. Inputs must share one device. Raises SwiftkernError on a bad shape, dtype,
    device or num_draft value (the value check is skipped while torch.compile traces, and
    replaced by max_draft's where given).
    Runs the backend of ``backend_for("greedy_accept", device)`` (see the module doc).
    """
    tensors = {"draft_tokens": draft_tokens, "target_logits": target_logits, "num_draft": num_draft}
    check_tensors("greedy_accept", **tensors)
    if draft_tokens.dim() != 2:
        raise SwiftkernError(f"greedy_accept: draft_tokens must be 2-D [B, K], got shape {tuple(draft_tokens.shape)}")
    if target_logits.dim() != 3:
        raise SwiftkernError("greedy_accept: target_logits must be 3-D [B, K+1, V], got shape "
                             f"{tuple(target_logits.shape)}")
    if num_draft.dim() != 1:
        raise SwiftkernError(f"greedy_accept: num_draft must be 1-D [B], got shape {tuple(num_draft.shape)}")
    B, K = draft_tokens.shape
    if tuple(target_logits.shape[:2]) != (B, K + 1):
        raise SwiftkernError(f"greedy_accept: target_logits must be [B, K+1, V] = [{B}, {K + 1}, V] for "
                             f"draft_tokens of shape [B, K] = [{B}, {K}], got {tuple(target_logits.shape)}")
    if num_draft.shape[0] != B:
        raise SwiftkernError(f"greedy_accept: num_draft must have one entry per row (B = {B}), "
                             f"got shape {tuple(num_draft.shape)}")
    if target_logits.shape[2] == 0:
        raise SwiftkernError("greedy_accept: target_logits has an empty vocabulary axis (V = 0)")
    one_device("greedy_accept", **tensors)
    if draft_tokens.dtype != torch.int64:
        raise SwiftkernError(f"greedy_accept: draft_tokens must be int64, got {draft_tokens.dtype}")
    if target_logits.dtype not in FLOAT_DTYPES:
        raise SwiftkernError("greedy_accept: target_logits must be float32, bfloat16 or float16, got "
                             f"{target_logits.dtype}")
    if num_draft.dtype not in (torch.int32, torch.int64):
        raise SwiftkernError(f"greedy_accept: num_draft must be int32 (or int64), got {num_draft.dtype}")
    check_num_draft("greedy_accept", num_draft, K, max_draft)
    num_draft = num_draft.to(torch.int32)
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    return run("greedy_accept", draft_tokens.device, draft_tokens, target_logits, num_draft)


def greedy_verify_here(device_type: str):
    """The C++ ``greedy_verify`` (csrc/greedy_verify_cpu.cpp) where ``greedy_accept`` and
    ``bi_max_exp_sum`` run their C++ kernels on ``device_type`` tensors (the CPU), else None. For
    callers whose inputs are valid by construction (a speculative step): ``greedy_verify(
    draft_tokens int64 [B, K], target_logits [B, K+1, V] contiguous along V, num_draft: list of B
    ints, logprobs: bool)`` -> (out_tokens int64 [B, K+1] as ``greedy_accept`` gives them, pending
    int64 [B]: out_tokens[b, num_accepted[b]], out_tokens' rows as lists, num_accepted as a list,
    with logprobs float32 [B, K+1]: ``bi_token_logprob``'s bits at each row's out tokens up to its
    num_accepted + 1, NaN past them; else None). The step's tail in one call: the op, a conversion,
    a gather, a read and the logprobs' ops each ran cold after the forward (~0.3 ms a SmolLM2 step
    on a 2-core AMD EPYC)."""
    if resolve("greedy_accept", device_type) != "cpp" or resolve("bi_max_exp_sum", device_type) != "cpp":
        return None
    return getattr(registry.extension, "greedy_verify", None)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row: ``torch.argmax(logits, -1)``'s answer (ties to the lowest
    index, NaN counting as the maximum), the same for every row wherever it sits.

    logits: float32 | bfloat16 | float16 [N, V], V >= 1 (rows may be strided; the vocabulary
    axis contiguous or not) -> int64 [N].

    A decode step is a verify step without drafts: on the CPU with the C++ kernels this is
    ``greedy_accept``'s kernel at K = 0 (one pass over the row in float32, order-preserving);
    a SmolLM2 row (V = 49152) takes ~8 us there against ~85 us for ``torch.argmax`` on the
    2-thread Xeon of 2026-11-28. Elsewhere ``torch.argmax`` (one launch on a GPU).
    """
    check_tensors("greedy_tokens", logits=logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise SwiftkernError(f"greedy_tokens: logits must be [N, V] with V >= 1, got shape {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise SwiftkernError(f"greedy_tokens: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    N = logits.shape[0]
    if N == 0 or not cpu_kernel("greedy_accept", logits.device.type):
        return logits.argmax(-1)
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    no_drafts = torch.empty(N, 0, dtype=torch.int64)  # [N, 0]
    out, _ = torch.ops.swiftkern.greedy_accept(no_drafts, rows.unsqueeze(1), torch.zeros(N, dtype=torch.int32))
    return out[:, 0]  # [N]


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    *,
    max_draft: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. / Chen et al.): emitted tokens follow target_probs.

    Args:
        draft_tokens: int64 [B, K]. Drafted tokens; row b uses only its first num_draft[b],
            which must lie in [0, V).
        draft_probs: float32 | bfloat16 | float16 [B, K, V], or None for a deterministic
            (greedy) draft, whose q is one-hot at the drafted token.
        target_probs: float32 | bfloat16 | float16 [B, K+1, V], V >= 1. The full model's
            probabilities at the K+1 verified positions (position j follows draft j-1).
        num_draft: int32 [B] (int64 is accepted and converted), each in [0, K].
        u_accept: float32 [B, K]; u_sample: float32 [B, K+1]. Uniforms in [0, 1), the only
            randomness, so every backend gives the same tokens for the same inputs.
        max_draft: max(num_draft) known on the host, as for ``greedy_accept`` (trusted): num_draft,
            the draft tokens and the uniforms are then not read back from the device to be checked.

    Returns:
        out_tokens: int64 [B, K+1]. Row b: its accepted drafts, then one drawn token, then -1.
        num_accepted: int32 [B], in [0, num_draft[b]]; row b emits num_accepted[b] + 1 tokens.

    Draft j of row b (token x) is accepted while every draft before it was, j < num_draft[b]
    and u_accept[b, j] * q_j(x) < p_j(x) (compared in float64). At the first rejection j the
    token is drawn from normalize(max(0, p_j - q_j)) with u_sample[b, j] (from p_j when that
    residual is all zero, which only rounding can cause); after all drafts the bonus token is
    drawn from p_{num_draft[b]} with u_sample[b, num_draft[b]]. A draw from weights w is the
    smallest i with cumsum(w)[i] > u * sum(w) (float64 left-to-right sums; V-1 if none).
    bfloat16/float16 probabilities are converted to float32 first. Inputs share one device,
    except an empty u_accept (K = 0), which may be anywhere. Raises SwiftkernError on a bad
    shape, dtype, device, num_draft, draft token or uniform value (value checks are skipped while
    torch.compile traces). Runs the backend of ``backend_for("rejection_sample", device)``.
    """
    def bad(msg):
        return SwiftkernError(f"rejection_sample: {msg}")

    tensors = {"draft_tokens": draft_tokens, "draft_probs": draft_probs, "target_probs": target_probs,
               "num_draft": num_draft, "u_accept": u_accept, "u_sample": u_sample}
    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (arg == "draft_probs" and t is None):
            raise bad(f"{arg} must be a torch.Tensor{' or None' if arg == 'draft_probs' else ''}, "
                      f"got {type(t).__name__}")
    if draft_probs is None:
        del tensors["draft_probs"]
    for arg, dims, shape in (("draft_tokens", 2, "[B, K]"), ("draft_probs", 3, "[B, K, V]"),
                             ("target_probs", 3, "[B, K+1, V]"), ("num_draft", 1, "[B]"),
                             ("u_accept", 2, "[B, K]"), ("u_sample", 2, "[B, K+1]")):
        if arg in tensors and tensors[arg].dim() != dims:
            raise bad(f"{arg} must be {dims}-D {shape}, got shape {tuple(tensors[arg].shape)}")
    B, K = draft_tokens.shape
    V = target_probs.shape[2]
    want = {"draft_probs": (B, K, V), "target_probs": (B, K + 1, V), "num_draft": (B,), "u_accept": (B, K),
            "u_sample": (B, K + 1)}
    for arg, shape in want.items():
        if arg in tensors and tuple(tensors[arg].shape) != shape:
            raise bad(f"{arg} must have shape {list(shape)} for draft_tokens [B, K] = [{B}, {K}] and "
                      f"target_probs [.., .., V = {V}], got {tuple(tensors[arg].shape)}")
    if V == 0:
        raise bad("target_probs has an empty vocabulary axis (V = 0)")
    if u_accept.numel() == 0:  # K = 0: callers build it anywhere (e.g. torch.zeros(B, 0) on the CPU)
        u_accept = u_accept.to(draft_tokens.device)
        tensors["u_accept"] = u_accept
    one_device("rejection_sample", **tensors)
    if draft_tokens.dtype != torch.int64:
        raise bad(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    for arg in ("draft_probs", "target_probs"):
        if arg in tensors and tensors[arg].dtype not in FLOAT_DTYPES:
            raise bad(f"{arg} must be float32, bfloat16 or float16, got {tensors[arg].dtype}")
    for arg in ("u_accept", "u_sample"):
        if tensors[arg].dtype != torch.float32:
            raise bad(f"{arg} must be float32, got {tensors[arg].dtype}")
    if num_draft.dtype not in (torch.int32, torch.int64):
        raise bad(f"num_draft must be int32 (or int64), got {num_draft.dtype}")
    hi = check_num_draft("rejection_sample", num_draft, K, max_draft)
    if hi is not None and max_draft is None:
        if K > 0 and hi > 0:  # one cheap reduction; the mask only when some draft is out of range
            lo, hi = (int(v) for v in torch.aminmax(draft_tokens))
            if lo < 0 or hi >= V:
                used = torch.arange(K, device=num_draft.device) < num_draft.unsqueeze(1)  # [B, K]
                out_of_vocab = used & ((draft_tokens < 0) | (draft_tokens >= V))
                if bool(out_of_vocab.any()):
                    b, j = (int(i) for i in out_of_vocab.nonzero()[0])
                    raise bad(f"draft_tokens[{b}, {j}] = {int(draft_tokens[b, j])} is outside the vocabulary "
                              f"[0, V = {V})")
        for arg, u in (("u_accept", u_accept), ("u_sample", u_sample)):  # u = 1 drew token V-1 at any probability
            outside = ~((u >= 0) & (u < 1))  # NaN too
            if bool(outside.any()):
                b, j = (int(i) for i in outside.nonzero()[0])
                raise bad(f"{arg}[{b}, {j}] = {float(u[b, j])} is not a uniform in [0, 1)")
    num_draft = num_draft.to(torch.int32)
    target_probs = target_probs.to(torch.float32)
    if target_probs.stride(-1) != 1:
        target_probs = target_probs.contiguous()
    if draft_probs is not None:
        draft_probs = draft_probs.to(torch.float32)
        if draft_probs.stride(-1) != 1:
            draft_probs = draft_probs.contiguous()
    args = (draft_tokens, draft_probs, target_probs, num_draft, u_accept, u_sample)
    return run("rejection_sample", draft_tokens.device, *args)
