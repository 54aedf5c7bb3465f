"""Deterministic mode on a GPU (skipped without one): the needle check with the model on CUDA
(with the replay, and without it: replay never, every step on the Triton invariant set),
where the fast path runs the GPU kernels (batch-variant allowed) and the verifier runs the
Triton ``bi_matmul`` and either verifier kernel set (portable: the batch-invariant torch
ops; fused: the Triton norms, SwiGLU and ``verify_attention_invariant``, which ``auto`` takes
on CUDA once these pass there); and the negative control, plain batched ``ar`` on the GPU,
whose logprobs change with the batch around a request."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel, ops
from swiftkern.verifier import Verifier
from test_deterministic import ar_needle_differences, needle_tiny, smollm2_needle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_gpu():
    return SkipModel(tiny_model("llama").cuda())


def test_bi_matmul_runs_the_triton_kernel_on_cuda():
    assert ops.backend_for("bi_matmul", "cuda") == "triton"


KERNEL_SETS = ["portable", "fused"]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny_on_gpu(tiny_gpu, sample, kernels):
    needle_tiny(tiny_gpu, sample, seed=17, trials=5, verifier_kernels=kernels)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_decode_equals_prefill_on_gpu(tiny_gpu, kernels):
    prompts = [[4, 77, 31], list(range(10, 60)), [200]]
    out = Generator(tiny_gpu, mode="deterministic", window=8, verify_batch=2, verifier_kernels=kernels,
                    replay="always").generate(prompts, max_new_tokens=20, eos_token_id=[])
    assert out.stats["verifier_kernels"] == {"portable": "portable", "fused": "fused (triton)"}[kernels]
    verifier = Verifier(tiny_gpu, window=8, verify_batch=2, kernels=kernels)
    for p, toks, lp in zip(prompts, out.tokens, out.logprobs):
        assert torch.equal(verifier.token_logprobs(p + toks, len(p)).cpu(), lp.cpu())


def test_negative_control_plain_batched_ar_on_gpu_is_batch_variant():
    """Plain batched ar on the GPU: the needle's logprobs differ somewhere across batch sizes
    (the GEMMs' kernel and reduction order change with M; attention runs over the padded
    batch). A wider model than the tiny one, so that the library has room to choose."""
    model = SkipModel(tiny_model("llama", hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                                 num_key_value_heads=4, vocab_size=2048).cuda())
    assert ar_needle_differences(model, trials=6, max_batch=48, vocab=2048) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_needle_smollm2_on_gpu(kernels):
    import swiftkern

    model, tok = swiftkern.load_model("smollm2", device="cuda")
    smollm2_needle(model, tok, 24, [(2, 6), (7, 16)], verifier_kernels=kernels)


@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny_on_gpu_without_replay(tiny_gpu, sample):
    """replay never: every step on the Triton invariant set (bi_matmul for cuBLAS), no replay;
    the needle keeps its bits in batches of 1-16 and alone gives ar's tokens and HF's logprobs."""
    needle_tiny(tiny_gpu, sample, seed=19, trials=5, replay="never")


@pytest.mark.slow
def test_smollm2_needle_without_replay_on_gpu():
    import swiftkern

    model, tok = swiftkern.load_model("smollm2", device="cuda")
    smollm2_needle(model, tok, 24, [(2, 6), (7, 16)], replay="never")


def test_auto_decodes_through_the_invariant_set_on_cuda(tiny_gpu):
    """replay auto on CUDA: every step through the Triton invariant set, no replay (measured the
    cheaper way there), with the bits of replay never; the self-spec drafter keeps the replay."""
    prompts = [[4, 77, 31], list(range(10, 40)), [200]]
    auto = Generator(tiny_gpu, mode="deterministic", window=8, verify_batch=2)
    assert auto.replay_elided()
    out = auto.generate(prompts, max_new_tokens=12, eos_token_id=[])
    never = Generator(tiny_gpu, mode="deterministic", window=8, verify_batch=2, replay="never").generate(
        prompts, max_new_tokens=12, eos_token_id=[])
    assert out.stats["verify_passes"] == 0 and out.tokens == never.tokens
    assert all(torch.equal(a, b) for a, b in zip(out.logprobs, never.logprobs))
    spec = Generator(tiny_gpu, mode="deterministic", drafter="self-spec", layer_set="attn:1", window=8)
    assert not spec.replay_elided()
