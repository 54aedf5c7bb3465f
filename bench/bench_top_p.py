"""Top-p filtering on the CPU: the value sort (``top_p.top_p_removed``) vs torch.sort's argsort
(``top_p_removed_by_sort``, HF's way), the mask alone and inside sampled generation.

    python -m bench --routine top_p [--providers value-sort,value-sort-torch,sort] [--reps N] [--smoke] [--no-csv]

Ways: ``value-sort`` (numpy sorts the rows, the C++ ``top_p_cut`` cuts them), ``value-sort-torch``
(the value sort as it was first written: one thread sorts, the cut in torch passes,
``reference.top_p_cut``) and ``sort``. Group ``mask``: one call on N x V float32 logits at top_p
0.9 (N = 1: a decode step; 9: a verify pass of 8 drafts; 32: a batch), V = 49152 (SmolLM2) and
128256 (Llama-3); the masks are checked equal first. Group ``generate``: SmolLM2 (``--smoke``:
the tiny random Llama) sampling at temperature 0.7, top_p 0.9, seed 0, ``--max-new-tokens``
tokens (default 128) from the first bench prompt, ``ar`` and self-spec with prompt lookup, each
with the top-p mask of every way (``<mode>`` / ``<mode>-<way>``), interleaved; group ``batch``:
``ar`` on 32 prompts (the bench prompts in turn) for 32 tokens. The tokens must be equal.
Column ``x_vs_sort``: the sort's median over this provider's, same case, same run; ``tok_s``: new
tokens over the whole call's median, ``decode_tok_s``: over the median decode time alone (the
prompts' prefill left out, which the batch's 32 prompts make a large share of the call).
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import encode, load_prompts, tiny_model  # noqa: E402
from swiftkern import reference, sampling  # noqa: E402
from swiftkern.top_p import top_p_removed, top_p_removed_by_sort  # noqa: E402

ROUTINE = "top_p"
PRINT_KEYS = ("group", "provider", "shape", "median_ms", "x_vs_sort", "tok_s", "decode_tok_s")
TOP_P = 0.9
BATCH = 32


def value_sort_torch(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The value sort as first written (4843af9): numpy sorts the rows one after another, the cut
    is torch passes over [N, V] (``reference.top_p_cut``, the C++ kernel's twin)."""
    rows = logits.contiguous()
    sorted_values = torch.from_numpy(np.sort(rows.detach().numpy(), axis=-1))  # [N, V]
    cut = reference.top_p_cut(sorted_values, sorted_values.softmax(dim=-1), top_p)  # [N]
    if bool((cut < 0).any()):
        return top_p_removed_by_sort(rows, top_p)
    return rows < sorted_values.gather(-1, cut.unsqueeze(-1))


MASKS = {"value-sort": top_p_removed, "value-sort-torch": value_sort_torch, "sort": top_p_removed_by_sort}
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
        want = top_p_removed_by_sort(x, TOP_P)
        if not all(torch.equal(mask(x, TOP_P), want) for mask in masks.values()):
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
    texts = [p["text"] for p in load_prompts()]
    n = 8 if args.smoke else args.max_new_tokens
    out = _generate_group("generate", model, tok, MODES, [encode(tok, texts[0], model.vocab_size)], n, masks, reps)
    batch = [encode(tok, texts[i % len(texts)], model.vocab_size) for i in range(4 if args.smoke else BATCH)]
    return out + _generate_group("batch", model, tok, {"ar": MODES["ar"]}, batch, 4 if args.smoke else 32, masks,
                                 max(1, reps // 2))


def _generate_group(group, model, tok, modes: dict, prompts: list, n: int, masks: dict, reps: int) -> list[dict]:
    """Each mode with each way's mask, interleaved; the tokens of every way must be the same."""
    kw = dict(max_new_tokens=n, do_sample=True, temperature=0.7, top_p=TOP_P, seed=0, eos_token_id=[])
    fns, tokens, decode_s = {}, {}, {}
    for mode, config in modes.items():
        gen = swiftkern.Generator(model, tok, **config)
        for way, mask in masks.items():
            name = mode if way == "value-sort" else f"{mode}-{way}"

            def fn(gen=gen, mask=mask, name=name):
                sampling.top_p_removed, saved = mask, sampling.top_p_removed
                try:
                    out = gen.generate(prompts, **kw)
                    tokens[name] = out.tokens
                    decode_s.setdefault(name, []).append(out.stats["decode_s"])
                finally:
                    sampling.top_p_removed = saved
            fns[name] = fn
    times = common.time_fn(fns, "cpu", warmup=1, reps=reps)
    out = []
    for mode in modes:
        mine = {k: v for k, v in times.items() if k == mode or k.startswith(f"{mode}-")}
        if any(tokens[k] != tokens[f"{mode}-sort"] for k in mine):
            raise AssertionError(f"{mode}: a value sort changed the sampled tokens")
        extra = {k: {"tok_s": round(len(prompts) * n / (t["median_ms"] * 1e-3), 1),
                     "decode_tok_s": round(len(prompts) * n / statistics.median(decode_s[k]), 1)}
                 for k, t in mine.items()}
        out += _rows(group, mine, f"B={len(prompts)} N={n}", f"{mode}-sort", **extra)
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
