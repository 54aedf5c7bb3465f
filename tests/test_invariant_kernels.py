"""The batch- and length-invariant CPU kernel set (``SkipModel.batch_invariant``).

The attention kernel ``verify_attention_invariant`` against the float64 definition on odd shapes,
and its point: a query's bits do not depend on how many tokens came with it or on the other rows,
where the regular kernel's do (the negative control: from 8 queries per kv head it sums in
another order). Then the model: inside ``batch_invariant()`` a row's
logits are the same bits alone or in a batch of other prompts, and decoding token by token,
verifying a chunk and prefilling everything agree bit for bit.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_invariance import attention_case, chunk_vs_one_by_one, rows_alone_vs_together
from conftest import tiny_model
from swiftkern import SkipModel, ops
from swiftkern.errors import SwiftkernError
from swiftkern.layer_kernels import invariant_kernels_available
from test_reference_ops import naive_attention
from triton_cases import assert_close

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

needs_cpp = pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                               reason="swiftkern._C is not built with the CPU kernels of the invariant set")
OPS = torch.ops.swiftkern
# the regular kernel's other order (16 queries a lane block) exists on AVX-512 CPUs only; elsewhere
# it computes every query as the invariant one does, and the negative controls have nothing to find
LANES = ops.registry.extension is not None and "avx512" in ops.registry.extension.skinny_linear_isas()
needs_lanes = pytest.mark.skipif(not LANES, reason="the regular kernel's lane path needs an AVX-512 CPU")
DRAWN = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HEADS = [(1, 1), (3, 3), (2, 4), (1, 8), (3, 6), (1, 16)]  # (kv heads, GQA group)


@needs_cpp
@DRAWN
@given(B=st.integers(1, 3), heads=st.sampled_from(HEADS), T=st.integers(1, 12),
       D=st.sampled_from([1, 20, 64, 100]), dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_invariant_attention_matches_the_definition(B, heads, T, D, dtype, data):
    Hkv, group = heads
    S = T + data.draw(st.integers(0, 150))
    seed = data.draw(st.integers(0, 2**31 - 1))
    lens = torch.tensor([data.draw(st.integers(T, S)) for _ in range(B)])
    q, k, v = attention_case(B, Hkv, group, T, D, S, dtype, seed, lens=lens)  # NaN past each length
    got = ops.verify_attention_invariant(q, k, v, lens, D ** -0.5)
    want = naive_attention(q.float(), k.float(), v.float(), lens, D ** -0.5).to(dtype)
    assert got.shape == (B, Hkv * group, T, D)
    assert_close("verify_attention", got, want)


@needs_cpp
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("T", [2, 5, 9])
def test_a_query_has_the_same_bits_in_any_chunk(heads, T):
    assert chunk_vs_one_by_one(OPS.verify_attention_invariant, *heads, T, 64, 140) == 0


@needs_cpp
def test_a_query_has_the_same_bits_in_any_batch():
    assert rows_alone_vs_together(OPS.verify_attention_invariant, [200, 4, 77, 130, 9]) == []


@needs_cpp
@needs_lanes
def test_negative_control_the_regular_kernel_is_not_length_invariant():
    """The regular kernel takes another order from 8 queries per kv head: a query's bits then
    change with the chunk it came in (so the check above can fail)."""
    assert chunk_vs_one_by_one(OPS.verify_attention, 3, 3, 5, 64, 140) > 0


def test_invariant_attention_refuses_bad_input():
    q, k, v = attention_case(1, 2, 2, 3, 16, 10, torch.float32, seed=0)
    with pytest.raises(SwiftkernError, match="cache_lens"):
        ops.verify_attention_invariant(q, k, v, torch.tensor([2]), 0.25)  # fewer than T
    with pytest.raises(SwiftkernError, match="multiple of kv heads"):
        ops.verify_attention_invariant(q[:, :3], k, v, torch.tensor([5]), 0.25)


# --------------------------------------------------------------------------- the model

@pytest.fixture(scope="module")
def tiny_gqa():
    """A tiny LLaMA whose GQA group (3) crosses the regular attention's lane threshold at T = 3."""
    return SkipModel(tiny_model(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, seed=4))


