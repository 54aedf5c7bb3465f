"""Planted bugs in the ops' plain PyTorch twins (swiftkern/reference.py), for tools/mutation_sweep.py.

The twins are the definitions every kernel is tested against and the runner's CPU path where no kernel
is built, so a bug in one must show somewhere other than in a kernel-against-twin comparison that would
blame the kernel: in a closed form, HF transformers' own modules or output, a distribution, or the
kernels' bits where a twin fixes an order (M190 on)."""

NORM_TESTS = ["tests/test_reference_ops.py", "tests/test_cpp_ops.py", "tests/test_triton_norms.py",
              "tests/test_layer_kernels.py"]
ROPE_TESTS = ["tests/test_reference_ops.py", "tests/test_cpp_ops.py", "tests/test_verifier_model_shapes.py"]
ATTENTION_TESTS = ["tests/test_reference_ops.py", "tests/test_triton_verify_attention.py", "tests/test_deterministic.py"]
GREEDY_TESTS = ["tests/test_greedy_accept.py", "tests/test_cpp_ops.py", "tests/test_triton_acceptance.py"]
SAMPLE_TESTS = ["tests/test_rejection_sample.py", "tests/test_cpp_ops.py", "tests/test_triton_acceptance.py"]
LINEAR_TESTS = ["tests/test_skinny_linear.py", "tests/test_packed_weights.py", "tests/test_layer_kernels.py"]
INVARIANT_TESTS = ["tests/test_bi_matmul.py", "tests/test_cpp_ops.py", "tests/test_triton_bi_exp_sum.py",
                   "tests/test_bi_matmul_swiglu.py"]

R = "swiftkern/reference.py"

