"""Deterministic mode (LLM-42): batch-invariant ops, the fixed-shape verifier, and the
decode-verify-rollback loop (``replay="always"``), and the mode without replay where the
batch-invariant kernel set runs (``replay="auto"`` on the CPU). The central check is the needle:
a prompt's tokens and logprobs are the same bits alone and at any place in batches of any size."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from swiftkern import ops, reference
from swiftkern.batch_invariant import (KEY_BLOCK, bi_attention, bi_exp, bi_log_softmax, bi_rms_norm, bi_silu_mul,
                                       tree_sum)
from swiftkern.deterministic import invariant_token_logprobs
from swiftkern.fast_path import FastPath
from swiftkern.errors import SwiftkernError
from swiftkern.generate import Generator, prefill
from swiftkern.layer_kernels import invariant_kernels_available
from swiftkern.model import SkipModel
from swiftkern.verifier import Slot, Verifier

SOME = settings(max_examples=15, deadline=None, derandomize=True)
needs_invariant = pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                                     reason="swiftkern._C is not built with the CPU kernels of the invariant set")
REPLAYS = ["always", pytest.param("auto", marks=needs_invariant)]
KERNEL_SETS = ["portable", pytest.param("fused", marks=needs_invariant)]  # the verifier's, on the CPU
# (replay, verifier kernels): the replay with each set, and no replay
DECODINGS = [("always", "portable"), pytest.param("always", "fused", marks=needs_invariant),
             pytest.param("auto", "auto", marks=needs_invariant)]
EOS = 2  # the tiny models' eos_token_id


@pytest.fixture(scope="module")
def tiny():
    return SkipModel(tiny_model("llama"))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- batch-invariant ops

@SOME
@given(rows=st.integers(1, 40), n=st.integers(1, 700))
def test_tree_sum_is_a_sum_with_rows_independent_of_the_rest(rows, n):
    x = rand(rows, n, seed=n)
    full = tree_sum(x)
    torch.testing.assert_close(full, x.sum(-1, keepdim=True), atol=1e-4, rtol=1e-5)
    m = max(1, rows // 2)
    assert torch.equal(tree_sum(x[:m]), full[:m])
    assert torch.equal(tree_sum(x[m - 1:m].clone()), full[m - 1:m])


@SOME
@given(rows=st.integers(1, 40), hidden=st.sampled_from([1, 7, 64, 111, 576]))
def test_bi_rms_norm_matches_reference_rowwise_bits(rows, hidden):
    x, w = rand(rows, hidden, seed=rows) * 3, rand(hidden, seed=hidden)
    full = bi_rms_norm(x, w, 1e-5)
    torch.testing.assert_close(full, reference.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    i = rows // 2
    assert torch.equal(bi_rms_norm(x[i:i + 1], w, 1e-5), full[i:i + 1])


def test_bi_exp_is_accurate_and_the_same_bits_at_any_place():
    """Within 2 float32 ulps of exp over its range; -inf and tiny inputs give 0; an element's
    bits do not depend on the array around it (size, offset, SIMD body or tail)."""
    x = torch.cat([torch.linspace(-86.9, 87.9, 50001), rand(20011, seed=3) * 8])
    y = bi_exp(x)
    rel = (y.double() - torch.exp(x.double())).abs() / torch.exp(x.double())
    assert float(rel.max()) < 2 * 2.0 ** -24
    assert bi_exp(torch.tensor([float("-inf"), -100.0, 0.0])).tolist() == [0.0, 0.0, 1.0]
    for size, offset in ((1, 0), (7, 3), (17, 1), (4097, 5), (33333, 11)):
        part = x[offset:offset + size].clone()
        assert torch.equal(bi_exp(part), y[offset:offset + size]), (size, offset)


def test_bi_silu_mul_matches_reference_at_any_place():
    g, u = rand(4097, seed=1) * 6, rand(4097, seed=2)
    full = bi_silu_mul(g, u)
    torch.testing.assert_close(full, reference.silu_mul(g, u), atol=1e-6, rtol=1e-5)
    # every element alone (the scalar tail of an elementwise loop) gives the same bits
    alone = torch.cat([bi_silu_mul(g[i:i + 1], u[i:i + 1]) for i in range(0, 4097, 13)])
    assert torch.equal(alone, full[::13])


@SOME
@given(rows=st.integers(1, 9), vocab=st.sampled_from([1, 5, 301, 1000]))
def test_bi_log_softmax_matches_torch_rowwise_bits(rows, vocab):
    x = rand(rows, vocab, seed=vocab) * 5
    full = bi_log_softmax(x)
    torch.testing.assert_close(full, torch.log_softmax(x, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(bi_log_softmax(x[-1:]), full[-1:])


def _attention_case(R, hkv, group, T, D, starts, S, seed=0):
    q = rand(R, hkv * group, T, D, seed=seed)
    keys, values = rand(R, hkv, S, D, seed=seed + 1), rand(R, hkv, S, D, seed=seed + 2)
    return q, keys, values, torch.tensor(starts)


@SOME
@given(R=st.integers(1, 3), hkv=st.integers(1, 2), group=st.integers(1, 3), T=st.integers(1, 9),
       D=st.sampled_from([8, 16]), data=st.data())
def test_bi_attention_matches_reference(R, hkv, group, T, D, data):
    starts = [data.draw(st.integers(0, 150)) for _ in range(R)]
    S = -(-(max(starts) + T) // KEY_BLOCK) * KEY_BLOCK
    q, keys, values, starts_t = _attention_case(R, hkv, group, T, D, starts, S)
    got = bi_attention(q, keys, values, starts_t, 0.3)
    lens = starts_t + T
    want = reference.verify_attention(q, keys, values, lens, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bi_attention_query_depends_on_its_own_keys_only():
    hkv, group, T, D = 2, 3, 8, 16
    q, keys, values, starts = _attention_case(2, hkv, group, T, D, [70, 5], 2 * KEY_BLOCK, seed=4)
    base = bi_attention(q, keys, values, starts, 0.25)
    # more key blocks, garbage after every query, a different neighbour row
    k2 = torch.cat([keys, rand(2, hkv, 3 * KEY_BLOCK, D, seed=9)], dim=2)
    v2 = torch.cat([values, rand(2, hkv, 3 * KEY_BLOCK, D, seed=10)], dim=2)
    k2[0, :, 78:] = 100.0
    v2[0, :, 78:] = -50.0
    k2[1], v2[1] = rand(hkv, 5 * KEY_BLOCK, D, seed=11), rand(hkv, 5 * KEY_BLOCK, D, seed=12)
    assert torch.equal(bi_attention(q, k2, v2, starts, 0.25)[0], base[0])
    # the same 8 queries in two chunks of 4 (a different window) and alone in a batch of one
    first = bi_attention(q[:1, :, :4].contiguous(), keys[:1], values[:1], starts[:1], 0.25)
    second = bi_attention(q[:1, :, 4:].contiguous(), keys[:1], values[:1], starts[:1] + 4, 0.25)
    assert torch.equal(torch.cat([first, second], dim=2)[0], base[0])


# --------------------------------------------------------------------------- the verifier

@functools.cache
def tiny_qwen3():
    return SkipModel(tiny_model("qwen3", seed=4))  # per-head q/k norms before RoPE


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_verifier_computes_the_model(tiny, kernels, family):
    tiny = tiny_qwen3() if family == "qwen3" else tiny
    prompt = [5, 9, 33, 7, 81, 120, 4, 250, 17, 3, 99]
    cache = tiny.new_cache(1, 64)
    want = tiny.forward(torch.tensor([prompt]), cache)[0]  # [T, V]
    verifier = Verifier(tiny, window=8, verify_batch=3, kernels=kernels)
    assert verifier.kernels.name == {"portable": "portable", "fused": "fused (cpp)"}[kernels]
    cache = tiny.new_cache(2, 64)
    first = verifier.forward(cache, [Slot(1, 0, prompt[:8], list(range(8)))])
    second = verifier.forward(cache, [Slot(1, 8, prompt[8:], [0, 1, 2])])
    torch.testing.assert_close(torch.cat([first, second]), want, atol=1e-4, rtol=1e-4)
    assert verifier.dummy_rows == 4  # each pass had 3 slots, 1 real


def test_verifier_rejects_bad_slots(tiny):
    verifier = Verifier(tiny, window=4, verify_batch=2)
    cache = tiny.new_cache(1, 16)
    with pytest.raises(SwiftkernError, match=r"5 tokens \(need 1..4\)"):
        verifier.forward(cache, [Slot(0, 0, [1, 2, 3, 4, 5], [0])])
    with pytest.raises(SwiftkernError, match="exceed the cache's 16"):
        verifier.forward(cache, [Slot(0, 14, [1, 2, 3], [0])])
    with pytest.raises(SwiftkernError, match="1..2 slots"):
        verifier.forward(cache, [Slot(0, 0, [1], [])] * 3)
    with pytest.raises(SwiftkernError, match="window"):
        Verifier(tiny, window=0, verify_batch=1)
    with pytest.raises(SwiftkernError, match="verifier kernels must be one of"):
        Verifier(tiny, window=4, verify_batch=1, kernels="fast")
    half = SkipModel(tiny_model("llama").to(torch.bfloat16))
    if invariant_kernels_available("cpu", torch.bfloat16):
        assert Verifier(half, 4, 1).kernels.name == "fused (cpp)"
    ops.set_backend("reference")  # no fused set without the C++ (or Triton) kernels
    try:
        with pytest.raises(SwiftkernError, match="the fused verifier kernels run on CUDA"):
            Verifier(half, window=4, verify_batch=1, kernels="fused")
        assert Verifier(half, 4, 1).kernels.name == "portable"
    finally:
        ops.set_backend("auto")


# --------------------------------------------------------------------------- the needle

def _random_prompts(rng, n, vocab=301):
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _needle_trials(gen, needle, rng, trials, max_batch, **kw):
    alone = gen.generate([needle], **kw)
    for _ in range(trials):
        B = rng.randint(1, max_batch)
        idx = rng.randrange(B)
        prompts = _random_prompts(rng, B, gen.model.vocab_size)
        prompts[idx] = needle
        seeds = [rng.randrange(1000) for _ in range(B)]
        seeds[idx] = kw.get("seed", 0)
        out = gen.generate(prompts, **dict(kw, seed=seeds))
        assert out.tokens[idx] == alone.tokens[0], (B, idx)
        assert torch.equal(out.logprobs[idx], alone.logprobs[0]), (B, idx)
    return alone


def hf_token_logprobs(model: SkipModel, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's log-softmax at each generated token, and its argmax there. -> float32 [n], int64 [n]"""
    with torch.no_grad():  # on the model's device, the answer on the CPU (where the tokens are compared)
        logits = model.hf_model(torch.tensor([prompt + tokens], device=model.device)).logits[0, len(prompt) - 1:-1]
    logits = logits.cpu()  # [n, V]
    return F.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0], logits.argmax(-1)


