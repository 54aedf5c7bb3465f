"""The custom ops ``torch.ops.swiftkern.<op>``: their schemas, the compiled extension, and the
reference kernels registered for a device the extension has no kernel for.

``extension`` is ``swiftkern._C`` (None when it is not built or fails to import, and
``EXTENSION_STATUS`` says why); ``COMPILED[op]`` says per device ("cpu", "cuda") whether
``torch.ops.swiftkern.<op>`` runs a compiled kernel ("cpp" | "cuda") or the reference. Every op
also gets a fake (meta) impl for torch.compile. Importing or reloading this module twice
registers nothing twice.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from .. import reference
from ..process_state import process_state

SCHEMAS = {
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
    "bi_max_exp_sum": "(Tensor x) -> (Tensor, Tensor)",
    "packed_linear": "(Tensor x, Tensor packed, Tensor? bias) -> Tensor",
    "top_p_cut": "(Tensor sorted_values, Tensor probs, float top_p) -> Tensor",
}

try:  # importing it registers the schemas and the compiled kernels in torch.ops.swiftkern
    extension = importlib.import_module("swiftkern._C")
    EXTENSION_STATUS = "built (cpu+cuda)" if extension.build_info()["cuda"] else "built (cpu)"
except ImportError as e:
    extension = None
    if isinstance(e, ModuleNotFoundError) and e.name == "swiftkern._C":
        EXTENSION_STATUS = ("not built: swiftkern._C is not installed (SWIFTKERN_BUILD_EXT=0, torch missing "
                      "at build time, or the compile failed; reinstall with "
                      "`pip install --no-build-isolation -e .` and `-v` to see why)")
    else:
        EXTENSION_STATUS = f"not built: swiftkern._C failed to import ({e}); rebuild it against this torch"
        warnings.warn(f"swiftkern: {EXTENSION_STATUS}; using the reference ops", RuntimeWarning, stacklevel=2)

# What this module registered, kept for the whole process so that a reload or a second import
# neither registers twice nor mistakes its own reference kernels for compiled ones.
# reference_kernels: {(op, dispatch key)}; fakes: {op}; autograd: {"namespace::op"} (ops/autograd.py)
_STATE = process_state("swiftkern._ops_state", reference_kernels=set(), fakes=set(), autograd=set())


def _register(name: str, ref_fn, fake_fn) -> dict:
    """Make torch.ops.swiftkern.<name> exist with CPU, CUDA and fake impls -> {device: backend}."""
    qual = f"swiftkern::{name}"
    if not hasattr(torch.ops.swiftkern, name):
        torch.library.define(qual, SCHEMAS[name])
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


def _bi_max_exp_sum_fake(x):
    return _bi_exp_sum_fake(x), _bi_exp_sum_fake(x)


def _packed_linear_fake(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _top_p_cut_fake(sorted_values, probs, top_p):
    return sorted_values.new_empty(sorted_values.shape[:1], dtype=torch.int64)


# op -> {"cpu": "cpp" | "reference", "cuda": "cuda" | "reference"}: what torch.ops.swiftkern runs
COMPILED = {name: _register(name, getattr(reference, name), globals()[f"_{name}_fake"]) for name in SCHEMAS}

from .autograd import register_autograd  # noqa: E402  (needs _STATE above)

register_autograd("swiftkern")
