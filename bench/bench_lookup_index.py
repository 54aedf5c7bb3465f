"""Prompt lookup over long contexts: the context's index (``lookup_index.ContextIndex``, through
``PromptLookup`` as the decoding loops use it) vs the scan of the whole context every step
(``drafters.lookup_match``).

    python -m bench --routine lookup_index [--providers index,scan] [--reps N] [--smoke] [--no-csv]

Group ``match``: one row's lookups (k = 8) over 64 steps, each committing one more output token,
after a prompt of P tokens (P = 256, 1024, 4096, 16384; ``--smoke``: 256, 1024) and, in the last
case, after a prompt of 128 tokens and 4096 output tokens already committed (a long answer). The
tokens are the bench prompts' SmolLM2 token ids (``--smoke``: their bytes) in chunks of 4-31
drawn at random, so that n-grams repeat as in text; the two ways' matches are checked equal
first. ``median_ms``: the 64 lookups (the index: with its growth by each committed token);
``us_step``: one; ``build_ms``: indexing what came before the 64 steps.
Group ``decode``: self-spec with prompt lookup, greedy, on a small random Llama with SmolLM2's
vocabulary (4 layers of 64: on the CPU a forward of about a millisecond, as a small model's on
a GPU, where the host's work a step is what decoding waits for), 8 prompts of 4096 such tokens
(``--smoke``: 2 of 512), 32 new tokens; the index on and off (``PromptLookup.INDEX_MIN_TOKENS``),
decode tok/s. The tokens must be equal. On ``--device cuda`` the decode group alone runs, there
(the match group is host work, timed on the CPU machine). ``x_vs_scan``: the scan's median over
this provider's, same case, same run.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import encode, load_prompts  # noqa: E402
from swiftkern.drafters import lookup_match  # noqa: E402
from swiftkern.lookup_index import PromptLookup  # noqa: E402

ROUTINE = "lookup_index"
PRINT_KEYS = ("group", "provider", "shape", "median_ms", "us_step", "x_vs_scan", "build_ms", "decode_tok_s")
STEPS = 64
VOCAB = 49152  # SmolLM2's


def token_stream(args, n: int, seed: int) -> list[int]:
    """n token ids: chunks of 4-31 consecutive tokens of the bench prompts, drawn at random."""
    if args.smoke:
        ids = [t for p in load_prompts() for t in encode(None, p["text"] * 4, VOCAB)]
    else:
        _, tok = swiftkern.load_model(args.model, device="cpu")
        ids = [t for p in load_prompts() for t in tok(p["text"])["input_ids"]]
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        j = rng.randrange(len(ids) - 32)
        out += ids[j:j + rng.randrange(4, 32)]
    return out[:n]


def match_rows(args, ways: list[str], reps: int) -> list[dict]:
    rows = []
    cases = [(256, 0), (1024, 0)] if args.smoke else [(256, 0), (1024, 0), (4096, 0), (16384, 0), (128, 4096)]
    for P, G in cases:
        tokens = token_stream(args, P + G + STEPS, seed=P + G)
        prompt = tokens[:P]
        steps = [tokens[P:P + G + g] for g in range(1, STEPS + 1)]  # the output committed at each step

        def fresh() -> PromptLookup:  # a lookup whose index holds the prompt and the first G output tokens
            lookup = PromptLookup([prompt])
            lookup.match(0, tokens[P:P + G], 8)
            return lookup

        t0 = time.perf_counter()
        first = fresh()
        build_ms = (time.perf_counter() - t0) * 1e3
        if any(first.match(0, out, 8) != lookup_match(prompt + out, 8) for out in steps):
            raise AssertionError(f"lookup_index: the index's matches differ from the scan's at P={P} G={G}")
        ready = [fresh() for _ in range(reps + 1)]  # warm-up and timed calls each start from a fresh index

        def indexed(ready=ready, steps=steps) -> list:
            lookup = ready.pop()
            return [lookup.match(0, out, 8) for out in steps]

        fns = {"index": indexed, "scan": lambda: [lookup_match(prompt + out, 8) for out in steps]}
        times = common.time_fn({w: fns[w] for w in ways}, "cpu", warmup=1, reps=reps)
        for way, t in times.items():
            rows.append(common.row(ROUTINE, way, "cpu", "", f"P={P} G={G}+{STEPS}", t, group="match",
                                   us_step=round(t["median_ms"] * 1e3 / STEPS, 2),
                                   x_vs_scan=round(times["scan"]["median_ms"] / t["median_ms"], 2) if "scan" in times
                                   else "", build_ms=round(build_ms, 2) if way == "index" else ""))
    return rows


def small_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return swiftkern.SkipModel.from_hf(LlamaForCausalLM(cfg).eval().to(device))


def decode_rows(args, ways: list[str], reps: int) -> list[dict]:
    batch, P, n = (2, 512, 8) if args.smoke else (8, 4096, 32)
    prompts = [token_stream(args, P, seed=100 + i) for i in range(batch)]
    gen = swiftkern.Generator(small_llama(args.device), mode="self-spec", drafter="lookup")
    limits = {"index": PromptLookup.INDEX_MIN_TOKENS, "scan": 10 ** 9}
    tokens, decode_s = {}, {}

    def run_way(way: str):
        saved, PromptLookup.INDEX_MIN_TOKENS = PromptLookup.INDEX_MIN_TOKENS, limits[way]
        try:
            out = gen.generate(prompts, max_new_tokens=n, eos_token_id=[])
        finally:
            PromptLookup.INDEX_MIN_TOKENS = saved
        tokens[way] = out.tokens
        decode_s.setdefault(way, []).append(out.stats["decode_s"])

    times = common.time_fn({w: (lambda w=w: run_way(w)) for w in ways}, args.device, warmup=1, reps=reps)
    if len({str(t) for t in tokens.values()}) > 1:
        raise AssertionError("lookup_index: the index changed the generated tokens")
    tok_s = {w: batch * n / statistics.median(decode_s[w]) for w in ways}
    return [common.row(ROUTINE, w, args.device, torch.float32, f"B={batch} P={P} N={n}", t, group="decode",
                       decode_tok_s=round(tok_s[w], 1),
                       x_vs_scan=round(tok_s[w] / tok_s["scan"], 2) if "scan" in tok_s else "")
            for w, t in times.items()]


def run(args) -> list[dict]:
    ways = [w for w in ("index", "scan") if not args.providers or w in args.providers]
    reps = args.reps or (2 if args.smoke else 10)
    rows = [] if args.device.startswith("cuda") else match_rows(args, ways, reps)
    return rows + decode_rows(args, ways, max(1, reps // 2))


if __name__ == "__main__":
    from bench.kernel_bench import standalone
    sys.exit(standalone(ROUTINE))
