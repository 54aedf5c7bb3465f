"""Nothing is downloaded at run time, in a user's environment: the CLI loads the bundled SmolLM2,
generates (self-spec, with the chat template) and reports `swiftkern info` with every socket
connection and name lookup refused, and without the HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
variables that conftest.py sets for the rest of the suite (under them a call to the hub would
fail quietly in the tests and still be made on a user's machine).

The refusal is a sitecustomize module first on PYTHONPATH in the subprocess: it records each
attempt in a file and raises, so an attempt that the library catches and survives is still seen."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

BLOCK = '''
import os, socket, traceback
LOG = os.environ["SWIFTKERN_TEST_NETWORK_LOG"]
def _record(what):
    with open(LOG, "a") as f:
        f.write(what + "\\n" + "".join(traceback.format_stack(limit=8)) + "\\n")
def _connect(self, address, *args, **kwargs):
    _record(f"connect {address!r}")
    raise OSError("network refused by tests/test_no_network.py")
def _getaddrinfo(host, *args, **kwargs):
    _record(f"getaddrinfo {host!r}")
    raise socket.gaierror("name lookup refused by tests/test_no_network.py")
socket.socket.connect = _connect
socket.socket.connect_ex = _connect
socket.getaddrinfo = _getaddrinfo
socket.create_connection = lambda address, *a, **k: _connect(None, address)
'''

RUNS = [  # the loader, the tokenizer's chat template, the speculative loop (its drafter policy), info
    ["generate", "--model", "smollm2", "--chat", "--prompt", "Why is the sky blue?", "--max-new-tokens", "8",
     "--mode", "self-spec"],
    ["info"],
]


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory):
    from swiftkern.loading import smollm2_path

    smollm2_path()  # the bundled model file, or the error that says how to install it
    site = tmp_path_factory.mktemp("no_network")
    (site / "sitecustomize.py").write_text(BLOCK)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["SWIFTKERN_TEST_NETWORK_LOG"] = str(site / "attempts.log")
    return env, site / "attempts.log"


@pytest.mark.parametrize("args", RUNS, ids=["generate", "info"])
def test_runs_with_the_network_refused(offline_env, args):
    env, log = offline_env
    if log.exists():
        log.unlink()
    run = subprocess.run([sys.executable, "-m", "swiftkern", *args], capture_output=True, text=True, timeout=600,
                         env=env, cwd=str(log.parent))
    attempts = log.read_text() if log.exists() else ""
    assert not attempts, f"swiftkern {' '.join(args)} tried the network:\n{attempts[:3000]}"
    assert run.returncode == 0, run.stderr[-3000:]
    if args[0] == "generate":
        assert "new tokens for 1 prompt(s)" in run.stdout + run.stderr, run.stdout[-2000:]
