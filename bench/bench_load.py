"""Loading a GGUF model: swiftkern's load against transformers' own path, whole and by piece.

    python -m bench --routine load [--providers ...] [--reps 3] [--smoke] [--no-csv]

Groups (shape column), each provider timed interleaved with its baseline in one run, the ratio
``x_vs_baseline`` = baseline's median / the provider's:

    reader          building ``gguf.GGUFReader`` on the file: ``memmap`` (gguf's, the baseline)
                    vs ``fast`` (``gguf_reader_fast``: the file as a plain array, arrays read in one loop)
    dequantize      every Q4_1 / Q8_0 tensor of the file: ``gguf`` (numpy, the baseline) vs
                    ``swiftkern`` (``gguf_dequant``, whole-tensor torch ops)
    find codes      ``packed_weights.pack`` of every dequantized weight: ``torch-twin`` (the
                    baseline) vs ``cpp`` (``csrc/pack_codes_cpu.cpp``)
    load_model      the whole ``load_model(--model)`` (model, tokenizer, packed weights):
                    ``transformers`` (no ``gguf_parsed_once``, codes found by the twin: the path
                    before any of it) vs ``swiftkern``; not in --smoke

Each call of the first three starts from the same inputs; ``load_model`` rows are a process's
later loads (the warm-up load imports transformers' model modules). --smoke: a small GGUF file
written on the spot (two Q4_1 and one Q8_0 tensor, a 300-string array), no load_model.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import common  # noqa: E402

ROUTINE = "load"
PRINT_KEYS = ("provider", "shape", "median_ms", "p20_ms", "p80_ms", "x_vs_baseline")
BASELINES = {"reader": "memmap", "dequantize": "gguf", "find codes": "torch-twin", "load_model": "transformers"}


def small_gguf(directory: str) -> str:
    """A GGUF file with two Q4_1 tensors, one Q8_0 tensor and a 300-string array -> its path."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    path = os.path.join(directory, "small.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(300)])
    rng = np.random.default_rng(0)
    for name, (n, k), qtype in (("a", (96, 256), Q.Q4_1), ("b", (64, 256), Q.Q4_1), ("c", (300, 128), Q.Q8_0)):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def piece_providers(path: str) -> dict:
    """{group: {provider: fn}} for the reader, dequantize and find-codes groups of a file."""
    import gguf
    import torch
    from gguf import GGMLQuantizationType as Q

    from swiftkern import packed_weights
    from swiftkern.gguf_dequant import fast_dequantize
    from swiftkern.gguf_reader_fast import fast_reader_class

    fast = fast_reader_class(gguf.GGUFReader)
    tensors = [(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors if t.tensor_type in (Q.Q4_1, Q.Q8_0)]
    ours = fast_dequantize(gguf.dequantize)
    weights = [torch.from_numpy(np.array(gguf.dequantize(d, q))) for d, q in tensors]
    weights = [w for w in weights if w.dim() == 2]

    def pack_all(native: bool):
        def fn():
            with _native_pack(native):
                for w in weights:
                    packed_weights.pack(w)
        return fn

    return {
        "reader": {"memmap": lambda: gguf.GGUFReader(path), "fast": lambda: fast(path)},
        "dequantize": {"gguf": lambda: [gguf.dequantize(d, q) for d, q in tensors],
                       "swiftkern": lambda: [ours(d, q) for d, q in tensors]},
        "find codes": {"torch-twin": pack_all(False), "cpp": pack_all(True)},
    }, len(tensors), len(weights)


@contextlib.contextmanager
def _native_pack(native: bool):
    """packed_weights.pack with the C++ pack_codes (native) or its torch twin."""
    from swiftkern import packed_weights

    original = packed_weights._native_pack_codes
    if not native:
        packed_weights._native_pack_codes = lambda: None
    try:
        yield
    finally:
        packed_weights._native_pack_codes = original


def load_providers(model: str) -> dict:
    from swiftkern import loading

    def transformers_path():
        original = loading.gguf_parsed_once
        loading.gguf_parsed_once = contextlib.nullcontext
        try:
            with _native_pack(False):
                loading.load_model(model)
        finally:
            loading.gguf_parsed_once = original

    return {"transformers": transformers_path, "swiftkern": lambda: loading.load_model(model)}


def run(args) -> list[dict]:
    from swiftkern.loading import smollm2_path

    reps = args.reps or (1 if args.smoke else 3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = small_gguf(tmp) if args.smoke else (smollm2_path() if args.model == "smollm2" else args.model)
        if not path.endswith(".gguf"):
            print(f"load: --model {args.model!r} is not a .gguf file or 'smollm2'; nothing to time", file=sys.stderr)
            return []
        groups, n_tensors, n_weights = piece_providers(path)
        labels = {"reader": f"reader {os.path.basename(path)}", "dequantize": f"dequantize {n_tensors} tensors",
                  "find codes": f"find codes {n_weights} weights"}
        if not args.smoke:
            groups["load_model"] = load_providers(args.model)
            labels["load_model"] = f"load_model {args.model}"
        for group, fns in groups.items():
            if args.providers:
                fns = {p: fn for p, fn in fns.items() if p in args.providers or p == BASELINES[group]}
            times = common.time_fn(fns, "cpu", warmup=1, reps=reps)
            base = times[BASELINES[group]]["median_ms"]
            for provider, timing in times.items():
                rows.append(common.row(ROUTINE, provider, "cpu", "float32", labels[group], timing, reps=reps,
                                       x_vs_baseline=round(base / timing["median_ms"], 2)))
            if common.interrupted():
                break
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    a = ap.parse_args()
    a.device, a.providers = "cpu", None
    common.print_rows(run(a), keys=PRINT_KEYS)
