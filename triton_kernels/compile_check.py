"""Compile every Triton kernel for a GPU, on a machine without one.

    python -m swiftkern.triton_kernels.compile_check [--arch 80 --arch 90] [--json PATH]

The interpreter tests (``TRITON_INTERPRET=1``) check what the kernels compute, but the
interpreter runs each program as numpy: it accepts code the compiler refuses (a loop-carried
value that changes type, a block that is not a power of two, a dtype the hardware lacks), and
it runs its own small launch plans (``launch.interpreting()``), never the ones a GPU gets.

This module runs each launcher on meta tensors of the shapes the model runner uses on a GPU
(``compile_cases``: SmolLM2, Llama-3-8B, Qwen2-0.5B and the tests' tiny models with one kv
head; decode, verification and replay; batch 1 to 32; caches up to 32768 keys; float32,
bfloat16, float16), with the launch plans of the target GPU (its SM count decides the key and
vocabulary splits). Each launch is compiled by Triton itself, the way
``kernel[grid](...)`` compiles it on a GPU (the same argument specialization, options and
cache), down to a cubin for the target, and not launched. A launch fails the check when:

- Triton cannot compile it for the target (the error is shown with the case);
- its shared memory exceeds what one block may use on the target (Triton would raise
  OutOfResources at the first launch);
- its grid exceeds CUDA's limits (2^31 - 1 programs on axis 0, 65535 on axes 1 and 2);
- one of the deterministic verifier's ops compiles to more than one binary across the shapes
  the verifier meets (``verifier_cases``; for the norms also offset and row-padded inputs):
  batch invariance must not rest on a specialization;
- a memory-bound kernel of ``WIDE_LOAD_KERNELS`` issues no 16-byte global load at a real
  model's shape (a lost vectorization: an unaligned or unspecialized size, a plan with too many
  threads per row); a case labelled ``<op> <model> ...`` is at one, ``kv_compact plan ...`` (its
  plan's tiles at a caller's entry counts) is not;
- it leaves multiply-add fusion to Triton's default (on through 3.9, announced to turn off in
  3.10): each launch names ``enable_fp_fusion``, so the kernels' bits do not move with the Triton
  installed;
- it spills more than ``SPILL_LIMIT`` bytes of registers per thread to local memory (read by
  the ``cuobjdump`` and ``ptxas`` Triton ships): a plan that spills is a slow plan, and the fix
  is in ``launch.py``'s plans. A few bytes are the register allocator's noise, not a plan that
  does not fit.

Triton must be imported with ``TRITON_INTERPRET`` unset or 0 (the
kernels are then ``JITFunction``s), so run this as its own process; the test suite does.
Exit status: 0 when every launch of every case passes on every target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from itertools import chain

import torch

from .compile_cases import MODELS, VERIFIER_PREFIX, VERIFIER_SHAPES, cases, verifier_cases
from .launch import MAX_GRID_Y_Z, gpu_launch_plans, interpreting

@dataclass(frozen=True)
class Target:
    """A GPU to compile for: its compute capability, SM count and shared memory per block."""
    arch: int
    sms: int
    max_shared: int  # bytes one block may use (the opt-in maximum)

    @property
    def name(self) -> str:
        return f"sm_{self.arch}" + ("a" if self.arch == 90 else "")


TARGETS = {
    80: Target(80, 108, 166912),  # A100: 163 KiB
    90: Target(90, 132, 232448),  # H100 / H200: 227 KiB
}
MAX_GRID = (2 ** 31 - 1, MAX_GRID_Y_Z, MAX_GRID_Y_Z)
SPILL_LIMIT = 32  # bytes of spill stores per thread a compiled kernel may have
# memory-bound kernels that must load 16 bytes per access at the real models' shapes (the tiny
# test model's rows are too short for it); rope_kv_append moves 8 bytes at head dim 64 in 16 bits
WIDE_LOAD_KERNELS = frozenset(("_silu_mul_kernel", "_fused_add_rms_norm_kernel", "_argmax_kernel",
                               "_chunk_sums_kernel", "_draw_kernel", "_kv_compact_kernel", "_verify_attention_kernel"))
WIDE_LOAD = re.compile(r"ld\.global(\.\w+)*\.(v4\.(b32|u32|f32)|v2\.(b64|u64|f64))")


@dataclass
class Launch:
    """One compiled kernel of one target, with every case that launched it."""
    kernel: str
    target: str
    constexprs: dict
    signature: dict
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    spill_bytes: int
    wide_loads: bool  # some global load moves 16 bytes
    cases: list = field(default_factory=list)
    grids: list = field(default_factory=list)


# ------------------------------------------------------------------------- recording

class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: one device per target, no stream, the target's
    compute capability. Triton's JIT asks it nothing else when it compiles without launching."""

    def __init__(self, target: Target):
        from triton.backends.compiler import GPUTarget

        self.device = 1000 + target.arch  # a device id of its own: the JIT caches per device
        self.gpu_target = GPUTarget("cuda", target.arch, 32)

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.gpu_target


