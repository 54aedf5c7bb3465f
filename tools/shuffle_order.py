"""A pytest plugin that runs the test files in a shuffled order and each file's tests shuffled
too, to find a test that leans on what another left behind (a patched global, a cache dir, a
backend setting).

    PYTHONPATH=tools SHUFFLE_SEED=1 .venv/bin/python -m pytest -q -n 2 -p shuffle_order tests

The order is drawn from SHUFFLE_SEED alone, so every xdist worker collects the same one (xdist
requires that). Tests of one file stay together, which keeps module-scoped fixtures built once.
"""

from __future__ import annotations

import os
import random


def pytest_collection_modifyitems(session, config, items):
    rng = random.Random(int(os.environ.get("SHUFFLE_SEED", "0")))
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    files = list(by_file)
    rng.shuffle(files)
    shuffled = []
    for name in files:
        tests = by_file[name]
        rng.shuffle(tests)
        shuffled += tests
    items[:] = shuffled
