"""Which of ``Generator``'s options go together.

A combination that would ignore an option, or that cannot run on the model's device and dtype,
is refused with a ``SwiftkernError`` that says what to pass instead; nothing is silently
dropped. Also the one rule both the checks and the Generator follow: where mode deterministic
runs without the LLM-42 replay (``replay_elided``).
"""

from __future__ import annotations

from . import ops
from .errors import SwiftkernError
from .layer_kernels import invariant_backend, invariant_kernels_available
from .layer_set import LayerSet
from .model import SkipModel
from .rope_table import check_deterministic_rope
from .search import check_searchable
from .tuner import AUTO_RATIOS
from .verifier_kernels import CHOICES as VERIFIER_KERNELS, verifier_kernels as verifier_kernels_for

REPLAY = ("auto", "always", "never")
MODES = ("ar", "self-spec", "deterministic")
DRAFTERS = ("auto", "layer-skip", "lookup", "none", "self-spec")


def replay_elided(model: SkipModel, mode: str, replay: str, drafter: str) -> bool:
    """Whether mode deterministic skips the LLM-42 replay (``Generator.replay_elided``)."""
    if mode != "deterministic" or replay == "always":
        return False
    device, dtype = model.device.type, model.dtype
    return replay == "never" or invariant_kernels_available(device, dtype) or (
        device == "cuda" and drafter != "self-spec" and invariant_backend(device, dtype) == "triton")


def check_options(model: SkipModel, mode: str, drafter: str, layer_set, replay: str, verifier_kernels: str,
                  skip_ratio, search_options: dict, adaptive_eps: bool) -> None:
    """Refuse the options that do not go together. layer_set: as given (None, "auto", a string
    form or a ``LayerSet``); search_options: as ``tuner.tuner_options`` returned them."""
    if drafter not in DRAFTERS:
        raise SwiftkernError(f"unknown drafter {drafter!r}; available: {', '.join(DRAFTERS)}")
    if (drafter == "self-spec") != (mode == "deterministic" and drafter not in ("auto", "none")):
        raise SwiftkernError(f"drafter {drafter} does not go with mode {mode}: mode deterministic takes "
                             "drafter self-spec (or auto/none: no drafts), and only it does")
    if mode == "ar" and drafter not in ("auto", "none"):
        raise SwiftkernError(f"drafter {drafter} needs mode self-spec: mode ar drafts nothing")
    _check_layer_set(mode, drafter, layer_set, skip_ratio, search_options)
    if is_auto(layer_set):  # when the Generator is made, not at its first generate call
        check_searchable(model.num_layers, min(AUTO_RATIOS) if skip_ratio == "auto" else skip_ratio)
    _check_replay(model, mode, drafter, replay, verifier_kernels)
    if adaptive_eps and not (mode == "self-spec" and drafter in ("auto", "layer-skip")):
        raise SwiftkernError(f"adaptive_eps moves the layer-skipped draft's eps in mode self-spec (drafter auto or "
                             f"layer-skip); mode {mode} with drafter {drafter} would ignore it: leave it out")


def is_auto(layer_set) -> bool:
    """layer_set "auto": found by the search while generating."""
    return isinstance(layer_set, str) and layer_set.strip() == "auto"


