"""The deterministic verifier's fused set at a real model's shapes (SmolLM2's: hidden 576, 9
query and 3 kv heads of 64, MLP 1536), random weights: its logprobs equal HF's, and a
deterministic generation with it (window 32, verify batch 4, the replay forced) gives plain
``ar``'s tokens with nothing rolled back, eagerly and through CUDA graphs, over three calls
(on an H100 the fused set rolled back 94-97 % of the tokens in ``--routine determinism
--cuda-graphs``: its graphs read a table freed with the Verifier of the call that captured
them; these shapes passed there on a single call). Without a GPU the Triton kernels run in the interpreter in an H100's
launch plans (slow: one small case)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel, reference
from swiftkern.triton_kernels.launch import gpu_launch_plans
from swiftkern.triton_kernels.verify_attention import verify_attention_invariant
from swiftkern.verifier import Verifier
from triton_cases import DEVICE, H100_SMS, NATIVE, backend  # noqa: F401

SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      rope_theta=100000.0, vocab_size=1000)


def _plans():
    return contextlib.nullcontext() if NATIVE else gpu_launch_plans(H100_SMS)


@pytest.fixture(scope="module")
def smol_shaped():
    return SkipModel(tiny_model("llama", num_hidden_layers=2 if NATIVE else 1, seed=5, **SMOLLM2_SHAPES).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,q_len,keys", [(4, 32, 256), (1, 8, 64)] if NATIVE else [(1, 8, 64)])
def test_invariant_attention_at_smollm2_head_shapes(rows, q_len, keys, dtype):
    """verify_attention_invariant against the reference at head dim 64, 9 / 3 heads, rows of
    unequal lengths (the verifier's gathered keys: [R, Hkv, S, D], S a multiple of 64)."""
    g = torch.Generator().manual_seed(rows * 1000 + q_len)
    q = torch.randn(rows, 9, q_len, 64, generator=g).to(DEVICE, dtype)
    k = torch.randn(rows, 3, keys, 64, generator=g).to(DEVICE, dtype)
    v = torch.randn(rows, 3, keys, 64, generator=g).to(DEVICE, dtype)
    ends = torch.randint(q_len, keys + 1, (rows,), generator=g).to(DEVICE)
    with backend("triton"), _plans():
        got = verify_attention_invariant(q, k, v, ends, 0.125)
    want = reference.verify_attention(q.float(), k.float(), v.float(), ends, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_fused_verifier_logprobs_equal_hf_at_smollm2_shapes(smol_shaped):
    prompt = [(7 * i + 3) % 1000 for i in range(70)]
    out = [5, 6, 7, 8, 9, 10]
    with backend("triton"), _plans():
        got = Verifier(smol_shaped, window=8, verify_batch=2, kernels="fused").token_logprobs(prompt + out, len(prompt))
    with torch.no_grad():
        ids = torch.tensor([prompt + out], device=DEVICE)
        logits = smol_shaped.hf_model(ids).logits[0, len(prompt) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-3, rtol=0)


@pytest.mark.skipif(not NATIVE, reason="a generation at these shapes takes minutes in the interpreter; "
                    "CUDA graphs need a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kernels", ["portable", "fused"])
def test_deterministic_generation_at_smollm2_shapes_equals_ar(smol_shaped, kernels, graphs):
    prompts = [[(11 * i + r) % 1000 for i in range(n)] for r, n in enumerate((40, 70, 9, 100))]
    kw = dict(max_new_tokens=40, eos_token_id=[])
    want = Generator(smol_shaped, mode="ar").generate(prompts, **kw).tokens
    gen = Generator(smol_shaped, mode="deterministic", window=32, verify_batch=4, replay="always",
                    verifier_kernels=kernels, cuda_graphs=graphs)
    for call in range(3):  # with graphs: eager, capture, replay (a graph outlives the call that captured it)
        out = gen.generate(prompts, **kw)
        assert out.stats["rolled_back"] == 0, (call, out.stats)
        assert out.tokens == want, call


def test_fused_ops_at_smollm2_shapes_equal_the_reference():
    """The fused set's norms, SwiGLU and RoPE (as the verifier calls them: q, k, v transposed
    views of the projections) at a verify pass of 4 x 32 tokens, float32."""
    from swiftkern.verifier_kernels import verifier_kernels

    g = torch.Generator().manual_seed(1)
    R, T, H, I, D = 4, 32, 576, 1536, 64
    rand = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    x, res, w = rand(R, T, H), rand(R, T, H), rand(H)
    gate, up = rand(R, T, I), rand(R, T, I)
    q = rand(R, T, 9, D).transpose(1, 2)  # [R, Hq, T, D] views, as the verifier makes them
    k, v = rand(R, T, 3, D).transpose(1, 2), rand(R, T, 3, D).transpose(1, 2)
    angles = rand(R, T, D)
    cos, sin = angles.cos(), angles.sin()
    with backend("triton"), _plans():
        kern = verifier_kernels("fused", DEVICE, torch.float32)
        got_norm = kern.rms_norm(x, w, 1e-5)
        got_add = kern.add_rms_norm(x, res, w, 1e-5)
        got_act = kern.silu_mul(gate, up)
        got_q, got_k, got_v = kern.rope(q, k, v, cos, sin)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_norm, reference.rms_norm(x, w, 1e-5), **tol)
    want_add = reference.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got_add[0], want_add[0], **tol)
    torch.testing.assert_close(got_add[1], want_add[1], **tol)
    torch.testing.assert_close(got_act, reference.silu_mul(gate, up), **tol)
    torch.testing.assert_close(got_q, reference.apply_rope(q, cos, sin), **tol)
    torch.testing.assert_close(got_k, reference.apply_rope(k, cos, sin), **tol)
    torch.testing.assert_close(got_v, v, **tol)
