"""Planted bugs in the modules around the decoding loops, for tools/mutation_sweep.py: the state kept on a
caller's HF model (transient.py), the Triton ops' registration, ``swiftkern info``, what differs between
transformers versions (integrations/compat.py), the projections' kernel choice and input checks, the
invariant ops' entry points, loading GGUF files once, the CUDA-graph stand-ins, the offline search and the
command line (M109 on)."""

HF_TESTS = ["tests/test_hf_integration.py", "tests/test_patching.py"]
GRAPH_TESTS = ["tests/test_graph_emulation.py", "tests/test_cuda_graphs.py", "tests/test_host_reads.py"]
PROJECTION_TESTS = ["tests/test_skinny_linear.py", "tests/test_packed_weights.py", "tests/test_cpp_ops.py",
                    "tests/test_input_contract.py", "tests/test_triton_skinny_linear.py"]
INVARIANT_TESTS = ["tests/test_invariant_kernels.py", "tests/test_bi_matmul.py", "tests/test_triton_bi_exp_sum.py",
                   "tests/test_triton_verifier.py", "tests/test_deterministic.py"]
CLI_TESTS = ["tests/test_cli.py"]

# (id, file, snippet, replacement, the bug it plants, the tests that should catch it)
SUPPORT_MUTANTS = [
    # state on a caller's HF model
    ("M109", "swiftkern/transient.py",
     '    def __deepcopy__(self, memo) -> "TransientState":\n        return TransientState()',
     '    def __deepcopy__(self, memo) -> "TransientState":\n        return self',
     "a deep copy of an HF model shares the original's Generators and packed weights", HF_TESTS),
    ("M110", "swiftkern/transient.py", "        return (TransientState, ())", "        return (TransientState, (dict(self),))",
     "torch.save of an HF model pickles its Generators (a lock: the save fails) and packed codes", HF_TESTS),
    ("M111", "swiftkern/transient.py", "(id(p), p.data_ptr(), p.dtype, tuple(p.shape))", "(id(p), p.dtype, tuple(p.shape))",
     "a kept Generator survives `param.data = other`: it reads the weights it packed before", HF_TESTS),
    # the Triton ops' registration
    ("M112", "triton_kernels/registry.py", "        if (name, key) not in _STATE.impls:\n", "        if True:\n",
     "a second import registers every Triton kernel again (torch refuses a second impl)",
     ["tests/test_triton_backend.py"]),
    ("M113", "triton_kernels/registry.py", "    key = device_type.upper()", "    key = device_type",
     "registered() finds no op for any device: every Triton path falls back to the reference",
     ["tests/test_triton_backend.py", "tests/test_triton_silu_mul.py"]),
    ("M114", "triton_kernels/registry.py", '    return ("CUDA", "CPU") if interpreting() else ("CUDA",)',
     '    return ("CUDA",)',
     "under the interpreter the Triton kernels are not registered for CPU tensors",
     ["tests/test_triton_backend.py", "tests/test_triton_silu_mul.py"]),
    # swiftkern info
    ("M115", "swiftkern/info.py", 'split = os.environ.get("SWIFTKERN_CUDA_GREEDY_SPLIT") != "0"',
     'split = os.environ.get("SWIFTKERN_CUDA_GREEDY_SPLIT") is None',
     "info says the CUDA greedy split is off for any value of SWIFTKERN_CUDA_GREEDY_SPLIT (the op turns it "
     "off only for 0)", CLI_TESTS),
    ("M116", "swiftkern/info.py",
     '    info["cuda_bi_matmul_plans"] = (f"{plan} (SWIFTKERN_BI_MATMUL_PLAN)" if plan\n',
     '    info["cuda_bi_matmul_plans"] = (f"{plan} (SWIFTKERN_BI_MATMUL_PLAN)" if not plan\n',
     "info names the forced bi_matmul plan when none is forced", CLI_TESTS),
    ("M117", "swiftkern/info.py", 'cpu = "cpu float32, bfloat16, float16" if invariant_kernels_available("cpu", torch.float32) else ""',
     'cpu = ""', "info says the CPU needs the replay where its kernels are invariant", CLI_TESTS),
    # what differs between transformers versions
    ("M118", "swiftkern/integrations/compat.py", "    return _NEUTRAL.get(name) if value is None else value",
     "    return value", "a field transformers 5 leaves None is read as None, not its neutral value", HF_TESTS),
    ("M119", "swiftkern/integrations/compat.py", "    return eos, (pad[0] if pad else None)", "    return eos, None",
     "the HF backend never sees the pad token HF prepared", HF_TESTS),
    ("M120", "swiftkern/integrations/compat.py", "            if f.f_code is target:\n", "            if False:\n",
     "the calling generate's streamer and assistant_model are never found (the streamer is ignored)", HF_TESTS),
    ("M121", "swiftkern/integrations/compat.py",
     'CACHE_KWARGS = ("past_key_values", "cache")', 'CACHE_KWARGS = ("past_key_values",)',
     "transformers 5.24's prepared cache (model kwarg `cache`) is not known: a filled one is not refused", HF_TESTS),
    ("M122", "swiftkern/integrations/compat.py", "    if transformers_version() < MIN_VERSION:\n",
     "    if transformers_version() < (4, 0):\n",
     "a transformers without a callable custom_generate (before 4.56) is not refused", HF_TESTS),
    # the projections
    ("M123", "swiftkern/ops/projections.py", "    return limit < 0 or x.numel() <= limit * x.shape[-1]",
     "    return limit < 0 or x.numel() < limit * x.shape[-1]",
     "a float32 projection of exactly SKINNY_MAX_ROWS rows goes to torch's matmul", PROJECTION_TESTS),
    ("M124", "swiftkern/ops/projections.py",
     "    return -1 if mkl_lags_here() else PACKED_MAX_ROWS", "    return -1 if mkl_lags_here() else SKINNY_MAX_ROWS",
     "packed weights are read up to 32 rows, not 64: 33-64-row passes take MKL on the float32 weights",
     PROJECTION_TESTS),
    ("M125", "swiftkern/ops/projections.py",
     "    if bias is not None and tuple(bias.shape) != (weight.shape[0],):\n        raise",
     "    if False:\n        raise", "linear takes a bias of the wrong length", PROJECTION_TESTS),
    ("M126", "swiftkern/ops/projections.py", "    if x.dim() < 1 or x.shape[-1] != packed.shape[1] * 32:\n",
     "    if x.dim() < 1 or x.shape[-1] > packed.shape[1] * 32:\n",
     "packed_linear takes x with fewer columns than the packed weight", PROJECTION_TESTS),
    ("M127", "swiftkern/ops/projections.py",
     "    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (packed.shape[0],)):\n",
     "    if bias is not None and tuple(bias.shape) != (packed.shape[0],):\n",
     "packed_linear takes a bf16 bias", PROJECTION_TESTS),
    ("M128", "swiftkern/ops/projections.py", "    return x.dtype == weight.dtype == torch.float32 and K > 0 and lo * K <= x.numel() <= hi * K",
     "    return x.dtype == weight.dtype == torch.float32 and K > 0 and lo * K <= x.numel()",
     "CUDA's float32 projections of any number of rows past 2 take the Triton skinny kernel, not cuBLAS",
     PROJECTION_TESTS),
    # the invariant ops' entry points
    ("M129", "swiftkern/ops/invariant.py", "    return top, bi_exp_sum(x - top)", "    return top, bi_exp_sum(x) * torch.exp(-top)",
     "the three-call softmax denominator scales the unshifted sum: the same value to rounding, other bits "
     "(overflow past 88)", INVARIANT_TESTS),
    ("M130", "swiftkern/ops/invariant.py",
     '    wants_triton = current_backend() == "triton" or (device == "cuda" and current_backend() == "auto")',
     '    wants_triton = device == "cuda" and current_backend() == "auto"',
     "SWIFTKERN_BACKEND=triton runs bi_exp_sum's reference, not the Triton kernel", INVARIANT_TESTS),
    ("M131", "swiftkern/ops/invariant.py", "    if a.shape[1] != b.shape[0] or a.dtype != b.dtype or a.device != b.device:\n",
     "    if a.shape[1] != b.shape[0] or a.device != b.device:\n",
     "bi_matmul takes operands of two dtypes", INVARIANT_TESTS + ["tests/test_input_contract.py"]),
    ("M132", "swiftkern/ops/invariant.py", "not 1 <= len(bs) <= 3", "not 1 <= len(bs)",
     "bi_matmul_group takes more than three weights (the Triton kernel has three slots)",
     INVARIANT_TESTS + ["tests/test_input_contract.py"]),
    ("M133", "swiftkern/ops/invariant.py", "    x = x.to(torch.float32)\n    if cpu_kernel(op, x.device.type):\n        return torch.ops.swiftkern.bi_exp(x)",
     "    if cpu_kernel(op, x.device.type):\n        return torch.ops.swiftkern.bi_exp(x)",
     "bi_exp keeps a bf16 / fp16 input's dtype", INVARIANT_TESTS + ["tests/test_cpp_ops.py"]),
    # loading GGUF files once
    ("M134", "swiftkern/gguf_once.py", "    return os.path.realpath(os.fspath(path)), mode", "    return os.path.realpath(os.fspath(path))",
     "a reader opened read-only is handed out for a read-write open of the same file",
     ["tests/test_gguf_once.py"]),
    ("M135", "swiftkern/gguf_once.py", "        _Patched.depth += 1\n        if _Patched.depth > 1:",
     "        _Patched.depth += 1\n        if _Patched.depth > 2:",
     "a nested block patches gguf again, taking the patch for the original: gguf stays patched after both close",
     ["tests/test_gguf_once.py"]),
    ("M136", "swiftkern/gguf_once.py", "        if _Patched.collecting:\n            gc.enable()", "        gc.enable()",
     "the block turns the garbage collector on even where it was off before", ["tests/test_gguf_once.py"]),
    ("M137", "swiftkern/gguf_once.py", "        _Patched.depth -= 1\n        if _Patched.depth > 0:",
     "        _Patched.depth -= 1\n        if _Patched.depth > 5:",
     "an inner block's exit restores gguf while an outer block is still open", ["tests/test_gguf_once.py"]),
    # the CUDA-graph stand-ins
    ("M138", "swiftkern/graph_capture.py", '_HOST_READS = frozenset(("item", "tolist", ', '_HOST_READS = frozenset(("item", ',
     "a graphed forward may call .tolist() (a device sync a capture refuses)", GRAPH_TESTS),
    ("M139", "swiftkern/graph_capture.py", "        if name in _HOST_DATA:\n", "        if False:\n",
     "a graphed forward may make a tensor from host data (its values baked into the graph)", GRAPH_TESTS),
    ("M140", "swiftkern/graph_capture.py", "        if self.launches is not None:\n            freed",
     "        if False:\n            freed", "a replay after memory its capture read was freed is not refused",
     GRAPH_TESTS),
    ("M141", "swiftkern/graph_capture.py", "        if body is not None:\n            self.fn = None\n", "",
     "the emulated graph keeps its capture's Python alive (a graph does not): what only it held is never freed",
     GRAPH_TESTS),
    ("M142", "swiftkern/graph_capture.py", "            if difference is not None:\n", "            if False:\n",
     "a replay that launches differently from its capture is not refused", GRAPH_TESTS),
    ("M143", "swiftkern/graph_capture.py", "        with no_host_reads(), LaunchLog(as_capture=True) as log:",
     "        with LaunchLog(as_capture=True) as log:", "the recorded capture allows host reads",
     GRAPH_TESTS),
    # the offline search
    ("M144", "swiftkern/offline_search.py", '    best = max(table, key=lambda r: r["speedup"])',
     '    best = max(table, key=lambda r: r["matchness"])',
     "the stored set is the best matching ratio's, not the fastest", ["tests/test_search.py"]),
    ("M145", "swiftkern/offline_search.py", "        share = budget_s / len(ratios)", "        share = budget_s",
     "every ratio of `auto` gets the whole budget (the search runs len(ratios) times longer)",
     ["tests/test_search.py"]),
    ("M146", "swiftkern/offline_search.py",
     '"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0',
     '"acceptance_rate": round(accepted / verifies, 4) if verifies else 0.0',
     "the stored acceptance rate is accepted tokens per verify pass", ["tests/test_search.py"]),
    ("M147", "swiftkern/offline_search.py", "    before = [c[:max(1, len(c) - 1 - min(",
     "    before = [c[:max(1, len(c) - 2 - min(",
     "the search's cache misses the position before the scored window", ["tests/test_search.py"]),
    # the command line
    ("M148", "swiftkern/cli.py", "    if value < 1:\n        raise argparse.ArgumentTypeError(f\"must be >= 1",
     "    if value < 0:\n        raise argparse.ArgumentTypeError(f\"must be >= 1", "a count of 0 passes", CLI_TESTS),
    ("M149", "swiftkern/cli.py", "    if not 0.0 < value < 1.0:", "    if not 0.0 <= value < 1.0:",
     "--skip-ratio 0 passes", CLI_TESTS),
    ("M150", "swiftkern/cli.py", "        if not ((lo < value if lo_open else lo <= value) and value <= hi):",
     "        if not (lo <= value and value <= hi):", "--top-p 0 (and --budget 0) pass", CLI_TESTS),
    ("M151", "swiftkern/cli.py", "    if args.top_k < 0:", "    if args.top_k < -1:", "--top-k -1 passes", CLI_TESTS),
    ("M152", "swiftkern/cli.py", "    if args.stream and (len(prompts) > 1 or args.json):",
     "    if args.stream and args.json:", "--stream with a prompt file of several prompts passes", CLI_TESTS),
    ("M153", "swiftkern/cli.py", "do_sample=args.temperature > 0,", "do_sample=args.temperature >= 0,",
     "the greedy default samples at temperature 1", CLI_TESTS),
    ("M154", "swiftkern/cli.py", "pack_weights=False if args.no_packed_weights else None",
     "pack_weights=None", "--no-packed-weights is ignored", CLI_TESTS),
    ("M155", "swiftkern/cli.py", "save=not args.no_save,", "save=True,", "search --no-save stores the set", CLI_TESTS),
    ("M156", "swiftkern/cli.py", "        stats = dict(out.stats, **out.request_stats[i])",
     "        stats = dict(out.stats)", "--json drops each prompt's own stats", CLI_TESTS),
    ("M157", "swiftkern/cli.py", "        if not p.strip():\n", "        if not p:\n",
     "a prompt of spaces passes", CLI_TESTS),
    ("M158", "swiftkern/cli.py",
     '    if args.mode == "self-spec" and args.drafter in ("auto", "layer-skip") and args.layer_set is None:\n'
     '        args.layer_set = "auto"\n', "",
     "self-spec from the command line drafts with no layer set (the search never runs)", CLI_TESTS),
    ("M159", "swiftkern/cli.py", '        print(f"swiftkern: error: {e}", file=sys.stderr)\n        return 2',
     '        print(f"swiftkern: error: {e}", file=sys.stderr)\n        return 1',
     "bad input exits with status 1, not argparse's 2", CLI_TESTS),
]


if __name__ == "__main__":  # every snippet must occur exactly once in its file
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for mid, path, old, *_ in SUPPORT_MUTANTS:
        with open(os.path.join(root, path)) as f:
            print(mid, path, f.read().count(old))
