"""The kernels of swiftkern, one function per op; the only module that imports kernels.

Every op exists in two custom-op namespaces, each with a fake (meta) impl for torch.compile:
``torch.ops.swiftkern.<op>`` runs the compiled kernel of ``swiftkern._C`` when the extension
has one for the device (``cpp`` on CPU, ``cuda`` on GPU) and otherwise the function of the same
name in ``swiftkern/reference.py``; ``torch.ops.swiftkern_triton.<op>`` runs the Triton kernel
of ``swiftkern.triton_kernels`` (CUDA; also CPU tensors under ``TRITON_INTERPRET=1``), and is
imported lazily, so ``import swiftkern`` never imports triton.

The public wrappers below validate their inputs (SwiftkernError saying what is wrong) and run
the backend chosen by ``SWIFTKERN_BACKEND`` (read at import; ``set_backend`` changes it):

  auto       CPU: cpp when built for the op, else reference. CUDA: cuda when built for the op,
             else triton when available for the op, else reference.
  reference  the reference functions, everywhere.
  cpp | triton | cuda   that backend for every op and device; an op or device it does not
             cover raises SwiftkernError (never a silent fallback).

``backend_info()`` (and ``swiftkern info``) shows per op and device what runs and what is built.
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

apply_rope = reference.apply_rope
attention_mask = reference.attention_mask

_SCHEMAS = {
    "greedy_accept": "(Tensor draft_tokens, Tensor target_logits, Tensor num_draft) -> (Tensor, Tensor)",
    "skinny_linear": "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "rejection_sample": ("(Tensor draft_tokens, Tensor? draft_probs, Tensor target_probs, Tensor num_draft, "
                         "Tensor u_accept, Tensor u_sample) -> (Tensor, Tensor)"),
    "rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "silu_mul": "(Tensor gate, Tensor up) -> Tensor",
    "rope_kv_append": ("(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
                       "Tensor(b!) v_cache, Tensor positions) -> Tensor"),
    "verify_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, float scale) -> Tensor",
    "verify_attention_invariant": ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, float scale) "
                                   "-> Tensor"),
    "kv_compact": ("(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src_positions, Tensor dst_start, "
                   "Tensor counts) -> ()"),
    "bi_exp": "(Tensor x) -> Tensor",
    "bi_exp_sum": "(Tensor x) -> Tensor",
    "packed_linear": "(Tensor x, Tensor packed, Tensor? bias) -> Tensor",
}
_BACKENDS = ("auto", "reference", "cpp", "triton", "cuda")
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_DTYPES = _LOGIT_DTYPES

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


# fake impls of torch.ops.swiftkern.<op>: the layouts of the reference and compiled kernels

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


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return _rms_norm_fake(x, weight, eps), torch.empty_like(x, memory_format=torch.contiguous_format)


def _silu_mul_fake(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _rope_kv_append_fake(q, k, v, cos, sin, k_cache, v_cache, positions):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _verify_attention_fake(q, k_cache, v_cache, cache_lens, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


_verify_attention_invariant_fake = _verify_attention_fake


def _kv_compact_fake(k_cache, v_cache, src_positions, dst_start, counts):
    return None


def _bi_exp_fake(x):
    return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)


def _bi_exp_sum_fake(x):
    return x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _packed_linear_fake(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


# op -> {"cpu": "cpp" | "reference", "cuda": "cuda" | "reference"}: what torch.ops.swiftkern runs
_OPS = {name: _register(name, getattr(reference, name), globals()[f"_{name}_fake"]) for name in _SCHEMAS}


# ------------------------------------------------------------------------- Triton (lazy)

_TRITON = {"loaded": False, "error": None}


def _triton_ops(device_type: str) -> set:
    """Ops with a Triton kernel for this device type; imports swiftkern.triton_kernels (and
    triton) on first use and remembers why that failed, if it did."""
    if not _TRITON["loaded"]:
        _TRITON["loaded"] = True
        try:
            importlib.import_module(__package__ + ".triton_kernels")
        except Exception as e:  # ImportError without triton; anything a broken triton raises
            _TRITON["error"] = f"{type(e).__name__}: {e}"
    if _TRITON["error"] is not None:
        return set()
    from .triton_kernels import registered
    return registered(device_type)


def _triton_status() -> str:
    _triton_ops("cuda")
    if _TRITON["error"] is not None:
        return f"not available ({_TRITON['error']})"
    from .triton_kernels import interpreting
    version = sys.modules["triton"].__version__
    return f"{version} (TRITON_INTERPRET=1: kernels also run on CPU tensors)" if interpreting() else version


# ------------------------------------------------------------------------- backend choice

_RESOLVED: dict = {}  # (op, device type) -> backend, for the current SWIFTKERN_BACKEND


def set_backend(name: str) -> None:
    """Choose the backend of the public wrappers: auto | reference | cpp | triton | cuda (see
    the module doc). An unknown name is refused at the next op call."""
    global _BACKEND
    _BACKEND = name
    _RESOLVED.clear()


set_backend(os.environ.get("SWIFTKERN_BACKEND", "auto").strip().lower() or "auto")


def _backend() -> str:
    if _BACKEND not in _BACKENDS:
        raise SwiftkernError(f"SWIFTKERN_BACKEND must be one of {', '.join(_BACKENDS)}, got {_BACKEND!r}")
    return _BACKEND


def _unavailable(op: str, device_type: str, backend: str) -> str | None:
    """Why ``backend`` cannot run ``op`` on ``device_type`` tensors, or None when it can."""
    hint = "; set SWIFTKERN_BACKEND to auto (or reference)"
    if backend == "cpp":
        if device_type != "cpu":
            return f"cpp is the CPU backend, not for {device_type} tensors{hint}"
        if _C is None:
            return f"the extension is {_EXTENSION}{hint}"
        if _OPS.get(op, {}).get("cpu") != "cpp":
            return f"swiftkern._C has no C++ CPU kernel for {op}{hint}"
    elif backend == "cuda":
        if device_type != "cuda":
            return f"cuda is the GPU backend, not for {device_type} tensors{hint}"
        if _OPS.get(op, {}).get("cuda") != "cuda":
            return (f"swiftkern._C has no CUDA kernel for {op} (extension {_EXTENSION}); build it with a "
                    f"CUDA torch and nvcc{hint}")
    elif backend == "triton":
        if op not in _triton_ops(device_type):
            if _TRITON["error"] is not None:
                return f"swiftkern.triton_kernels cannot be imported ({_TRITON['error']}){hint}"
            if device_type == "cpu":
                return ("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1, set before "
                        f"triton is first imported{hint}")
            return f"there is no Triton kernel for {op} on {device_type}{hint}"
    return None


def _resolve(op: str, device_type: str) -> str:
    """The backend that runs ``op`` on ``device_type`` tensors now: reference | cpp | cuda |
    triton. Raises SwiftkernError when a forced backend cannot."""
    key = (op, device_type)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    backend = _backend()
    if backend == "auto":
        compiled = _OPS.get(op, {}).get(device_type, "reference")
        if compiled != "reference":
            backend = compiled
        elif device_type == "cuda" and op in _triton_ops("cuda"):
            backend = "triton"
        else:
            backend = "reference"
    elif backend != "reference":
        why = _unavailable(op, device_type, backend)
        if why is not None:
            raise SwiftkernError(f"{op}: SWIFTKERN_BACKEND={backend} cannot run on {device_type}: {why}")
    _RESOLVED[key] = backend
    return backend


def backend_for(op: str, device) -> str:
    """The backend ``op`` runs with on tensors of ``device`` (a torch.device or 'cpu'/'cuda'):
    'reference', 'cpp', 'cuda' or 'triton'. Raises SwiftkernError when a forced backend cannot."""
    return _resolve(op, torch.device(device).type)


def _run(op: str, device: torch.device, *args, **hints):
    """Run ``op`` with the backend for ``device``; reference functions also get the hints."""
    backend = _resolve(op, device.type)
    if backend == "reference":
        return getattr(reference, op)(*args, **hints)
    if backend == "triton":
        return getattr(torch.ops.swiftkern_triton, op)(*args)
    return getattr(torch.ops.swiftkern, op)(*args)


def unchecked(op: str, device_type: str):
    """The callable that runs ``op`` on ``device_type`` tensors with the backend chosen now,
    without the public wrapper's input checks: for callers whose inputs are valid by
    construction (the model runner's hot loop; see ``layer_kernels``). Takes the positional
    arguments of ``_SCHEMAS[op]``. Triton ops are the launchers themselves, which skips the
    dispatcher's round trip through ``torch.ops``; a new ``set_backend`` needs a new call."""
    backend = _resolve(op, device_type)
    if backend == "reference":
        return getattr(reference, op)
    if backend == "triton":
        from .triton_kernels import KERNELS
        return KERNELS[op][0]
    return getattr(torch.ops.swiftkern, op)


def backend_info() -> dict:
    """What runs where. {"extension": "built (cpu)" | "built (cpu+cuda)" | "not built: <reason>",
    "build": swiftkern._C.build_info() or None, "triton": version or "not available (<why>)",
    "swiftkern_backend": auto | reference | cpp | triton | cuda,
    "ops": {op: {"cpu": backend, "cuda": backend}} with backend reference | cpp | cuda | triton, or
    "unavailable: <why>" for a forced backend that cannot run there,
    "kernels": {op: {"cpu": [...], "cuda": [...]}} the backends built for each op and device}.
    """
    triton = _triton_status()
    ops, kernels = {}, {}
    for op in _SCHEMAS:
        ops[op], kernels[op] = {}, {}
        for dev in ("cpu", "cuda"):
            try:
                ops[op][dev] = _resolve(op, dev)
            except SwiftkernError as e:
                ops[op][dev] = "unavailable: " + str(e).split(": ", 2)[-1]
            built = ["reference"] + [b for b in ("cpp", "cuda") if _OPS[op][dev] == b]
            built += ["triton"] if op in _triton_ops(dev) else []
            kernels[op][dev] = built
    return {"extension": _EXTENSION, "build": _C.build_info() if _C is not None else None, "triton": triton,
            "swiftkern_backend": _BACKEND, "ops": ops, "kernels": kernels}


info = backend_info


# ------------------------------------------------------------------------- input checks

def _is_tensor(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise SwiftkernError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _one_device(op: str, **tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise SwiftkernError(f"{op}: all inputs must be on one device, got "
                             + ", ".join(f"{n} on {d}" for n, d in devices.items()))
    return next(iter(devices.values()))


def _float(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.dtype not in _FLOAT_DTYPES:
            raise SwiftkernError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")


def _same_dtype(op: str, **tensors) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise SwiftkernError(f"{op}: inputs must share one dtype, got "
                             + ", ".join(f"{n} {d}" for n, d in dtypes.items()))


def _shape(op: str, name: str, t: torch.Tensor, want: tuple, text: str) -> None:
    """want: a tuple of ints (None matches any size)."""
    if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
        raise SwiftkernError(f"{op}: {name} must be {text}, got shape {tuple(t.shape)}")


def _checking_values() -> bool:
    """Value checks need the data on the host: skipped while torch.compile traces."""
    return not torch.compiler.is_compiling()


def _range(op: str, name: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Raise unless every element of t is in [lo, hi] (one reduction, one sync)."""
    if t.numel() == 0 or not _checking_values():
        return
    mn, mx = (int(v) for v in torch.aminmax(t))
    if mn < lo or mx > hi:
        raise SwiftkernError(f"{op}: {name} must be in [{lo}, {hi}] ({what}), got min {mn}, max {mx}")


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
    Runs the backend of ``backend_for("greedy_accept", device)`` (see the module doc).
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
    return _run("greedy_accept", draft_tokens.device, draft_tokens, target_logits, num_draft)


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
    return _run("rejection_sample", draft_tokens.device, *args)




# ------------------------------------------------------------------------- decoder-layer ops

def _norm_args(op: str, x, weight, eps, residual=None) -> None:
    tensors = {"x": x, "weight": weight} if residual is None else {"x": x, "residual": residual, "weight": weight}
    _is_tensor(op, **tensors)
    _one_device(op, **tensors)
    _float(op, **tensors)
    _same_dtype(op, **tensors)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise SwiftkernError(f"{op}: x must be [..., H] with H >= 1, got shape {tuple(x.shape)}")
    _shape(op, "weight", weight, (x.shape[-1],), f"[H] = [{x.shape[-1]}]")
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
    return _run("rms_norm", x.device, x, weight, float(eps))


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
    return _run("fused_add_rms_norm", x.device, x, residual, weight, float(eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation silu(gate) * up.

    gate, up: float32 | bfloat16 | float16 [..., I], one shape, dtype and device -> [..., I].
    silu(gate) is rounded to the dtype before the product (``reference.silu_mul``).
    Runs ``backend_for("silu_mul", gate.device)``.
    """
    op = "silu_mul"
    _is_tensor(op, gate=gate, up=up)
    _one_device(op, gate=gate, up=up)
    _float(op, gate=gate, up=up)
    _same_dtype(op, gate=gate, up=up)
    if gate.shape != up.shape:
        raise SwiftkernError(f"{op}: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return _run(op, gate.device, gate, up)


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
    _is_tensor(op, **tensors)
    device = _one_device(op, **tensors)
    _shape(op, "q", q, (None, None, None, None), "4-D [B, Hq, T, D]")
    B, Hq, T, D = q.shape
    _shape(op, "k", k, (B, None, T, D), f"[B, Hkv, T, D] = [{B}, Hkv, {T}, {D}]")
    Hkv = k.shape[1]
    _shape(op, "v", v, (B, Hkv, T, D), f"[B, Hkv, T, D] = [{B}, {Hkv}, {T}, {D}]")
    for name in ("cos", "sin"):
        _shape(op, name, tensors[name], (B, T, D), f"[B, T, D] = [{B}, {T}, {D}]")
    _shape(op, "k_cache", k_cache, (B, Hkv, None, D), f"[B, Hkv, S, D] = [{B}, {Hkv}, S, {D}]")
    _shape(op, "v_cache", v_cache, tuple(k_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
    _shape(op, "positions", positions, (B, T), f"int64 [B, T] = [{B}, {T}]")
    if D % 2:
        raise SwiftkernError(f"{op}: head_dim must be even for the rotate-half rotary embedding, got {D}")
    _float(op, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    _same_dtype(op, q=q, k=k, v=v, cos=cos, sin=sin)
    _same_dtype(op, k_cache=k_cache, v_cache=v_cache)
    if positions.dtype != torch.int64:
        raise SwiftkernError(f"{op}: positions must be int64, got {positions.dtype}")
    S = k_cache.shape[2]
    if uniform_start is not None:
        if not 0 <= uniform_start <= S - T:
            raise SwiftkernError(f"{op}: uniform_start {uniform_start} + T = {T} new tokens must fit in the "
                                 f"cache of S = {S} positions")
    elif max_len is not None:
        if max_len > S:
            raise SwiftkernError(f"{op}: max_len {max_len} is beyond the cache of S = {S} positions")
    else:
        _range(op, "positions", positions, 0, S - 1, f"positions of a cache of S = {S}")
    backend = _resolve(op, device.type)
    if backend == "reference":
        return reference.rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions, uniform_start)
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
    _is_tensor(op, **tensors)
    device = _one_device(op, **tensors)
    _shape(op, "q", q, (None, None, None, None), "4-D [B, Hq, T, D]")
    B, Hq, T, D = q.shape
    _shape(op, "k_cache", k_cache, (B, None, None, D), f"[B, Hkv, S, D] = [{B}, Hkv, S, {D}]")
    _shape(op, "v_cache", v_cache, tuple(k_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
    _shape(op, "cache_lens", cache_lens, (B,), f"int64 [B] = [{B}]")
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise SwiftkernError(f"{op}: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    _float(op, q=q, k_cache=k_cache, v_cache=v_cache)
    _same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if cache_lens.dtype != torch.int64:
        raise SwiftkernError(f"{op}: cache_lens must be int64, got {cache_lens.dtype}")
    if max_len is not None:
        if not T <= max_len <= S:
            raise SwiftkernError(f"{op}: max_len {max_len} must be in [T = {T}, S = {S}]")
    else:
        _range(op, "cache_lens", cache_lens, T, S, f"each row holds its T = {T} new tokens in a cache of S = {S}")
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
    backend = _resolve(op, device.type)
    if backend == "reference":
        return reference.verify_attention(q, k_cache, v_cache, cache_lens, scale, max_len, mask)
    k_cache, v_cache = keys_in_use(k_cache, v_cache, max_len)
    ns = torch.ops.swiftkern_triton if backend == "triton" else torch.ops.swiftkern
    return ns.verify_attention(q, k_cache, v_cache, cache_lens, float(scale))


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
    return _run(op, q.device, q, k_cache, v_cache, cache_lens, float(scale))


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
    _is_tensor(op, **tensors)
    device = _one_device(op, **tensors)
    _shape(op, "k_cache", k_cache, (None,) * 5, "5-D [L, B, H, S, D]")
    _shape(op, "v_cache", v_cache, tuple(k_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
    _float(op, k_cache=k_cache, v_cache=v_cache)
    _same_dtype(op, k_cache=k_cache, v_cache=v_cache)
    L, B, H, S, D = k_cache.shape
    _shape(op, "src_positions", src_positions, (B, None), f"int64 [B, M] with B = {B}")
    _shape(op, "dst_start", dst_start, (B,), f"int64 [B] = [{B}]")
    _shape(op, "counts", counts, (B,), f"int32 [B] = [{B}]")
    if src_positions.dtype != torch.int64 or dst_start.dtype != torch.int64:
        raise SwiftkernError(f"{op}: src_positions and dst_start must be int64, got {src_positions.dtype}, "
                             f"{dst_start.dtype}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise SwiftkernError(f"{op}: counts must be int32 (or int64), got {counts.dtype}")
    M = src_positions.shape[1]
    _range(op, "counts", counts, 0, M, f"entries kept of the M = {M} given")
    _range(op, "dst_start", dst_start, 0, S, f"a position of the cache of S = {S}")
    if _checking_values() and B:
        if bool((dst_start + counts > S).any()):
            raise SwiftkernError(f"{op}: dst_start[b] + counts[b] must be <= S = {S} for every row")
        used = torch.arange(M, device=device) < counts.unsqueeze(1)  # [B, M]
        if bool((used & ((src_positions < 0) | (src_positions >= S))).any()):
            raise SwiftkernError(f"{op}: the used src_positions must be in [0, S = {S})")
    counts = counts.to(torch.int32)
    if k_cache.stride() != v_cache.stride():
        raise SwiftkernError(f"{op}: k_cache and v_cache must share one layout, got strides "
                             f"{k_cache.stride()} and {v_cache.stride()}")
    _run(op, device, k_cache, v_cache, src_positions, dst_start, counts)


# rows up to which ops.linear runs the C++ kernel on the CPU: a SmolLM2 forward of 20 / 26 / 32
# tokens took 60 / 68 / 74 ms with it and 71 / 74 / 78 ms with MKL; for prefill-sized inputs MKL wins
SKINNY_MAX_ROWS = 32


def _cpu_kernel(op: str, device_type: str) -> bool:
    """True when ``op``'s C++ kernel may run on tensors of ``device_type``: the CPU, the kernel
    built, and SWIFTKERN_BACKEND auto or cpp. For the ops whose reference is the same function
    (bits aside for linear), other backends take the reference rather than refusing."""
    return device_type == "cpu" and _OPS[op]["cpu"] == "cpp" and _backend() in ("auto", "cpp")


def skinny_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the C++ skinny kernel takes x @ weight.T, once ``_cpu_kernel`` allows it:
    float32 operands of at most SKINNY_MAX_ROWS rows."""
    return x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() <= SKINNY_MAX_ROWS * x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, the projection every layer of the model runner uses.

    x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N]. On the CPU with float32 and at
    most SKINNY_MAX_ROWS rows (decode, verification, drafting) it runs the C++ ``skinny_linear``
    kernel: one pass over the weight, each output a fixed-order dot product whatever the number
    of rows (so a row's result does not depend on the batch). Other cases, and
    SWIFTKERN_BACKEND=reference | triton | cuda (which have no such kernel), use torch's matmul
    (``reference.skinny_linear``); the two agree to float32 rounding.
    ``backend_info()["kernels"]["skinny_linear"]`` says which kernel is built.
    """
    if _cpu_kernel("skinny_linear", x.device.type) and skinny_fits(x, weight):
        return torch.ops.swiftkern.skinny_linear(x, weight, bias)
    return reference.skinny_linear(x, weight, bias)


# rows up to which the runner reads packed weights (packed_weights.py) on the CPU: SmolLM2's
# projections at 1 / 8 / 16 / 32 rows took 7.8 / 14.8 / 22.3 / 39.2 ms packed and 21.0 / 28.1 /
# 40.2 / 54.8 ms from float32 (the same bits); past SKINNY_MAX_ROWS the regular path is torch's
# matmul (faster at prefill sizes), the invariant set reads them at any size (64 / 128 rows:
# 69.8 / 135.1 ms packed, 81.8 / 152.3 ms from float32)
PACKED_MAX_ROWS = SKINNY_MAX_ROWS


def packed_linear_fast() -> bool:
    """Whether the C++ ``packed_linear`` runs here and beats ``skinny_linear`` on the float32
    weight: the kernel built, allowed (SWIFTKERN_BACKEND auto or cpp) and vectorized (AVX-512)."""
    return (_cpu_kernel("packed_linear", "cpu") and hasattr(_C, "packed_linear_fast")
            and bool(_C.packed_linear_fast()))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with the weight packed as integer codes (``packed_weights.pack``).

    x: float32 [..., K] on the CPU; packed: uint8 [N, K/32, 24 | 40]; bias: float32 [N] or None
    -> float32 [..., N]. The C++ kernel (CPU, auto/cpp) gives ``linear(x, unpack(packed),
    bias)``'s bits at up to SKINNY_MAX_ROWS rows (the same fixed-order sum); without it, the
    reference unpacks and calls torch's matmul.
    """
    op = "packed_linear"
    _is_tensor(op, x=x, packed=packed)
    if x.dtype != torch.float32 or packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[2] not in (24, 40):
        raise SwiftkernError(f"{op}: x must be float32 [..., K] and packed uint8 [N, K/32, 24 or 40] "
                             f"(packed_weights.pack), got {x.dtype} {tuple(x.shape)} and {packed.dtype} "
                             f"{tuple(packed.shape)}")
    if x.dim() < 1 or x.shape[-1] != packed.shape[1] * 32:
        raise SwiftkernError(f"{op}: x [..., K] must have K = 32 * packed.shape[1] = {packed.shape[1] * 32}, "
                             f"got {tuple(x.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (packed.shape[0],)):
        raise SwiftkernError(f"{op}: bias must be float32 [N = {packed.shape[0]}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
    device = _one_device(op, x=x, packed=packed, **({} if bias is None else {"bias": bias}))
    if device.type != "cpu":
        raise SwiftkernError(f"{op}: packed weights run on the CPU, got {device}")
    return _run(op, device, x, packed, bias)


def bi_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for the deterministic verifier, the same bits for an element whatever the tensor
    around it (size, offset, SIMD body or tail, threads). x: float tensor [...] -> float32 [...].

    One definition, ``reference.bi_exp`` (range reduction + degree-7 Taylor polynomial, single
    IEEE operations; within 2 ulps of exp, 0 below -87); the C++ kernel (CPU, auto/cpp) does
    the same operations in the same order and gives the same bits (tested).
    """
    op = "bi_exp"
    _is_tensor(op, x=x)
    if not x.is_floating_point():
        raise SwiftkernError(f"{op}: x must be a float tensor, got {x.dtype}")
    x = x.to(torch.float32)
    if _cpu_kernel(op, x.device.type):
        return torch.ops.swiftkern.bi_exp(x)
    return reference.bi_exp(x)


def bi_exp_sum(x: torch.Tensor) -> torch.Tensor:
    """sum(exp(x)) along the last axis for the deterministic verifier's softmax: the same bits
    for a row whatever the rows around it. x: float tensor [..., V], V >= 1 -> float32 [..., 1].

    One definition, ``reference.bi_exp_sum``: ``bi_exp`` of every element, then ``tree_sum``
    (zero-padded to a multiple of 64, halved by elementwise adds, the rest added in order); the
    C++ kernel (CPU, auto/cpp) makes the same additions and gives the same bits (tested) in one
    pass, without the torch ops of every halving (SmolLM2's vocabulary: ~120 -> ~20 us a row).
    """
    op = "bi_exp_sum"
    _is_tensor(op, x=x)
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] < 1:
        raise SwiftkernError(f"{op}: x must be a float tensor [..., V] with V >= 1, got {x.dtype} "
                             f"{tuple(x.shape)}")
    x = x.to(torch.float32)
    if _cpu_kernel(op, x.device.type):
        return torch.ops.swiftkern.bi_exp_sum(x)
    return reference.bi_exp_sum(x)


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batch-invariant matmul for the deterministic verifier: a @ b with each row of the result
    independent of M and of the other rows (same bits for a row alone or in any batch).

    a: [M, K], b: [K, N] (one float dtype and device, any strides) -> [M, N] in a's dtype,
    accumulated in float32. CUDA (auto): the Triton kernel ``triton_kernels/bi_matmul.py`` (fixed
    tiles, no split-K); CPU (auto, cpp): the C++ ``skinny_linear`` kernel, whose every output is
    a dot product in an order fixed by K alone; CPU without it: ``reference.bi_matmul`` (the
    same order from elementwise torch ops, slow); SWIFTKERN_BACKEND=triton also runs the
    Triton kernel on CPU tensors under TRITON_INTERPRET=1.
    """
    op = "bi_matmul"
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2:
        raise SwiftkernError(f"{op}: a must be a tensor [M, K] and b a tensor [K, N]")
    if a.shape[1] != b.shape[0] or a.dtype != b.dtype or a.device != b.device:
        raise SwiftkernError(f"{op}: a {tuple(a.shape)} {a.dtype} on {a.device} and b {tuple(b.shape)} {b.dtype} "
                             f"on {b.device} must share K, dtype and device")
    if _cpu_kernel("skinny_linear", a.device.type):
        w = b.t().to(torch.float32)  # [N, K]: no copy for b = weight.t() of a float32 weight
        return torch.ops.swiftkern.skinny_linear(a.to(torch.float32), w, None).to(a.dtype)
    return _run(op, a.device, a, b)


__all__ = ["bi_exp", "bi_exp_sum", "bi_matmul", "greedy_accept", "linear", "rejection_sample", "rms_norm",
           "fused_add_rms_norm", "silu_mul", "apply_rope", "rope_kv_append", "attention_mask", "verify_attention",
           "verify_attention_invariant", "kv_compact", "packed_linear", "backend_info",
           "backend_for", "info", "set_backend", "unchecked"]
