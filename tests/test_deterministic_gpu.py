"""Deterministic mode on a GPU (skipped without one): the needle check with the model on CUDA,
where the fast path runs the GPU kernels (batch-variant allowed) and the verifier runs the
Triton ``bi_matmul`` and the batch-invariant ops; and the negative control, plain batched
``ar`` on the GPU, whose logprobs change with the batch around a request."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel, ops
from swiftkern.verifier import Verifier
from test_deterministic import _ar_logprobs, _needle_trials, _random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_gpu():
    return SkipModel(tiny_model("llama").cuda())


def test_bi_matmul_runs_the_triton_kernel_on_cuda():
    assert ops.backend_for("bi_matmul", "cuda") == "triton"


@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny_on_gpu(tiny_gpu, sample):
    rng = random.Random(17 + sample)
    gen = Generator(tiny_gpu, mode="deterministic", window=8, verify_batch=4)
    kw = dict(max_new_tokens=24, eos_token_id=[], do_sample=sample, temperature=1.3, seed=11)
    alone = _needle_trials(gen, [17, 250, 9, 3, 44, 61], rng, trials=5, max_batch=16, **kw)
    assert len(alone.tokens[0]) == 24 and alone.logprobs[0].device.type in ("cpu", "cuda")


def test_decode_equals_prefill_on_gpu(tiny_gpu):
    prompts = [[4, 77, 31], list(range(10, 60)), [200]]
    out = Generator(tiny_gpu, mode="deterministic", window=8, verify_batch=2).generate(
        prompts, max_new_tokens=20, eos_token_id=[])
    verifier = Verifier(tiny_gpu, window=8, verify_batch=2)
    for p, toks, lp in zip(prompts, out.tokens, out.logprobs):
        assert torch.equal(verifier.token_logprobs(p + toks, len(p)).cpu(), lp.cpu())


def test_negative_control_plain_batched_ar_on_gpu_is_batch_variant():
    """Plain batched ar on the GPU: the needle's logprobs differ somewhere across batch sizes
    (the GEMMs' kernel and reduction order change with M; attention runs over the padded
    batch). A wider model than the tiny one, so that the library has room to choose."""
    model = SkipModel(tiny_model("llama", hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                                 num_key_value_heads=4, vocab_size=2048).cuda())
    rng = random.Random(0)
    needle = [5, 6, 7, 8, 9]
    alone = _ar_logprobs(model, [needle], 0, 12)
    differ = 0
    for _ in range(6):
        B = rng.randint(2, 48)
        idx = rng.randrange(B)
        prompts = _random_prompts(rng, B, 2048)
        prompts[idx] = needle
        differ += not torch.equal(_ar_logprobs(model, prompts, idx, 12), alone)
    assert differ > 0


@pytest.mark.slow
def test_needle_smollm2_on_gpu():
    import swiftkern

    model, tok = swiftkern.load_model("smollm2", device="cuda")
    gen = Generator(model, tok, mode="deterministic", window=16, verify_batch=4)
    needle = tok("The three primary colors are")["input_ids"]
    rng = random.Random(5)
    others = ["def fib(n):", "Paris is", "Once upon a time, in a small village", "1, 2, 3,",
              "The weather today", "import numpy as np", "Dear John,", "What is 2 + 2?"]
    for sample in (False, True):
        kw = dict(max_new_tokens=24, eos_token_id=[], do_sample=sample, temperature=0.9, seed=3)
        alone = gen.generate([needle], **kw)
        for B in (rng.randint(2, 6), rng.randint(7, 16)):
            prompts = [tok(rng.choice(others))["input_ids"] for _ in range(B)]
            idx = rng.randrange(B)
            prompts[idx] = needle
            out = gen.generate(prompts, **kw)
            assert out.tokens[idx] == alone.tokens[0], (sample, B, idx)
            assert torch.equal(out.logprobs[idx], alone.logprobs[0]), (sample, B, idx)
