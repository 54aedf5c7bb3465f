"""The deterministic verifier with its fused set on the Triton kernels (``SWIFTKERN_BACKEND=triton``:
the interpreter on CPU, natively on a GPU): a slot's logits are the same bits alone and beside
other slots, in float32 and bfloat16 (and not with a launch plan that follows the pass's key
length: the negative control), and the loop's logprobs equal scoring prompt + output from
scratch (decode = prefill), as with the portable set; and close to the portable set's logits.
Without a GPU the first and the last also run in an H100's launch plans (``plans``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.triton_kernels.verify_attention import verify_attention as launch
from swiftkern.verifier import Slot, Verifier
from swiftkern.verifier_kernels import attention_from_cache_lens
from triton_cases import DEVICE, backend, plans  # noqa: F401 (plans: a fixture)


def _tiny(dtype):
    """Two layers: the interpreter takes ~0.16 s a launch."""
    return SkipModel(tiny_model("llama", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                hidden_size=96, seed=3).to(DEVICE, dtype))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    return _tiny(request.param)


@pytest.fixture(scope="module")
def tiny_fp32():
    """float32 only: in bfloat16 this tiny model's logits round the negative control's
    differences away (and one dtype suffices for decode = prefill under the interpreter)."""
    return _tiny(torch.float32)


# the cache rows' lengths before the pass (random keys and values): the slot beside row 2's
# makes the pass's key length longer than the slot's alone (so a plan that followed the key
# length would change its bits)
LENGTHS = [37, 70, 130]


def _history(model):
    cache = model.new_cache(3, 160)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))  # in the cache's dtype
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.set_lengths(LENGTHS)
    return cache


def _slot_logits(verifier, model, slots, row):
    cache = _history(model)
    logits = verifier.forward(cache, slots)
    n = sum(len(s.want) for s in slots[:row])
    return logits[n:n + len(slots[row].want)]


def test_a_slot_has_the_same_bits_alone_and_beside_others(tiny, plans):
    with backend("triton"):
        verifier = Verifier(tiny, window=8, verify_batch=3, kernels="fused")
        assert verifier.kernels.name == "fused (triton)"
        mine = Slot(1, 70, [5, 9, 33, 7, 81, 120], list(range(6)))
        alone = _slot_logits(verifier, tiny, [mine], 0)
        others = [Slot(0, 37, [7, 7, 200, 3, 1, 5, 6, 8], [2, 7]), mine, Slot(2, 130, [44], [0])]
        assert torch.equal(_slot_logits(verifier, tiny, others, 1), alone)
        portable = Verifier(tiny, window=8, verify_batch=3, kernels="portable")
        close = _slot_logits(portable, tiny, [mine], 0)
    tol = 1e-4 if tiny.dtype == torch.float32 else 0.15  # bf16: two roundings of every activation
    torch.testing.assert_close(alone.float(), close.float(), atol=tol, rtol=tol)


def test_negative_control_a_plan_that_follows_the_key_length_changes_the_bits(tiny_fp32):
    """The check above with the attention's key splits chosen by the pass's key length (as the
    regular launch plan does): the slot's bits beside the longer row differ from alone."""
    def by_key_length(q, k, v, lens, scale):
        return launch(q, k, v, lens, scale, num_splits=1 if k.shape[2] <= 128 else 3)

    with backend("triton"):
        verifier = Verifier(tiny_fp32, window=8, verify_batch=3, kernels="fused")
        verifier.kernels = dataclasses.replace(verifier.kernels, attention=attention_from_cache_lens(by_key_length))
        mine = Slot(1, 70, [5, 9, 33, 7, 81, 120], list(range(6)))
        alone = _slot_logits(verifier, tiny_fp32, [mine], 0)
        others = [Slot(0, 37, [7, 7, 200, 3, 1, 5, 6, 8], [2, 7]), mine, Slot(2, 130, [44], [0])]
        assert not torch.equal(_slot_logits(verifier, tiny_fp32, others, 1), alone)


def test_decode_equals_prefill(tiny_fp32, plans):
    prompts = [[4, 77, 31], list(range(10, 40))]
    with backend("triton"):
        out = Generator(tiny_fp32, mode="deterministic", window=4, verify_batch=2, replay="always",
                        verifier_kernels="fused").generate(prompts, max_new_tokens=9, eos_token_id=[])
        assert out.stats["verifier_kernels"] == "fused (triton)"
        verifier = Verifier(tiny_fp32, window=8, verify_batch=2, kernels="fused")
        for p, toks, lp in zip(prompts, out.tokens, out.logprobs):
            assert torch.equal(verifier.token_logprobs(p + toks, len(p)), lp)


def test_grouped_projections_give_the_bits_of_separate_ones(tiny, monkeypatch):
    """With the Triton matmul the pass projects q, k and v in one ``bi_matmul_group`` launch a
    layer, and gate and up in another (silu_mul reads the halves in place): the logits equal
    those of five separate ``bi_matmul`` launches bit for bit."""
    from swiftkern import ops

    calls = []
    grouped = ops.bi_matmul_group
    monkeypatch.setattr(ops, "bi_matmul_group", lambda a, bs: calls.append(len(bs)) or grouped(a, bs))
    slots = [Slot(0, 37, [7, 7, 200, 3, 1, 5, 6, 8], [2, 7]), Slot(1, 70, [5, 9, 33, 7, 81, 120], list(range(6)))]
    with backend("triton"):
        verifier = Verifier(tiny, window=8, verify_batch=3, kernels="fused")
        one = _slot_logits(verifier, tiny, slots, 1)
        assert calls == [3, 2] * tiny.num_layers
        monkeypatch.setattr(Verifier, "_linears", lambda self, x, ws, bs: [self._linear(x, w, b) for w, b in zip(ws, bs)])
        three = _slot_logits(verifier, tiny, slots, 1)
    assert torch.equal(one, three)