@contextlib.contextmanager
def recording(target: Target, on_launch):
    """Inside this block the launchers accept meta tensors and plan for ``target``; each
    ``kernel[grid](...)`` compiles for ``target`` (through Triton's own JIT path, warm-up mode:
    nothing is launched) and calls ``on_launch(jit_function, grid, compiled_kernel, launch_kwargs)``
    (the launch's keyword arguments: constexprs and options such as num_warps)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if interpreting():
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset or 0 when triton is first imported "
                           "(run it as its own process: python -m swiftkern.triton_kernels.compile_check)")
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        compiled = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        on_launch(self, tuple(grid), compiled, kwargs)
        return compiled

    saved_driver = driver._active
    driver.set_active(_CompileOnlyDriver(target))
    JITFunction.run = compile_only
    try:
        with gpu_launch_plans(target.sms):
            yield
    finally:
        JITFunction.run = real_run
        driver._active = saved_driver


def all_kernels() -> set[str]:
    """Names of every @triton.jit kernel in swiftkern.triton_kernels' modules."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    from .. import triton_kernels as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {name for name, obj in vars(module).items()
                  if isinstance(obj, JITFunction) and name.endswith("_kernel")}
    return names


# ------------------------------------------------------------------------- checking

def _resource_usage(compiled, target: Target) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) of one compiled kernel. The registers come
    from the cubin (``cuobjdump -res-usage``); where it shows a stack frame, the spill stores
    are read from ``ptxas -v`` on the kernel's PTX (a stack frame alone is not a spill)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton compiled this target with

    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin], capture_output=True,
                              text=True, check=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
        if not found:
            raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK/LOCAL line:\n{text}")
        registers, frame = int(found.group(1)), int(found.group(2)) + int(found.group(3))
        if not frame:
            return registers, 0
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(target.arch).path, "-v", f"--gpu-name={target.name}", ptx, "-o",
                              os.path.join(tmp, "v.cubin")], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", log)
    if not spills:
        raise RuntimeError(f"ptxas -v printed no spill count:\n{log}")
    return registers, int(spills.group(1))


