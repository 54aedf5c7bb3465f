"""`swiftkern generate` when its reader leaves (`| head`) or the user presses Ctrl-C: it stops
without a traceback (exit 1 and 130). Before, both printed a traceback through the streamer,
and the pipe's came after every token had been generated."""

import os
import signal
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

# the CLI in a process of its own, on tiny_model with test_cli's character tokenizer
CLI_ON_A_TINY_MODEL = f"""
import signal
import sys
# Ctrl-C as a terminal's process gets it: a run started in the background by a non-interactive
# shell (`make test &`) ignores SIGINT, and its children inherit that (the test then saw exit 0)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {TESTS!r})
from conftest import tiny_model
from test_cli import _CharTokenizer
import swiftkern.loading
from swiftkern import SkipModel, cli

class WideTokenizer(_CharTokenizer):  # 100 characters a token: a reader that stops reading blocks the CLI
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(t) % 26) * 100 for t in ids)

model = SkipModel.from_hf(tiny_model("llama", max_position_embeddings=8192))
swiftkern.loading.load_model = lambda *a, **k: (model, WideTokenizer())
print("loaded", file=sys.stderr, flush=True)
sys.exit(cli.main(sys.argv[1:]))
"""

ARGS = ["generate", "--prompt", "abc abc", "--stream", "--max-new-tokens", "6000"]


def cli_process(stdout, args=ARGS, unbuffered=False):
    """The CLI with stdout block-buffered as a user's shell gives it (PYTHONUNBUFFERED unset),
    or unbuffered."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([sys.executable, "-c", CLI_ON_A_TINY_MODEL, *args], stdout=stdout,
                            stderr=subprocess.PIPE, text=True, env=env)


PRINTED = ["generate", "--prompt", "abc abc", "--max-new-tokens", "8"]


@pytest.mark.parametrize("args, unbuffered", [(ARGS, False), (PRINTED, False), (PRINTED, True)],
                         ids=["streamed", "printed-at-the-end", "printed-unbuffered"])
def test_a_reader_that_left_ends_it_quietly(args, unbuffered):
    """Streamed, the first flush fails inside the call; printed at the end, the few lines sit in
    stdout's buffer until the exit's flush (which printed "Exception ignored ... BrokenPipeError"
    and exit 120)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write fails
    proc = cli_process(write_end, args, unbuffered)
    os.close(write_end)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err.strip().splitlines() == ["loaded"], err


def test_ctrl_c_ends_it_with_130_and_one_line():
    """The text streamed is read only in part: past the pipe's buffer (64 KiB, some 650 tokens)
    the CLI waits in a write, so it is still inside generate when the signal comes, however
    fast or slow the machine."""
    proc = cli_process(subprocess.PIPE)
    try:
        assert proc.stdout.read(40)  # the prompt's line, then streamed text: generating now
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "swiftkern: interrupted", err
