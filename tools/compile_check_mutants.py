"""Planted bugs in the GPU compile check that runs without a GPU (triton_kernels/compile_check.py), for
tools/mutation_sweep.py: each one lets a kernel a GPU cannot run, or runs slowly or batch-dependently,
pass the check (M219 on); and in the cases it compiles (M226-M228, M231). The check's tests hand it kernels that break each rule on purpose."""

COMPILE_TESTS = ["tests/test_triton_compile.py"]
C = "triton_kernels/compile_check.py"

# (id, file, snippet, replacement, the bug it plants, the tests that should catch it)
COMPILE_CHECK_MUTANTS = [
    ("M219", C, "int(found.group(2)) + int(found.group(3))", "int(found.group(2))",
     "a kernel whose spills show only as local memory (no stack frame) is read as spilling nothing", COMPILE_TESTS),
    ("M220", C, "                if meta.shared > target.max_shared:",
     "                if meta.shared > TARGETS[90].max_shared:",
     "every target's shared memory checked against the H100's limit (an A100 allows less)", COMPILE_TESTS),
    ("M221", C, "MAX_GRID = (2 ** 31 - 1, MAX_GRID_Y_Z, MAX_GRID_Y_Z)", "MAX_GRID = (2 ** 31 - 1,) * 3",
     "a grid's axes 1 and 2 allowed 2^31 - 1 programs", COMPILE_TESTS),
    ("M222", C, r'WIDE_LOAD = re.compile(r"ld\.global(\.\w+)*\.(v4\.(b32|u32|f32)|v2\.(b64|u64|f64))")',
     r'WIDE_LOAD = re.compile(r"ld\.global(\.\w+)*\.(v[24]\.(b32|u32|f32)|v2\.(b64|u64|f64))")',
     "an 8-byte load passes for a 16-byte one", COMPILE_TESTS),
    ("M223", C, "for (target, kernel, model, dtype, op), hashes in sorted(binaries.items()) if len(hashes) > 1]",
     "for (target, kernel, model, dtype, op), hashes in sorted(binaries.items()) if len(hashes) > 2]",
     "a verifier op compiled to two binaries across its shapes passes", COMPILE_TESTS),
    ("M224", C, "                if spills > SPILL_LIMIT:", "                if spills > 8 * SPILL_LIMIT:",
     "hundreds of bytes of spilled registers pass", COMPILE_TESTS),
    ("M225", C, "        with gpu_launch_plans(target.sms):", "        with gpu_launch_plans(8):",
     "the launch plans of an 8-SM GPU compiled, not the target's (its key and vocabulary splits)", COMPILE_TESTS),
    ("M226", "triton_kernels/compile_cases.py",
     '            yield from _attention_plan_cases(k["verify_attention"], tag, Hq, Hkv, D, dt)\n', "",
     "the cases compile only the attention plans of long caches: a short cache's unsplit tiles and most combine "
     "widths are first compiled on a GPU, unchecked", ["tests/test_triton_gpu_plans.py"]),
    ("M227", "triton_kernels/compile_cases.py", "        yield from _acceptance_plan_cases(k, model, V)\n", "",
     "the acceptance kernels compiled for 4 and 8 drafts only: the tiles of 0-2 and 16-63 drafts and some combine "
     "widths are first compiled on a GPU, unchecked", ["tests/test_triton_gpu_plans.py"]),
    ("M228", "triton_kernels/compile_cases.py", "        for splits in _combine_widths(K + 1, K, V):\n",
     "        for splits in _combine_widths(K + 1, K, V)[-1:]:\n",
     "greedy_accept's combine compiled at each token tile's widest split only: its [K + 1, splits] tiles with "
     "fewer splits (more rows) are first compiled on a GPU, unchecked", ["tests/test_triton_gpu_plans.py"]),
    ("M231", "triton_kernels/compile_cases.py",
     '                yield from _compact_plan_cases(k["kv_compact"], tag, Hkv, D, dt)\n', "                pass\n",
     "kv_compact compiled at 16 and 64 entries only: its tiles of more entries (which spilled kilobytes) are first "
     "compiled on a GPU, unchecked", ["tests/test_triton_gpu_plans.py"]),
    ("M234", C, '            if "enable_fp_fusion" not in kwargs:', "            if False:",
     "a launch that leaves multiply-add fusion to Triton's default passes (its bits would move with Triton 3.10)",
     COMPILE_TESTS),
]

