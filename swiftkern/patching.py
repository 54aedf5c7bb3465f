"""Liger-style patching: HF LLaMA-family modules run swiftkern's ops, for plain HF inference.

    import swiftkern
    patch = swiftkern.apply_swiftkern_to_llama()             # class level: every Llama model, loaded or not
    model = AutoModelForCausalLM.from_pretrained(...)
    ...
    patch.undo()                                             # back to HF's own forwards

    patch = swiftkern.apply_swiftkern_to_llama(model=model)  # this model's modules only

What is replaced: ``<Family>RMSNorm.forward`` by ``swiftkern.ops.rms_norm`` and the SwiGLU
activation of ``<Family>MLP.forward`` by ``swiftkern.ops.silu_mul`` (the projections stay
HF's ``nn.Linear``). The patched forwards look ``swiftkern.ops`` up on every call, so they use
whatever kernel ``ops`` dispatches to on the tensor's device (and ``ops.set_backend``).
Outputs equal the unpatched modules within the dtype's tolerance (tests/test_patching.py).
"""

from __future__ import annotations

import importlib

import torch

from . import ops, reference
from .errors import SwiftkernError
from .ops.checks import FLOAT_DTYPES

# family -> (HF modeling module, RMSNorm class, MLP class)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "LlamaMLP"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm", "MistralMLP"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP"),
}


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF RMSNorm.forward on swiftkern.ops.rms_norm. hidden_states: [..., H] -> [..., H]. A
    weight of another dtype than the input (a float32 norm in a bf16 model: HF promotes the
    output to float32) or a dtype the kernels do not take (float64) runs HF's own arithmetic
    (``reference.rms_norm``), as the unpatched module would, instead of being refused."""
    if hidden_states.dtype != self.weight.dtype or hidden_states.dtype not in FLOAT_DTYPES:
        return reference.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """HF MLP.forward with swiftkern.ops.silu_mul as the activation. x: [..., H] -> [..., H]"""
    return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


def is_swiglu(mlp) -> bool:
    """Whether an HF MLP module's activation is SiLU (so silu_mul computes it)."""
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _swiglu_or_original(original):
    """A class-level MLP forward: swiglu_forward for SiLU MLPs, HF's own forward otherwise
    (a model of the class that is not SwiGLU keeps its exact arithmetic)."""
    def forward(self, x):
        return swiglu_forward(self, x) if is_swiglu(self) else original(self, x)
    forward.__doc__ = swiglu_forward.__doc__
    forward._swiftkern = True
    return forward


rms_norm_forward._swiftkern = True
swiglu_forward._swiftkern = True


def _is_swiftkern(forward) -> bool:
    """Whether a forward (a function or a bound method) is one of swiftkern's."""
    return getattr(getattr(forward, "__func__", forward), "_swiftkern", False)


def is_patched(module) -> bool:
    """Whether the module's forward (its own or its class's) is a swiftkern forward."""
    return _is_swiftkern(module.__dict__.get("forward", None) or type(module).forward)


class Patch:
    """What one ``apply_swiftkern_to_*`` call replaced; ``undo()`` puts it back (also on
    leaving a ``with`` block). ``targets`` names each patched class or counts the modules."""

    def __init__(self):
        self._undo = []
        self.targets: list[str] = []

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def _classes(family: str):
    path, norm, mlp = FAMILIES[family]
    mod = importlib.import_module(path)
    return getattr(mod, norm), getattr(mod, mlp)


def _patch_class(patch: Patch, cls, make_forward) -> None:
    """cls.forward = make_forward(HF's forward), undone by the patch."""
    original = cls.__dict__["forward"]
    if _is_swiftkern(original):
        return  # patched already (by an earlier call, which owns the undo)
    cls.forward = make_forward(original)

    def undo():
        cls.forward = original
    patch._undo.append(undo)
    patch.targets.append(cls.__name__)


