"""The HF modules whose tensors a SkipModel reads, and whether they are still the ones it wrapped.

``SkipModel`` holds references to the HF model's weight tensors and runs its own arithmetic on
them. A change that keeps those objects (an in-place update, ``load_state_dict``, a write
through ``.data`` of the same shape and dtype) is read as it is. One that replaces them was not:
after ``lm_head.weight = nn.Parameter(...)``, a new projection module, a new final norm weight
or fewer layers, the next ``generate`` returned the old model's tokens without a word (4 of 5
such changes on a tiny Llama), and after ``model.to(torch.bfloat16)``, ``.half()`` or
``.double()`` it failed inside a kernel ("q, k, v, cos, sin and the caches must share one
dtype", "view BFloat16 as Int"). ``Snapshot`` records the modules and their tensors (objects,
dtype, device, shape) when a model is wrapped; ``Snapshot.change`` names the first difference,
which ``SkipModel.check_unchanged`` turns into a refusal at every ``generate`` call. A captured
CUDA graph reads addresses, not objects: ``Snapshot.addresses`` lets the graph runner drop its
graphs where a write through ``.data`` moved a weight's storage.
"""

from __future__ import annotations

import torch

from .errors import SwiftkernError

# (parent, child, the plain type it must be or None) of each module read in a decoder layer
_IN_LAYER = ((None, "input_layernorm", None), ("self_attn", "q_proj", torch.nn.Linear),
             ("self_attn", "k_proj", torch.nn.Linear), ("self_attn", "v_proj", torch.nn.Linear),
             ("self_attn", "o_proj", torch.nn.Linear), (None, "post_attention_layernorm", None),
             ("mlp", "gate_proj", torch.nn.Linear), ("mlp", "up_proj", torch.nn.Linear),
             ("mlp", "down_proj", torch.nn.Linear))
_HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head norms, where the model has them


def _walk(hf_model) -> list[tuple[tuple, torch.nn.Module, type | None]]:
    """(where, module, the plain type it must be or None) for every module whose tensors the
    runner reads, in a fixed order: embedding, final norm, LM head, rotary, then each layer's.
    ``where``: (name,) or (layer, parent or None, child); children read from ``_modules`` (what
    attribute access returns for a submodule, without nn.Module's slower lookup)."""
    inner = hf_model.model
    out = [(("model.embed_tokens",), inner.embed_tokens, torch.nn.Embedding), (("model.norm",), inner.norm, None),
           (("lm_head",), hf_model.lm_head, torch.nn.Linear), (("model.rotary_emb",), inner.rotary_emb, None)]
    for i, layer in enumerate(inner.layers):
        try:
            parents = {None: layer, "self_attn": layer._modules["self_attn"], "mlp": layer._modules["mlp"]}
            out += [((i, parent, child), parents[parent]._modules[child], plain) for parent, child, plain in _IN_LAYER]
        except (KeyError, AttributeError):  # a wrapper around the layer (activation checkpointing's), or another layer
            raise SwiftkernError(
                f"model.layers.{i} is a {type(layer).__module__}.{type(layer).__qualname__} without the decoder layer's "
                f"modules (self_attn.q_proj, ..., mlp.down_proj, the two norms) as its children: swiftkern reads "
                f"them there. Unwrap the layers (e.g. remove activation-checkpointing wrappers) first") from None
        for name in _HEAD_NORMS:
            norm = parents["self_attn"]._modules.get(name)
            if norm is not None:
                out.append(((i, "self_attn", name), norm, None))
    return out


def _path(where: tuple) -> str:
    """The module's dotted path in the HF model."""
    if len(where) == 1:
        return where[0]
    i, parent, child = where
    return f"model.layers.{i}.{child}" if parent is None else f"model.layers.{i}.{parent}.{child}"


def modules_read(hf_model) -> list[tuple[str, torch.nn.Module, type | None]]:
    """(path, module, the plain type it must be or None) for every module whose tensors the
    runner reads, in a fixed order: embedding, final norm, LM head, rotary, then each layer's."""
    return [(_path(where), module, plain) for where, module, plain in _walk(hf_model)]


def check_plain_modules(hf_model) -> None:
    """The runner reads the weights of the model's linear layers and embedding and runs its own
    arithmetic: a module of another type (an adapter's wrapper such as PEFT's ``lora.Linear``,
    whose ``.weight`` is the base layer's; a quantized linear) would be bypassed and the tokens
    would silently be the plain weights' ones. Refused, named. (Forward hooks do not run
    either; they are left alone: most observe, as a forward counter does, and one that changes
    an output cannot be told from them.)"""
    for name, module, plain in modules_read(hf_model):
        if plain is not None and type(module) is not plain:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            raise SwiftkernError(
                f"{name} is a {kind}, not a plain torch.nn.{plain.__name__}: swiftkern reads the weights and would "
                f"bypass what it adds (an adapter, a quantized matmul). Merge adapters first (PEFT: "
                f"model.merge_and_unload()) or load the model unquantized")


def _tensors(where: tuple, module: torch.nn.Module) -> tuple:
    """((name, tensor, dtype, device, shape), ...) of the module's parameters; none for the rotary
    module, whose buffers HF's own forward may swap (dynamic and longrope frequencies)."""
    if where == ("model.rotary_emb",):
        return ()
    return tuple((name, t, t.dtype, t.device, t.shape) for name, t in module._parameters.items() if t is not None)


class Snapshot:
    """The modules a SkipModel read from ``hf_model`` and their tensors, as they were."""

    def __init__(self, hf_model):
        self.entries = [(where, module, _tensors(where, module)) for where, module, _ in _walk(hf_model)]
        self.num_layers = len(hf_model.model.layers)

    def addresses(self) -> tuple[int, ...]:
        """Where each tensor's data lives now: a write through ``.data`` keeps the tensor and may
        move its storage, which a captured CUDA graph would still read at the old address."""
        return tuple(t.data_ptr() for _, _, tensors in self.entries for _, t, _, _, _ in tensors)

    def change(self, hf_model) -> str | None:
        """What differs in ``hf_model`` now (the first difference, in words), or None."""
        if len(hf_model.model.layers) != self.num_layers:
            return f"it has {len(hf_model.model.layers)} layers, it had {self.num_layers}"
        now = _walk(hf_model)
        if len(now) != len(self.entries):
            return "per-head norms (q_norm, k_norm) were added or removed"
        for (where, module, tensors), (_, current, _) in zip(self.entries, now):
            if current is not module:
                return f"{_path(where)} is another module ({type(current).__name__})"
            params = current._parameters
            if tensors and sum(t is not None for t in params.values()) != len(tensors):
                return f"{_path(where)} has other parameters"
            for name, tensor, dtype, device, shape in tensors:
                t = params.get(name)
                if t is not tensor:
                    return f"{_path(where)}.{name} is another tensor"
                if t.dtype != dtype or t.device != device or t.shape != shape:
                    return (f"{_path(where)}.{name} is {t.dtype} {tuple(t.shape)} on {t.device}, "
                            f"was {dtype} {tuple(shape)} on {device}")
        return None