# |our logprob - HF's| at the same tokens: float32 rounding, or HF's own bf16 / fp16 activations
LOGPROB_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def needle_tiny(model, sample, seed, trials, replay="always", **gen_kw):
    """The needle on a tiny model, window 8, verify batch 4, 24 tokens, batches of 1-16; alone,
    its tokens are plain ar's (the same seeded draws; the speculative loop without replay draws
    by rejection sampling instead) and its logprobs HF's at those tokens (to the dtype's
    LOGPROB_ATOL)."""
    gen = Generator(model, mode="deterministic", window=8, verify_batch=4, replay=replay, **gen_kw)
    kw = dict(max_new_tokens=24, eos_token_id=[], do_sample=sample, temperature=1.3, seed=11)
    needle = [17, 250, 9, 3, 44, 61]
    alone = _needle_trials(gen, needle, random.Random(seed + sample), trials=trials, max_batch=16, **kw)
    assert len(alone.tokens[0]) == 24 and alone.logprobs[0].shape == (24,)
    if not (sample and gen.drafter == "self-spec" and gen.replay_elided()):  # that one: rejection sampling's draws
        assert alone.tokens == Generator(model, mode="ar").generate([needle], **kw).tokens
    want, argmax = hf_token_logprobs(model, needle, alone.tokens[0])
    torch.testing.assert_close(alone.logprobs[0].cpu(), want, rtol=0, atol=LOGPROB_ATOL[model.dtype])
    assert sample == bool((argmax != torch.tensor(alone.tokens[0])).any())  # sampled: not every token the argmax


