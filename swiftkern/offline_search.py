"""Offline layer-set search (Self-SD style): ``swiftkern search``.

Generate greedy continuations of the given prompts with the full model once; then search layer
sets by their matchness on those continuations (several candidates per batched forward, random
+ BO proposals, SWIFT's stop rules, a time budget); for the best set of each skip ratio, measure
the real acceptance and speedup of self-spec decoding against ``ar`` on the same prompts; keep
the fastest and store it for the model (``layer_set_store``), where ``--layer-set auto`` finds it.
"""

from __future__ import annotations

import time


from . import layer_set_store
from .draft_head import DEFAULT_DRAFT_VOCAB, DraftHead
from .generate import Generator, prefill
from .search import LayerSetSearch, SearchConfig, matchness, window_start
from .tuner import AUTO_RATIOS


def _progress(total_s: float, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        return None
    return tqdm(total=round(total_s), desc=desc, unit="s", leave=False)


def search_layer_set(model, tokenizer, prompts: list[str], skip_ratio="auto", budget_s: float = 120.0,
                     max_new_tokens: int = 64, candidates_per_forward: int = 4, config: SearchConfig | None = None,
                     measure_repeats: int = 1, save: bool = True, log=print) -> dict:
    """Search, measure and (``save``) store the best layer set for ``model``.

    prompts: the texts to tune on; skip_ratio: a fraction or "auto" (each ratio of
    tuner.AUTO_RATIOS gets an equal share of ``budget_s``, the fastest measured one wins).
    -> the record: layer_set (str), skip_ratio, matchness, acceptance_rate (0.0 when nothing
    was drafted), drafted, mean_accepted, speedup (self-spec tokens/s over ar tokens/s,
    measured), table (one row per ratio), path.
    """
    gen = Generator(model, tokenizer)
    ids = gen.encode(prompts)
    outs = gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[]).tokens
    contexts = [p + o for p, o in zip(ids, outs)]
    # matchness scores the last max_new_tokens positions, reading the full model's KV before them
    before = [c[:max(1, window_start(c, max_new_tokens))] for c in contexts]
    cache = model.new_cache(len(before), max(len(b) for b in before))
    prefill(model, cache, before)
    rows = list(range(len(contexts)))
    head = None  # score the top-1 the draft proposes: over the same pruned head as drafting
    if DEFAULT_DRAFT_VOCAB < model.vocab_size:
        head = DraftHead.for_model(model, DEFAULT_DRAFT_VOCAB, [t for c in contexts for t in c])
    ratios = AUTO_RATIOS if skip_ratio == "auto" else (float(skip_ratio),)
    base = config or SearchConfig()
    table = []
    for ratio in ratios:
        search = LayerSetSearch(model.num_layers, SearchConfig(**{**base.__dict__, "skip_ratio": ratio}))
        share = budget_s / len(ratios)
        bar = _progress(share, f"search r={ratio}")
        t0 = time.perf_counter()
        # one batch at least, however small the budget (else no set to measure, a confusing error)
        while search.done() is None and (search.best is None or time.perf_counter() - t0 < share):
            cands = search.propose(candidates_per_forward)
            for cand, score in zip(cands, matchness(model, cache, rows, contexts, cands, max_new_tokens, head)):
                search.observe(cand, score)
            if bar is not None:
                bar.n = min(round(time.perf_counter() - t0), bar.total)
                bar.set_postfix(best=f"{search.best_score:.3f}", scored=search.steps)
        if bar is not None:
            bar.close()
        row = {"skip_ratio": ratio, "layer_set": str(search.best), "matchness": round(search.best_score, 4),
               "scored": search.steps, "stop": search.done() or "budget"}
        row.update(measure_speedup(model, tokenizer, ids, search.best, max_new_tokens, measure_repeats))
        log(f"r={ratio}: {row['layer_set']} matchness {row['matchness']:.3f} ({row['scored']} scored, "
            f"{row['stop']}) | {acceptance_text(row)}, accepted/verify "
            f"{row['mean_accepted']:.2f} | x{row['speedup']:.2f} vs ar"
            + (f" | {row['differing']} outputs differ from ar's to rounding" if row.get("differing") else ""))
        table.append(row)
    best = max(table, key=lambda r: r["speedup"])
    record = {k: best[k] for k in ("layer_set", "skip_ratio", "matchness", "acceptance_rate", "drafted",
                                   "mean_accepted", "speedup")}
    record.update(table=table, prompts=len(prompts), max_new_tokens=max_new_tokens, budget_s=budget_s)
    if save:
        from .layer_set import LayerSet
        record["path"] = layer_set_store.save(model, LayerSet.parse(best["layer_set"], model.num_layers),
                                              **{k: v for k, v in record.items() if k != "layer_set"})
    return record


def measure_speedup(model, tokenizer, ids, layer_set, max_new_tokens, repeats=1) -> dict:
    """Greedy self-spec (layer-skip drafter with this set) vs ar on the same prompts, one at a
    time, interleaved; -> speedup (ar's total decode time over self-spec's), acceptance_rate,
    mean_accepted, differing (runs whose self-spec output was not ar's: possible only where
    decoding is not batch-invariant, e.g. bf16 on a GPU, where a verify pass and a decode step
    may round a near tie apart; where it is invariant, a difference is a bug and raised)."""
    ar = Generator(model, tokenizer)
    spec = Generator(model, tokenizer, mode="self-spec", drafter="layer-skip", layer_set=layer_set)
    bitwise = spec.invariant_decode()
    t_ar, t_spec, accepted, drafted, verifies, differing = 0.0, 0.0, 0, 0, 0, 0
    for _ in range(repeats):
        for p in ids:
            a = ar.generate([p], max_new_tokens=max_new_tokens, eos_token_id=[])
            s = spec.generate([p], max_new_tokens=max_new_tokens, eos_token_id=[])
            if s.tokens != a.tokens and bitwise:
                raise AssertionError("self-spec output differs from ar: a bug, please report it")
            differing += s.tokens != a.tokens
            t_ar += a.stats["decode_s"]
            t_spec += s.stats["decode_s"]
            accepted += s.stats["accepted"]
            drafted += s.stats["drafted"]
            verifies += s.stats["row_verifies"]
    return {"speedup": round(t_ar / t_spec, 4) if t_spec else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0, "drafted": drafted,
            "mean_accepted": round(accepted / verifies, 4) if verifies else 0.0, "differing": differing}


def acceptance_text(row: dict) -> str:
    """'acceptance 0.83', or 'no drafts' where the draft was never confident enough to draft
    (an acceptance rate of 0/0, stored as 0.0 as in the Generator's stats)."""
    return f"acceptance {row['acceptance_rate']:.2f}" if row.get("drafted", 1) else "no drafts"


__all__ = ["search_layer_set", "measure_speedup", "acceptance_text"]
