"""Graph keys the decoding loops meet round after round: how often a run through CUDA graphs still
pays an eager forward (a key's first sight) or a capture (its second).

    python -m bench --routine graph_keys [--providers lookup,self-spec] [--reps 4] [--max-new-tokens 32] [--smoke]

A round is the determinism bench's batch-1 calls: each bench prompt generated alone, one after
the other, by one Generator whose runner keeps its graphs across rounds (``--reps`` rounds). On
a GPU the runner captures real graphs; on the CPU it is the emulated runner
(``graph_capture.EmulatedGraph``: the same keys and bookkeeping, each replay running the body
again), so the counts are the loops' own. Providers (greedy):

    ar          plain decoding (one key a span after the prefills)
    lookup      self-spec with prompt lookup and its drafter policy (widths chosen from timings)
    lookup-unpadded  the same with the runner's verify passes at their own widths
                (``GraphRunner.padded_tokens`` turned off: how the loop ran before 2026-12-05)
    self-spec   self-spec with the bench's layer set (eps 0.8), the draft forwards keyed too

Columns: round, first_sights (keys met the first time: eager forwards), captures, replays,
graphs (kept by the runner), widths (the forward widths T among the runner's keys, prefills
included), median_ms (the round's wall time; on the CPU the emulation's, not a GPU's). A loop
whose widths follow its timings keeps meeting new keys in later rounds; steady rounds show 0 / 0.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_determinism import LAYER_SET  # noqa: E402
from bench.bench_generate import encode, load_prompts, tiny_model  # noqa: E402
from swiftkern.cuda_graphs import GraphRunner  # noqa: E402
from swiftkern.graph_capture import EmulatedGraph  # noqa: E402

ROUTINE = "graph_keys"
PRINT_KEYS = ("provider", "round", "first_sights", "captures", "replays", "graphs", "widths", "median_ms")
PROVIDERS = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="self-spec", drafter="lookup"),
    "lookup-unpadded": dict(mode="self-spec", drafter="lookup"),
    "self-spec": dict(mode="self-spec", drafter="layer-skip", eps=0.8),
}


def run(args) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.smoke:
        model, tok, name, layer_set = swiftkern.SkipModel.from_hf(tiny_model()), None, "tiny-llama", "attn:1|mlp:2"
    else:
        model, tok = swiftkern.load_model(args.model, device=args.device)
        name, layer_set = args.model, LAYER_SET
    texts = [encode(tok, p["text"], model.vocab_size)[:16 if args.smoke else None] for p in load_prompts()]
    n = 8 if args.smoke else args.max_new_tokens
    rounds = args.reps or (2 if args.smoke else 4)
    graph_type = None if model.device.type == "cuda" else EmulatedGraph
    names = [p for p in (args.providers or PROVIDERS) if p in PROVIDERS]
    rows = []
    with common.KeepRowsOnInterrupt(rows, "providers"):
        for provider in names:
            kw = dict(PROVIDERS[provider], **({"layer_set": layer_set} if provider == "self-spec" else {}))
            runner = GraphRunner(model, graph_type)
            if provider.endswith("-unpadded"):
                runner.padded_tokens = lambda batch, tokens, room: tokens
            gen = swiftkern.Generator(model, tok, cuda_graphs=runner, **kw)
            for rnd in range(rounds):
                before = (runner.first_sights, runner.captures, runner.replays)
                start = time.perf_counter()
                for text in texts:
                    gen.generate([text], max_new_tokens=n, eos_token_id=[])
                ms = (time.perf_counter() - start) * 1e3
                sights, captures, replays = (a - b for a, b in zip(
                    (runner.first_sights, runner.captures, runner.replays), before))
                widths = sorted({key[2] for key in runner.entries if key[0] == "forward"})
                rows.append(common.row(ROUTINE, provider, args.device, model.dtype, f"B=1 N={n}",
                                       dict(median_ms=ms, p20_ms=ms, p80_ms=ms), model=name, round=rnd,
                                       first_sights=sights, captures=captures, replays=replays,
                                       graphs=len(runner.entries), widths="|".join(map(str, widths))))
    return rows
