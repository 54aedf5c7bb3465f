"""setup.py's choice of CUDA toolkit: torch's CUDA_HOME where it holds the CUDA headers, else the
toolkit the nvcc on PATH runs from. (A wrapper script at /usr/local/bin/nvcc made torch take
/usr/local, which has no headers: a CUDA torch then failed to build the extension on
cuda_runtime_api.h and fell back to pure Python.) setup.py calls setup() when it is run, so its
functions are taken from its source."""

import ast
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "setup.py"
NAMES = {"note", "has_cuda_headers", "nvcc_toolkit", "cuda_home"}


def _setup_functions():
    tree = ast.parse(SETUP.read_text())
    module = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in NAMES],
                        type_ignores=[])
    namespace = {"os": os, "shutil": shutil, "subprocess": subprocess, "sys": sys}
    exec(compile(module, str(SETUP), "exec"), namespace)
    assert NAMES <= namespace.keys()
    return types.SimpleNamespace(**{name: namespace[name] for name in NAMES})


def _user_cuda_home():
    """What setup.py's make_extension passes: the CUDA_HOME or CUDA_PATH the user set."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")


def _toolkit(root: Path, headers: bool) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    if headers:
        (root / "include" / "cuda_runtime_api.h").write_text("// a stand-in\n")
    return root


def _wrapper_nvcc(folder: Path, toolkit: Path) -> None:
    """An nvcc on PATH that, like the real one under -dryrun, names the folder it runs from."""
    folder.mkdir(parents=True)
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '#$ _NVVM_BRANCH_=nvvm' >&2\necho '#$ _HERE_={toolkit}/bin' >&2\n")
    nvcc.chmod(0o755)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_wrapper_nvcc_leads_to_its_own_toolkit(tmp_path, clean_env):
    toolkit = _toolkit(tmp_path / "cuda-13.0", headers=True)
    _wrapper_nvcc(tmp_path / "local" / "bin", toolkit)
    clean_env.setenv("PATH", str(tmp_path / "local" / "bin"))
    fns = _setup_functions()
    torch_ce = types.SimpleNamespace(CUDA_HOME=str(tmp_path / "local"))  # torch's guess: nvcc's parent's parent
    assert fns.cuda_home(torch_ce, _user_cuda_home()) == str(toolkit)
    assert torch_ce.CUDA_HOME == str(toolkit) and os.environ["CUDA_HOME"] == str(toolkit)


def test_torchs_cuda_home_is_kept_where_it_has_the_headers(tmp_path, clean_env):
    good = _toolkit(tmp_path / "cuda", headers=True)
    _wrapper_nvcc(tmp_path / "bin", _toolkit(tmp_path / "other", headers=True))
    clean_env.setenv("PATH", str(tmp_path / "bin"))
    torch_ce = types.SimpleNamespace(CUDA_HOME=str(good))
    assert _setup_functions().cuda_home(torch_ce, _user_cuda_home()) == str(good)


def test_no_toolkit_with_headers_means_no_cuda_build(tmp_path, clean_env):
    _wrapper_nvcc(tmp_path / "bin", _toolkit(tmp_path / "cuda", headers=False))
    clean_env.setenv("PATH", str(tmp_path / "bin"))
    fns = _setup_functions()
    assert fns.cuda_home(types.SimpleNamespace(CUDA_HOME=str(tmp_path)), _user_cuda_home()) is None
    clean_env.setenv("PATH", str(tmp_path / "nowhere"))  # no nvcc at all
    assert fns.nvcc_toolkit() is None
    assert fns.cuda_home(types.SimpleNamespace(CUDA_HOME=None), _user_cuda_home()) is None


def test_a_cuda_home_the_user_set_is_not_second_guessed(tmp_path, clean_env):
    _wrapper_nvcc(tmp_path / "bin", _toolkit(tmp_path / "cuda", headers=True))
    clean_env.setenv("PATH", str(tmp_path / "bin"))
    clean_env.setenv("CUDA_HOME", str(tmp_path / "mine"))
    torch_ce = types.SimpleNamespace(CUDA_HOME=str(tmp_path / "mine"))
    assert _setup_functions().cuda_home(torch_ce, _user_cuda_home()) == str(tmp_path / "mine")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_the_real_nvcc_names_a_toolkit_with_headers():
    fns = _setup_functions()
    assert fns.has_cuda_headers(fns.nvcc_toolkit())
