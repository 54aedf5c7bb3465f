"""Deterministic mode (LLM-42) vs plain batched ar: throughput, rollback fraction, and self-spec.

    python -m bench --routine determinism [--max-new-tokens 64] [--reps 2] [--smoke] [--no-csv]
        [--providers ar,deterministic,self-spec+det,self-spec] [--cuda-graphs] [--dtype bfloat16]

Three groups, each timed interleaved (A B C ... A B C) so drift hits every provider alike, greedy,
exactly ``--max-new-tokens`` per prompt (EOS off), prompts from bench/prompts.jsonl cycled
to fill the batch (chat template):

    throughput  batch 8 and 32: ar vs deterministic (replay auto: no replay where an invariant set
                runs, the CPU's C++ kernels or CUDA's Triton set; else window 32, verify batch 4,
                16 on a GPU) vs det-replay
                (the LLM-42 replay forced; verifier kernels auto: the fused set) vs
                det-replay-portable (the replay with the portable set of torch compositions)
                vs det-replay-1/8 (one request in eight needs determinism, the others skip
                verification: LLM-42's case)
    windows     batch 8: ar vs the replay at windows 8, 16, 32, 64 (rollback fraction, speed)
    arrivals    batch 8 arriving while others decode (two at the start, then one every
                ARRIVAL_GAP steps: dynamic batching, LLM-42's setting): ar vs deterministic vs
                det-replay, each with the same arrivals
    batch 1     each of the five prompts alone, in turn: ar vs deterministic (replay auto;
                window 32, verify batch 1, unused where auto skips the replay) vs self-spec +
                deterministic (replay auto: on the CPU the speculative loop on the invariant
                kernels, drafter policy over lookup
                and the layer set; with replay: the full model checking prompt-lookup drafts
                and the layer-skipped draft are the fast path, window 32, verify batch 1) vs
                self-spec+det-replay (the replay forced) vs self-spec+det-portable (a GPU: the
                replay with the portable verifier set) vs det-replay-w32 (the replay with the
                regular fast path at the same window 32: what the self-spec fast path's policy
                must beat) vs self-spec alone (layer-skip
                drafter), layer set LAYER_SET, vs lookup (self-spec with prompt-lookup drafts
                alone: the speculative loop's own gain or loss against ar, no model drafts)

Where replay "auto" replays (``Generator.replay_elided``: on a GPU under the self-spec drafter;
on a CPU without the C++ kernels), the provider that would repeat it (det-replay,
self-spec+det-replay) is left out and det-invariant / self-spec+det-invariant (``replay="never"``:
every step through the invariant set, on CUDA the Triton one with ``bi_matmul`` in place of
cuBLAS, nothing replayed) stands beside it: which of the two ways costs less. On a GPU,
deterministic (auto) decodes through the Triton invariant set and det-replay is the replay.

``--providers`` keeps ar in every group and skips a group where none of the other named providers
is (``--providers det-replay-portable,det-replay-1/8`` runs the throughput group alone).

Columns: tok_s (all new tokens / median wall time, prefill included), replay (elided or
replayed), deterministic_share (the
fraction of requests replayed), ratio_vs_ar (same batch,
same run), rollback_fraction (fast-path tokens discarded / proposed), verify_passes,
dummy_rows, tokens_equal_ar (the deterministic tokens equal plain ar's, greedy), host_ms_tok /
wait_ms_tok / reads_tok (the last rep's decoding time per token outside / inside the loops'
reads of device results, and their reads a token: on a GPU the first is host work the device
waited for, ``swiftkern.device_reads``); where the speculative loop ran, its steps, layer-
skipped draft forwards, drafted / accepted tokens and steps by drafter (spec_steps ...
steps_none).
``--cuda-graphs`` (a GPU): every provider replays its forwards through CUDA graphs (named
<provider>+graphs), ar included, so ratio_vs_ar compares graphed with graphed (and, under
SWIFTKERN_BI_MATMUL_PLAN, <provider>@<its value>: the invariant set's matmuls in that plan); each provider
first runs its timed calls twice untimed (a graph is captured at a shape's second sight), so
the timing is of replays, as in a server that has seen its shapes; timed_first_sights /
timed_captures count the graph keys met first and the graphs captured inside the timed reps
all the same (a drafter policy's timed choices can pick widths not seen before).
``--smoke``: a tiny random Llama, 16-token prompts, batches 2 and 4, 8 new tokens, one repetition.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_generate import encode, load_prompts, tiny_model  # noqa: E402

ROUTINE = "determinism"
VERIFY_BATCH_GPU = 16
ARRIVAL_GAP = 4  # the arrivals group: a request joins every 4 decoding steps
LAYER_SET = "attn:9,13,17,21|mlp:11,15,19"  # the README's example set for SmolLM2 (7 of 60 sub-layers)
PRINT_KEYS = ("group", "provider", "batch", "window", "tok_s", "ratio_vs_ar", "rollback_fraction", "verify_passes",
              "dummy_rows", "tokens_equal_ar", "median_ms", "host_ms_tok", "wait_ms_tok", "reads_tok", "spec_steps",
              "draft_forwards", "accepted", "steps_lookup", "steps_layer_skip", "steps_none", "timed_first_sights",
              "timed_captures")


def _setups(smoke: bool, layer_set: str, verify_batch: int = 4, auto_elides: bool = True,
            spec_auto_elides: bool = True) -> list[tuple[str, int, dict]]:
    """[(group, batch, {provider: Generator kwargs})] in the documented order. ``auto_elides`` /
    ``spec_auto_elides``: whether replay "auto" skips the replay here for deterministic / for
    self-spec+det (``Generator.replay_elided``); each named provider stands beside the other way
    (det-replay or det-invariant, self-spec+det-replay or self-spec+det-invariant), and none
    repeats another."""
    det = dict(mode="deterministic", verify_batch=verify_batch)
    batches = (2, 4) if smoke else (8, 32)
    windows = (4, 8) if smoke else (8, 16, 32, 64)
    w32 = 8 if smoke else 32
    replay = dict(det, replay="always")
    groups = [("throughput", b, {"ar": dict(mode="ar"), "deterministic": dict(det, window=w32),
                                 "det-replay": dict(replay, window=w32),
                                 "det-replay-portable": dict(replay, window=w32, verifier_kernels="portable"),
                                 "det-replay-1/8": dict(replay, window=w32, share=1 / 8)}) for b in batches]
    groups.append(("windows", batches[0], {"ar": dict(mode="ar"),
                                           **{f"det-w{w}": dict(replay, window=w) for w in windows}}))
    # requests arriving while others decode: one every ARRIVAL_GAP steps after the first two
    arrive = [0, 0] + [ARRIVAL_GAP * i for i in range(1, batches[0] - 1)]
    groups.append(("arrivals", batches[0], {"ar": dict(mode="ar", arrive=arrive),
                                            "deterministic": dict(det, window=w32, arrive=arrive),
                                            "det-replay": dict(replay, window=w32, arrive=arrive)}))
    spec = dict(layer_set=layer_set, eps=0.8)
    spec_det = dict(mode="deterministic", window=w32, verify_batch=1, drafter="self-spec", **spec)
    groups.append(("batch1", 1, {
        "ar": dict(mode="ar"),
        "deterministic": dict(mode="deterministic", window=32, verify_batch=1),
        "self-spec+det": spec_det,
        "self-spec+det-portable": dict(spec_det, verifier_kernels="portable"),
        "self-spec+det-replay": dict(spec_det, replay="always"),
        f"det-replay-w{w32}": dict(mode="deterministic", window=w32, verify_batch=1, replay="always"),
        "self-spec": dict(mode="self-spec", drafter="layer-skip", **spec),
        # the speculative loop with free drafts alone (no determinism): what it can gain over ar here
        "lookup": dict(mode="self-spec", drafter="lookup"),
    }))
    for i, (group, batch, configs) in enumerate(groups):
        if spec_auto_elides:  # no replay there: the verifier's kernel set does not run
            configs.pop("self-spec+det-portable", None)
        # every step through the invariant set (replay never) beside the auto providers
        for name in ("deterministic", "self-spec+det"):
            if name in configs:
                configs[name.replace("deterministic", "det") + "-invariant"] = dict(configs[name], replay="never")
        # a provider doing what an earlier one does (replay auto taking the way it names) goes
        taken = {}
        for name, kw in configs.items():
            taken.setdefault(_as_run(kw, auto_elides, spec_auto_elides), name)
        groups[i] = (group, batch, {name: configs[name] for name in taken.values()})
    return groups


def _as_run(kw: dict, auto_elides: bool, spec_auto_elides: bool) -> tuple:
    """Generator kwargs as they run: replay "auto" of mode deterministic named by the way it
    takes here (never / always) -> a hashable key."""
    if kw.get("mode") == "deterministic" and kw.get("replay", "auto") == "auto":
        elides = spec_auto_elides if kw.get("drafter") == "self-spec" else auto_elides
        kw = dict(kw, replay="never" if elides else "always")
    return tuple(sorted((k, repr(v)) for k, v in kw.items()))


WARM_CALLS_MAX = 5


def _until_no_capture(runner, fn) -> int:
    """Run fn (every call of a timed rep) until one whole run captures no graph and meets no new
    key (a first sight runs eagerly and the next one captures: either in a timed rep costs
    launches or a capture), at least twice, at most WARM_CALLS_MAX times -> the runs. Two were
    not always enough: the batch-1 group's first warm call sized the runner's
    cache for its first prompt, a longer one replaced it, and keys seen with the first cache were
    captured during the timed reps (the emulated graphs showed 2 captures in the third round)."""
    for run in range(1, WARM_CALLS_MAX + 1):
        before = (runner.captures, runner.first_sights)
        fn()
        if run >= 2 and (runner.captures, runner.first_sights) == before:
            return run
    return WARM_CALLS_MAX


def run(args) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.smoke:
        hf, tok, model_name, layer_set = tiny_model(), None, "tiny-llama", "attn:1|mlp:2"
    else:
        model, tok = swiftkern.load_model(args.model)
        hf, model_name, layer_set = model.hf_model, args.model, LAYER_SET
    if args.dtype:  # e.g. bfloat16 on a GPU: the verifier's fixed-tile matmuls then run on tensor cores
        hf.to(getattr(torch, args.dtype))
    hf.to(args.device)
    model = swiftkern.SkipModel.from_hf(hf)
    n = 8 if args.smoke else args.max_new_tokens
    reps = args.reps or (1 if args.smoke else 2)
    texts = [encode(tok, p["text"], hf.config.vocab_size)[:16 if args.smoke else None] for p in load_prompts()]
    rows = []
    # rows timed under another bi_matmul plan than PLANS name it: "<provider>@<SWIFTKERN_BI_MATMUL_PLAN>"
    plan = os.environ.get("SWIFTKERN_BI_MATMUL_PLAN", "").strip()
    plan_tag = f"@{plan}" if plan else ""
    # a verify pass on a GPU costs about the same for 4 or 16 rows (launches, not bytes, bound
    # it at these sizes), so the GPU runs fewer, wider passes; the output is the same bits for any
    # verify batch (rows are independent in the verifier)
    verify_batch = VERIFY_BATCH_GPU if args.device.startswith("cuda") else 4
    # which way replay "auto" takes here (Generator.replay_elided), for plain and self-spec drafting
    elides = {d: swiftkern.Generator(model, mode="deterministic", **kw).replay_elided()
              for d, kw in (("plain", {}), ("spec", dict(drafter="self-spec", layer_set=layer_set)))}
    with common.KeepRowsOnInterrupt(rows, "groups"):
        for group, batch, configs in _setups(args.smoke, layer_set, verify_batch, elides["plain"], elides["spec"]):
            if args.providers:
                configs = {k: v for k, v in configs.items() if k in args.providers or k == "ar"}
                if set(configs) == {"ar"} and args.providers != ["ar"]:
                    continue  # none of the named providers is in this group: ar alone would compare nothing
            # batch 1: every prompt kind in turn (one prompt alone says little); else one batch of
            # the prompts cycled
            calls = [[t] for t in texts] if batch == 1 else [[texts[i % len(texts)] for i in range(batch)]]
            graphs = getattr(args, "cuda_graphs", False)
            gens = {name: swiftkern.Generator(model, tok, cuda_graphs=graphs,
                                              **{k: v for k, v in kw.items() if k not in ("share", "arrive")})
                    for name, kw in configs.items()}
            flags = {name: [i % round(1 / kw["share"]) == 0 for i in range(batch)] if "share" in kw else True
                     for name, kw in configs.items()}
            last = {}

            def timed(name):
                def fn():
                    last[name] = [gens[name].generate(prompts, max_new_tokens=n, eos_token_id=[],
                                                      deterministic=flags[name], arrive_at=configs[name].get("arrive"))
                                   for prompts in calls]
                return fn

            for name in gens:  # warm-up at the timed batch: kernel compiles for its shapes stay out of the timing
                gens[name].generate(calls[0], max_new_tokens=2, eos_token_id=[])
                if graphs:  # every graph of the timed calls seen once (eager) and captured: the reps replay
                    _until_no_capture(gens[name].graph_runner, timed(name))
            unsteady_before = {name: _unsteady(gen) for name, gen in gens.items()}
            times = common.time_fn({name: timed(name) for name in gens}, args.device, warmup=0, reps=reps)
            # graph keys met for the first time and graphs captured inside the timed reps (each an
            # eager forward or a capture: host time no steady run pays); "" without graphs
            unsteady = {name: [a - b for a, b in zip(_unsteady(gen), unsteady_before[name])] if graphs else ("", "")
                        for name, gen in gens.items()}
            if getattr(args, "host_profile", None):
                _host_profile(args.host_profile, f"{group} B={batch}", {name: timed(name) for name in gens})
            new_tokens = batch * n * len(calls)
            ar_tok_s = new_tokens / (times["ar"]["median_ms"] * 1e-3) if "ar" in times else None
            group_rows = []  # added whole: an interrupt leaves no group half in rows
            for name, timing in times.items():
                outs, kw = last[name], configs[name]
                s = _merged_stats([o.stats for o in outs])
                tok_s = new_tokens / (timing["median_ms"] * 1e-3)
                group_rows.append(common.row(
                    ROUTINE, name + ("+graphs" if graphs else "") + plan_tag, args.device, hf.dtype, f"B={batch} N={n}", timing,
                    model=model_name, group=group,
                    batch=batch, new_tokens=n, reps=reps, window=s.get("window", ""),  # the replay's, where it ran
                    deterministic_share=kw.get("share", 1.0 if kw["mode"] == "deterministic" else 0.0),
                    verify_batch=s.get("verify_batch", ""), fast_path=s.get("fast_path", ""),
                    verifier_kernels=s.get("verifier_kernels", ""),
                    replay=("elided" if "replay" in s else "replayed") if kw["mode"] == "deterministic" else "",
                    layer_set=kw.get("layer_set", ""), tok_s=round(tok_s, 2),
                    ratio_vs_ar=round(tok_s / ar_tok_s, 3) if ar_tok_s else "",
                    rollback_fraction=round(s["rollback_fraction"], 5) if "rollback_fraction" in s else "",
                    verify_passes=s.get("verify_passes", ""), dummy_rows=s.get("dummy_rows", ""),
                    **_host_and_wait(outs), **_draft_counts(outs),
                    timed_first_sights=unsteady[name][0], timed_captures=unsteady[name][1],
                    tokens_equal_ar=[o.tokens for o in outs] == [o.tokens for o in last["ar"]] if "ar" in last else ""))
            rows.extend(group_rows)
    _summary(rows)
    return rows


# CPython 3.12+'s cProfile (sys.monitoring) drops a function that calls a pybind11 method
# (torch._C._InferenceMode's __enter__, inside torch.inference_mode) and the functions it was
# called from (pybind/pybind11#5600; seen on 3.12.1 and 3.13.0, not on 3.11)
LOST_FRAMES_NOTE = ("NOTE: Generator.generate is missing from this profile: this Python's cProfile lost frames (CPython "
                    "3.12+ around pybind11 methods such as torch.inference_mode's __enter__, pybind/pybind11#5600); "
                    "the cProfile listings below are incomplete, the stack samples after them are not")

SAMPLED_SECONDS = 1.0  # the stack sampler repeats a provider's calls this long at least


def _host_profile(path: str, title: str, fns: dict, top: int = 25) -> None:
    """Each of ``fns`` (a provider's timed calls) run once more under cProfile, its ``top``
    functions by own time (tottime) and by time inside them (cumtime) appended to ``path``, and
    once more under a stack sampler (``bench/stack_sampler.py``: the same two views from samples,
    which CPython 3.12+'s lost call events do not touch): on a GPU, where the speculative loops'
    host work goes (a device wait inside a function other than ``device_reads.read`` shows up as
    its own time), and which of the loop's steps holds it."""
    import cProfile
    import io
    import pstats

    from bench.stack_sampler import sample_call
    from swiftkern.generate import Generator

    code = Generator.generate.__code__
    generate_key = (code.co_filename, code.co_firstlineno, code.co_name)
    with open(path, "a") as out:
        for name, fn in fns.items():
            profile = cProfile.Profile()
            profile.runcall(fn)
            text = io.StringIO()
            if generate_key not in pstats.Stats(profile).stats:
                text.write(LOST_FRAMES_NOTE + "\n")
            for order in ("tottime", "cumulative"):
                pstats.Stats(profile, stream=text).sort_stats(order).print_stats(top)
            text.write(sample_call(fn, min_seconds=SAMPLED_SECONDS)[1].report(top) + "\n")
            out.write(f"=== {title} {name}\n{text.getvalue()}\n")


def _unsteady(gen) -> tuple[int, int]:
    """(first sights, captures) of a Generator's graph runner so far ((0, 0) without one)."""
    runner = gen.graph_runner
    return (runner.first_sights, runner.captures) if runner is not None else (0, 0)


def _merged_stats(stats: list[dict]) -> dict:
    """The stats of several generate calls as one: counts summed, the rollback fraction of the
    sums, the rest from the first call."""
    out = dict(stats[0])
    for key in ("verify_passes", "dummy_rows", "rolled_back", "fast_tokens"):
        if key in out:
            out[key] = sum(s[key] for s in stats)
    if "rollback_fraction" in out:
        out["rollback_fraction"] = out["rolled_back"] / out["fast_tokens"] if out["fast_tokens"] else 0.0
    return out


def _host_and_wait(outs) -> dict:
    """Decoding's time per generated token (ms) split at the loops' reads of device results
    (stats read_wait_s): wait_ms_tok the host waited for the device in them, host_ms_tok the
    rest (host work the device waited for, on a GPU); reads_tok the reads. On the CPU the
    wait is ~0 (its kernels have run when a read starts)."""
    tokens = sum(o.stats["new_tokens"] for o in outs)
    wait = sum(o.stats["read_wait_s"] for o in outs)
    decode = sum(o.stats["decode_s"] for o in outs)
    return dict(host_ms_tok=round((decode - wait) * 1e3 / tokens, 4), wait_ms_tok=round(wait * 1e3 / tokens, 4),
                reads_tok=round(sum(o.stats["device_reads"] for o in outs) / tokens, 3))


def _draft_counts(outs) -> dict:
    """The speculative loop's steps, summed over the calls (where it ran: self-spec, and
    self-spec + deterministic without replay): steps (verify steps) and draft_forwards (layer-
    skipped forwards), drafted / accepted tokens, and the steps by drafter (lookup, layer-skip,
    none) -> {} elsewhere."""
    stats = [o.stats for o in outs]
    if not all("drafter_steps" in s for s in stats):
        return {}
    by = {d: sum(s["drafter_steps"][d] for s in stats) for d in ("lookup", "layer-skip", "none")}
    return dict(spec_steps=sum(s["verify_steps"] for s in stats), draft_forwards=sum(s["draft_steps"] for s in stats),
                drafted=sum(s["drafted"] for s in stats), accepted=sum(s["accepted"] for s in stats),
                steps_lookup=by["lookup"], steps_layer_skip=by["layer-skip"], steps_none=by["none"])


def _summary(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{rows[0]['device']}, {rows[0]['model']}, {rows[0]['new_tokens']} new tokens per prompt:")
    for r in rows:
        ratio = f"x{r['ratio_vs_ar']:.2f} vs ar" if r["ratio_vs_ar"] != "" else ""
        rb = f"rollback {r['rollback_fraction']:.2%}" if r["rollback_fraction"] != "" else ""
        print(f"  {r['group']:10s} B={r['batch']:<3d} {r['provider']:15s} {r['tok_s']:8.1f} tok/s  {ratio:12s} {rb}")
    det = [r for r in rows if r["group"] == "throughput" and common.provider_base(r["provider"]) == "deterministic"]
    if det:
        print(f"  deterministic / ar, median over batches: x{statistics.median(r['ratio_vs_ar'] for r in det):.2f}")


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