def _check_layer_set(mode: str, drafter: str, layer_set, skip_ratio, search_options: dict) -> None:
    auto = is_auto(layer_set)
    drafts_with_layers = (mode == "self-spec" and drafter in ("auto", "layer-skip")) or drafter == "self-spec"
    if layer_set is not None and not auto and not drafts_with_layers:
        raise SwiftkernError(f"mode {mode} with drafter {drafter} would ignore layer_set: a layer set is for "
                             "a layer-skipped draft (mode self-spec with drafter auto or layer-skip, or mode "
                             "deterministic with drafter self-spec); leave it out here")
    if drafter == "self-spec" and layer_set is None:
        raise SwiftkernError("drafter self-spec needs a layer set: the sub-layers its draft skips (e.g. "
                             "'attn:3,5|mlp:4'; `swiftkern search` finds one for a model), or 'none' to draft "
                             "with prompt lookup alone")
    if auto and (mode != "self-spec" or drafter not in ("auto", "layer-skip")):
        raise SwiftkernError("layer_set 'auto' (search while generating) needs mode self-spec with "
                             "drafter auto or layer-skip")
    if not (skip_ratio == "auto" or (isinstance(skip_ratio, (int, float)) and 0 < skip_ratio < 1)):
        raise SwiftkernError(f"skip_ratio must be 'auto' or in (0, 1), got {skip_ratio!r}")
    if skip_ratio != "auto" and not auto:
        raise SwiftkernError(f"skip_ratio is the search's (layer_set='auto'); with layer_set {layer_set!r} it "
                             "would be ignored: leave it out")
    if search_options and not auto:
        raise SwiftkernError("search_options are for the search of layer_set='auto'; leave them out here")
    if mode == "self-spec" and drafter == "layer-skip" and layer_set is None:
        raise SwiftkernError("drafter layer-skip needs a layer set (e.g. 'attn:3,5|mlp:4' or 'none')")


def _check_replay(model: SkipModel, mode: str, drafter: str, replay: str, verifier_kernels: str) -> None:
    if replay not in REPLAY:
        raise SwiftkernError(f"replay must be one of {', '.join(REPLAY)}, got {replay!r}")
    if mode != "deterministic" and (replay != "auto" or verifier_kernels != "auto"):
        raise SwiftkernError(f"replay and verifier_kernels are for mode deterministic; mode {mode} would ignore "
                             f"replay={replay!r}, verifier_kernels={verifier_kernels!r}: leave them out")
    if mode == "deterministic" and replay == "never" and invariant_backend(model.device.type, model.dtype) is None:
        raise SwiftkernError(
            f"replay='never' decodes through the batch-invariant kernels, which run on the CPU with the C++ "
            f"extension (float32, bfloat16, float16) or on CUDA with the Triton kernels (SWIFTKERN_BACKEND auto "
            f"or triton); here: {model.device.type}, {model.dtype}, SWIFTKERN_BACKEND="
            f"{ops.backends.current_backend()}. Use replay='auto' or 'always'")
    if mode == "deterministic":
        check_deterministic_rope(model.rotary)
    if verifier_kernels not in VERIFIER_KERNELS or mode == "deterministic":  # refuse a bad choice now
        verifier_kernels_for(verifier_kernels, model.device.type, model.dtype)
    if verifier_kernels != "auto" and replay_elided(model, mode, replay, drafter):
        raise SwiftkernError(
            f"verifier_kernels={verifier_kernels!r} picks the replay's per-row ops, but replay={replay!r} runs no "
            f"replay here ({model.device.type}, {model.dtype}: every step on the batch-invariant "
            "kernels); pass replay='always' to replay with them, or leave verifier_kernels out")


def parse_layer_set(layer_set, num_layers: int) -> LayerSet | None:
    """None, a ``LayerSet`` or its string form ('attn:3,5|mlp:4', 'none') -> a LayerSet for a
    model of num_layers layers, or None. ("auto" is the caller's: it passes None then.)"""
    if isinstance(layer_set, str):
        layer_set = LayerSet.parse(layer_set, num_layers)
    elif layer_set is not None and not isinstance(layer_set, LayerSet):
        raise SwiftkernError(f"layer_set must be a LayerSet, its string form ('attn:3,5|mlp:4', 'none'), 'auto' "
                             f"or None, got {layer_set!r} ({type(layer_set).__name__})")
    if layer_set is not None and layer_set.num_layers != num_layers:
        raise SwiftkernError(f"layer set is for {layer_set.num_layers} layers, the model has {num_layers}")
    return layer_set