def _feed(prompt, steps):
    """Tokens fed after a prompt: a function of the prompt alone."""
    return [(7 * sum(prompt) + 13 * j) % 290 + 3 for j in range(steps)]


def _logits(model, prompts, steps, chunks=None):
    """Prefill prompts (batched, right-padded), then feed each row ``_feed(prompt, steps)``,
    ``chunks`` tokens per forward (default one by one).
    -> per row, float32 [steps, V]: the logits after each fed token."""
    from swiftkern.generate import prefill

    feed = [_feed(p, steps) for p in prompts]
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + steps)
    prefill(model, cache, prompts)
    out, done = [[] for _ in prompts], 0
    for size in chunks or [1] * steps:
        tokens = torch.tensor([f[done:done + size] for f in feed])
        logits = model.forward(tokens, cache)  # [B, size, V]
        for i in range(len(prompts)):
            out[i].append(logits[i])
        done += size
    return [torch.cat(o) for o in out]


@needs_cpp
def test_model_row_alone_equals_row_in_a_batch(tiny_gqa):
    rng = random.Random(0)
    needle = [17, 250, 9, 3, 44, 61]
    with tiny_gqa.batch_invariant():
        alone = _logits(tiny_gqa, [needle], 6)[0]
        for _ in range(3):
            B = rng.randint(2, 9)
            prompts = [[rng.randrange(3, 301) for _ in range(rng.randint(1, 40))] for _ in range(B)]
            idx = rng.randrange(B)
            prompts[idx] = needle
            assert torch.equal(_logits(tiny_gqa, prompts, 6)[idx], alone), (B, idx)


@needs_cpp
def test_model_decode_verify_and_prefill_agree(tiny_gqa):
    prompts = [[5, 6, 7, 8], list(range(20, 61))]
    with tiny_gqa.batch_invariant():
        one_by_one = _logits(tiny_gqa, prompts, 9)
        chunked = _logits(tiny_gqa, prompts, 9, chunks=[4, 1, 3, 1])
        for a, b in zip(one_by_one, chunked):
            assert torch.equal(a, b)
        # the whole sequence in one forward: the logits at the fed tokens are the same bits
        for i, p in enumerate(prompts):
            cache = tiny_gqa.new_cache(1, len(p) + 9)
            full = tiny_gqa.forward(torch.tensor([p + _feed(p, 9)]), cache)[0, len(p):]
            assert torch.equal(full, one_by_one[i])
    # the regular kernels: the same comparison finds other bits (the control; AVX-512 CPUs only)
    regular_a, regular_b = _logits(tiny_gqa, prompts, 9), _logits(tiny_gqa, prompts, 9, chunks=[4, 1, 3, 1])
    assert any(not torch.equal(a, b) for a, b in zip(regular_a, regular_b)) or not LANES


@needs_cpp
def test_invariant_logits_agree_with_the_regular_ones(tiny_gqa):
    prompts = [[5, 6, 7, 8], list(range(20, 61))]
    regular = _logits(tiny_gqa, prompts, 5)
    with tiny_gqa.batch_invariant():
        invariant = _logits(tiny_gqa, prompts, 5)
    for a, b in zip(regular, invariant):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_batch_invariant_refuses_where_the_kernels_do_not_run():
    """Without the C++ kernels (SWIFTKERN_BACKEND=reference) the set does not run, in any dtype."""
    from swiftkern import ops

    ops.set_backend("reference")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model = SkipModel(tiny_model().to(dtype))
            with pytest.raises(SwiftkernError, match="with the C.. extension built"):
                with model.batch_invariant():
                    pass
    finally:
        ops.set_backend("auto")


