"""End to end at long context: the generate routine with a document before each prompt.

    python -m bench --routine long_context [--context-tokens 2000] [--max-new-tokens 64] [--reps 2]
                    [--providers hf-greedy,ar,auto,...] [--smoke] [--no-csv]

Each bench prompt follows a document of about ``--context-tokens`` tokens (default 2000: the
bench prompts' texts cycled, cut at that many tokens) in the same user message, so decoding
attends to a long cache and the time includes the prompt's prefill. Providers as in the
generate routine (default hf-greedy, ar and auto), timed interleaved per prompt; ratio_vs_hf
is to HF greedy in the same run, and tokens_equal_hf says the new tokens equal HF's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import bench_generate  # noqa: E402

ROUTINE = "long_context"
PRINT_KEYS = bench_generate.PRINT_KEYS
DEFAULT_CONTEXT = 2000
DEFAULT_PROVIDERS = "hf-greedy,ar,auto"


def run(args) -> list[dict]:
    args = argparse.Namespace(**vars(args))  # the defaults below are this routine's alone
    args.context_tokens = args.context_tokens or DEFAULT_CONTEXT
    args.providers = args.providers or DEFAULT_PROVIDERS.split(",")
    return bench_generate.run(args, routine=ROUTINE)


if __name__ == "__main__":
    from bench.__main__ import main as driver

    sys.exit(driver(["--routine", ROUTINE, *sys.argv[1:]]))
