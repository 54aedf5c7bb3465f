"""HF transformers backend: swiftkern's decoding behind ``model.generate``.

    from swiftkern.integrations.transformers import generate as swift_generate
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64,
                         custom_generate=swift_generate, swift_mode="self-spec", layer_set="auto")

HF prepares the inputs and the ``GenerationConfig`` as usual, then hands the decoding to
``generate`` below, which runs ``swiftkern.Generator`` and returns what HF returns. Version
differences between transformers 4.57+ and 5.x live in ``compat.py``.
"""

from __future__ import annotations

import inspect

import torch

from ..arg_checks import whole
from ..errors import SwiftkernError
from ..generate import Generator
from ..sampling import SEED_RANGE
from ..transient import transient, weights_key
from . import compat

# logits processors whose effect the Generator reproduces (HF's order: temperature, top-k, top-p)
_WARPERS = {"TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p"}
_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}  # max_new_tokens / max_length, eos_token_id
# model kwargs HF's generate adds by itself (or the caller may pass: they change nothing here); other
# model kwargs the caller passed are refused. Where the calling generate is not found, every model
# kwarg outside this set is taken for the caller's.
_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "num_logits_to_keep", "use_cache",
                 "cache_position", *compat.CACHE_KWARGS}
# GenerationConfig fields that must keep their neutral value: they select something other than
# one sequence per prompt decoded by the model itself, or ask for outputs the Generator does not keep
_MUST_BE_NEUTRAL = {  # field: (neutral value, what it asks for)
    "num_beams": (1, "beam search"), "num_beam_groups": (1, "group beam search"),
    "num_return_sequences": (1, "several sequences per prompt"), "penalty_alpha": (None, "contrastive search"),
    "dola_layers": (None, "DoLa decoding"),
    "prompt_lookup_num_tokens": (None, "HF prompt lookup; use swift_mode='self-spec', drafter='lookup'"),
    "assistant_early_exit": (None, "HF early-exit drafting"), "output_scores": (False, "scores"),
    "output_logits": (False, "logits"), "output_attentions": (False, "attentions"),
    "output_hidden_states": (False, "hidden states"), "token_healing": (False, "token healing"),
}


def _neutral(proc, prompt_width: int) -> bool:
    """A processor that changes no logit here: a minimum length the prompts already reach
    (HF adds one for min_new_tokens=0, or a min_length at most the input's width; it adds a
    MinNewTokensLengthLogitsProcessor only for min_new_tokens > 0)."""
    return type(proc).__name__ == "MinLengthLogitsProcessor" and proc.min_length <= prompt_width


def _refusals(generation_config, logits_processor, stopping_criteria, model_kwargs, hf_args,
              prompt_width: int) -> list[str]:
    problems = []
    for name, (neutral, what) in _MUST_BE_NEUTRAL.items():
        value = getattr(generation_config, name, None)
        if value is not None and (type(value) is not type(neutral) or value != neutral):
            problems.append(f"{name}={value!r} ({what})")
    for proc in logits_processor or []:
        if type(proc).__name__ not in _WARPERS and not _neutral(proc, prompt_width):
            problems.append(f"logits processor {type(proc).__name__} (from a GenerationConfig field such as "
                            "repetition_penalty, min_new_tokens, bad_words_ids, or passed by the caller)")
    for crit in stopping_criteria or []:
        if type(crit).__name__ not in _CRITERIA:
            problems.append(f"stopping criterion {type(crit).__name__} (stop_strings, max_time, or passed by the caller)")
    caller = hf_args.get("kwargs")  # the keyword arguments the caller gave generate (None: not found)
    # only the caller's: kwargs a new transformers adds by itself (5.24's cache) are no request of theirs
    extra = sorted(k for k, v in model_kwargs.items()
                   if k not in _MODEL_KWARGS and v is not None and (caller is None or k in caller))
    if extra:
        problems.append(f"model inputs {', '.join(extra)}")
    for name in compat.CACHE_KWARGS:
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            problems.append(f"a filled {name} (continuing from a cache)")
    if hf_args.get("assistant_model") is not None:
        problems.append("assistant_model (swiftkern drafts with the model itself)")
    return problems


def _warper_values(logits_processor) -> dict:
    """temperature / top_k / top_p as the prepared warpers apply them (HF's order). The other
    processors in the list are the ones ``_refusals`` let through as changing no logit."""
    values, order = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, []
    for proc in logits_processor or []:
        field = _WARPERS.get(type(proc).__name__)
        if field is None:
            continue
        values[field] = getattr(proc, field)
        order.append(field)
    if order != sorted(order, key=["temperature", "top_k", "top_p"].index):
        raise SwiftkernError(f"logits warpers in the order {order}; the transformers backend applies "
                             "temperature, then top_k, then top_p, as HF builds them from a GenerationConfig")
    return values