@pytest.mark.parametrize("replay,kernels", DECODINGS)
@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny(tiny, sample, replay, kernels):
    needle_tiny(tiny, sample, seed=7, trials=4, replay=replay, verifier_kernels=kernels)


@needs_invariant
@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny_self_spec_without_replay(tiny, sample):
    """No replay, drafter self-spec: the speculative loop on the invariant kernels (lookup and
    layer-skip drafts of varying lengths) still gives the needle its own bits."""
    needle_tiny(tiny, sample, seed=9, trials=4, replay="auto", drafter="self-spec", layer_set="attn:1|mlp:2",
                eps=0.0)


@needs_invariant
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("drafter", ["none", "self-spec"])
@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny_half_precision_without_replay(dtype, drafter, sample):
    """A bf16 / fp16 model on the CPU needs no replay either: the projections sum in fp32 in the
    fixed order and round once, the attention takes its one-query path, the norms are per row
    (through torch's bf16 matmul, rows of one batch were summed in orders that depend on the
    batch)."""
    spec = dict(drafter="self-spec", layer_set="attn:1|mlp:2", eps=0.0) if drafter == "self-spec" else {}
    model = SkipModel(tiny_model("llama").to(dtype))
    assert Generator(model, mode="deterministic").replay_elided()
    needle_tiny(model, sample, seed=21, trials=3, replay="auto", **spec)
    if drafter == "none":  # the replay, its verifier on the fused C++ set in the dtype
        needle_tiny(model, sample, seed=22, trials=2, replay="always", verifier_kernels="fused")


