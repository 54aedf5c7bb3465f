"""bench/gpu_session.sh is run only on a lent GPU machine, minutes at a time: a stage that names a
test file, test, routine or bi_matmul plan that no longer exists would spend that time on an
error. These checks read the script on the CPU machine: its stages listed and defined alike,
every test path and pytest selection it runs collecting tests, every routine it benches known to
``python -m bench``, every plan it sets parsed by ``bi_matmul.plan_from_env``."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION = os.path.join(ROOT, "bench", "gpu_session.sh")


def script() -> str:
    with open(SESSION) as f:
        return f.read()


def commands(name: str) -> list[list[str]]:
    """The argument lists of every call of shell function ``name`` in the stages (continuation
    lines joined; a guard before it, as in ``[ -e f ] || name ...``, dropped)."""
    text = script().replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#") or line.startswith(f"{name}()"):
            continue
        at = re.search(rf"(^|\|\| ){name} ", line)
        if at:
            calls.append(shlex.split(line[at.end():].split(">")[0]))
    return calls


@pytest.mark.parametrize("path", ["bench/gpu_session.sh", "bench/gpu_prepare.sh"])
def test_scripts_parse_as_bash(path):
    result = subprocess.run(["bash", "-n", os.path.join(ROOT, path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_listed_stage_is_defined_and_every_defined_stage_listed():
    text = script()
    listed = set(re.findall(r"^#\s+bash bench/gpu_session\.sh (\w+)", text, re.M))
    defined = set(re.findall(r"^stage_(\w+)\(\)", text, re.M))
    assert listed and listed == defined, (listed - defined, defined - listed)


def test_every_test_path_the_stages_name_exists():
    paths = set(re.findall(r"tests/[\w*]+\.py(?:::\w+)?", script()))
    assert paths
    for path in paths:
        file, _, test = path.partition("::")
        matches = glob.glob(os.path.join(ROOT, file))
        assert matches, f"gpu_session.sh names {file}, which matches no file"
        if test:
            with open(matches[0]) as f:
                assert re.search(rf"^def {test}\(", f.read(), re.M), f"{file} has no test {test}"


COLLECT = """
import json, sys
import pytest

class Count:
    def pytest_collection_finish(self, session):
        self.n = len(session.items)

counts = []
for args in json.loads(sys.argv[1]):
    count = Count()
    count.n = 0
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[count])
    counts.append(count.n)
print("COUNTS", json.dumps(counts))
"""


def test_every_pytest_selection_of_a_stage_collects_tests():
    """Each ``pytest_gpu`` call's files, ``-m`` / ``-k`` selections and deselections, collected
    here in one process (``-n`` dropped): a selection that matches nothing would run nothing on
    the GPU."""
    calls = commands("pytest_gpu")
    assert len(calls) >= 5
    selections = []
    for call in calls:
        args = call[2:]
        if "-n" in args:
            i = args.index("-n")
            del args[i:i + 2]
        selections.append([a for arg in args for a in (sorted(glob.glob(arg, root_dir=ROOT)) if "*" in arg else [arg])])
    result = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(selections)], cwd=ROOT,
                            capture_output=True, text=True)
    counts = re.search(r"^COUNTS (.*)$", result.stdout, re.M)
    assert counts, result.stdout[-2000:] + result.stderr[-2000:]
    for call, n in zip(calls, json.loads(counts.group(1))):
        assert n > 0, f"gpu_session.sh: pytest_gpu {call[0]} collects no test"


def test_every_routine_the_stages_bench_exists():
    sys.path.insert(0, ROOT)
    from bench.__main__ import routines

    named = {r for routine in re.findall(r"--routine (\S+)", script()) for r in routine.split(",")}
    named.discard("$r")  # a loop over names written beside it, checked below
    for loop in re.findall(r"for r in ([\w ]+); do", script()):
        named.update(loop.split())
    assert named and named <= set(routines()), named - set(routines())


def test_every_plan_the_stages_set_parses():
    from swiftkern.errors import SwiftkernError  # noqa: F401  (plan_from_env raises it for a bad name)

    sys.path.insert(0, ROOT)
    from triton_kernels.bi_matmul import CANDIDATES, PLANS, plan_from_env

    values = re.findall(r"SWIFTKERN_BI_MATMUL_PLAN=([^\s$(]+)", script())
    assert values
    for value in values:
        picked = plan_from_env(PLANS, CANDIDATES, value)
        assert picked != PLANS, value


def test_a_failure_is_logged_as_it_happens(tmp_path):
    """pytest_gpu sets SWIFTKERN_FAILURE_LOG: tests/conftest.py appends each failure's id and
    traceback at once (xdist's controller, as its workers report), which a run cut at its limit
    keeps. A planted failure beside a passing test, in two workers: the log names it once, with
    its message."""
    assert "SWIFTKERN_FAILURE_LOG=" in script()
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_planted.py").write_text("def test_fails():\n    assert 1 == 2, 'planted'\n\n"
                                              "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's xdist worker
    env.update(SWIFTKERN_FAILURE_LOG=str(log), PYTHONPATH=os.path.join(ROOT, "tests"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                          "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-2000:]
    text = log.read_text()
    assert text.count("=== ") == 1 and "test_planted.py::test_fails (call)" in text and "planted" in text