# (id, file, snippet, replacement, the bug it plants, the tests that should catch it)
REFERENCE_MUTANTS = [
    # norms
    ("M190", R, "torch.rsqrt(variance + eps)", "torch.rsqrt(variance)", "rms_norm drops eps", NORM_TESTS),
    ("M191", R, "    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)",
     "    return (weight * (x32 * torch.rsqrt(variance + eps))).to(x.dtype)",
     "rms_norm scales by the weight in float32, not in the input dtype as HF (differs in bf16 / fp16 only)",
     NORM_TESTS),
    ("M192", R, "    return rms_norm(new_residual, weight, eps), new_residual",
     "    return rms_norm(new_residual, weight, eps), residual",
     "fused_add_rms_norm hands back the residual before the add", NORM_TESTS),
    # projections and the activation
    ("M193", R, "    return torch.nn.functional.linear(x, weight, bias)", "    return torch.nn.functional.linear(x, weight)",
     "skinny_linear drops the bias (Qwen2's q, k, v)", LINEAR_TESTS),
    ("M194", R, "torch.nn.functional.linear(x, unpack(packed), bias)", "torch.nn.functional.linear(x, unpack(packed))",
     "packed_linear drops the bias", LINEAR_TESTS),
    ("M195", R, "torch.nn.functional.silu(gate) * up", "torch.nn.functional.silu(up) * gate",
     "silu_mul gates the wrong input", ["tests/test_reference_ops.py", "tests/test_cpp_ops.py",
                                         "tests/test_triton_silu_mul.py"]),
    # rotary embedding and the cache write
    ("M196", R, "torch.cat((-x[..., half:], x[..., :half]), dim=-1)", "torch.cat((x[..., half:], -x[..., :half]), dim=-1)",
     "rotate_half turns the other way (the rotary embedding by minus the angle)", ROPE_TESTS),
    ("M197", R, "        k_cache[:, :, uniform_start:uniform_start + T] = k_rot",
     "        k_cache[:, :, uniform_start:uniform_start + T] = k",
     "the slice write of rope_kv_append stores the key unrotated", ROPE_TESTS + ["tests/test_generate.py"]),
    ("M198", R, "    k_cache[rows, :, positions] = k_rot.transpose(1, 2).to(k_cache.dtype)",
     "    k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)",
     "the per-row write of rope_kv_append stores the key unrotated", ROPE_TESTS),
    ("M199", R, "            kept = cache[:, b].index_select(2, src)  # [L, H, n, D], a copy",
     "            kept = cache[:, b, :, int(src[0]):int(src[0]) + n].clone()",
     "kv_compact takes a row's kept entries as one run from the first (sources assumed contiguous)",
     ["tests/test_reference_ops.py", "tests/test_cpp_ops.py", "tests/test_triton_kv_compact.py"]),
    # attention
    ("M200", R, "torch.arange(1, num_new + 1, device=cache_lens.device)",
     "torch.arange(0, num_new, device=cache_lens.device)",
     "attention_mask hides each new token from its own key", ATTENTION_TESTS),
    ("M201", R, "    return bias.unsqueeze(1).repeat(1, 1, group, 1)",
     "    return bias.unsqueeze(1).repeat_interleave(group, dim=2)",
     "the grouped bias lays the query heads of a kv head out token-major (the mask of another token)",
     ATTENTION_TESTS),
    ("M202", R, "attn_mask=attn_mask, scale=scale", "attn_mask=attn_mask",
     "verify_attention ignores the caller's scale (SDPA's 1 / sqrt(D))", ATTENTION_TESTS),
    ("M203", R, "    if mask is not False:\n", "    if mask is not False and T > 1:\n",
     "a decode step of a batch sees the keys past a short row's length", ATTENTION_TESTS),
    # acceptance
    ("M204", R, "num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)",
     "num_accepted = match.to(torch.int64).sum(dim=1)",
     "greedy_accept counts matches past the first mismatch", GREEDY_TESTS),
    ("M205", R, "    match = (draft_tokens == target[:, :K]) & in_draft\n",
     "    match = draft_tokens == target[:, :K]\n",
     "greedy_accept reads drafts past num_draft", GREEDY_TESTS),
    ("M206", R, "(u * cdf[-1]).unsqueeze(0), right=True))", "(u * cdf[-1]).unsqueeze(0), right=False))",
     "the inverse-CDF draw can pick a token of weight 0 (the first i with cumsum >= u * sum)", SAMPLE_TESTS),
    ("M207", R, "            if not float(u_accept[b, j]) * q < p:",
     "            if not float(u_accept[b, j]) < p:",
     "rejection_sample accepts a draft with probability p, not min(1, p / q)", SAMPLE_TESTS),
    ("M208", R, "            residual = (p_row - q_row).clamp_min(0.0)",
     "            residual = p_row.clamp_min(0.0)",
     "rejection_sample draws a rejected step's token from p, not from max(0, p - q)", SAMPLE_TESTS),
    ("M209", R, "        out[b, j] = _inverse_cdf(weights, float(u_sample[b, j]))",
     "        out[b, j] = _inverse_cdf(weights, float(u_sample[b, 0]))",
     "rejection_sample draws every row's token with the first step's uniform", SAMPLE_TESTS),
    # the batch-invariant ops' fixed orders
    ("M210", R, "            acc = acc[..., :width] + acc[..., width:2 * width]",
     "            acc = acc[..., 0:2 * width:2] + acc[..., 1:2 * width:2]",
     "bi_matmul sums its lanes in neighbouring pairs, not by halving (another order than the kernels')",
     INVARIANT_TESTS),
    ("M211", R, "    return bi_matmul(silu_mul(gate, up), b)", "    return bi_matmul(silu_mul(up, gate), b)",
     "bi_matmul_swiglu gates the wrong input", INVARIANT_TESTS),
    ("M212", R, "    r = torch.sub(torch.sub(x, torch.mul(n, _LN2_HI)), torch.mul(n, _LN2_LO))",
     "    r = torch.sub(x, torch.mul(n, _LN2_HI + _LN2_LO))",
     "bi_exp reduces by ln 2 in one product (n ln 2 rounded: a few ulps off the kernels' bits)", INVARIANT_TESTS),
    ("M213", R, "    return torch.mul(p, scale).masked_fill(tiny, 0.0)", "    return torch.mul(p, scale)",
     "bi_exp gives exp(-87), not 0, below -87 and for -inf", INVARIANT_TESTS),
    ("M214", R, "    for j in range(1, x.shape[-1]):", "    for j in range(1, x.shape[-1] - 1):",
     "tree_sum drops the last of the odd columns left after halving", INVARIANT_TESTS),
    ("M215", R, "    if n % 64:\n        x = torch.nn.functional.pad(x, (0, 64 - n % 64))",
     "    if n % 32:\n        x = torch.nn.functional.pad(x, (0, 32 - n % 32))",
     "tree_sum pads to a multiple of 32, not 64 (another order than the kernels' for some lengths)",
     INVARIANT_TESTS),
    ("M216", R, "    return top, bi_exp_sum(x - top)", "    return top, bi_exp_sum(x)",
     "bi_max_exp_sum's denominator is not shifted by the row's maximum", INVARIANT_TESTS),
    # top-p
    ("M217", R, "    exact = (first_kept == cut) & ((cut == 0) | (largest_removed < smallest_kept))",
     "    exact = (first_kept == cut) & ((cut == 0) | (largest_removed <= smallest_kept))",
     "top_p_cut claims a cut that splits a tie", ["tests/test_top_p.py"]),
    ("M218", R, "    removed[..., -1] = False\n", "",
     "top_p_cut may remove the last (largest) token too", ["tests/test_top_p.py"]),
]

