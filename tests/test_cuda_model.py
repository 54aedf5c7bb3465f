"""The model runner with the CUDA kernels in the loop, without a GPU: the CUDA ops
(greedy_accept, rejection_sample, fused_add_rms_norm, rope_kv_append, kv_compact), compiled by
tests/cuda_emu and run by its CPU emulation of CUDA, take the place of the C++ CPU kernels of
torch.ops.swiftkern for the test's duration, so the runner calls them with the tensors it builds
(its views, strides and caches). Tiny random models: logits against the C++ CPU kernels, greedy
tokens of ar and self-spec against HF generate. (On a GPU the same runner runs the real kernels:
tests/test_deterministic_gpu.py, tests/test_cuda_graphs.py.)
"""

import collections
import contextlib
import warnings

import pytest
import torch

from conftest import tiny_model
from cuda_emu.build import emulated_cuda_ops
from swiftkern import Generator, LayerSet, SkipModel, layer_kernels, ops
from test_triton_model import hf_greedy_on, run_steps

CUDA_OPS = ("greedy_accept", "rejection_sample", "fused_add_rms_norm", "rope_kv_append", "kv_compact")


@contextlib.contextmanager
def cuda_kernels_emulated():
    """torch.ops.swiftkern.<op> on CPU tensors runs the emulated CUDA kernel of each CUDA_OPS op
    (a second CPU registration, removed on exit) -> {op: calls}. The C++ decoder stack, which
    calls the CPU kernels directly, is off meanwhile."""
    if ops.registry.extension is None:
        pytest.skip(f"swiftkern._C is {ops.registry.EXTENSION_STATUS}: "
                    "torch.ops.swiftkern has no CPU kernels to replace")
    emulated = emulated_cuda_ops()
    calls = collections.Counter()

    def counted(op):
        fn = getattr(emulated, op)

        def run(*args):
            calls[op] += 1
            return fn(*args)
        return run

    library = torch.library.Library("swiftkern", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel overrides the C++ one: it is meant to
        warnings.simplefilter("ignore")
        for op in CUDA_OPS:
            library.impl(op, counted(op), "CPU")
    stack_for = layer_kernels._stack_for
    layer_kernels._stack_for = lambda invariant: None
    layer_kernels._CACHE.clear()
    try:
        yield calls
    finally:
        library._destroy()
        layer_kernels._stack_for = stack_for
        layer_kernels._CACHE.clear()


def test_the_emulated_kernels_replace_the_cpu_ones_only_meanwhile():
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    want = torch.ops.swiftkern.fused_add_rms_norm(x, x, w, 1e-5)
    with cuda_kernels_emulated() as calls:
        got = torch.ops.swiftkern.fused_add_rms_norm(x, x, w, 1e-5)
    again = torch.ops.swiftkern.fused_add_rms_norm(x, x, w, 1e-5)
    assert calls["fused_add_rms_norm"] == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(again, want))


@pytest.mark.parametrize("layer_set", [None, "attn:1|mlp:1,2"])
def test_forward_matches_the_cpu_kernels(layer_set):
    """Prefill of rows of different lengths, a verify chunk and a decode step (skipped
    sub-layers folded into the fused norm's residual add): logits and the cache of record."""
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=4))
    ls = LayerSet.parse(layer_set, 4) if layer_set else None
    want, want_cache = run_steps(model, ls)
    with cuda_kernels_emulated() as calls:
        got, got_cache = run_steps(model, ls)
    assert calls["fused_add_rms_norm"] > 0 and calls["rope_kv_append"] > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    for b, n in enumerate(want_cache.host_lengths):
        torch.testing.assert_close(got_cache.k[:, b, :, :n], want_cache.k[:, b, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_cache.v[:, b, :, :n], want_cache.v[:, b, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ar_and_self_spec_greedy_match_hf(arch):
    hf = tiny_model(arch, num_hidden_layers=4)
    prompt = [5, 17, 99, 3, 250, 7]
    want = hf_greedy_on(hf, prompt, 12)
    with cuda_kernels_emulated() as calls:
        ar = Generator(hf).generate([prompt], max_new_tokens=12).tokens[0]
        spec = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:1", k_max=3,
                         eps=0.0).generate([prompt], max_new_tokens=12)
    assert ar == want
    assert spec.tokens[0] == want and spec.stats["verify_steps"] > 0
    assert all(calls[op] > 0 for op in ("greedy_accept", "fused_add_rms_norm", "rope_kv_append")), calls


def test_sampled_self_spec_matches_the_cpu_kernels():
    """Rejection sampling in the loop: the CUDA rejection_sample reproduces the CPU kernel's
    float64 chain, so with the same seed the tokens are those of the C++ kernels' run."""
    hf = tiny_model("llama", num_hidden_layers=4)
    prompts = [[5, 17, 99, 3, 250, 7], [9, 8, 7]]

    def sample():
        return Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:1", k_max=3,
                         eps=0.0).generate(prompts, max_new_tokens=16, do_sample=True, temperature=0.8, seed=11)
    want = sample()
    with cuda_kernels_emulated() as calls:
        got = sample()
    assert calls["rejection_sample"] > 0
    assert got.tokens == want.tokens and got.stats["verify_steps"] > 0
