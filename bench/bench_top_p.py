"""Top-p filtering on the CPU: the value sort (``top_p.top_p_removed``) vs torch.sort's argsort
(``top_p_removed_by_sort``, HF's way), the mask alone and inside sampled generation.

    python -m bench --routine top_p [--providers value-sort,sort] [--reps N] [--smoke] [--no-csv]

Group ``mask``: one call on N x V float32 logits at top_p 0.9 (N = 1: a decode step; 9: a
verify pass of 8 drafts; 32: a batch), V = 49152 (SmolLM2) and 128256 (Llama-3); the two masks
are checked equal first. Group ``generate``: SmolLM2 (``--smoke``: the tiny random Llama)
sampling at temperature 0.7, top_p 0.9, seed 0, ``--max-new-tokens`` tokens (default 128)
from the first bench prompt, ``ar`` and self-spec with prompt lookup, each with the top-p mask
of either way (``<mode>`` / ``<mode>-sort``), interleaved; the tokens must be equal.
Column ``x_vs_sort``: the sort's median over this provider's, same case, same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import encode, load_prompts, tiny_model  # noqa: E402
from swiftkern import sampling  # noqa: E402
from swiftkern.top_p import top_p_removed, top_p_removed_by_sort  # noqa: E402

ROUTINE = "top_p"
PRINT_KEYS = ("group", "provider", "shape", "median_ms", "x_vs_sort", "tok_s")
TOP_P = 0.9
MASKS = {"value-sort": top_p_removed, "sort": top_p_removed_by_sort}
MODES = {"ar": dict(mode="ar"), "lookup": dict(mode="self-spec", drafter="lookup")}


def _rows(group: str, times: dict, shape: str, base: str, **extra) -> list[dict]:
    ref = times[base]["median_ms"]
    return [common.row(ROUTINE, name, "cpu", torch.float32, shape, t, group=group,
                       x_vs_sort=round(ref / t["median_ms"], 2), **extra.get(name, {}))
            for name, t in times.items()]


def mask_rows(args, masks: dict, reps: int) -> list[dict]:
    grid = [(1, 1000), (9, 1000)] if args.smoke else [(n, v) for v in (49152, 128256) for n in (1, 9, 32)]
    out = []
    for n, v in grid:
        x = torch.randn(n, v, generator=torch.Generator().manual_seed(n + v)) * 4
        if not torch.equal(top_p_removed(x, TOP_P), top_p_removed_by_sort(x, TOP_P)):
            raise AssertionError(f"top_p masks differ at N={n} V={v}")
        times = common.time_fn({name: (lambda f=f: f(x, TOP_P)) for name, f in masks.items()}, "cpu",
                               warmup=1, reps=reps)
        out += _rows("mask", times, f"N={n} V={v}", "sort")
    return out


def generate_rows(args, masks: dict, reps: int) -> list[dict]:
    if args.smoke:
        model, tok = swiftkern.SkipModel.from_hf(tiny_model()), None
    else:
        model, tok = swiftkern.load_model(args.model, device="cpu")
    n = 8 if args.smoke else args.max_new_tokens
    prompt = encode(tok, load_prompts()[0]["text"], model.vocab_size)
    kw = dict(max_new_tokens=n, do_sample=True, temperature=0.7, top_p=TOP_P, seed=0, eos_token_id=[])
    fns, tokens = {}, {}
    for mode, config in MODES.items():
        gen = swiftkern.Generator(model, tok, **config)
        for way, mask in masks.items():
            name = mode if way == "value-sort" else f"{mode}-sort"

            def fn(gen=gen, mask=mask, name=name):
                sampling.top_p_removed, saved = mask, sampling.top_p_removed
                try:
                    tokens[name] = gen.generate([prompt], **kw).tokens[0]
                finally:
                    sampling.top_p_removed = saved
            fns[name] = fn
    times = common.time_fn(fns, "cpu", warmup=1, reps=reps)
    out = []
    for mode in MODES:
        pair = {k: v for k, v in times.items() if k in (mode, f"{mode}-sort")}
        if len(pair) == 2 and tokens[mode] != tokens[f"{mode}-sort"]:
            raise AssertionError(f"{mode}: the value sort changed the sampled tokens")
        if f"{mode}-sort" in pair:
            extra = {k: {"tok_s": round(n / (t["median_ms"] * 1e-3), 1)} for k, t in pair.items()}
            out += _rows("generate", pair, f"B=1 N={n}", f"{mode}-sort", **extra)
    return out


def run(args) -> list[dict]:
    if args.device.startswith("cuda"):
        print("note: top_p times the CPU path (on CUDA top_p_removed is the sort itself); running on the CPU")
    wanted = args.providers or list(MASKS)
    masks = {k: v for k, v in MASKS.items() if k in wanted or k == "sort"}
    reps = args.reps or (2 if args.smoke else 20)
    rows = mask_rows(args, masks, reps)
    rows += generate_rows(args, masks, max(1, reps // 4) if not args.reps else reps)
    return rows


if __name__ == "__main__":
    from bench.kernel_bench import standalone
    sys.exit(standalone(ROUTINE))
