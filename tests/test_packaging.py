"""What `pip install` gets from a source distribution and a wheel: every file the extension build
compiles or includes, every module of the packages.

The sdist is built the way pip and `python -m build` build it (setuptools.build_meta) from a copy
of the checkout, so the test writes nothing into the tree. Before MANIFEST.in the sdist had no
csrc/*.h, *.cuh or *.cu: an install from it failed to compile every file, fell back to pure Python
and exited 0. The wheel is built without the extension (SWIFTKERN_BUILD_EXT=0): what it must hold
is every module, which setup.py's explicit `packages` list would silently miss for a new folder,
and its metadata (version, console script, triton on Linux only). Last, a build that cannot import
torch (pip's build isolation hiding the installed one, or a fresh build environment as `python -m
build` and uv make) must stop and say so rather than install a package without its kernels, and so
must a compile that fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import swiftkern

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SOURCES = (".h", ".cuh", ".cu", ".cpp")
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
PACKAGES = {"swiftkern": ROOT / "swiftkern", "swiftkern/triton_kernels": ROOT / "triton_kernels"}
COPIED = ["setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "Makefile", "csrc", "swiftkern",
          "triton_kernels", "tests"]


def _run_hook(tmp_path: Path, hook: str, env_extra: dict,
              python: str = sys.executable) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs setuptools.build_meta.<hook>(out) with ``python`` in a copy of the checkout;
    -> (the run, out)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(parents=True)
    out.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info", "build")
    for name in COPIED:
        path = ROOT / name
        if not path.exists():  # MANIFEST.in removed: the archive is built without it
            continue
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    # the build's knob only as a test sets it: one exported by the developer would change the path
    inherited = {k: v for k, v in os.environ.items() if k != "SWIFTKERN_BUILD_EXT"}
    run = subprocess.run([python, "-c", code], cwd=src, capture_output=True, text=True, timeout=600,
                         env={**inherited, **env_extra})
    return run, out


def _build(tmp_path: Path, hook: str, env_extra: dict) -> Path:
    """-> the archive setuptools.build_meta.<hook> builds from a copy of the checkout."""
    run, out = _run_hook(tmp_path, hook, env_extra)
    assert run.returncode == 0, f"{hook} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return out / run.stdout.strip().splitlines()[-1]


def _package_modules() -> set[str]:
    """Each .py of the packages as its path inside an installed swiftkern."""
    return {f"{prefix}/{p.relative_to(folder).as_posix()}"
            for prefix, folder in PACKAGES.items() for p in folder.rglob("*.py") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def sdist_files(tmp_path_factory) -> dict[str, bytes]:
    archive = _build(tmp_path_factory.mktemp("sdist"), "build_sdist", {})
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        return {m.name[len(top) + 1:]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_sdist_has_every_kernel_source_and_header(sdist_files):
    checkout = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.suffix in KERNEL_SOURCES}
    assert checkout, "no csrc files found in the checkout"
    missing = sorted(checkout - set(sdist_files))
    assert not missing, f"the sdist lacks {missing}: add them to MANIFEST.in"


def test_sdist_kernel_includes_resolve_inside_it(sdist_files):
    unresolved = []
    for name, data in sdist_files.items():
        if not (name.startswith("csrc/") and name.endswith(KERNEL_SOURCES)):
            continue
        for header in LOCAL_INCLUDE.findall(data.decode()):
            path = os.path.normpath(os.path.join(os.path.dirname(name), header))
            if path not in sdist_files:
                unresolved.append(f"{name}: {header}")
    assert not unresolved, f"includes the sdist cannot compile: {unresolved}"


def test_sdist_has_every_module_and_the_build_files(sdist_files):
    wanted = {"setup.py", "pyproject.toml", "README.md"}
    wanted |= {m.replace("swiftkern/triton_kernels/", "triton_kernels/", 1) for m in _package_modules()}
    missing = sorted(wanted - set(sdist_files))
    assert not missing, f"the sdist lacks {missing}"
    # all of the test suite or none of it: it runs from a checkout (bench/, tools/, docs/)
    assert not [n for n in sdist_files if n.startswith("tests/")], "the sdist carries part of tests/"


def test_wheel_installs_every_module(tmp_path):
    wheel = _build(tmp_path, "build_wheel", {"SWIFTKERN_BUILD_EXT": "0"})
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = sorted(_package_modules() - names)
    assert not missing, f"the wheel lacks {missing}: a package folder missing from setup.py's packages?"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as zf:
        assert "swiftkern = swiftkern.cli:main" in zf.read(entry).decode()
        fields = zf.read(metadata).decode().splitlines()
    requires = [line for line in fields if line.startswith("Requires-Dist:")]
    version = next(line.split()[1] for line in fields if line.startswith("Version:"))
    assert version == swiftkern.__version__, "the wheel's version is not swiftkern.__version__"
    # triton has wheels for Linux only; swiftkern runs without it, so elsewhere it must not be required
    triton = [r for r in requires if r.split()[1].startswith("triton")]
    assert len(triton) == 1 and 'platform_system == "Linux"' in triton[0], requires


def test_a_build_that_cannot_see_the_installed_torch_refuses(tmp_path):
    """A plain `pip install .` builds where pip's isolation hides the installed torch: the build used
    to install pure Python (exit 0, the reason shown only with -v); it now fails and names the fix.
    The isolation is played by a torch package first on PYTHONPATH that fails to import."""
    stub = tmp_path / "isolation" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("hidden, as pip\'s build isolation hides it")\n')
    hidden = {"PYTHONPATH": str(stub.parent)}
    run, _ = _run_hook(tmp_path / "plain", "build_wheel", hidden)
    assert run.returncode != 0, "the build went on without the installed torch"
    assert "--no-build-isolation" in run.stderr and "SWIFTKERN_BUILD_EXT=0" in run.stderr, run.stderr[-2000:]
    import torch  # the refusal names the torch it found hidden, not only the general fixes

    assert f"torch {torch.__version__} is installed in this Python" in run.stderr, run.stderr[-2000:]
    # asked for explicitly, a pure-Python build still goes through
    run, _ = _run_hook(tmp_path / "pure", "build_wheel", {**hidden, "SWIFTKERN_BUILD_EXT": "0"})
    assert run.returncode == 0, run.stderr[-2000:]


def _build_environment(root: Path) -> str:
    """A fresh virtual environment holding setuptools and wheel and nothing else, as `python -m
    build` and uv make to build in; -> its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import _distutils_hack
    import setuptools
    import wheel

    folders = [Path(m.__file__).parent for m in (setuptools, _distutils_hack, wheel)]
    # the metadata too: setuptools finds its commands (egg_info, bdist_wheel) through its entry points
    folders += [p for m in ("setuptools", "wheel") for p in folders[0].parent.glob(f"{m}-*.dist-info")]
    for folder in folders:
        (Path(site) / folder.name).symlink_to(folder)
    return str(python)


