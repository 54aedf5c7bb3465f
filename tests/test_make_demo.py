"""`make demo`, the README's first command, runs and shows what it promises: `swiftkern info`, the
default model's text streamed in mode ar, then the same prompt in mode self-spec with its speed
and acceptance stats, and the two texts equal (greedy self-spec is lossless). CI runs `make test`,
not `make demo`: without this test a broken demo recipe would pass CI.

The recipe runs against the environment running the tests (VENV=sys.prefix) and its set-up step
is taken as done (`make -o <stamp>`), so the test never reinstalls anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_demo_streams_ar_then_self_spec_with_equal_text():
    venv = sys.prefix
    if not os.path.exists(os.path.join(venv, "bin", "swiftkern")):
        pytest.fail(f"no swiftkern console script in {venv}/bin: install swiftkern into the test environment")
    run = subprocess.run(["make", "-s", f"VENV={venv}", "-o", os.path.join(venv, ".swiftkern-setup"), "demo"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert "extension:" in out and "cpu_layer_loop:" in out, out[:2000]  # swiftkern info
    texts = re.findall(r"^### .*?\n(.*?)\n\[(ar|self-spec)\] (\d+) new tokens", out, re.MULTILINE | re.DOTALL)
    assert [mode for _, mode, _ in texts] == ["ar", "self-spec"], out[-3000:]
    (ar_text, _, ar_n), (spec_text, _, spec_n) = texts
    assert ar_n == spec_n and int(ar_n) > 0
    assert spec_text.strip() == ar_text.strip(), (ar_text, spec_text)
    assert re.search(r"decode [\d.]+ tok/s", out) and re.search(r"drafts accepted \(\d+%\)", out), out[-2000:]
