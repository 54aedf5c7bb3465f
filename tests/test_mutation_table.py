"""The planted-bug table of tools/mutation_sweep.py stays runnable: every snippet occurs exactly
once in its file, every test file a mutant names exists, no id is used twice. A change that moves
or rewrites a mutated line must carry its mutant along, or the sweep would report it STALE and
the bug it stands for would go unchecked."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_sweep():
    spec = importlib.util.spec_from_file_location("mutation_sweep", os.path.join(ROOT, "tools", "mutation_sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies_to_this_checkout():
    sweep = load_sweep()
    assert len(sweep.MUTANTS) > 200
    assert sweep.stale() == []


def test_stale_names_each_kind_of_rot(monkeypatch):
    sweep = load_sweep()
    ref = "swiftkern/reference.py"
    monkeypatch.setattr(sweep, "MUTANTS", [
        ("X1", ref, "def rms_norm(", "def rms_norm_(", "fine", ["tests/test_reference_ops.py"]),
        ("X1", ref, "def silu_mul(", "def silu_mul_(", "a second X1", ["tests/test_reference_ops.py"]),
        ("X2", ref, "torch.Tensor", "Tensor", "occurs many times", ["tests/test_reference_ops.py"]),
        ("X3", ref, "no such line", "", "gone", ["tests/test_reference_ops.py"]),
        ("X4", ref, "def rms_norm(", "def rms_norm_(", "no tests", ["tests/test_nothing_here.py"]),
        ("X5", "swiftkern/gone.py", "x", "y", "no file"),
    ])
    problems = sweep.stale()
    assert problems[0] == "X1: the id is used twice"
    assert [p.split(":")[0] for p in problems] == ["X1", "X2", "X3", "X4", "X5"]
    assert "occurs 0 times" in problems[2] and "tests/test_nothing_here.py" in problems[3]
    assert problems[1].startswith("X2: the snippet occurs") and "occurs 1 times" not in problems[1]
