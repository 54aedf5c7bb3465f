"""The kernels of swiftkern, one function per op; the only module that imports kernels.

Each op is a ``torch.ops.swiftkern.<op>`` custom op with a fake (meta) impl, so it works under
``torch.compile``. Per device the op runs the compiled kernel of ``swiftkern._C`` when the
extension has one (``cpp`` on CPU, ``cuda`` on GPU) and otherwise ``swiftkern/reference.py``
registered for that device. Ops that have no kernel yet are the reference functions themselves.
``backend_info()`` says which is in use; nothing falls back silently.

``SWIFTKERN_BACKEND`` (read at import; ``set_backend`` changes it later) picks what the public
wrappers call: ``auto`` (default) the registered op, ``reference`` the reference functions
directly, ``cpp`` the registered op but an error when swiftkern._C was not built.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings

import torch

from . import reference
from .errors import SwiftkernError

# ops without kernels yet: the reference functions (same signatures)
rms_norm = reference.rms_norm
fused_add_rms_norm = reference.fused_add_rms_norm
silu_mul = reference.silu_mul
apply_rope = reference.apply_rope
rope_kv_append = reference.rope_kv_append
attention_mask = reference.attention_mask
verify_attention = reference.verify_attention

_SCHEMAS = {
    "greedy_accept": "(Tensor draft_tokens, Tensor target_logits, Tensor num_draft) -> (Tensor, Tensor)",
    "skinny_linear": "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "rejection_sample": ("(Tensor draft_tokens, Tensor? draft_probs, Tensor target_probs, Tensor num_draft, "
                         "Tensor u_accept, Tensor u_sample) -> (Tensor, Tensor)"),
}
_BACKENDS = ("auto", "reference", "cpp")
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # importing it registers the schemas and the compiled kernels in torch.ops.swiftkern
    _C = importlib.import_module(__package__ + "._C")
    _EXTENSION = "built (cpu+cuda)" if _C.build_info()["cuda"] else "built (cpu)"
except ImportError as e:
    _C = None
    if isinstance(e, ModuleNotFoundError) and e.name == __package__ + "._C":
        _EXTENSION = ("not built: swiftkern._C is not installed (SWIFTKERN_BUILD_EXT=0, torch missing "
                      "at build time, or the compile failed; reinstall with "
                      "`pip install --no-build-isolation -e .` and `-v` to see why)")
    else:
        _EXTENSION = f"not built: swiftkern._C failed to import ({e}); rebuild it against this torch"
        warnings.warn(f"swiftkern: {_EXTENSION}; using the reference ops", RuntimeWarning, stacklevel=2)

# What this module registered, kept for the whole process so that a reload or a second import
# neither registers twice nor mistakes its own reference kernels for compiled ones.
_STATE = sys.modules.get("swiftkern._ops_state")
if _STATE is None:
    _STATE = types.ModuleType("swiftkern._ops_state")
    _STATE.reference_kernels = set()  # {(op, dispatch key)}
    _STATE.fakes = set()
    sys.modules["swiftkern._ops_state"] = _STATE


def _register(name: str, ref_fn, fake_fn) -> dict:
    """Make torch.ops.swiftkern.<name> exist with CPU, CUDA and fake impls -> {device: backend}."""
    qual = f"swiftkern::{name}"
    if not hasattr(torch.ops.swiftkern, name):
        torch.library.define(qual, _SCHEMAS[name])
    used = {}
    for key, compiled in (("CPU", "cpp"), ("CUDA", "cuda")):
        mine = (name, key) in _STATE.reference_kernels
        if not mine and torch._C._dispatch_has_kernel_for_dispatch_key(qual, key):
            used[key.lower()] = compiled
            continue
        if not mine:
            torch.library.impl(qual, key, ref_fn)
            _STATE.reference_kernels.add((name, key))
        used[key.lower()] = "reference"
    if name not in _STATE.fakes:
        torch.library.register_fake(qual, fake_fn)
        _STATE.fakes.add(name)
    return used


def _greedy_accept_fake(draft_tokens, target_logits, num_draft):
    B, K = draft_tokens.shape
    return (draft_tokens.new_empty((B, K + 1), dtype=torch.int64),
            num_draft.new_empty((B,), dtype=torch.int32))


def _skinny_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _rejection_sample_fake(draft_tokens, draft_probs, target_probs, num_draft, u_accept, u_sample):
    B, K = draft_tokens.shape
    return (draft_tokens.new_empty((B, K + 1), dtype=torch.int64),
            num_draft.new_empty((B,), dtype=torch.int32))


_OPS = {"greedy_accept": _register("greedy_accept", reference.greedy_accept, _greedy_accept_fake),
        "skinny_linear": _register("skinny_linear", reference.skinny_linear, _skinny_linear_fake),
        "rejection_sample": _register("rejection_sample", reference.rejection_sample, _rejection_sample_fake)}
for _name in ("rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append", "verify_attention"):
    _OPS[_name] = {"cpu": "reference", "cuda": "reference"}


def set_backend(name: str) -> None:
    """Choose what the public wrappers call: 'auto', 'reference' or 'cpp' (see module doc)."""
    global _BACKEND
    _BACKEND = name


set_backend(os.environ.get("SWIFTKERN_BACKEND", "auto").strip().lower() or "auto")


def _backend() -> str:
    if _BACKEND not in _BACKENDS:
        raise SwiftkernError(f"SWIFTKERN_BACKEND must be one of {', '.join(_BACKENDS)}, got {_BACKEND!r}")
    if _BACKEND == "cpp" and _C is None:
        raise SwiftkernError(f"SWIFTKERN_BACKEND=cpp but the extension is {_EXTENSION}; "
                             "unset it or set it to auto to use the reference ops")
    return _BACKEND


def backend_info() -> dict:
    """{"extension": "built (cpu)" | "built (cpu+cuda)" | "not built: <reason>",
    "build": swiftkern._C.build_info() or None, "swiftkern_backend": auto|reference|cpp,
    "ops": {op: {"cpu": "cpp" | "reference", "cuda": "cuda" | "reference"}}}.

    With SWIFTKERN_BACKEND=reference every op reports "reference" (the wrappers bypass the
    kernels)."""
    forced = _BACKEND == "reference"
    ops = {op: {dev: "reference" if forced else b for dev, b in devs.items()} for op, devs in _OPS.items()}
    return {"extension": _EXTENSION, "build": _C.build_info() if _C is not None else None,
            "swiftkern_backend": _BACKEND, "ops": ops}


info = backend_info


def _check_num_draft(op: str, num_draft: torch.Tensor, K: int) -> int | None:
    """Raise unless every num_draft is in [0, K]; -> max(num_draft), or None when not checked
    (empty batch, or while torch.compile traces)."""
    if torch.compiler.is_compiling() or num_draft.numel() == 0:
        return None
    lo, hi = (int(v) for v in torch.aminmax(num_draft))
    if lo < 0 or hi > K:
        raise SwiftkernError(f"{op}: num_draft values must be in [0, K = {K}], got min {lo}, max {hi}")
    return hi


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of drafted tokens against the full model's logits (lossless).

    Args:
        draft_tokens: int64 [B, K]. Drafted tokens; row b uses only its first num_draft[b].
        target_logits: float32 | bfloat16 | float16 [B, K+1, V], V >= 1. The full model's
            logits at the K+1 verified positions: position j scores the token after draft j-1
            (position 0 follows the last committed token).
        num_draft: int32 [B] (int64 is accepted and converted), each in [0, K].

    Returns:
        out_tokens: int64 [B, K+1]. Row b: its accepted drafts, then one target token (the
            corrected token at the first mismatch, or the bonus token when all num_draft[b]
            drafts were accepted), then -1 padding.
        num_accepted: int32 [B], in [0, num_draft[b]]; row b emits num_accepted[b] + 1 tokens.

    Target tokens are argmax(target_logits[b, j]) computed in fp32, ties to the lowest index,
    NaN counting as the maximum (as torch.argmax). Draft j is accepted while every draft
    before it was accepted, j < num_draft[b] and draft_tokens[b, j] equals the target token
    at position j. Inputs must share one device. Raises SwiftkernError on a bad shape, dtype,
    device or num_draft value (the value check is skipped while torch.compile traces).
    Runs ``torch.ops.swiftkern.greedy_accept``: see ``backend_info()`` for the kernel in use.
    """
    tensors = {"draft_tokens": draft_tokens, "target_logits": target_logits, "num_draft": num_draft}
    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise SwiftkernError(f"greedy_accept: {arg} must be a torch.Tensor, got {type(t).__name__}")
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
    devices = {arg: t.device for arg, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise SwiftkernError("greedy_accept: all inputs must be on one device, got "
                             + ", ".join(f"{arg} on {d}" for arg, d in devices.items()))
    if draft_tokens.dtype != torch.int64:
        raise SwiftkernError(f"greedy_accept: draft_tokens must be int64, got {draft_tokens.dtype}")
    if target_logits.dtype not in _LOGIT_DTYPES:
        raise SwiftkernError("greedy_accept: target_logits must be float32, bfloat16 or float16, got "
                             f"{target_logits.dtype}")
    if num_draft.dtype not in (torch.int32, torch.int64):
        raise SwiftkernError(f"greedy_accept: num_draft must be int32 (or int64), got {num_draft.dtype}")
    _check_num_draft("greedy_accept", num_draft, K)
    num_draft = num_draft.to(torch.int32)
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    if _backend() == "reference":
        return reference.greedy_accept(draft_tokens, target_logits, num_draft)
    return torch.ops.swiftkern.greedy_accept(draft_tokens, target_logits, num_draft)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
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
    shape, dtype, device, num_draft or draft token value (value checks are skipped while
    torch.compile traces). Runs ``torch.ops.swiftkern.rejection_sample`` (see
    ``backend_info()``), or ``reference.rejection_sample`` with SWIFTKERN_BACKEND=reference.
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
    devices = {arg: t.device for arg, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise bad("all inputs must be on one device, got " + ", ".join(f"{a} on {d}" for a, d in devices.items()))
    if draft_tokens.dtype != torch.int64:
        raise bad(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    for arg in ("draft_probs", "target_probs"):
        if arg in tensors and tensors[arg].dtype not in _LOGIT_DTYPES:
            raise bad(f"{arg} must be float32, bfloat16 or float16, got {tensors[arg].dtype}")
    for arg in ("u_accept", "u_sample"):
        if tensors[arg].dtype != torch.float32:
            raise bad(f"{arg} must be float32, got {tensors[arg].dtype}")
    if num_draft.dtype not in (torch.int32, torch.int64):
        raise bad(f"num_draft must be int32 (or int64), got {num_draft.dtype}")
    hi = _check_num_draft("rejection_sample", num_draft, K)
    if hi is not None:
        if K > 0 and hi > 0:  # one cheap reduction; the mask only when some draft is out of range
            lo, hi = (int(v) for v in torch.aminmax(draft_tokens))
            if lo < 0 or hi >= V:
                used = torch.arange(K, device=num_draft.device) < num_draft.unsqueeze(1)  # [B, K]
                out_of_vocab = used & ((draft_tokens < 0) | (draft_tokens >= V))
                if bool(out_of_vocab.any()):
                    b, j = (int(i) for i in out_of_vocab.nonzero()[0])
                    raise bad(f"draft_tokens[{b}, {j}] = {int(draft_tokens[b, j])} is outside the vocabulary "
                              f"[0, V = {V})")
    num_draft = num_draft.to(torch.int32)
    target_probs = target_probs.to(torch.float32)
    if target_probs.stride(-1) != 1:
        target_probs = target_probs.contiguous()
    if draft_probs is not None:
        draft_probs = draft_probs.to(torch.float32)
        if draft_probs.stride(-1) != 1:
            draft_probs = draft_probs.contiguous()
    args = (draft_tokens, draft_probs, target_probs, num_draft, u_accept, u_sample)
    if _backend() == "reference":
        return reference.rejection_sample(*args)
    return torch.ops.swiftkern.rejection_sample(*args)


SKINNY_MAX_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, the projection every layer of the model runner uses.

    x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N]. On the CPU with float32 and at
    most SKINNY_MAX_ROWS rows (decode, verification, drafting) it runs the C++ ``skinny_linear``
    kernel: one pass over the weight, each output a fixed-order dot product whatever the number
    of rows (so a row's result does not depend on the batch). Other cases, and
    SWIFTKERN_BACKEND=reference, use torch's matmul (``reference.skinny_linear``); the two agree
    to float32 rounding. ``backend_info()["ops"]["skinny_linear"]`` says which kernel is built.
    """
    if (_OPS["skinny_linear"]["cpu"] == "cpp" and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.numel() <= SKINNY_MAX_ROWS * x.shape[-1]
            and _backend() != "reference"):
        return torch.ops.swiftkern.skinny_linear(x, weight, bias)
    return reference.skinny_linear(x, weight, bias)


__all__ = ["greedy_accept", "linear", "rejection_sample", "rms_norm", "fused_add_rms_norm", "silu_mul",
           "apply_rope", "rope_kv_append", "attention_mask", "verify_attention", "backend_info", "info",
           "set_backend"]