def _prompts(input_ids: torch.Tensor, attention_mask, position_ids) -> list[list[int]]:
    """Each row's real tokens. input_ids, attention_mask, position_ids: [B, T] (left padding)."""
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise SwiftkernError("the transformers backend needs input_ids of shape [batch, tokens] "
                             "(inputs_embeds are not supported)")
    B, T = input_ids.shape
    if attention_mask is None:
        lengths = [T] * B
    else:
        if attention_mask.shape != input_ids.shape:
            raise SwiftkernError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                                 f"{tuple(input_ids.shape)}; pass a 2-D mask of the same shape")
        mask = attention_mask.to(torch.bool)
        lengths = mask.sum(1).tolist()
        for b, n in enumerate(lengths):
            if n == 0 or not bool(mask[b, T - n:].all()):
                raise SwiftkernError(
                    f"attention_mask row {b} is not left-padded (zeros, then ones up to the last token); "
                    "tokenize with padding_side='left' as for HF generate")
    if position_ids is not None and position_ids.shape != input_ids.shape:  # HF makes them of the mask's
        raise SwiftkernError(f"position_ids have shape {tuple(position_ids.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}; pass an attention_mask (and position_ids) of "
                             "input_ids' shape, one row per prompt")
    prompts = []
    for b, n in enumerate(lengths):
        if position_ids is not None:
            real = position_ids[b, T - n:].tolist()
            if real != list(range(n)):
                raise SwiftkernError(f"position_ids row {b} is not 0..{n - 1} over its real tokens; "
                                     "custom position_ids are not supported by the transformers backend")
        prompts.append(input_ids[b, T - n:].tolist())
    return prompts


def _sequences(input_ids: torch.Tensor, new_tokens: list[list[int]], pad: int | None) -> torch.Tensor:
    """[B, T + W]: the input (padding kept) then each row's new tokens, padded with ``pad``
    after a row finished, as HF. W = the longest row's new tokens."""
    width = max(len(t) for t in new_tokens)
    if pad is None and any(len(t) < width for t in new_tokens):
        raise SwiftkernError("rows finished at different lengths and there is no pad_token_id; pass pad_token_id")
    rows = [t + [pad] * (width - len(t)) for t in new_tokens]
    new = torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device).reshape(len(rows), width)
    return torch.cat([input_ids, new], dim=1)


def _generator_options(swift_kwargs, **named) -> dict:
    """The Generator keyword arguments: the named ones given (not None) and ``swift_kwargs``,
    which must be a dict of other ``Generator`` parameters."""
    options = {k: v for k, v in named.items() if v is not None}
    if swift_kwargs is None:
        return options
    if not isinstance(swift_kwargs, dict):
        raise SwiftkernError(f"swift_kwargs must be a dict of Generator options, got {type(swift_kwargs).__name__}")
    accepted = [p for p in inspect.signature(Generator).parameters if p not in ("model", "tokenizer", "mode")]
    for key in swift_kwargs:
        if key == "mode":
            raise SwiftkernError("swift_kwargs: pass the mode as swift_mode=..., not in swift_kwargs")
        if key not in accepted:
            raise SwiftkernError(f"swift_kwargs: Generator has no option {key!r}; it takes {', '.join(accepted)}")
        if key in options:
            raise SwiftkernError(f"{key} given twice, as {key}= and in swift_kwargs: give it once")
    return {**options, **swift_kwargs}


def _generator_for(model, swift_mode: str, options: dict, keep: bool) -> Generator:
    """The Generator for ``model`` with this mode and these options. keep: made on the first
    call and kept on the model (``transient.transient(model)``, for as long as its parameters are
    the same objects, storage and dtype, ``transient.weights_key``, and the modules it reads the
    same, ``SkipModel.change_since_wrap``), so that what it learns while
    generating, the layer set it searched and the drafter policy's timed costs, carries over to
    the next greedy ``model.generate`` with the same options, as it does for a Generator a caller
    keeps (a new one per call searched again, and timed again, every time). Sampling takes a new
    one each call: which drafts a row verifies changes which tokens a seed draws (not their
    distribution), so a seed gives the same tokens on every call only from the same start."""
    if not keep:
        return Generator(model, mode=swift_mode, **options)
    state = transient(model)
    weights = weights_key(model)
    key = (swift_mode, repr(sorted(options.items())))
    kept = state.get("generators", {})
    if (state.get("generators_for") != weights  # new parameters, storage or dtype: the kept ones read the old
            or (key in kept and kept[key].model.change_since_wrap() is not None)):  # or a module replaced
        state["generators"], state["generators_for"] = {}, weights
    kept = state["generators"]
    if key not in kept:
        kept[key] = Generator(model, mode=swift_mode, **options)
    return kept[key]