@pytest.mark.parametrize("sample", [False, True])
def test_needle_tiny_self_spec_with_replay(tiny, sample):
    """The replay with the self-spec fast path: its policy picks full or draft forwards and
    lookup matches by timings and by the batch's rows, so the needle is shown other proposals
    in every batch; the verifier's tokens and logprobs stay its own."""
    needle_tiny(tiny, sample, seed=13, trials=4, replay="always", drafter="self-spec", layer_set="attn:1|mlp:2",
                eps=0.0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k/v biases; per-head q/k norms
def test_needle_tiny_qwen_families(family):
    model = SkipModel(tiny_model("qwen2", seed=3)) if family == "qwen2" else tiny_qwen3()
    for replay in ("always", "auto") if invariant_kernels_available("cpu", torch.float32) else ("always",):
        gen = Generator(model, mode="deterministic", window=4, verify_batch=2, replay=replay)
        _needle_trials(gen, [8, 8, 100, 7], random.Random(3), trials=2, max_batch=9, max_new_tokens=12,
                       eos_token_id=[])


def test_needle_among_requests_that_skip_verification(tiny):
    """LLM-42's common case: few requests need determinism; the rest decode at regular cost."""
    gen = Generator(tiny, mode="deterministic", window=8, verify_batch=2, replay="always")
    needle = [17, 250, 9, 3, 44, 61]
    kw = dict(max_new_tokens=20, eos_token_id=[])
    alone = gen.generate([needle], **kw)
    prompts = _random_prompts(random.Random(2), 7)
    prompts.insert(3, needle)
    out = gen.generate(prompts, deterministic=[i == 3 for i in range(8)], **kw)
    assert out.tokens[3] == alone.tokens[0] and torch.equal(out.logprobs[3], alone.logprobs[0])
    assert out.stats["fast_tokens"] == 19 + out.stats["rolled_back"]  # only the needle was replayed
    others = [p for i, p in enumerate(prompts) if i != 3]
    ar = Generator(tiny, mode="ar").generate(others, **kw)
    assert [t for i, t in enumerate(out.tokens) if i != 3] == ar.tokens
    assert all(lp.shape == (20,) and bool(torch.isfinite(lp).all()) for lp in out.logprobs)
    with pytest.raises(SwiftkernError, match="needs mode='deterministic'"):
        Generator(tiny, mode="ar").generate(others, deterministic=False, **kw)
    spec = Generator(tiny, mode="deterministic", drafter="self-spec", layer_set="attn:1", replay="always")
    with pytest.raises(SwiftkernError, match="must be verified"):
        spec.generate(others[:2], deterministic=[True, False], **kw)


def _ar_logprobs(model, prompts, idx, steps):
    """Plain batched ar (prefill + batched decode), greedy: row idx's chosen-token logprobs."""
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + steps + 1)
    logits = prefill(model, cache, prompts)
    out = []
    for _ in range(steps):
        token = logits.argmax(-1)
        out.append(torch.log_softmax(logits.float(), -1)[idx, token[idx]])
        logits = model.forward(token.unsqueeze(1), cache)[:, -1]
    return torch.stack(out)


def test_negative_control_plain_batched_ar_is_batch_variant(tiny, monkeypatch):
    """The needle check on plain batched ar finds differences: the prefill GEMM of a short
    prompt alone takes another MKL path than the padded [B * width] batch, and attention runs
    over the batch's padded key length, so the needle's logprobs change in the last bits. Where
    the C++ kernels take every float32 projection (``ops.mkl_lags_here``: MKL on a non-Intel
    CPU) plain ar has no batch-variant kernel left on the CPU, so the control takes torch's
    matmul past 32 rows on purpose, as a CPU where MKL runs AVX-512 does."""
    from swiftkern.ops import projections

    monkeypatch.setattr(projections, "mkl_lags_here", lambda: False)
    assert ar_needle_differences(tiny, trials=4, max_batch=16) > 0


def ar_needle_differences(model, trials, max_batch, vocab=301):
    """In how many of ``trials`` random batches (2..max_batch prompts) plain batched ar gives a
    fixed needle other logprobs than alone."""
    rng = random.Random(0)
    needle = [5, 6, 7, 8, 9]
    alone = _ar_logprobs(model, [needle], 0, 12)
    differ = 0
    for _ in range(trials):
        B = rng.randint(2, max_batch)
        idx = rng.randrange(B)
        prompts = _random_prompts(rng, B, vocab)
        prompts[idx] = needle
        differ += not torch.equal(_ar_logprobs(model, prompts, idx, 12), alone)
    return differ


# --------------------------------------------------------------------------- decode vs prefill

@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_decode_equals_prefill_and_windows_agree(tiny, kernels):
    prompts = [[4, 77, 31], list(range(10, 60)), [200]]
    runs = {}
    for window, vb in [(8, 2), (4, 3), (16, 1)]:
        gen = Generator(tiny, mode="deterministic", window=window, verify_batch=vb, replay="always",
                        verifier_kernels=kernels)
        runs[window] = gen.generate(prompts, max_new_tokens=20, eos_token_id=[])
    base = runs[8]
    assert base.stats["verifier_kernels"].startswith(kernels)
    for window, out in runs.items():  # the verifier's output does not depend on how it was chunked
        assert out.tokens == base.tokens, window
        assert all(torch.equal(a, b) for a, b in zip(out.logprobs, base.logprobs)), window
    verifier = Verifier(tiny, window=8, verify_batch=2, kernels=kernels)
    for p, toks, lp in zip(prompts, base.tokens, base.logprobs):
        assert torch.equal(verifier.token_logprobs(p + toks, len(p)), lp)


def test_a_window_past_the_call_replays_at_the_width_a_row_can_fill(tiny, monkeypatch):
    """A window wider than max_new_tokens + 1 was padded to in every replay pass, and its cache
    room allocated (16384 for 12 new tokens: 5.1 s against 0.008 s). A call's passes are now
    max_new_tokens + 1 wide at most: the same bits as that window, the passes that narrow."""
    widths = []  # of the replay passes (the prompts' prefill passes give their own width)
    forward = Verifier.forward

    def spy(self, cache, slots, width=None, rows=None):
        if width is None:
            widths.append(self.window)
        return forward(self, cache, slots, width, rows)

    monkeypatch.setattr(Verifier, "forward", spy)
    prompts = [[4, 77, 31], list(range(10, 60))]
    runs = {w: Generator(tiny, mode="deterministic", window=w, replay="always").generate(
        prompts, max_new_tokens=12, eos_token_id=[]) for w in (13, 4096)}
    assert runs[4096].tokens == runs[13].tokens
    assert all(torch.equal(a, b) for a, b in zip(runs[4096].logprobs, runs[13].logprobs))
    assert runs[4096].stats["window"] == runs[13].stats["window"] == 13
    assert widths and max(widths) <= 13
    assert Generator(tiny, mode="deterministic", window=5, replay="always").generate(
        prompts, max_new_tokens=12, eos_token_id=[]).stats["window"] == 5


