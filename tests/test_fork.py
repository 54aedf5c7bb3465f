"""A Generator used in a fork() child (multiprocessing's default start method on Linux up to
Python 3.13): with one torch thread in the child, every mode gives the parent's tokens; at more
than one, the first call warns that GNU OpenMP may hang there and names the fixes (a child whose
parent ran torch's OpenMP threads hung in a plain matmul, so this cannot be mended, only said)."""

import os
import pickle
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [3, 4, 5, 3, 4, 5, 3, 4]]
MODES = [dict(mode="ar"), dict(mode="self-spec", layer_set="attn:1|mlp:2"), dict(mode="deterministic")]

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


def in_child(body, seconds: int = 120):
    """body() run in a fork() child under an alarm; returns what it returned (or raises)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+: "This process is multi-threaded, use of fork() may
        warnings.simplefilter("ignore", DeprecationWarning)  # lead to deadlocks": the case under test
        pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        os.close(read_end)
        signal.alarm(seconds)
        try:
            result = ("ok", body())
        except BaseException as e:  # noqa: BLE001 (sent back to the parent)
            result = ("error", repr(e))
        with os.fdopen(write_end, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child ended with status {status}"
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


def fork_warnings(gen):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tokens = gen.generate(PROMPTS, max_new_tokens=24).tokens
    return tokens, [str(w.message) for w in seen if "forked" in str(w.message)]


@pytest.mark.parametrize("kwargs", MODES, ids=[m["mode"] for m in MODES])
def test_a_forked_child_at_one_thread_gives_the_parents_tokens(kwargs):
    gen = Generator(tiny_model("llama"), **kwargs)
    expected = gen.generate(PROMPTS, max_new_tokens=24).tokens

    def child():
        torch.set_num_threads(1)
        return fork_warnings(gen)

    tokens, said = in_child(child)
    assert tokens == expected
    assert said == []  # one thread: nothing to warn about
    assert fork_warnings(gen) == (expected, [])  # the parent, after the fork: no warning


def warned_child_at_two_threads():
    """Run in a fresh process at one torch thread (so no OpenMP pool exists to hang a child):
    the forked child at two threads warns on its first call only, then decodes the parent's
    tokens."""
    gen = Generator(tiny_model("llama"))
    expected = gen.generate(PROMPTS, max_new_tokens=24).tokens

    def child():
        torch.set_num_threads(2)
        return fork_warnings(gen), fork_warnings(gen)

    (first, said_first), (second, said_second) = in_child(child)
    assert first == second == expected
    assert len(said_first) == 1 and said_second == [], (said_first, said_second)
    assert "torch.set_num_threads(1)" in said_first[0] and "'spawn'" in said_first[0]
    assert torch.get_num_threads() == 1  # the parent's own setting is untouched


def test_a_forked_child_at_two_threads_is_warned_once():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, __file__], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("forked child warned once")


if __name__ == "__main__":
    warned_child_at_two_threads()
    print("forked child warned once")
