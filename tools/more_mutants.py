"""More planted bugs in the Python source, for tools/mutation_sweep.py: the CUDA-graph runner's keys and
writes, layer-set parsing, packed-weight refresh, the runner's forward bookkeeping, the invariant ops and
RoPE table, the portable verifier, the deterministic fast path and invariant_token_logprobs, and the
default model's loading (the GGUF dequantizers, the fast reader's strings, the packing twin's exactness)."""

# (id, file, snippet, replacement, the bug it plants, the tests that should catch it)
MORE_MUTANTS = [
    ("M40", "swiftkern/cuda_graphs.py",
     'key = ("forward", B, T, tuple(skip_attn), tuple(skip_mlp), span,',
     'key = ("forward", B, T, tuple(skip_attn), tuple(skip_mlp),',
     "a graphed forward's key leaves out the attention span: rows that grow past 64 keys replay a graph "
     "captured for fewer keys",
     ["tests/test_cuda_graphs.py"]),
    ("M41", "swiftkern/cuda_graphs.py",
     "out = self.run(key, body, inputs, restore=(cache.lengths,))",
     "out = self.run(key, body, inputs, restore=())",
     "a capture's warm-up run leaves the cache's device lengths advanced: the capturing step appends "
     "its tokens T positions late",
     ["tests/test_cuda_graphs.py"]),
    ("M42", "swiftkern/cuda_graphs.py",
     "            cache.reset(batch)\n            return cache",
     "            return cache",
     "the runner hands its kept cache to a new call without emptying it: the prompt lands after the "
     "previous call's tokens",
     ["tests/test_cuda_graphs.py"]),
    ("M43", "swiftkern/layer_set.py",
     "out.update(range(start, stop + 1))",
     "out.update(range(start, stop))",
     "a range like attn:3-5 leaves out its last layer",
     ["tests/test_layer_set.py"]),
    ("M44", "swiftkern/packed_weights.py",
     "if _version(w) != self._versions[j]:",
     "if _version(w) != self._versions[j] and self._packed[i] is None:",
     "a packed weight changed in place (or given new storage) keeps its stale codes: only a weight that "
     "did not pack before is packed again",
     ["tests/test_packed_weights.py"]),
    ("M45", "swiftkern/model.py",
     "            pending = None if pending is None else pending.gather(1, idx)",
     "            pending = None",
     "with logits_positions (every prefill) the last kept sub-layer's output is never added before the "
     "final norm",
     ["tests/test_model.py", "tests/test_generate.py"]),
    ("M46", "swiftkern/model.py",
     "packed = self.packed_head if head is None else packed",
     "packed = self.packed_head",
     "a pruned draft head on packed weights is scored with the full LM head's packed rows",
     ["tests/test_packed_weights.py"]),
    ("M47", "swiftkern/model.py",
     "uniform_start = starts[0] if min(starts) == max(starts) else None",
     "uniform_start = starts[0]",
     "rows of unequal lengths are taken as all starting at row 0's length (the reference backend writes "
     "their keys there and drops the decode step's mask)",
     ["tests/test_cuda_graphs.py"]),
    ("M48", "swiftkern/batch_invariant.py",
     "torch.arange(T, device=q.device)).repeat(1, group)",
     "torch.arange(T, device=q.device)).repeat_interleave(group, dim=1)",
     "bi_attention lays the folded GQA queries' positions out head-major instead of token-major: with "
     "2+ query heads per kv head and 2+ tokens, queries see the wrong causal limit",
     ["tests/test_deterministic.py"]),
    ("M49", "swiftkern/verifier_kernels.py",
     "    return bi_rms_norm(new_residual, weight, eps), new_residual",
     "    return bi_rms_norm(new_residual, weight, eps), residual",
     "the portable verifier's add + norm drops the sub-layer's output from the residual stream",
     ["tests/test_deterministic.py", "tests/test_arrivals.py"]),
    ("M50", "swiftkern/rope_table.py",
     "positions = torch.arange(have, have + BLOCK, device=self.device).unsqueeze(0)",
     "positions = torch.arange(0, BLOCK, device=self.device).unsqueeze(0)",
     "the invariant set's RoPE table fills every block past the first with positions 0..1023 again: "
     "positions >= 1024 get the wrong rotation",
     ["tests/test_rope_table.py", "tests/test_cuda_graphs.py", "tests/test_generate.py",
      "tests/test_deterministic.py"]),
    ("M51", "swiftkern/fast_path.py",
     "positions = [n + 1 for n in cache.host_lengths]  # position of the token chosen now",
     "positions = [n for n in cache.host_lengths]  # position of the token chosen now",
     "the deterministic fast path's sampled draws are keyed one position early (what a request that "
     "skips verification keeps)",
     ["tests/test_keyed_draws.py", "tests/test_deterministic.py", "tests/test_feature_mix.py",
      "tests/test_streaming.py"]),
    ("M52", "swiftkern/deterministic.py",
     "return bi_token_logprob(logits[prompt_len - 1:-1], targets)",
     "return bi_token_logprob(logits[prompt_len:], targets)",
     "invariant_token_logprobs scores each token with the logits after it (off by one: the same count)",
     ["tests/test_deterministic.py", "tests/test_self_spec.py"]),
    # the loading of the default model: what the model's weights and vocabulary are
    ("M53", "swiftkern/gguf_dequant.py", "q = torch.cat([qs & 0x0F, qs >> 4], 1).float()",
     "q = torch.cat([qs >> 4, qs & 0x0F], 1).float()",
     "the Q4_1 dequantizer puts a block's high nibbles first (inputs 0-15 and 16-31 swapped)",
     ["tests/test_gguf_dequant.py"]),
    ("M54", "swiftkern/gguf_dequant.py", "q = blocks[:, 2:].contiguous().view(torch.int8).float()",
     "q = blocks[:, 2:].contiguous().float()",
     "the Q8_0 dequantizer reads its codes unsigned (a negative code becomes code + 256)",
     ["tests/test_gguf_dequant.py"]),
    ("M55", "swiftkern/gguf_reader_fast.py", "parts.append(data[offs + 8:offs + 8 + length])",
     "parts.append(data[offs + 8:offs + 7 + length])",
     "the fast GGUF reader drops the last byte of every string of an array (the vocabulary's tokens)",
     ["tests/test_gguf_once.py"]),
    ("M56", "swiftkern/packed_weights.py",
     "exact = ((s * c + offset).view(torch.int32) == blocks.view(torch.int32)).all(-1, keepdim=True)",
     "exact = ((s * c + offset).view(torch.int32) == blocks.view(torch.int32)).any(-1, keepdim=True)",
     "the torch twin of pack_codes takes a block where any one weight comes back, not every one",
     ["tests/test_pack_codes.py", "tests/test_packed_weights.py"]),
]


if __name__ == "__main__":  # every snippet must occur exactly once in its file
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for mid, path, old, *_ in MORE_MUTANTS:
        with open(os.path.join(root, path)) as f:
            print(mid, path, f.read().count(old))