@needs_invariant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_replay_decode_equals_prefill(tiny, dtype):
    """No replay: the logprobs returned are the invariant model's, equal bit for bit to scoring
    prompt + output in one forward (``invariant_token_logprobs``); with or without self-spec."""
    if dtype != torch.float32:
        tiny = SkipModel(tiny_model("llama").to(dtype))
    prompts = [[4, 77, 31], list(range(10, 60)), [200]]
    plain = Generator(tiny, mode="deterministic").generate(prompts, max_new_tokens=20, eos_token_id=[])
    spec = Generator(tiny, mode="deterministic", drafter="self-spec", layer_set="attn:1|mlp:2", eps=0.0).generate(
        prompts, max_new_tokens=20, eos_token_id=[])
    assert spec.tokens == plain.tokens and plain.stats["replay"].startswith("elided")
    for p, toks, lp, lp_spec in zip(prompts, plain.tokens, plain.logprobs, spec.logprobs):
        assert lp.shape == (20,)
        assert torch.equal(invariant_token_logprobs(tiny, p + toks, len(p)), lp)
        assert torch.equal(lp_spec, lp)
    s = spec.stats
    assert s["verify_passes"] == 0 and s["rolled_back"] == 0 and s["drafted"] > 0
    assert s["fast_path"].startswith("self-spec")


@pytest.mark.parametrize("replay", REPLAYS)
def test_greedy_equals_ar_on_a_tiny_model(tiny, replay):
    prompts = [[4, 77, 31], list(range(10, 60)), [200, 3]]
    det = Generator(tiny, mode="deterministic", window=8, replay=replay).generate(prompts, max_new_tokens=16)
    ar = Generator(tiny, mode="ar").generate(prompts, max_new_tokens=16)
    assert det.tokens == ar.tokens


# --------------------------------------------------------------------------- rollback

class WrongAt(FastPath):
    """The regular fast path, except that its proposal for ``(request, step)`` is ``token``."""

    def __init__(self, wrong: dict, **kw):
        super().__init__(**kw)
        self.wrong, self.calls = wrong, 0

    def propose(self, model, cache, last, params, seeds, **kw):
        tokens, ok, logits = super().propose(model, cache, last, params, seeds, **kw)
        self.calls += 1
        for row, token in self.wrong.get(self.calls, {}).items():
            if row < len(tokens):
                tokens[row] = token
        return tokens, ok, logits


def _run(model, prompts, fast_path=None, window=6, verify_batch=2, max_new=20, **kw):
    from swiftkern.deterministic import decode_deterministic
    from swiftkern.requests import Requests
    from swiftkern.sampling import SamplingParams

    requests = Requests(len(prompts), max_new, frozenset(kw.pop("stop_ids", [EOS])))
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + max_new + window)
    stats = decode_deterministic(model, cache, prompts, SamplingParams(**kw), [0] * len(prompts), requests,
                                 window, verify_batch, fast_path)
    return requests.out, stats


def test_eos_rolled_back_by_a_mismatch(tiny):
    prompts = [[5, 6, 7], [100, 101]]
    want, clean = _run(tiny, prompts)
    assert all(len(t) == 20 and EOS not in t for t in want)
    # the fast path says EOS at its 3rd step for row 0 and garbage for row 1 at step 4
    got, stats = _run(tiny, prompts, WrongAt({3: {0: EOS}, 4: {1: 299}}))
    assert got == want and [len(t) for t in got] == [20, 20]
    assert stats["corrected"] >= 2 and stats["rolled_back"] >= 2
    assert stats["fast_tokens"] - stats["rolled_back"] <= clean["fast_tokens"]


def test_real_eos_ends_the_output_exactly(tiny):
    prompts = [[5, 6, 7], [100, 101]]
    free, _ = _run(tiny, prompts, stop_ids=[])
    stop = free[0][9]  # a token the verifier emits: make it the stop token
    got, _ = _run(tiny, prompts, stop_ids=[stop])
    for toks, full in zip(got, free):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert toks == full[:cut]


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_self_spec_fast_path_gives_the_same_output(tiny, draft_vocab):
    prompts = [[5, 6, 7], list(range(30, 45))]
    plain = Generator(tiny, mode="deterministic", window=6, replay="always").generate(
        prompts, max_new_tokens=18, eos_token_id=[])
    spec = Generator(tiny, mode="deterministic", window=6, drafter="self-spec", layer_set="attn:1,2|mlp:2",
                     eps=0.0, draft_vocab=draft_vocab, replay="always").generate(prompts, max_new_tokens=18,
                                                                                   eos_token_id=[])
    assert spec.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(spec.logprobs, plain.logprobs))
    s = spec.stats
    assert s["fast_path"].startswith("self-spec") and s["fast_tokens"] > 0 and s["rolled_back"] > 0
    assert 0 < s["rollback_fraction"] == s["rolled_back"] / s["fast_tokens"]


