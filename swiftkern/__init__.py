"""swiftkern: lossless faster LLM decoding (self-speculative, deterministic) with fused kernels.

Public API: ``load_model``, ``SkipModel``, ``KVCache``, ``LayerSet``, ``Generator``,
``SwiftkernError``, ``TextStream`` (text as it is generated); the kernels are in ``swiftkern.ops`` and their twins in
``swiftkern.reference``.
"""

__version__ = "0.1.0"

from .errors import SwiftkernError
from .layer_set import LayerSet
from .kv_cache import KVCache
from .model import SkipModel
from .generate import Generator, GenerationOutput
from .loading import load_model
from .streaming import TextStream
from .patching import (apply_swiftkern_to_llama, apply_swiftkern_to_mistral, apply_swiftkern_to_qwen2,
                       apply_swiftkern_to_qwen3)

__all__ = ["SwiftkernError", "LayerSet", "KVCache", "SkipModel", "Generator", "GenerationOutput",
           "TextStream", "load_model", "__version__"]