def test_a_build_in_a_fresh_environment_without_torch_refuses(tmp_path):
    """`python -m build` and uv build in a new environment with only the build requirements: no torch
    to find anywhere. The build used to install pure Python with exit 0; it now stops at the
    compile and names the fixes. An sdist, which compiles nothing, still builds there."""
    python = _build_environment(tmp_path / "env")
    probe = subprocess.run([python, "-E", "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0, "the fresh build environment imports torch"
    run, _ = _run_hook(tmp_path / "wheel", "build_wheel", {}, python)
    assert run.returncode != 0, "the build went on without torch"
    for fix in ("--no-build-isolation", "--no-isolation", "SWIFTKERN_BUILD_EXT=0", "install it first"):
        assert fix in run.stderr, f"the refusal does not name {fix!r}:\n{run.stderr[-2000:]}"
    run, out = _run_hook(tmp_path / "sdist", "build_sdist", {}, python)
    assert run.returncode == 0 and list(out.glob("*.tar.gz")), run.stderr[-2000:]
    run, out = _run_hook(tmp_path / "pure", "build_wheel", {"SWIFTKERN_BUILD_EXT": "0"}, python)
    assert run.returncode == 0 and list(out.glob("*.whl")), run.stderr[-2000:]


def test_a_failed_compile_stops_the_build_unless_a_fallback_is_asked_for(tmp_path):
    """pip shows a build's output only when it fails, so a compile that failed and fell back to pure
    Python (the default until now) installed a package without kernels with no word. A compiler
    that fails (here /bin/false) now fails the build with what to do; SWIFTKERN_BUILD_EXT=auto
    still asks for the fallback, and gets a wheel without the extension."""
    broken = {"CXX": "/bin/false", "CC": "/bin/false"}
    run, out = _run_hook(tmp_path / "default", "build_wheel", broken)
    assert run.returncode != 0 and not list(out.glob("*.whl")), "a failed compile went on as pure Python"
    assert "building swiftkern._C FAILED" in run.stderr and "SWIFTKERN_BUILD_EXT=auto" in run.stderr, \
        run.stderr[-2000:]
    wheel = _build(tmp_path / "auto", "build_wheel", {**broken, "SWIFTKERN_BUILD_EXT": "auto"})
    with zipfile.ZipFile(wheel) as zf:
        assert not [n for n in zf.namelist() if n.startswith("swiftkern/_C")], "the fallback built an extension"
        assert "swiftkern/reference.py" in zf.namelist()
