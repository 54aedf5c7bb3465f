"""The README's examples run as a user runs them and say what they claim: examples/hf_custom_generate.py
(HF generate, then swiftkern behind ``custom_generate`` in ar and self-spec: the same tokens) and
examples/patch_llama.py (the patched model's logits within float32 rounding of HF's). No test ran
them before: an API change could break them with every test passing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str) -> str:
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, f"{name} failed:\n{run.stderr[-3000:]}"
    return run.stdout


def test_hf_custom_generate_gives_hf_greedy_tokens():
    out = run_example("hf_custom_generate.py", "--max-new-tokens", "24")
    verdicts = re.findall(r"^(.+?)\s+(\d+) tokens in [\d.]+ s, equal to HF: (True|False)$", out, re.MULTILINE)
    assert [v[0].strip() for v in verdicts] == ["HF generate", "swiftkern ar", "swiftkern self-spec (lookup)"], out
    assert all(v[2] == "True" for v in verdicts), out
    assert "streamed" in out


def test_patch_llama_keeps_hf_logits():
    out = run_example("patch_llama.py")
    diff = re.search(r"max \|logit difference\| patched vs HF: ([\d.e+-]+) \(logits up to ([\d.e+-]+)\)", out)
    assert diff, out
    assert float(diff.group(1)) < 1e-3 * float(diff.group(2)), out
    assert re.search(r"patched: \d+ RMSNorm modules, \d+ MLP modules", out), out
