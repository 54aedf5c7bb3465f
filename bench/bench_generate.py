"""End to end: HF generate (greedy, prompt lookup, early exit) vs swiftkern's modes, same prompts, one run.

    python -m bench --routine generate [--model smollm2] [--max-new-tokens 128] [--reps 3]
                    [--providers hf-greedy,ar,lookup,...] [--smoke] [--no-csv] [--plot]
    python bench/bench_generate.py [same options]

Providers, timed interleaved per prompt (A B C ... A B C, so drift hits all alike), batch 1,
greedy, exactly ``--max-new-tokens`` new tokens (EOS disabled for every provider):

    hf-greedy          HF model.generate(do_sample=False): the baseline of every ratio
    hf-prompt-lookup   HF assisted generation with prompt_lookup_num_tokens
    hf-early-exit      HF assistant_early_exit (LayerSkip-style: the first layers + LM head draft)
    hf-custom-ar       HF model.generate(custom_generate=swiftkern, swift_mode="ar")
    ar                 swiftkern.Generator(mode="ar")
    self-spec          swiftkern self-spec with layer_set="auto"
    lookup             swiftkern self-spec with the prompt-lookup drafter
    auto               swiftkern self-spec with the drafter policy (drafter="auto")
    deterministic      swiftkern mode="deterministic"
    ar-float32, auto-float32   ar and auto reading the float32 weights, where the others read
                       packed ones (a GGUF model on an AVX2 or AVX-512 CPU; swiftkern/packed_weights.py)
    <name>+graphs      with --cuda-graphs (a GPU): each swiftkern provider again, cuda_graphs=True

A provider swiftkern cannot build yet (SwiftkernError) is skipped with a printed note.
Columns: tok_s (new tokens / median time), ratio_vs_hf (to hf-greedy, same prompt, same run),
mean_accepted (accepted drafts per verify pass; HF's from counted full-model forwards),
tokens_equal_hf (the new tokens equal hf-greedy's). The prompts are bench/prompts.jsonl
(one {"kind", "text"} per line; other routines reuse them through ``load_prompts``), sent
through the chat template (the routine long_context puts a document before each:
``with_document``). ``--smoke``: a tiny random Llama, 8 tokens, one repetition.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import swiftkern  # noqa: E402
from bench import common  # noqa: E402
from swiftkern.errors import SwiftkernError  # noqa: E402
from swiftkern.integrations import compat  # noqa: E402
from swiftkern.integrations.transformers import generate as swift_generate  # noqa: E402

ROUTINE = "generate"
PROMPTS_FILE = os.path.join(os.path.dirname(__file__), "prompts.jsonl")
PRINT_KEYS = ("prompt_kind", "provider", "tok_s", "ratio_vs_hf", "mean_accepted", "tokens_equal_hf", "median_ms",
              "p20_ms", "p80_ms")
HF_LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens, as in HF's documentation
LOOKUP_K_MAX = 5  # swiftkern lookup drafter: most drafts per verify


def load_prompts(path: str = PROMPTS_FILE) -> list[dict]:
    """[{"kind": ..., "text": ...}] from a JSONL file (bench/prompts.jsonl by default)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tiny_model():
    """A 4-layer random Llama (vocab 301) for --smoke; lm_head scaled so greedy has no near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301, max_position_embeddings=512, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def skip_model(args):
    """(SkipModel, name) for a routine: the tiny random Llama with --smoke, else --model."""
    if args.smoke:
        return swiftkern.SkipModel.from_hf(tiny_model()), "tiny-llama"
    model, _ = swiftkern.load_model(args.model, device=args.device)
    return model, args.model


def encode(tok, text: str, vocab: int) -> list[int]:
    """Chat-template token ids; without a tokenizer (--smoke) bytes folded into the vocabulary."""
    if tok is None:
        return [3 + b % (vocab - 3) for b in text.encode()][:64]
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


class ForwardCounter:
    """Counts full-model forwards of an HF model (early-exit drafts run fewer layers)."""

    def __init__(self, hf):
        self.base = hf.model
        self.full_layers = hf.config.num_hidden_layers
        self.full = 0
        self.handle = self.base.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if module.config.num_hidden_layers == self.full_layers:
            self.full += 1

    def close(self):
        self.handle.remove()


def hf_provider(hf, counter: ForwardCounter, **extra):
    """-> run(ids, n) -> (new tokens, accepted drafts per verify)."""
    def run(ids, n):
        x = torch.tensor([ids], device=hf.device)
        counter.full = 0
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **extra)
        new = out[0, len(ids):].tolist()
        verifies = counter.full  # each full forward emits accepted + 1 tokens (the first includes prefill)
        return new, (len(new) - verifies) / verifies if verifies else 0.0
    return run


def swift_provider(gen: swiftkern.Generator):
    def run(ids, n):
        out = gen.generate([ids], max_new_tokens=n, eos_token_id=[])
        return out.tokens[0], float(out.stats.get("mean_accepted", 0.0))
    return run


def providers(hf, tok, smoke: bool, cuda_graphs: bool = False) -> tuple[dict, dict]:
    """({name: run}, {name: why skipped}) in the documented order."""
    counter = ForwardCounter(hf)
    layers = hf.config.num_hidden_layers
    runs = {
        "hf-greedy": hf_provider(hf, counter),
        "hf-prompt-lookup": hf_provider(hf, counter, prompt_lookup_num_tokens=HF_LOOKUP_TOKENS),
        "hf-early-exit": hf_provider(hf, counter, assistant_early_exit=max(1, layers // 2)),
        "hf-custom-ar": hf_provider(hf, counter, custom_generate=swift_generate, swift_mode="ar"),
    }
    skipped = {}
    if compat.transformers_version() < (5, 0):  # 4.57: a TypeError without an EOS id, 42 tokens for 40
        import transformers

        skipped["hf-prompt-lookup"] = (f"transformers {transformers.__version__}'s prompt lookup fails without an "
                                       "EOS id and returns more than max_new_tokens: fixed-length runs need 5.x")
        del runs["hf-prompt-lookup"]
    swift = {
        "ar": dict(mode="ar"),
        "self-spec": dict(mode="self-spec", layer_set="auto"),
        "lookup": dict(mode="self-spec", drafter="lookup", k_max=LOOKUP_K_MAX),
        "auto": dict(mode="self-spec", drafter="auto"),
        "deterministic": dict(mode="deterministic"),
    }
    if cuda_graphs:
        swift.update({f"{name}+graphs": dict(kw, cuda_graphs=True) for name, kw in list(swift.items())})
    models = {name: hf for name in swift}
    if swiftkern.SkipModel.from_hf(hf).packed is not None:
        unpacked = swiftkern.SkipModel.from_hf(hf, pack_weights=False)
        for name in ("ar", "auto"):
            swift[f"{name}-float32"] = swift[name]
            models[f"{name}-float32"] = unpacked
    for name, kw in swift.items():
        try:
            runs[name] = swift_provider(swiftkern.Generator(models[name], tok, **kw))
        except SwiftkernError as e:
            skipped[name] = str(e)
    return runs, skipped


def _load(args):
    if args.smoke:
        return tiny_model(), None, "tiny-llama"
    model, tok = swiftkern.load_model(args.model)
    return model.hf_model, tok, args.model


def run(args, routine: str = ROUTINE) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf, tok, model_name = _load(args)
    if args.dtype:
        hf.to(getattr(torch, args.dtype))
    hf.to(args.device)
    n = 8 if args.smoke else args.max_new_tokens
    reps = args.reps or (1 if args.smoke else 3)
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None  # fixed-length runs for every provider
    try:
        runs, skipped = providers(hf, tok, args.smoke, getattr(args, "cuda_graphs", False))
        if args.providers:
            runs = {k: v for k, v in runs.items() if k in args.providers or k == "hf-greedy"}
        rows = _measure(hf, tok, model_name, runs, skipped, n, reps, args, routine)
    finally:
        hf.generation_config.eos_token_id = eos
    _summary(rows)
    return rows


def with_document(tok, text: str, tokens: int | None) -> str:
    """``text`` after a document of about ``tokens`` tokens (the bench prompts' texts cycled,
    cut at that many tokens), or ``text`` alone when ``tokens`` is None or there is no tokenizer."""
    if not tokens or tok is None:
        return text
    texts = [p["text"] for p in load_prompts()]
    doc: list[int] = []
    for i in range(tokens):  # at least one token a text: never more than `tokens` texts
        if len(doc) >= tokens:
            break
        doc += tok(texts[i % len(texts)] + "\n\n")["input_ids"]
    return tok.decode(doc[:tokens]) + "\n\n" + text


def _measure(hf, tok, model_name, runs, skipped, n, reps, args, routine: str) -> list[dict]:
    rows = []
    for prompt in load_prompts():
        text = with_document(tok, prompt["text"], getattr(args, "context_tokens", None))
        ids = encode(tok, text, hf.config.vocab_size)
        last = {}

        def timed(name):
            def fn():
                last[name] = runs[name](ids, n)
            return fn

        fns = {}
        for name in runs:  # a provider that fails on its first call is skipped, with the reason
            try:
                timed(name)()
                fns[name] = timed(name)
            except SwiftkernError as e:
                skipped[name] = str(e)
        times = common.time_fn(fns, args.device, warmup=0, reps=reps)
        hf_tokens = last["hf-greedy"][0]
        hf_tok_s = n / (times["hf-greedy"]["median_ms"] * 1e-3)
        for name, timing in times.items():
            tokens, accepted = last[name]
            tok_s = n / (timing["median_ms"] * 1e-3)
            rows.append(common.row(
                routine, name, args.device, hf.dtype, f"B=1 T={len(ids)} N={n}", timing, model=model_name,
                prompt_kind=prompt["kind"], new_tokens=n, reps=reps, tok_s=round(tok_s, 2),
                ratio_vs_hf=round(tok_s / hf_tok_s, 3), mean_accepted=round(accepted, 3),
                tokens_equal_hf=tokens == hf_tokens))
    for name, why in skipped.items():
        print(f"note: skipped provider {name}: {why}")
    return rows


def _summary(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{rows[0]['device']}, {rows[0]['model']}, {rows[0]['new_tokens']} new tokens; medians over prompts:")
    for name in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == name]
        med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
        print(f"  {name:18s} {med('tok_s'):7.1f} tok/s  x{med('ratio_vs_hf'):.2f} vs hf-greedy  "
              f"accepted/verify {med('mean_accepted'):.2f}  all equal HF: {all(r['tokens_equal_hf'] for r in mine)}")


def main(argv=None) -> int:
    from bench.__main__ import main as driver

    return driver(["--routine", ROUTINE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
