"""What differs between transformers versions, in one place, for the HF ``generate`` backend.

Supported: transformers 4.57+ and 5.x (run: 4.57.6, 5.17, 5.25). Both call a *callable*
``custom_generate`` the same way: ``GenerationMixin.generate`` prepares the inputs, the
``GenerationConfig`` (max_length set from max_new_tokens, special-token tensors), the logits
processors and stopping criteria, then calls ``custom_generate(model, input_ids,
logits_processor=..., stopping_criteria=..., generation_config=..., **custom_kwargs,
**model_kwargs)``. What changed between versions and is handled here:

- before 4.56 a callable ``custom_generate`` did not exist (only Hub repo names), and 4.56's
  ``generate`` refuses its own keyword arguments (``swift_mode``, ...) as model kwargs the
  model does not use (4.56.2: 49 failures in the backend's tests), so 4.57 is the floor;
- 4.x fills unset ``GenerationConfig`` fields with values (top_k=50, temperature=1.0, ...),
  5.x leaves them None in a bare config and fills them while preparing; ``config_value``
  reads either as the neutral value;
- ``_eos_token_tensor`` / ``_pad_token_tensor`` (prepared special tokens) exist from 4.41 on,
  earlier only the raw ids; ``special_tokens`` reads whichever is there;
- in both 4.57+ and 5.x the ``streamer`` and ``assistant_model`` arguments of ``generate``
  are not passed on to a callable ``custom_generate`` (it receives only its own extra keyword
  arguments); ``generate_call_arguments`` reads them from the calling ``generate`` frame;
- 5.24 renamed the KV cache that ``generate`` prepares (an empty ``DynamicCache``, passed on
  in the model kwargs) from ``past_key_values`` to ``cache``: ``CACHE_KWARGS`` names both.
"""

from __future__ import annotations

import inspect
import re

import torch

from ..errors import SwiftkernError

MIN_VERSION = (4, 57)
CACHE_KWARGS = ("past_key_values", "cache")  # the prepared KV cache's model-kwarg name: before / from 5.24


def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    import transformers

    m = re.match(r"(\d+)\.(\d+)", transformers.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_version() -> None:
    """Raise SwiftkernError when transformers cannot call a callable custom_generate."""
    if transformers_version() < MIN_VERSION:
        import transformers

        raise SwiftkernError(
            f"transformers {transformers.__version__} cannot call a callable custom_generate with its own keyword "
            "arguments (4.57 on; 4.56 refuses them as unused model kwargs); "
            "upgrade transformers, or call swiftkern.Generator(model).generate(...) directly")


def output_class():
    """GenerateDecoderOnlyOutput (the same dataclass in 4.x and 5.x)."""
    from transformers.generation import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput


def generation_mixin():
    from transformers.generation.utils import GenerationMixin

    return GenerationMixin


# neutral value of each GenerationConfig field the backend reads (5.x leaves them None)
_NEUTRAL = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_beams": 1,
            "num_return_sequences": 1, "num_beam_groups": 1, "output_scores": False, "output_logits": False,
            "output_attentions": False, "output_hidden_states": False, "return_dict_in_generate": False,
            "token_healing": False}


def config_value(generation_config, name: str):
    """generation_config.<name>, with None (unset in 5.x) read as the field's neutral value."""
    value = getattr(generation_config, name, None)
    return _NEUTRAL.get(name) if value is None else value


def _ids(value) -> list[int]:
    if value is None:
        return []
    if torch.is_tensor(value):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def special_tokens(generation_config) -> tuple[list[int], int | None]:
    """(eos token ids, pad token id or None) as HF's generate prepared them."""
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = _ids(eos if eos is not None else generation_config.eos_token_id)
    pad = getattr(generation_config, "_pad_token_tensor", None)
    pad = _ids(pad if pad is not None else generation_config.pad_token_id)
    return eos, (pad[0] if pad else None)


def generate_call_arguments(max_depth: int = 8) -> dict:
    """The local variables of the ``GenerationMixin.generate`` call that invoked the caller
    (found by its code object, within ``max_depth`` frames), or {} when there is none.

    Needed because transformers (4.56 to 5.x at least) drops ``streamer`` and
    ``assistant_model`` when it calls a callable ``custom_generate``."""
    target = inspect.unwrap(generation_mixin().generate).__code__
    frame = inspect.currentframe()
    try:
        f = frame.f_back
        for _ in range(max_depth):
            if f is None:
                return {}
            if f.f_code is target:
                return dict(f.f_locals)
            f = f.f_back
        return {}
    finally:
        del frame