def _patch_instance(module, forward) -> callable:
    module.forward = forward.__get__(module)

    def undo():
        if module.__dict__.get("forward") is not None and getattr(module.forward, "__func__", None) is forward:
            del module.forward
    return undo


def _apply(families: tuple[str, ...], model, rms_norm: bool, swiglu: bool) -> Patch:
    patch = Patch()
    pairs = [_classes(f) for f in families]
    if model is None:
        for norm_cls, mlp_cls in pairs:
            if rms_norm:
                _patch_class(patch, norm_cls, lambda original: rms_norm_forward)
            if swiglu:
                _patch_class(patch, mlp_cls, _swiglu_or_original)
        return patch
    if not isinstance(model, torch.nn.Module):
        raise SwiftkernError(f"model must be a torch.nn.Module (an HF model), got {type(model).__name__}")
    norm_types = tuple(n for n, _ in pairs)
    mlp_types = tuple(m for _, m in pairs)
    norms = [m for m in model.modules() if isinstance(m, norm_types)]
    mlps = [m for m in model.modules() if isinstance(m, mlp_types)]
    if not norms and not mlps:
        names = ", ".join(c.__name__ for c in norm_types + mlp_types)
        raise SwiftkernError(f"{type(model).__name__} has no {names} modules; use the apply_swiftkern_to_* "
                             f"function of its family ({', '.join(FAMILIES)})")
    if swiglu:
        other = [m for m in mlps if not is_swiglu(m)]
        if other:
            raise SwiftkernError(f"{len(other)} MLP modules do not use SiLU (act_fn {type(other[0].act_fn).__name__});"
                                 " swiglu=True needs a SwiGLU model: pass swiglu=False")
    for modules, enabled, forward, what in ((norms, rms_norm, rms_norm_forward, "RMSNorm"),
                                            (mlps, swiglu, swiglu_forward, "MLP")):
        # a module patched already by an earlier call stays that call's (its undo restores it),
        # as a patched class does: this patch neither takes nor reports it
        fresh = [m for m in modules if not _is_swiftkern(m.__dict__.get("forward"))]
        if enabled and fresh:
            patch._undo.extend(_patch_instance(m, forward) for m in fresh)
            patch.targets.append(f"{len(fresh)} {what} modules")
    return patch


def apply_swiftkern_to_llama(model=None, rms_norm: bool = True, swiglu: bool = True) -> Patch:
    """Run HF Llama modules on swiftkern ops: RMSNorm (``rms_norm``) and the SwiGLU MLP
    activation (``swiglu``).

    model=None patches the classes ``LlamaRMSNorm`` / ``LlamaMLP``: every Llama model, created
    before or after the call (an MLP whose activation is not SiLU keeps HF's forward).
    model=<an HF model> patches that model's modules only (SmolLM2 and other Llama-architecture
    checkpoints; raises SwiftkernError when it has none, or swiglu=True and its MLP is not
    SiLU). Returns a ``Patch``; ``patch.undo()`` restores HF's forwards.
    """
    return _apply(("llama",), model, rms_norm, swiglu)


def apply_swiftkern_to_mistral(model=None, rms_norm: bool = True, swiglu: bool = True) -> Patch:
    """As ``apply_swiftkern_to_llama``, for ``MistralRMSNorm`` / ``MistralMLP``."""
    return _apply(("mistral",), model, rms_norm, swiglu)


def apply_swiftkern_to_qwen2(model=None, rms_norm: bool = True, swiglu: bool = True) -> Patch:
    """As ``apply_swiftkern_to_llama``, for ``Qwen2RMSNorm`` / ``Qwen2MLP``."""
    return _apply(("qwen2",), model, rms_norm, swiglu)


def apply_swiftkern_to_qwen3(model=None, rms_norm: bool = True, swiglu: bool = True) -> Patch:
    """As ``apply_swiftkern_to_llama``, for ``Qwen3RMSNorm`` (the layer norms and each
    attention's per-head query and key norms) / ``Qwen3MLP``."""
    return _apply(("qwen3",), model, rms_norm, swiglu)