@pytest.mark.parametrize("sample", [False, True])
def test_self_spec_fast_path_with_lookup_drafts(tiny, sample, monkeypatch):
    """Repetitive prompts give the self-spec fast path prompt-lookup drafts (no model call);
    the verifier decides every token, so the output and logprobs equal the regular fast path's,
    and a needle keeps its bits in a batch."""
    import swiftkern.deterministic as deterministic

    policy = deterministic.FastPathPolicy  # fixed costs: which matches it takes must not hang on the load
    monkeypatch.setattr(deterministic, "FastPathPolicy", lambda *a, **k: policy(*a, **k, measure=False))
    prompts = [[5, 6, 7, 8, 9] * 4, [40, 41, 42, 40, 41, 42, 40, 41], list(range(30, 45))]
    kw = dict(max_new_tokens=20, eos_token_id=[], do_sample=sample, temperature=1.3, seed=[3, 4, 5])
    plain = Generator(tiny, mode="deterministic", window=6, replay="always").generate(prompts, **kw)
    gen = Generator(tiny, mode="deterministic", window=6, drafter="self-spec", layer_set="attn:1,2|mlp:2",
                    eps=0.0, replay="always", verify_batch=2)
    spec = gen.generate(prompts, **kw)
    assert spec.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(spec.logprobs, plain.logprobs))
    assert spec.stats["fast_tokens"] > spec.stats["lookup_tokens"]  # the model proposed too
    if not sample:  # sampled tokens rarely continue the prompts' n-grams
        assert spec.stats["lookup_tokens"] + spec.stats["lookup_checked"] > 0
    alone = gen.generate(prompts[:1], **dict(kw, seed=3))
    assert alone.tokens[0] == spec.tokens[0] and torch.equal(alone.logprobs[0], spec.logprobs[0])


@pytest.mark.parametrize("sample", [False, True])
def test_full_fast_steps_check_lookup_drafts_in_their_forward(tiny, sample, monkeypatch):
    """A full fast step feeds a row's lookup drafts through its own forward and keeps those the
    model agrees with: fewer fast steps for the same tokens, logprobs and verify passes' say
    as without them (RIDE_ALONG_MAX = 0), and a row alone keeps its bits in a batch."""
    import swiftkern.deterministic as deterministic
    import swiftkern.deterministic_steps as steps

    policy = deterministic.FastPathPolicy  # fixed costs: the full model wins every step
    monkeypatch.setattr(deterministic, "FastPathPolicy", lambda *a, **k: policy(*a, **k, measure=False))
    prompts = [[5, 6, 7, 8, 9] * 4, [40, 41, 42, 40, 41, 42, 40, 41]]
    kw = dict(max_new_tokens=24, eos_token_id=[], do_sample=sample, temperature=0.7, seed=[3, 4])
    gen = Generator(tiny, mode="deterministic", window=8, drafter="self-spec", layer_set="attn:1,2|mlp:2",
                    eps=0.0, replay="always", verify_batch=2)
    checked = gen.generate(prompts, **kw)
    monkeypatch.setattr(steps, "RIDE_ALONG_MAX", 0)
    plain = gen.generate(prompts, **kw)
    assert checked.tokens == plain.tokens and all(len(t) == 24 for t in checked.tokens)
    assert all(torch.equal(a, b) for a, b in zip(checked.logprobs, plain.logprobs))
    assert plain.stats["lookup_checked"] == 0
    if not sample:
        assert checked.stats["lookup_checked"] > 0
        assert checked.stats["fast_steps"] < plain.stats["fast_steps"]
        # the CPU's regular kernels give the verifier's bits: every checked draft is the model's
        assert checked.stats["rolled_back"] == 0
    monkeypatch.setattr(steps, "RIDE_ALONG_MAX", 3)
    alone = gen.generate(prompts[1:], **dict(kw, seed=4))
    assert alone.tokens[0] == checked.tokens[1] and torch.equal(alone.logprobs[0], checked.logprobs[1])


