"""``swiftkern generate | search | bench | info``: the command line.

Bad input exits with status 2 and one line on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import SwiftkernError
from .prompt_file import read_prompt_file, read_prompt_records

MODEL_HELP = "'smollm2' (the bundled SmolLM2-135M-Instruct), a local HF model folder, or a .gguf file"
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_HELP = ("the model's dtype (default float32; a GGUF model is dequantized to it). On the CPU float32 is the "
              "fastest for a GGUF model (its weights read as their 4/8-bit codes); bfloat16 / float16 read half "
              "the bytes of float32 weights, summed in float32 in a fixed order (self-spec and deterministic "
              "outputs equal ar's bit for bit there too)")


def _int_at_least(low: int):
    """argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1)  # argparse type: an integer >= 1 (also bench/__main__.py's counts)


def _skip_ratio(text: str):
    if text.strip() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a fraction in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"skip ratio must be in (0, 1), got {value}")
    return value


def _float_in(lo: float, hi: float, lo_open: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not ((lo < value if lo_open else lo <= value) and value <= hi):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (status 2), like every other input error."""

    def error(self, message):
        self.exit(2, f"swiftkern: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="swiftkern",
        description="Lossless fast LLM decoding. 'generate' writes text with a Llama, Mistral, Qwen2 or Qwen3 "
                    "model; 'info' shows versions, device and kernel backends; 'search' finds a "
                    "model's draft layer set offline and stores it; 'bench' runs the kernel and "
                    "end-to-end benchmarks of a source checkout.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from prompts",
                         description="Generate text for one prompt or a JSONL file of prompts. "
                                     "Greedy by default; --temperature > 0 samples (seeded).")
    gen.add_argument("--model", default="smollm2", help=f"model: {MODEL_HELP} (default: smollm2)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help='a JSONL file (- for standard input), one {"prompt": "..."} per line; all are run as one batch, '
                                           'a line with "arrive_at": N joining it at decoding step N (requests arriving '
                                           'while others decode); the flags below apply to every line (a line with '
                                           'its own "seed", "temperature", ... is refused)')
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default 64)")
    gen.add_argument("--mode", default="ar", choices=["ar", "self-spec", "deterministic"],
                     help="ar: plain decoding (default); self-spec: draft with --layer-set skipped, "
                          "verify with the full model (same greedy output, same sampling distribution); "
                          "deterministic: a prompt's output is the same whatever the batch: decoded through "
                          "batch-invariant kernels, or batched decoding replayed every --window tokens by a "
                          "fixed-shape batch-invariant verifier (see --replay)")
    gen.add_argument("--window", type=positive_int, default=32,
                     help="deterministic with the replay: unverified tokens per row before a verify pass (default 32; "
                          "at most --max-new-tokens + 1 are used)")
    gen.add_argument("--verify-batch", type=positive_int, default=4,
                     help="deterministic with the replay: rows of every (fixed-shape) verify pass (default 4; fewer when "
                          "fewer prompts are verified)")
    gen.add_argument("--replay", default="auto", choices=["auto", "always", "never"],
                     help="deterministic: auto (default) skips the replay where it cannot change a bit "
                          "(CPU with the C++ kernels, float32, bf16 or fp16: every kernel is batch- and "
                          "length-invariant, so rows decode directly; --drafter self-spec then speculates with "
                          "lookup and the --layer-set draft) and on CUDA, where every step on the Triton "
                          "invariant set costs less than the replay (not with --drafter self-spec, which "
                          "replays there); always: the LLM-42 replay everywhere; never: "
                          "decode through the batch-invariant kernels wherever a set runs (on CUDA the "
                          "verifier's Triton kernels, bi_matmul for every matmul) and replay nothing")
    gen.add_argument("--verifier-kernels", default="auto", choices=["auto", "portable", "fused"],
                     help="deterministic replay: the verifier's per-row ops. portable: torch compositions, "
                          "any device, many small ops; fused: one kernel per op (C++ on the CPU, Triton on "
                          "CUDA); auto (default): fused where it runs, else portable")
    gen.add_argument("--drafter", default="auto", choices=["auto", "layer-skip", "lookup", "none", "self-spec"],
                     help="self-spec: auto (default) picks per step among lookup, layer-skip (with "
                          "--layer-set) and none by measured cost and acceptance; layer-skip drafts with "
                          "the skipped model; lookup drafts the continuation of an earlier match in "
                          "prompt + output (no model call), as many tokens as measured costs say pay; none "
                          "drafts nothing. deterministic: self-spec "
                          "speculates with the --layer-set draft and prompt lookup (with the replay: each step "
                          "the draft or the full model proposes, and lookup matches are taken, by measured cost "
                          "and agreement; auto/none: no drafts, regular batched decoding with the replay, else the "
                          "invariant kernels)")
    gen.add_argument("--layer-set", default=None,
                     help="self-spec: sub-layers the draft skips, 'attn:3,5-7|mlp:4,9', JSON, 'none', or "
                          "'auto' (default for self-spec: searched while generating, starting from the set "
                          "`swiftkern search` stored for this model)")
    gen.add_argument("--skip-ratio", type=_skip_ratio, default="auto",
                     help="--layer-set auto: fraction of sub-layers to skip, or 'auto' (default: a ladder of "
                          "ratios, the fastest by measured cost kept)")
    gen.add_argument("--draft-vocab", type=positive_int, default=8192,
                     help="layer-skip drafts score only this many frequent tokens plus the prompt's and "
                          "output's (a pruned LM head; verification uses the full head; default 8192)")
    gen.add_argument("--k-max", type=positive_int, default=25, help="self-spec: most drafts per step (default 25)")
    gen.add_argument("--eps", type=_float_in(0.0, 1.0, False), default=0.8,
                     help="self-spec: stop drafting when the draft's top-1 probability is below this (default 0.8)")
    gen.add_argument("--adaptive-eps", action="store_true",
                     help="self-spec: move --eps toward a 0.9 acceptance rate as generation goes (Self-SD)")
    gen.add_argument("--temperature", type=_float_in(0.0, 100.0, False), default=0.0,
                     help="0 = greedy (default); >= 1e-5 samples from softmax(logits / T)")
    gen.add_argument("--top-k", type=_int_at_least(0), default=0,
                     help="keep the k most likely tokens when sampling (0 = all)")
    gen.add_argument("--top-p", type=_float_in(0.0, 1.0, True), default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed; a token depends only on (seed, position)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt: prompt, tokens, text, stats")
    gen.add_argument("--stream", action="store_true",
                     help="print the text as it is generated (one prompt, not with --json); only final tokens "
                          "are printed: verified ones in --mode deterministic, accepted ones in self-spec")
    gen.add_argument("--device", default=None, help="torch device (default cpu)")
    gen.add_argument("--dtype", default=None, choices=list(DTYPES), help=DTYPE_HELP)
    gen.add_argument("--no-packed-weights", action="store_true",
                     help="CPU: read the float32 weights even where a GGUF model's can be read as their 4/8-bit "
                          "codes (the default there: the same logits bit for bit from a sixth of the bytes)")
    gen.add_argument("--cuda-graphs", action="store_true",
                     help="with --device cuda: replay decode, draft and verify forwards through CUDA graphs, "
                          "each shape captured on its second use (removes the per-op launch cost of small models)")

    sub.add_parser("info", help="versions, device, and which kernel backends are built and in use")
    sub.add_parser("bench", add_help=False,
                   help="kernel and end-to-end benchmarks: python -m bench of the source checkout "
                        "(swiftkern bench --list, swiftkern bench --routine silu_mul; --help for the flags)")

    se = sub.add_parser("search", help="find the best draft layer set for a model offline and store it",
                        description="Offline layer-set search: generate greedy continuations of the prompts, "
                                    "score layer sets by matchness on them (random + Bayesian optimization), "
                                    "measure the real speedup of the best set per skip ratio, and store the "
                                    "fastest for the model, where --layer-set auto starts from it.")
    se.add_argument("--model", default="smollm2", help=f"model: {MODEL_HELP} (default: smollm2)")
    ssrc = se.add_mutually_exclusive_group(required=True)
    ssrc.add_argument("--prompt", action="append", help="a prompt to tune on (repeatable)")
    ssrc.add_argument("--prompt-file", help='a JSONL file (- for standard input), one {"prompt": "..."} per line')
    se.add_argument("--skip-ratio", type=_skip_ratio, default="auto",
                    help="fraction of sub-layers to skip, or 'auto' (default: try several, keep the fastest)")
    se.add_argument("--budget", type=_float_in(0.0, 1e6, True), default=120.0,
                    help="seconds of search in all (split over the ratios; default 120)")
    se.add_argument("--max-new-tokens", type=positive_int, default=64,
                    help="tokens generated per prompt to score and measure on (default 64)")
    se.add_argument("--no-save", action="store_true", help="print the result, do not store it")
    se.add_argument("--json", action="store_true", help="print the result as one JSON object")
    se.add_argument("--device", default=None, help="torch device (default cpu)")
    se.add_argument("--dtype", default=None, choices=list(DTYPES), help=DTYPE_HELP)
    return parser


def cmd_generate(args) -> int:
    prompts, arrive_at = [args.prompt], None
    if args.prompt is None:
        prompts, arrive_at = read_prompt_records(args.prompt_file)
    for i, p in enumerate(prompts):
        if not p.strip():
            raise SwiftkernError(f"prompt {i} is empty")
    if args.stream and (len(prompts) > 1 or args.json):
        raise SwiftkernError("--stream prints one prompt's text as it comes: give one prompt and no --json "
                             "(or drop --stream)")
    from .generate import Generator
    from .loading import load_model

    if args.mode == "self-spec" and args.drafter in ("auto", "layer-skip") and args.layer_set is None:
        args.layer_set = "auto"
    if args.drafter == "self-spec" and (args.mode != "deterministic" or args.layer_set is None):
        raise SwiftkernError("--drafter self-spec goes with --mode deterministic and needs --layer-set "
                             "(e.g. 'attn:10-14|mlp:12', from `swiftkern search`), or --layer-set none to "
                             "draft with prompt lookup alone")
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype,
                                  pack_weights=False if args.no_packed_weights else None)
    gen = Generator(model, tokenizer, mode=args.mode, layer_set=args.layer_set, k_max=args.k_max,
                    eps=args.eps, adaptive_eps=args.adaptive_eps, drafter=args.drafter,
                    draft_vocab=args.draft_vocab, window=args.window, verify_batch=args.verify_batch,
                    skip_ratio=args.skip_ratio, replay=args.replay, cuda_graphs=args.cuda_graphs,
                    verifier_kernels=args.verifier_kernels)
    stream = None
    if args.stream:
        from .streaming import TextStream

        stream = TextStream(tokenizer)
        print(f"### {prompts[0]}", flush=True)
    out = gen.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                       temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, chat=args.chat, streamer=stream, arrive_at=arrive_at)
    if stream is not None:
        stream.finish()
        print("\n")
    for i, prompt in enumerate(prompts if stream is None else []):
        stats = dict(out.stats, **out.request_stats[i])
        if args.json:
            print(json.dumps({"prompt": prompt, "tokens": out.tokens[i], "text": out.texts[i], "stats": stats}))
        else:
            print(f"### {prompt}\n{out.texts[i]}\n")
    if not args.json:
        s = out.stats
        print(f"[{s['mode']}] {s['new_tokens']} new tokens for {s['batch']} prompt(s) | prefill "
              f"{s['prefill_s'] * 1e3:.0f} ms | decode {s['decode_tokens_per_s']:.1f} tok/s | "
              f"overall {s['tokens_per_s']:.1f} tok/s | {s['steps']} decode steps")
        if s["mode"] == "self-spec":
            print(f"[self-spec] drafter {s['drafter']} {s['layer_set']} | {s['draft_steps']} draft + {s['verify_steps']} "
                  f"verify forwards | {s['accepted']}/{s['drafted']} drafts accepted "
                  f"({s['acceptance_rate']:.0%}) | mean accepted per verify {s['mean_accepted']:.2f} | "
                  "row steps by drafter " + ", ".join(f"{k} {v}" for k, v in s["drafter_steps"].items())
                  + (f" ({s['drafter_trials']} trying a drafter again)" if s.get("drafter_trials") else ""))
            if "search_phases" in s:
                print(f"[search] {s['search_phases']} phases, {s['candidates_scored']} sets scored in "
                      f"{s['search_s']:.2f} s | layer set {s['searched_layer_set'] or '-'} | "
                      f"{'layer skip on' if s['layer_skip_enabled'] else 'layer skip off'} "
                      f"{('(' + s['search_stop'] + ')') if s['search_stop'] else ''}")
        if "cuda_graphs" in s:
            g = s["cuda_graphs"]
            print(f"[cuda graphs] {g['captures']} captured | {g['replays']} replays | {g['eager']} eager forwards")
        if s["mode"] == "deterministic" and "replay" in s:
            print(f"[deterministic] no replay ({s['replay']}) | fast path {s['fast_path']} | "
                  f"{s['fast_steps']} forwards")
        elif s["mode"] == "deterministic":
            print(f"[deterministic] fast path {s['fast_path']} | verifier {s['verifier_kernels']} | "
                  f"window {s['window']} x verify batch "
                  f"{s['verify_batch']} | {s['fast_steps']} fast steps + {s['verify_passes']} verify passes | "
                  f"{s['rolled_back']}/{s['fast_tokens']} fast tokens rolled back ({s['rollback_fraction']:.1%})"
                  + (f" | {s['lookup_tokens']} from prompt lookup" if s.get("lookup_tokens") else ""))
            if "fast_kinds" in s:
                kinds = s["fast_kinds"]
                print(f"[deterministic] fast forwards full {kinds['full']}, draft {kinds['draft']} | lookup matches "
                      f"taken {s['lookup_taken']}, declined {s['lookup_declined']} | {s['trials']} trials")
    return 0


def cmd_search(args) -> int:
    prompts = args.prompt if args.prompt is not None else read_prompt_file(args.prompt_file)
    if any(not p.strip() for p in prompts):
        raise SwiftkernError("a prompt is empty")
    from .loading import load_model
    from .offline_search import acceptance_text, search_layer_set

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    record = search_layer_set(model, tokenizer, prompts, skip_ratio=args.skip_ratio, budget_s=args.budget,
                              max_new_tokens=args.max_new_tokens, save=not args.no_save,
                              log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(record))
    else:
        print(f"best: {record['layer_set']} (skip ratio {record['skip_ratio']}) matchness {record['matchness']:.3f}, "
              f"{acceptance_text(record)}, x{record['speedup']:.2f} vs ar"
              + (f"\nstored in {record['path']}" if "path" in record else ""))
        if record["speedup"] < 1:
            print(f"no layer set decoded faster than ar on these prompts here (the fastest: x{record['speedup']:.2f}); "
                  "--layer-set auto starts from it and drafts with it only where its measured costs pay, "
                  "and --drafter lookup or --mode ar may be faster on this machine")
    return 0


def bench_checkout() -> str | None:
    """The source checkout this swiftkern runs from (an editable install: bench/ beside
    swiftkern/), or None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isfile(os.path.join(root, "bench", "__main__.py")) else None


def cmd_bench(argv: list[str]) -> int:
    """``swiftkern bench ...``: the benchmark driver (``python -m bench``) of the source checkout."""
    root = bench_checkout()
    if root is None:
        raise SwiftkernError("swiftkern bench runs the benchmarks of a source checkout (bench/ beside swiftkern/), "
                             "and this swiftkern is installed without one: clone the repository, "
                             "`pip install --no-build-isolation -e .` there, then run swiftkern bench")
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench.__main__ import main as bench_main

    return bench_main(argv, prog="swiftkern bench")


def cmd_info(args) -> int:
    from .info import collect_info

    for key, value in collect_info().items():
        print(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:  # its own flags (python -m bench's), passed on as they are
            return cmd_bench(argv[1:])
        args = build_parser().parse_args(argv)
        code = {"generate": cmd_generate, "info": cmd_info, "search": cmd_search}[args.command](args)
        sys.stdout.flush()  # a reader gone is found here, not in Python's flush at exit
        return code
    except SwiftkernError as e:
        print(f"swiftkern: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was streamed stays printed; no traceback through torch
        print("\nswiftkern: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (`| head`): stop generating, quietly
        _silence_stdout()
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null: a block-buffered stdout keeps what it could not write, and
    Python's flush at exit would fail again ("Exception ignored ... BrokenPipeError", exit 120)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
