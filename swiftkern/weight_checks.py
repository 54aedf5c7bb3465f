"""Every tensor the runner reads from an HF model: in memory, on one device, in one dtype it runs."""

from __future__ import annotations

from .errors import SwiftkernError
from .ops.checks import FLOAT_DTYPES


def check_weights_placed(hf_model) -> None:
    """Refuse, naming the tensor and the fix, a model whose parameters or buffers (RoPE's
    frequencies) are on the meta device (accelerate's offload, a ``device_map`` that offloads to
    'cpu' or 'disk', ``init_empty_weights``: a hook fills them for each HF forward, which the
    runner does not call), on more than one device (``device_map="auto"`` over several GPUs),
    in a dtype no kernel runs (float64), or in more than one dtype. Each failed before inside a
    kernel, with torch's message about a meta tensor, a dtype pair or a view, or none at all."""
    params = list(hf_model.named_parameters())
    tensors = params + list(hf_model.named_buffers())
    for name, t in tensors:
        if t.is_meta:
            raise SwiftkernError(
                f"{name} is on the meta device (no data): the model's weights are not all in memory (accelerate's "
                f"offload, a device_map that offloads to 'cpu' or 'disk', or init_empty_weights leave them there "
                f"for a hook that HF's forward calls and swiftkern's does not). Load the model with every weight "
                f"on one device (device_map={{'': 'cpu'}} or {{'': 'cuda:0'}}, or no device_map)")
    embed = hf_model.model.embed_tokens.weight
    for name, t in tensors:
        if t.device != embed.device:
            raise SwiftkernError(
                f"{name} is on {t.device}, the embedding on {embed.device}: swiftkern runs a model on one device "
                f"(device_map='auto' may split it over several). Load it with device_map={{'': '{embed.device}'}} "
                f"or move it with model.to('{embed.device}')")
    if embed.dtype not in FLOAT_DTYPES:
        raise SwiftkernError(f"the model's weights are {embed.dtype}: swiftkern runs float32, bfloat16 or float16 "
                             f"models. Convert it first, e.g. model.to(torch.float32)")
    for name, p in params:
        if p.dtype != embed.dtype:
            raise SwiftkernError(f"{name} is {p.dtype}, the embedding {embed.dtype}: swiftkern runs every weight in "
                                 f"one dtype. Convert the model first, e.g. model.to({embed.dtype})")