def check(targets: list[Target], verbose: bool = True, case_list=None) -> tuple[list[Launch], list[str]]:
    """Compile every launch of every case (``cases()``, or ``case_list``: (label, launcher,
    args) triples) for each target -> (compiled kernels, failures)."""
    launches: dict[tuple, Launch] = {}
    failures: list[str] = []
    all_cases = list(chain(cases(), verifier_cases()) if case_list is None else case_list)
    binaries: dict[tuple, set] = {}  # (target, kernel, verifier model and dtype, op) -> compiled hashes
    for target in targets:
        current = {"case": None}

        def on_launch(fn, grid, compiled, kwargs, target=target):
            meta = compiled.metadata
            key = (fn.__name__, target.name, compiled.hash)
            if key not in launches:
                regs, spills = _resource_usage(compiled, target)
                constexprs = {fn.arg_names[path[0]]: repr(v) for path, v in compiled.src.constants.items()}
                launches[key] = Launch(fn.__name__, target.name, constexprs, dict(compiled.src.signature),
                                       meta.num_warps, meta.num_stages, meta.shared, regs, spills,
                                       bool(WIDE_LOAD.search(compiled.asm["ptx"])))
                if spills > SPILL_LIMIT:
                    failures.append(f"{target.name} {current['case']}: {fn.__name__} spills {spills} bytes of "
                                    f"registers ({regs} registers per thread, {meta.num_warps} warps, {constexprs})")
                if meta.shared > target.max_shared:
                    failures.append(f"{target.name} {current['case']}: {fn.__name__} needs {meta.shared} bytes of "
                                    f"shared memory, more than the {target.max_shared} one block may use")
            model = current["case"].split()[1] if len(current["case"].split()) > 1 else ""
            if (fn.__name__ in WIDE_LOAD_KERNELS and model in MODELS and model != "tiny-mqa"
                    and not launches[key].wide_loads):
                failures.append(f"{target.name} {current['case']}: {fn.__name__} has no 16-byte global load "
                                "(a memory-bound kernel at a real model's shape; see its PTX)")
            if "enable_fp_fusion" not in kwargs:
                failures.append(f"{target.name} {current['case']}: {fn.__name__} leaves multiply-add fusion to "
                                "Triton's default (announced to change in 3.10); pass enable_fp_fusion=launch.FP_FUSION")
            launches[key].cases.append(current["case"])
            launches[key].grids.append(list(grid))
            if current["case"].startswith(VERIFIER_PREFIX):  # "verifier <model> <dtype> <op> ...shape"
                group = (target.name, fn.__name__, *current["case"].split()[1:4])
                binaries.setdefault(group, set()).add(compiled.hash)
            over = [f"axis {i} = {g} > {m}" for i, (g, m) in enumerate(zip(grid, MAX_GRID)) if g > m]
            if over:
                failures.append(f"{target.name} {current['case']}: {fn.__name__} grid {grid} past CUDA's limit "
                                f"({', '.join(over)})")

        with recording(target, on_launch):
            for i, (label, launcher, args) in enumerate(all_cases):
                current["case"] = label
                if verbose:
                    print(f"\r{target.name}: case {i + 1}/{len(all_cases)}, {len(launches)} kernels compiled",
                          end="", file=sys.stderr, flush=True)
                try:
                    launcher(*args)
                except Exception as e:  # noqa: BLE001 - every failing case is reported, not just the first
                    failures.append(f"{target.name} {label}: {type(e).__name__}: {str(e).strip()[:2000]}")
        if verbose:
            print(file=sys.stderr)
    failures += [f"{target} {VERIFIER_PREFIX}{model} {dtype} {op}: {kernel} compiles to {len(hashes)} binaries across "
                 f"the verifier's shapes {VERIFIER_SHAPES} (a specialization on a shape value or an input's alignment: a "
                 "row's bits could depend on the batch, the window or the memory; mark the argument do_not_specialize, "
                 "or have the launcher hand the kernel canonical inputs)"
                 for (target, kernel, model, dtype, op), hashes in sorted(binaries.items()) if len(hashes) > 1]
    return list(launches.values()), failures


def table(launches: list[Launch]) -> str:
    rows = [("target", "kernel", "pointers", "warps", "stages", "shared B", "regs", "spill B", "16B loads", "cases",
             "constexprs")]
    for t in sorted(launches, key=lambda t: (t.target, t.kernel, str(t.constexprs), str(t.signature))):
        pointers = ",".join(sorted({v[1:] for v in t.signature.values() if v.startswith("*")}))
        rows.append((t.target, t.kernel, pointers, str(t.num_warps), str(t.num_stages), str(t.shared), str(t.registers),
                     str(t.spill_bytes), "yes" if t.wide_loads else "no", str(len(t.cases)),
                     " ".join(f"{k}={v}" for k, v in t.constexprs.items())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swiftkern.triton_kernels.compile_check",
        description="Compile every swiftkern Triton kernel, in the launch plans the model runner uses on a "
                    "GPU, for GPU targets (no GPU needed): fails on a compile error, shared memory over the "
                    "target's per-block limit, a grid past CUDA's limits, spilled registers, a launch that leaves "
                    "multiply-add fusion to Triton's default, a memory-bound "
                    "kernel without 16-byte loads, or a verifier op compiled to more than one binary.")
    parser.add_argument("--arch", type=int, action="append", choices=sorted(TARGETS),
                        help="compute capability to compile for (repeat; default: 80 and 90)")
    parser.add_argument("--json", metavar="PATH", help="write the compiled kernels and the failures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    targets = [TARGETS[a] for a in (args.arch or sorted(TARGETS))]
    import triton

    launches, failures = check(targets, verbose=not args.quiet)
    print(f"triton {triton.__version__}, torch {torch.__version__}: {len(launches)} compiled kernels")
    print(table(launches))
    kernels = all_kernels()
    missing = {(t.name, k) for t in targets for k in kernels} - {(t.target, t.kernel) for t in launches}
    failures += [f"{name}: no case launches {kernel}; add one to compile_cases.cases()"
                 for name, kernel in sorted(missing)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "targets": [asdict(t) for t in targets],
                       "kernels": sorted(kernels), "launches": [asdict(t) for t in launches],
                       "failures": failures}, f, indent=1)
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"{len(failures)} failures" if failures else "all launches compile within the targets' limits")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
