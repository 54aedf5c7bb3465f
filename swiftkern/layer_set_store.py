"""Searched layer sets on disk, keyed by the model's fingerprint.

A file ``<cache dir>/layer_sets/<fingerprint>.json`` holds the best set an offline search
(``swiftkern search``) found for one model, with its matchness, acceptance and measured
speedup. The cache dir is $SWIFTKERN_CACHE_DIR, else $XDG_CACHE_HOME/swiftkern, else
~/.cache/swiftkern. The fingerprint hashes the architecture and a sample of the weights, so a
set is never applied to another model, even one of the same shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch

from .errors import SwiftkernError
from .layer_set import LayerSet

FORMAT = 1


def cache_dir() -> str:
    root = os.environ.get("SWIFTKERN_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "swiftkern")
    return os.path.join(root, "layer_sets")


def fingerprint(model) -> str:
    """sha256 (16 hex digits) of the config's shape fields and 4096 strided values of the
    embedding, the first layer's q projection and the LM head."""
    cfg = model.config
    h = hashlib.sha256()
    for key in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta"):
        h.update(f"{key}={getattr(cfg, key, None)};".encode())
    for w in (model.embed, model.layers[0].q, model.lm_head):
        flat = w.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096]
        h.update(sample.to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def path_for(model) -> str:
    return os.path.join(cache_dir(), f"{fingerprint(model)}.json")


def save(model, layer_set: LayerSet, **results) -> str:
    """Write the set and its results (matchness, acceptance, speedup, ...) -> the file path."""
    record = {"format": FORMAT, "fingerprint": fingerprint(model), "num_layers": model.num_layers,
              "layer_set": str(layer_set), **results}
    path = path_for(model)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")  # a writer of its own: no collision
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a cache dir that cannot be written: say where, and keep the set itself
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        raise SwiftkernError(f"cannot store layer set {layer_set} in {path} ({e.strerror or e}); set "
                             "SWIFTKERN_CACHE_DIR to a writable folder, or pass the set as --layer-set / "
                             "layer_set= yourself") from None
    return path


def load_record(path: str, model) -> dict:
    """Read a stored record and check it belongs to ``model``; -> the record with a LayerSet
    under "layer_set". Raises SwiftkernError for another model's file or a malformed one."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8 text
        raise SwiftkernError(f"layer-set file {path}: cannot read it ({e}); delete it or run `swiftkern search` "
                             "again") from None
    redo = "delete it or run `swiftkern search` again"
    if not isinstance(record, dict) or not isinstance(record.get("layer_set"), str):
        raise SwiftkernError(f"layer-set file {path} is not a swiftkern search record (no layer_set string); {redo}")
    if record.get("format", FORMAT) != FORMAT:
        raise SwiftkernError(f"layer-set file {path} has format {record.get('format')!r}, this swiftkern "
                             f"reads format {FORMAT}; {redo}")
    mine = fingerprint(model)
    if record.get("fingerprint") != mine:
        raise SwiftkernError(f"layer-set file {path} is for model {record.get('fingerprint')}, this model is {mine}; "
                             "run `swiftkern search` for this model")
    try:
        record["layer_set"] = LayerSet.parse(record["layer_set"], model.num_layers)
    except SwiftkernError as e:
        raise SwiftkernError(f"layer-set file {path}: {e}; {redo}") from None
    return record


def load(model) -> dict | None:
    """The stored record for this model, or None when there is none."""
    path = path_for(model)
    return load_record(path, model) if os.path.exists(path) else None
