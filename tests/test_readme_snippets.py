"""The README's Python examples run as written, on SmolLM2, with only their placeholders filled
(`prompts`, the `...` of the per-request lists, `tokens` and `cache`, HF's `model`, `tokenizer` and
`texts`) and 8 new tokens instead of 64. A renamed argument, a stats key that moved or an API that
changed makes a README example fail for its reader while every other test passes.

Each placeholder substitution must match exactly once, so an edit of those lines is noticed too."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

pytestmark = pytest.mark.slow
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks() -> list[str]:
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```$", f.read(), re.MULTILINE | re.DOTALL)


def filled(block: str, substitutions: dict[str, str], preamble: str) -> str:
    for old, new in substitutions.items():
        assert block.count(old) == 1, f"README example: {old!r} occurs {block.count(old)} times"
        block = block.replace(old, new)
    return preamble + block


def run(code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, README, "exec"), namespace)
    return out.getvalue()


def test_using_it_example_runs():
    block = next(b for b in python_blocks() if "swiftkern.load_model(" in b)
    block = block.replace("max_new_tokens=64", "max_new_tokens=8")
    code = filled(block, {
        "deterministic=[True, False, ...]": "deterministic=[True, False]",
        "arrive_at=[0, 0, 5, 9, ...]": "arrive_at=[0, 3]",
    }, preamble='import torch\nprompts = ["The capital of France is", "def quicksort(arr):"]\n'
                'tokens = torch.tensor([[1, 2, 3]])\n')
    code = filled(code, {"    logits = model.forward(tokens, cache)":
                         "    cache = model.new_cache(1, 8)\n    logits = model.forward(tokens, cache)"}, "")
    namespace: dict = {}
    printed = run(code, namespace)
    assert namespace["logits"].shape[:2] == (1, 3)
    assert len(namespace["out"].tokens) == 2 and all(len(t) == 8 for t in namespace["out"].tokens)
    assert "'mode': 'ar'" in printed and "tensor([" in printed, printed  # the stats dict, the logprobs


def test_hf_backend_example_runs(smollm2):
    block = next(b for b in python_blocks() if "custom_generate=swift_generate" in b)
    block = block.replace("max_new_tokens=64", "max_new_tokens=8")
    skip_model, tokenizer = smollm2  # the session's model: the README's block loads none itself
    namespace = {"model": skip_model.hf_model, "tokenizer": tokenizer,
                 "texts": ["The capital of France is", "def quicksort(arr):"]}
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # the block's "# left padding"
    try:
        run(block, namespace)
    finally:
        tokenizer.padding_side = side
    assert namespace["out"].shape[0] == 2


def test_every_readme_command_line_parses():
    """Each `swiftkern ...` line of the README's command block is accepted by the CLI's parser (a
    renamed or removed flag fails here; running them all would load the model ~20 times)."""
    import shlex

    from swiftkern.cli import build_parser

    lines, fence = [], None  # fence: the open block's language ("" for a plain one), None outside
    with open(README) as f:
        for line in f.read().splitlines():
            if line.startswith("```"):
                fence = line[3:].strip() if fence is None else None
            elif fence in ("", "bash") and line.startswith("swiftkern "):
                lines.append(line.split("#", 1)[0].strip())
    commands = [shlex.split(line)[1:] for line in lines]
    assert len(commands) >= 15, lines
    parser = build_parser()
    for argv in commands:
        if argv[0] == "bench":  # handed to the bench driver whole (python -m bench), checked there
            from bench.__main__ import parser as bench_parser

            bench_parser().parse_args(argv[1:])
            continue
        parser.parse_args(argv)
