"""Build of swiftkern: metadata lives in pyproject.toml; this file picks the extension.

Install with ``pip install --no-build-isolation -e .`` so the build sees the installed torch
(torch is not a build or runtime requirement: install the build you want first). Paths:

  (a) torch built with CUDA and a CUDA toolkit found (CUDA_HOME, or the one nvcc on PATH runs
      from) -> CUDAExtension swiftkern._C from csrc/*.cpp + csrc/*.cu, -DSWIFTKERN_WITH_CUDA;
      TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0a" when no GPU is visible (else torch builds for
      the visible GPU);
  (b) any other torch -> CppExtension swiftkern._C from csrc/*.cpp (CPU kernels, -O3, OpenMP);
  (c) SWIFTKERN_BUILD_EXT=0 -> pure Python (ops use swiftkern/reference.py).
  A build that cannot import torch stops at build_ext (an sdist or the metadata still build) with
  what to do: install torch first, or build without isolation where the torch is installed but
  hidden (pip and uv: --no-build-isolation; python -m build: --no-isolation). swiftkern cannot run
  without torch, so such a build could only install a package without its kernels.

``python setup.py --print-host-flags [PLATFORM]`` prints the host compile flags (for this platform,
or another by its sys.platform name: linux, darwin, win32) and builds nothing.
SWIFTKERN_BUILD_EXT=0 asks for (c); a failed extension build is an error (=1, the default: pip
shows no build output unless it fails, so a fallback would go unseen), and =auto makes it fall
back to pure Python with a note instead. MAX_JOBS limits parallel compile jobs.
The chosen path is printed to stderr (``pip install -v`` shows it).
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
KNOB = os.environ.get("SWIFTKERN_BUILD_EXT", "1").strip().lower() or "1"
if KNOB not in ("0", "1", "auto"):
    sys.exit(f"swiftkern setup: SWIFTKERN_BUILD_EXT must be 0, 1 or auto, got {KNOB!r}")
STRICT = KNOB == "1"


def note(msg: str, loud: bool = False) -> None:
    bar = "=" * 78
    text = f"\n{bar}\nswiftkern setup: {msg}\n{bar}\n" if loud else f"swiftkern setup: {msg}\n"
    sys.stderr.write(text)
    sys.stderr.flush()


def sources(*patterns: str) -> list[str]:
    # relative paths: setuptools refuses absolute source paths in some modes
    found = (p for pat in patterns for p in glob.glob(os.path.join(ROOT, "csrc", pat)))
    return sorted(os.path.relpath(p, ROOT) for p in found)


def host_flags(platform: str = sys.platform) -> tuple[list[str], list[str]]:
    """(compile, link) flags for the host compiler of ``platform`` (sys.platform's names): -O3 and
    OpenMP where it is supported."""
    if platform == "win32":
        return ["/O2", "/openmp"], []
    # -fno-trapping-math lets the compiler if-convert (vectorize) the fp16 -> fp32 loads;
    # -ffp-contract=off keeps a * b + c two roundings, as torch computes it (the kernels that
    # want a fused multiply-add call std::fma), so fp32 kernels can match the reference bit for bit
    if platform == "darwin":  # Apple clang has no -fopenmp; the kernels then run serially
        return ["-O3", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp-simd"], []
    return ["-O3", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"], ["-fopenmp"]


def loaded_libstdcxx() -> list[str]:
    """[path] of the libstdc++ this process runs with (torch imported), on Linux; else [].

    Linked by full path so that the extension takes libstdc++ from the same shared library as
    torch. A toolchain that would link its own libstdc++ statically (seen with a GCC installed
    under /opt/gcc on a GPU machine) then adds only what that library lacks; with Python's
    -Bsymbolic-functions a static copy crashed in its own uninitialized locale the first time
    an error message formatted a number."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return [path]
    except OSError:
        pass
    return []


def cuda_archs(torch) -> str:
    """What the CUDA build compiles for: TORCH_CUDA_ARCH_LIST, else the visible GPU's arch."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ")
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor} (visible GPU)"


def has_cuda_headers(home: str | None) -> bool:
    return bool(home) and os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h"))


def nvcc_toolkit() -> str | None:
    """The CUDA toolkit the nvcc on PATH runs from, as nvcc reports it (`_HERE_` of a dry run).

    torch takes the folder above nvcc's for CUDA_HOME; where nvcc on PATH is a wrapper script
    (/usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc, as on this project's machines)
    that is /usr/local, which has no CUDA headers, and the build failed on cuda_runtime_api.h."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        run = subprocess.run([nvcc, "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (run.stdout + run.stderr).splitlines():
        if line.startswith("#$ _HERE_="):
            return os.path.dirname(os.path.normpath(line.split("=", 1)[1].strip()))
    return None


def cuda_home(ce, user_cuda_home: str | None) -> str | None:
    """torch's CUDA_HOME where it has the CUDA headers, else nvcc's own toolkit (torch's module
    then uses it too), else None; with a CUDA_HOME or CUDA_PATH set by the user, torch's as it is."""
    if user_cuda_home or has_cuda_headers(ce.CUDA_HOME):
        return ce.CUDA_HOME
    found = nvcc_toolkit()
    if not has_cuda_headers(found):
        return None
    if ce.CUDA_HOME:
        note(f"torch's CUDA_HOME {ce.CUDA_HOME} has no CUDA headers; building with the toolkit nvcc runs "
             f"from, {found}")
    ce.CUDA_HOME = found
    os.environ["CUDA_HOME"] = found
    return found


def remove_stale_extension() -> None:
    """An earlier in-place (editable) build must not shadow a pure-Python install."""
    for path in glob.glob(os.path.join(ROOT, "swiftkern", "_C.*")):
        if path.endswith((".so", ".pyd")):
            os.remove(path)
            note(f"removed the stale extension {os.path.relpath(path, ROOT)}")


def torch_behind_isolation() -> str | None:
    """The version of a torch this interpreter imports outside the build's environment, or None.

    pip builds in an isolated environment (PYTHONPATH to its own packages and a sitecustomize that
    drops the interpreter's site-packages), where an installed torch cannot be imported; `python -E`
    ignores that environment and sees the interpreter's own packages."""
    try:
        run = subprocess.run([sys.executable, "-E", "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if run.returncode != 0:
        return None
    return run.stdout.strip() or None


def no_torch_message(error: ImportError) -> str:
    """What a build that cannot import torch says: why it stops, and the fix."""
    pure = "or set SWIFTKERN_BUILD_EXT=0 to install pure Python (no kernels) on purpose"
    hidden = torch_behind_isolation()
    if hidden:  # a plain `pip install .`: pip's isolation keeps the interpreter, hides its packages
        return (f"swiftkern setup: torch {hidden} is installed in this Python ({sys.executable}) but "
                "this build cannot import it: pip's build isolation hides the installed packages, and "
                "swiftkern would install without its kernels. Install with `pip install "
                f"--no-build-isolation ...` (the same arguments), {pure}.")
    return (f"swiftkern setup: this build cannot import torch ({error}; Python {sys.executable}). swiftkern "
            "runs on torch and compiles its kernels against the torch you choose (CPU or CUDA), so "
            "torch is not one of its requirements: install it first (e.g. `pip install torch`), then "
            "`pip install --no-build-isolation ...`. If torch is installed, the build ran in an "
            "isolated environment that hides it: build without isolation (pip and uv: "
            f"--no-build-isolation; python -m build: --no-isolation), {pure}.")


def refused_build(error: ImportError):
    """-> (a placeholder extension, a build_ext that stops with ``no_torch_message``): the refusal
    waits for the build, so an sdist and the metadata (which never compile) build without torch."""
    from setuptools import Extension
    from setuptools.command.build_ext import build_ext

    class RefusedBuildExt(build_ext):
        def run(self):
            sys.exit(no_torch_message(error))

    return [Extension("swiftkern._C", sources=[])], {"build_ext": RefusedBuildExt}


def make_extension():
    """-> (list of extensions, cmdclass dict); prints which path was taken and why."""
    if KNOB == "0":
        note("path (c) pure Python: SWIFTKERN_BUILD_EXT=0, so no swiftkern._C is built "
             "(ops use swiftkern/reference.py)", loud=True)
        remove_stale_extension()
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension as ce
    except ImportError as e:
        return refused_build(e)

    cflags, lflags = host_flags()
    lflags = lflags + loaded_libstdcxx()
    nvcc = shutil.which("nvcc")
    user_cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if torch.version.cuda and cuda_home(ce, user_cuda_home):
        if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0a"
        cflags = cflags + ["-DSWIFTKERN_WITH_CUDA"]
        srcs = sources("*.cpp", "*.cu")
        archs = cuda_archs(torch)
        note(f"path (a) CUDAExtension: torch {torch.__version__} has CUDA {torch.version.cuda}, "
             f"CUDA_HOME={ce.CUDA_HOME}, archs {archs}; sources: {', '.join(srcs)}")
        flags = cflags + ['-DSWIFTKERN_CXX_FLAGS="' + " ".join(cflags) + '"',
                          f'-DSWIFTKERN_CUDA_ARCHS="{archs}"']
        # -lineinfo: compute-sanitizer and profilers map kernel addresses to source lines
        nvcc_flags = ["-O3", "-lineinfo", "-DSWIFTKERN_WITH_CUDA"]  # -std: torch picks it
        ext = ce.CUDAExtension("swiftkern._C", srcs, extra_link_args=lflags,
                               extra_compile_args={"cxx": flags, "nvcc": nvcc_flags})
    else:
        if torch.version.cuda:
            why = (f"torch {torch.__version__} has CUDA {torch.version.cuda} but no CUDA toolkit with "
                   "its headers was found (nvcc, CUDA_HOME), so the CUDA kernels are NOT compiled (CUDA "
                   f"ops run the Triton kernels or the reference); install the CUDA {torch.version.cuda} toolkit, put nvcc on "
                   "PATH or set CUDA_HOME, and reinstall to build them")
        elif nvcc or user_cuda_home:
            why = (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None), so "
                   f"nvcc ({nvcc or user_cuda_home}) is not used")
        else:
            why = f"torch {torch.__version__} is a CPU-only build and there is no nvcc"
        srcs = sources("*.cpp")
        note(f"path (b) CppExtension (CPU kernels): {why}; sources: {', '.join(srcs)}",
             loud=bool(torch.version.cuda))
        flags = cflags + ['-DSWIFTKERN_CXX_FLAGS="' + " ".join(cflags) + '"']
        ext = ce.CppExtension("swiftkern._C", srcs, extra_compile_args={"cxx": flags}, extra_link_args=lflags)

    class OptionalBuildExt(ce.BuildExtension):
        """torch's BuildExtension (ninja, MAX_JOBS): a failure stops the build with what to do, or
        with SWIFTKERN_BUILD_EXT=auto falls back to pure Python."""

        def run(self):
            try:
                super().run()
            except (Exception, SystemExit) as e:  # compiler errors arrive as several types
                if STRICT:
                    note(f"building swiftkern._C FAILED ({type(e).__name__}: {e}); the compiler's "
                         "error is above. Fix it (a C++ compiler that builds torch extensions, with "
                         "OpenMP; for CUDA, the toolkit of torch's CUDA version), or set "
                         "SWIFTKERN_BUILD_EXT=auto to fall back to pure Python (no kernels; ops use "
                         "swiftkern/reference.py), or =0 to build none.", loud=True)
                    raise
                note(f"building swiftkern._C FAILED ({type(e).__name__}: {e}); continuing as pure "
                     "Python (ops use swiftkern/reference.py), as SWIFTKERN_BUILD_EXT=auto asks.",
                     loud=True)
                remove_stale_extension()

        def get_outputs(self):  # editable installs must not expect a .so that was not built
            return [p for p in super().get_outputs() if os.path.exists(p)]

    return [ext], {"build_ext": OptionalBuildExt}


if __name__ == "__main__" and sys.argv[1:2] == ["--print-host-flags"] and len(sys.argv) <= 3:
    # for tools/check_torch_headers.sh: the host compile flags the extension is built with
    print(" ".join(host_flags(*sys.argv[2:])[0]))
    sys.exit(0)

ext_modules, cmdclass = make_extension()

setup(
    packages=["swiftkern", "swiftkern.integrations", "swiftkern.ops", "swiftkern.triton_kernels"],
    package_dir={"swiftkern": "swiftkern", "swiftkern.triton_kernels": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