def test_generator_stats_and_errors(tiny):
    out = Generator(tiny, mode="deterministic", window=4, verify_batch=2, replay="always").generate(
        [[5, 6], [7]], max_new_tokens=9, eos_token_id=[])
    s = out.stats
    assert s["mode"] == "deterministic" and s["window"] == 4 and s["verify_batch"] == 2
    assert s["new_tokens"] == 18 and s["prefill_passes"] == 1 and s["verify_passes"] >= 2
    assert s["fast_tokens"] == 16 + s["rolled_back"]  # every token but the prefill's came from the fast path
    assert all(r["verifies"] >= 2 for r in out.request_stats)
    elided = Generator(tiny, mode="deterministic").generate([[5, 6], [7]], max_new_tokens=9, eos_token_id=[])
    assert elided.stats["replay"].startswith("elided") and elided.tokens == out.tokens
    # counted alike with the replay elided (each new token was counted, the prefill's too)
    assert elided.stats["fast_tokens"] == 16 and [r["fast_tokens"] for r in elided.request_stats] == [8, 8]
    one = Generator(tiny, mode="deterministic", replay="always").generate([[5, 6]], max_new_tokens=1,
                                                                          eos_token_id=[])
    assert len(one.tokens[0]) == 1 and one.stats["verify_passes"] == 0
    with pytest.raises(SwiftkernError, match="replay must be one of"):
        Generator(tiny, mode="deterministic", replay="sometimes")
    with pytest.raises(SwiftkernError, match="window"):
        Generator(tiny, mode="deterministic", window=0)
    with pytest.raises(SwiftkernError, match="does not go with mode"):
        Generator(tiny, mode="deterministic", drafter="lookup")
    with pytest.raises(SwiftkernError, match="does not go with mode"):
        Generator(tiny, mode="ar", drafter="self-spec", layer_set="attn:1")
    with pytest.raises(SwiftkernError, match="needs a layer set.*'none' to draft with prompt lookup alone"):
        Generator(tiny, mode="deterministic", drafter="self-spec")
    # what that message offers is taken: layer_set 'none' drafts with prompt lookup alone
    looped = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    out = Generator(tiny, mode="deterministic", drafter="self-spec", layer_set="none").generate(
        [looped], max_new_tokens=12, eos_token_id=[])
    assert out.tokens == Generator(tiny).generate([looped], max_new_tokens=12, eos_token_id=[]).tokens
    assert out.stats["draft_steps"] == 0


# --------------------------------------------------------------------------- SmolLM2

def smollm2_needle(model, tok, max_new_tokens, batch_ranges, replay="always", verifier_kernels="auto"):
    """The needle on SmolLM2 (window 16, verify batch 4), greedy and sampled: alone, then in
    one batch of random other prompts per (lo, hi) in batch_ranges, at a random place.
    -> (needle ids, {sample: its output alone})."""
    gen = Generator(model, tok, mode="deterministic", window=16, verify_batch=4, replay=replay,
                    verifier_kernels=verifier_kernels)
    needle = tok("The three primary colors are")["input_ids"]
    rng = random.Random(5)
    others = ["def fib(n):", "Paris is", "Once upon a time, in a small village", "1, 2, 3,",
              "The weather today", "import numpy as np", "Dear John,", "What is 2 + 2?"]
    alone_by = {}
    for sample in (False, True):
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=[], do_sample=sample, temperature=0.9, seed=3)
        alone = alone_by[sample] = gen.generate([needle], **kw)
        for lo, hi in batch_ranges:
            B = rng.randint(lo, hi)
            prompts = [tok(rng.choice(others))["input_ids"] for _ in range(B)]
            idx = rng.randrange(B)
            prompts[idx] = needle
            out = gen.generate(prompts, **kw)
            assert out.tokens[idx] == alone.tokens[0], (sample, B, idx)
            assert torch.equal(out.logprobs[idx], alone.logprobs[0]), (sample, B, idx)
    return needle, alone_by


@pytest.mark.slow
def test_verifier_reads_packed_weights_with_the_same_bits(smollm2):
    """Where SmolLM2 keeps packed weights (an AVX2 or AVX-512 CPU), the verifier's matmuls read them:
    the logits of a pass equal those of the same pass on the float32 weights, bit for bit."""
    model, tok = smollm2
    if model.packed is None:
        pytest.skip("SmolLM2 is not packed here (packed weights need the C++ kernels on an AVX2 or AVX-512 CPU)")
    ids = tok("The three primary colors are red, yellow and")["input_ids"]
    slots = [Slot(0, 0, ids[:8], list(range(8))), Slot(1, 3, ids[3:9], [0, 5])]
    logits = {}
    for packed in (True, False):
        saved = model.packed
        model.packed = saved if packed else None
        try:
            verifier = Verifier(model, window=8, verify_batch=3)
            assert bool(verifier._packed_index) == packed
            logits[packed] = verifier.forward(model.new_cache(2, 32), slots)
        finally:
            model.packed = saved
    assert torch.equal(logits[True], logits[False])


@pytest.mark.slow
@pytest.mark.parametrize("replay", REPLAYS)
def test_needle_smollm2(smollm2, replay):
    model, tok = smollm2
    needle, alone = smollm2_needle(model, tok, 16, [(2, 4), (5, 10)], replay)
    greedy = alone[False]  # the verifier is the model: greedy output equals plain decoding's
    assert greedy.tokens == Generator(model, tok, mode="ar").generate([needle], max_new_tokens=16,
                                                                      eos_token_id=[]).tokens
    if replay == "always":
        lp = Verifier(model, 16, 4).token_logprobs(needle + greedy.tokens[0], len(needle))
    else:
        lp = invariant_token_logprobs(model, needle + greedy.tokens[0], len(needle))
    assert torch.equal(lp, greedy.logprobs[0])


# --------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("args", [["--mode", "deterministic", "--drafter", "self-spec"],
                                  ["--mode", "self-spec", "--drafter", "self-spec", "--layer-set", "attn:3"]])