@torch.no_grad()
def generate(model, input_ids: torch.Tensor | None = None, logits_processor=None, stopping_criteria=None,
             generation_config=None, swift_mode: str = "self-spec", layer_set=None, drafter: str | None = None,
             k_max: int | None = None, eps: float | None = None, seed: int | None = None,
             swift_kwargs: dict | None = None, **model_kwargs):
    """Decode with swiftkern as an HF ``custom_generate``; returns what HF ``generate`` returns.

    Called by HF: ``model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=...,
    custom_generate=generate, swift_mode=..., layer_set=..., ...)``. Called directly:
    ``generate(model, input_ids, max_new_tokens=..., ...)`` (it goes through ``model.generate``).

    model: an HF LLaMA / Mistral / Qwen2 / Qwen3 causal LM. input_ids: int64 [B, T], left-padded when
    rows differ in length, with attention_mask [B, T] (0 on padding).

    swiftkern options (the rest is HF's): ``swift_mode`` — ``"self-spec"`` (default: layer-skipped
    or lookup drafts, verified by the full model; greedy tokens equal plain decoding), ``"ar"``
    (plain decoding), or any other mode ``swiftkern.Generator`` has; ``layer_set`` (a
    ``LayerSet``, its string form, or a name such as ``"auto"`` where the Generator supports it),
    ``drafter`` (``"layer-skip"``, ``"lookup"``, ...), ``k_max``, ``eps``; ``swift_kwargs``: any
    further ``Generator`` keyword arguments. ``seed``: sampling seed (row b uses seed + b;
    draws are keyed on (seed, position), see ``swiftkern.sampling``); default: drawn from
    torch's global generator, so ``torch.manual_seed`` makes a sampled call repeatable.

    Honoured GenerationConfig fields: max_new_tokens / max_length, do_sample, temperature,
    top_k, top_p, eos_token_id, pad_token_id, return_dict_in_generate; ``streamer`` (batch 1;
    each token is put as soon as it is verified). Refused with a SwiftkernError naming them:
    beams, several return sequences, any other logits processor or stopping criterion
    (repetition_penalty, min_new_tokens, stop_strings, ...), score/logit/attention outputs,
    assistant models, inputs_embeds, a filled cache, custom position_ids.

    Returns int64 [B, T + N] (input, then new tokens padded with pad_token_id after EOS), or a
    ``GenerateDecoderOnlyOutput`` with only ``sequences`` set when return_dict_in_generate.
    Greedy tokens equal plain ``model.generate`` in float32 (in bfloat16 / float16 up to the
    rounding of a near tie, as the README says); sampled ones follow the same distribution but
    not HF's random stream.
    """
    compat.check_version()
    if generation_config is None:  # a direct call: let HF prepare everything, then come back here
        return model.generate(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              custom_generate=generate, swift_mode=swift_mode, layer_set=layer_set,
                              drafter=drafter, k_max=k_max, eps=eps, seed=seed, swift_kwargs=swift_kwargs,
                              **model_kwargs)
    hf_args = compat.generate_call_arguments()
    problems = _refusals(generation_config, logits_processor, stopping_criteria, model_kwargs, hf_args,
                         input_ids.shape[-1])
    if problems:
        raise SwiftkernError("the swiftkern transformers backend does not support: " + "; ".join(problems)
                             + ". Drop these options, or call model.generate without custom_generate")
    prompts = _prompts(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"))
    streamer = hf_args.get("streamer")
    if streamer is not None and len(prompts) > 1:
        raise SwiftkernError(f"a streamer takes one sequence; got a batch of {len(prompts)} prompts")

    do_sample = bool(compat.config_value(generation_config, "do_sample"))
    warp = _warper_values(logits_processor) if do_sample else {}
    max_length = generation_config.max_length
    if max_length is None:
        raise SwiftkernError("no max_length / max_new_tokens in the generation config; pass max_new_tokens")
    max_new_tokens = max_length - input_ids.shape[1]
    eos, pad = compat.special_tokens(generation_config)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item()) if do_sample else 0
    seed = whole("seed", seed, *SEED_RANGE)
    options = _generator_options(swift_kwargs, layer_set=layer_set, drafter=drafter, k_max=k_max, eps=eps)
    gen = _generator_for(model, swift_mode, options, keep=not do_sample)

    def put(request: int, tokens: list[int]) -> None:  # one put a token, as HF's own loop
        for t in tokens:
            streamer.put(torch.tensor([t]))

    out = gen.generate(prompts, max_new_tokens=max_new_tokens, do_sample=do_sample, seed=[(seed + b) % (1 << 64) for b in
                       range(len(prompts))], eos_token_id=eos, streamer=put if streamer is not None else None,
                       **warp)
    if streamer is not None:
        streamer.end()
    sequences = _sequences(input_ids, out.tokens, pad)
    if compat.config_value(generation_config, "return_dict_in_generate"):
        return compat.output_class()(sequences=sequences)
    return sequences