@needs_cpp
def test_prefill_per_row_equals_the_padded_batch(tiny_gqa):
    """Prefilling each prompt at its own length (``prefill(per_row=True)``, the path mode
    deterministic takes) writes the same cache and returns the same last logits as one padded
    forward, bit for bit, under the invariant kernels (and close to it under the regular ones)."""
    from swiftkern.generate import prefill

    prompts = [[5, 6, 7], list(range(20, 61)), [9] * 17]
    runs = {}
    for per_row in (False, True):
        with tiny_gqa.batch_invariant():
            cache = tiny_gqa.new_cache(3, 64)
            runs[per_row] = (prefill(tiny_gqa, cache, prompts, per_row=per_row), cache)
    (a, ca), (b, cb) = runs[False], runs[True]
    assert torch.equal(a, b) and ca.host_lengths == cb.host_lengths == [3, 41, 17]
    assert torch.equal(ca.lengths, cb.lengths)
    for r, n in enumerate(ca.host_lengths):
        assert torch.equal(ca.k[:, r, :, :n], cb.k[:, r, :, :n]) and torch.equal(ca.v[:, r, :, :n], cb.v[:, r, :, :n])
    regular = prefill(tiny_gqa, tiny_gqa.new_cache(3, 64), prompts, per_row=True)
    torch.testing.assert_close(regular, a, rtol=1e-4, atol=1e-4)
    with pytest.raises(SwiftkernError, match="row_view"):
        tiny_gqa.new_cache(2, 8).row_view(2)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_is_per_row_with_the_padded_batchs_bits(dtype, monkeypatch):
    """bf16 / fp16 on the CPU: generate prefills each prompt on its own (``per_row_pays``), which
    changes no bit: the regular kernels are row-invariant there, so one padded forward writes the
    same cache and last logits. (Where torch's bf16 matmul is native a bf16 prefill takes it
    past 32 rows instead, padded: test_bf16_prefill_takes_torchs_native_matmul.)"""
    from swiftkern.generate import per_row_pays, prefill
    from swiftkern.ops import projections

    from swiftkern import ops

    monkeypatch.setattr(projections, "torch_bf16_matmul_native", lambda: False)
    model = SkipModel(tiny_model("llama", num_key_value_heads=1).to(dtype))
    # float32 prefills per row only where the C++ kernels take every projection (MKL lags there)
    assert per_row_pays(model) and per_row_pays(SkipModel(tiny_model("llama"))) == ops.mkl_lags_here()
    prompts = [[5, 6, 7], list(range(20, 61)), [9] * 17]
    runs = {}
    for per_row in (False, True):
        cache = model.new_cache(3, 64)
        runs[per_row] = (prefill(model, cache, prompts, per_row=per_row), cache)
    (a, ca), (b, cb) = runs[False], runs[True]
    assert a.dtype == dtype and torch.equal(a, b)
    for r, n in enumerate(ca.host_lengths):
        assert torch.equal(ca.k[:, r, :, :n], cb.k[:, r, :, :n]) and torch.equal(ca.v[:, r, :, :n], cb.v[:, r, :, :n])


@needs_cpp
def test_bf16_prefill_takes_torchs_native_matmul(monkeypatch):
    """Where torch's bf16 matmul runs native instructions (AVX512-BF16, AMX) a bf16 prefill takes
    it past 32 rows, still one prompt at a time (alone, a prompt's bits do not depend on the
    batch); decode steps and verify passes outside the prefill keep the C++ kernel at any size,
    so self-spec still equals ar bit for bit, at batch 3 and alone."""
    from swiftkern.generate import per_row_pays, prefill
    from swiftkern.ops import projections

    from swiftkern import Generator, ops

    model = SkipModel(tiny_model("llama", num_key_value_heads=1).to(torch.bfloat16))
    prompts = [[5, 6, 7], list(range(20, 61)), [9] * 17]
    logits = {}
    for native in (False, True):
        monkeypatch.setattr(projections, "torch_bf16_matmul_native", lambda native=native: native)
        assert per_row_pays(model)
        assert ops.skinny_max_rows(torch.bfloat16) == -1  # outside a prefill: any size
        with ops.prefill_projections():
            assert ops.skinny_max_rows(torch.bfloat16) == (32 if native else -1)
            assert ops.skinny_max_rows(torch.float16) == -1
        logits[native] = prefill(model, model.new_cache(3, 64), prompts, per_row=True)
        kw = dict(max_new_tokens=12, eos_token_id=[])
        ar = Generator(model, mode="ar").generate(prompts, **kw)
        spec = Generator(model, mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:2", eps=0.0,
                         k_max=4)
        assert spec.generate(prompts, **kw).tokens == ar.tokens
        assert [spec.generate([p], **kw).tokens[0] for p in prompts] == ar.tokens
    torch.testing.assert_close(logits[True].float(), logits[False].float(), atol=0.1, rtol=0.05)