def test_cli_self_spec_fast_path_needs_deterministic_and_a_layer_set(args, capsys):
    from swiftkern import cli

    assert cli.main(["generate", "--prompt", "hi", *args]) == 2  # refused before loading a model
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mode deterministic" in err[0] and "--layer-set" in err[0]


@pytest.mark.slow
def test_cli_deterministic_json(smollm2, capsys, monkeypatch):
    import json

    from swiftkern import cli, loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: smollm2)  # the session's copy

    assert cli.main(["generate", "--prompt", "The capital of France is", "--mode", "deterministic",
                     "--window", "8", "--verify-batch", "2", "--max-new-tokens", "10", "--replay", "always",
                     "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = rec["stats"]
    assert s["mode"] == "deterministic" and s["window"] == 8
    assert s["verify_batch"] == 1 and s["dummy_rows"] == 0  # one request: passes of one row, no dummies
    assert len(rec["tokens"]) == 10 and s["verify_passes"] >= 1 and 0.0 <= s["rollback_fraction"] <= 1.0
    if invariant_kernels_available("cpu", torch.float32):  # the default, no replay: the same tokens
        assert cli.main(["generate", "--prompt", "The capital of France is", "--mode", "deterministic",
                         "--max-new-tokens", "10", "--json"]) == 0
        plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert plain["tokens"] == rec["tokens"] and plain["stats"]["verify_passes"] == 0


def test_the_replays_prefill_is_timed_as_prefill(monkeypatch):
    """With the replay the prompts prefill through the verifier, inside decoding: prefill_s was
    ~0 and the prefill's time went to decode_s (and decode_tokens_per_s)."""
    import time

    tiny = SkipModel.from_hf(tiny_model("llama"))
    slow = Verifier.prefill

    def prefill_slowly(self, *args, **kwargs):
        time.sleep(0.3)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(Verifier, "prefill", prefill_slowly)
    out = Generator(tiny, mode="deterministic", replay="always", window=4).generate([[5, 6, 7]], max_new_tokens=3,
                                                                                    eos_token_id=[])
    assert out.stats["prefill_s"] >= 0.3


@pytest.mark.parametrize("how", ["stop id", "stop string"])
def test_a_lookup_draft_stops_at_a_stop_token(how):
    """A prompt-lookup match ran on past a stop token: the tokens after it were verified, then
    dropped by the commit without being counted as rolled back (rollback_fraction said 0 while
    most fast tokens were thrown away). A repeated prompt makes lookup predict through the stop.
    The same for a stop string (``Requests.stop_check``), which the cut did not look at."""
    import random

    from swiftkern.deterministic import decode_deterministic
    from swiftkern.layer_set import LayerSet
    from swiftkern.requests import Requests
    from swiftkern.sampling import SamplingParams

    model = SkipModel(tiny_model("llama", seed=3))
    ar = Generator(model, mode="ar")
    rng = random.Random(1)
    for _ in range(5):  # the fifth draw: a prompt whose lookup match runs through the stop
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(3, 8))]
    prompt = prompt + ar.generate([prompt], max_new_tokens=20, eos_token_id=[]).tokens[0] + prompt
    stop = ar.generate([prompt], max_new_tokens=24, eos_token_id=[]).tokens[0][2]
    want = ar.generate([prompt], max_new_tokens=24, eos_token_id=[stop]).tokens[0]
    for window in (8, 16):
        fast = FastPath(LayerSet.parse("attn:1|mlp:2", model.num_layers), eps=0.5, lookup=True, adaptive=False)
        requests = (Requests(1, 24, frozenset([stop])) if how == "stop id" else
                    Requests(1, 24, frozenset(), stop_check=lambda r, tokens: tokens[-1] == stop))
        stats = decode_deterministic(model, model.new_cache(1, len(prompt) + 24 + window + 26), [prompt],
                                     SamplingParams(), [0], requests, window, 1, fast)
        assert requests.out[0] == want and stats["lookup_tokens"] > 0
        # every fast token is committed or counted as rolled back (the first token is the prefill's)
        assert stats["fast_tokens"] == len(requests.out[0]) - 1 - stats["corrected"] + stats["rolled_back"]


@needs_invariant
def test_verifier_kernels_without_a_replay_are_refused(tiny):
    """verifier_kernels picks the replay's ops: where replay auto (or never) runs no replay, a
    set named there would be ignored, so it is refused with what to pass; with the replay it runs."""
    for replay in ("auto", "never"):
        with pytest.raises(SwiftkernError, match="verifier_kernels='portable' picks the replay's per-row ops.*"
                                                 "pass replay='always'"):
            Generator(tiny, mode="deterministic", replay=replay, verifier_kernels="portable")
    out = Generator(tiny, mode="deterministic", replay="always", verifier_kernels="portable", window=4).generate(
        [[5, 6, 7]], max_new_tokens=5, eos_token_id=[])
    assert out.stats["verifier_kernels"] == "portable" and out.stats["verify_passes"] >= 1
    plain = Generator(tiny, mode="deterministic").generate([[5, 6, 7]], max_new_tokens=5, eos_token_id=[])
    assert "window" not in plain.stats and plain.stats["verify_passes"] == 0  # no replay: no replay shape
