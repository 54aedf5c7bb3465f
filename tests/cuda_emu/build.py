"""Builds ``swiftkern_cuda_emu``: csrc/ops_cuda.cpp and the kernels of csrc/*.cu compiled by the
host compiler against this folder's stand-ins for CUDA's headers (emu.h), so the CUDA ops run on
CPU tensors. The sources are copied with two rewrites the preprocessor cannot make:
``kernel<<<grid, block, smem, stream>>>(args)`` becomes
``::emu::Launch(grid, block, smem, stream).kernel(&kernel)(args)``, and
``extern __shared__ T name[];`` a pointer to the launch's dynamic shared memory; and every
``__shared__`` declaration is followed by a call that fills it with garbage once per block (as
a GPU leaves it), so a kernel that reads shared memory before writing it in a block fails
instead of reading the last block's values. Built once per
content of those sources (a hash names the build folder under build/cuda_emu)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CSRC = ROOT / "csrc"

# kernel<<<config>>>(   ->   ::emu::Launch(config).kernel(&kernel)(
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(")
# extern __shared__ [__align__(n)] T name[];   ->   T* name = <the launch's dynamic shared memory>;
DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];")
# __shared__ T name[...];   ->   the same, then ::emu::fresh_shared(&name, sizeof(name));
STATIC_SHARED = re.compile(r"^(\s*)__shared__\s+([\w:<> ]+?)\s+(\w+)((?:\[[^\]]+\])*);", re.M)


def rewrite(source: str) -> str:
    source = LAUNCH.sub(lambda m: f"::emu::Launch({m.group(2)}).kernel(&{m.group(1)})(", source)
    source = DYNAMIC_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = static_cast<{m.group(1)}*>(::emu::dynamic_shared());", source)
    # each block's first thread to get there fills the block's static shared memory with garbage
    return STATIC_SHARED.sub(lambda m: f"{m.group(1)}__shared__ {m.group(2)} {m.group(3)}{m.group(4)}; "
                                       f"::emu::fresh_shared(&{m.group(3)}, sizeof({m.group(3)}));", source)


def sources() -> dict[str, str]:
    """{file name: text} of what is compiled: the rewritten csrc kernels and headers, ops_cuda.cpp,
    and this folder's runtime and module."""
    out = {}
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".cu", ".cuh", ".h") or path.name == "ops_cuda.cpp":
            name = path.name[:-3] + "_emu.cpp" if path.suffix == ".cu" else path.name
            out[name] = rewrite(path.read_text())
    for path in sorted(HERE.glob("*")):
        if path.suffix in (".h", ".cpp"):
            out[path.name] = path.read_text()
    return out


@functools.cache
def emulated_cuda_ops(verbose: bool = False):
    """-> the built module (functions greedy_accept, rejection_sample, fused_add_rms_norm,
    rope_kv_append, kv_compact with torch.ops.swiftkern's arguments, on CPU tensors)."""
    from torch.utils.cpp_extension import load

    # the ninja that `pip install ninja` put beside this interpreter, when the venv is not on PATH
    bin_dir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    files = sources()
    flags = ["-O1", "-ffp-contract=off", "-DSWIFTKERN_CUDA_EMULATION", "-Wno-unknown-pragmas"]
    if os.environ.get("SWIFTKERN_EMULATED_ASAN") == "1":  # for a process run with libasan preloaded
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    digest = hashlib.sha256("".join(k + v for k, v in sorted(files.items())).encode() + str(flags).encode())
    digest = digest.hexdigest()[:16]
    folder = ROOT / "build" / "cuda_emu" / digest
    src_dir = folder / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = src_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    compiled = [str(src_dir / n) for n in files if n.endswith(".cpp")]
    return load(name="swiftkern_cuda_emu", sources=compiled, build_directory=str(folder),
                extra_cflags=flags + [f"-I{src_dir}"], verbose=verbose)


if __name__ == "__main__":
    print(emulated_cuda_ops(verbose=True))
