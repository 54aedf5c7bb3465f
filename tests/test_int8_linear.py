"""int8_linear: the draft passes' approximate matmul (x quantized to int8 per block of 32, integer
dot products with the weight codes). Checked against its float64 twin (reference.int8_linear) on
odd shapes, the VNNI kernel against the portable loop bit for bit, the layout against the packed
weight it came from, the error against the exact matmul, and through the runner: int8 drafts
leave self-spec's greedy output equal to ar's, on a tiny GGUF-like model and on SmolLM2."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import hf_greedy, tiny_model
from swiftkern import Generator, ops, reference
from swiftkern.errors import SwiftkernError
from swiftkern.int8_weights import Int8Set, from_packed, quantize_blocks, unpack_int8
from swiftkern.layer_set import LayerSet
from swiftkern.model import SkipModel
from swiftkern.packed_weights import PackedSet, pack, unpack
from test_packed_weights import gguf_like, gguf_weight

needs_cpp = pytest.mark.skipif(ops.backend_info()["ops"]["int8_linear"]["cpu"] != "cpp",
                               reason="the C++ int8_linear kernel was not built")
needs_vnni = pytest.mark.skipif(not ops.int8_linear_fast(), reason="this CPU has no AVX-512 VNNI")
QTYPE = {4: Q.Q4_1, 8: Q.Q8_0}


def make(lead, K, N, bits, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = gguf_weight(N, K, QTYPE[bits], seed)
    x = torch.randn(*lead, K, generator=g)
    return x, w, from_packed(pack(w)), (torch.randn(N, generator=g) if bias else None)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 50), st.sampled_from([32, 64, 96, 576]), st.sampled_from([4, 8]), st.integers(0, 2**31 - 1))
def test_layout_holds_the_packed_weights_codes(N, K, bits, seed):
    w = gguf_weight(N, K, QTYPE[bits], seed)
    weights = from_packed(pack(w))
    assert weights.shape == (-(-N // 16), K // 32, 384 if bits == 4 else 640)
    scale, offset, codes = unpack_int8(weights, N)
    assert torch.equal((scale.unsqueeze(-1) * codes.float() + offset.unsqueeze(-1)).reshape(N, K), w)


def test_quantize_blocks_closed_form():
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5] + [0.0] * 28 + [0.0] * 32])  # a second block of zeros
    q, s = quantize_blocks(x)
    assert s.tolist() == [[1.0, 0.0]]
    assert q[0, 0, :4].tolist() == [127, -64, 0, 2]  # halves round to even
    assert q[0, 1].abs().sum() == 0


@needs_cpp
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([(0,), (1,), (2,), (3,), (4,), (5,), (9,), (2, 3)]), st.sampled_from([32, 96, 576]),
       st.sampled_from([1, 15, 16, 17, 49, 200]), st.sampled_from([4, 8]), st.booleans(), st.integers(0, 2**31 - 1))
def test_kernel_matches_its_twin(lead, K, N, bits, bias, seed):
    x, _, weights, b = make(lead, K, N, bits, bias, seed)
    y = ops.int8_linear(x, weights, b, N)
    want = reference.int8_linear(x, weights, b, N)
    assert y.shape == (*lead, N) and y.dtype == torch.float32
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)


@needs_cpp
@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_and_portable_give_the_same_bits(bits):
    from swiftkern import _C

    for M in (1, 2, 3, 4, 5, 8):
        for N in (1, 16, 37):
            x, _, weights, _ = make((M,), 96, N, bits, False, M * 100 + N)
            a, b = _C.int8_linear_isa(x, weights, N, "vnni"), _C.int8_linear_isa(x, weights, N, "portable")
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_error_against_the_exact_matmul_is_int8_sized(bits):
    """x rounded to 8 bits per block: the dot products move by about 1 % of their scale, not more."""
    x, w, weights, _ = make((6,), 576, 64, bits, False, 3)
    exact = x @ w.T
    err = (ops.int8_linear(x, weights, None, 64) - exact).abs().max()
    assert 0 < err < 0.02 * exact.abs().max()


def test_bad_input_is_refused_with_a_reason():
    x, w, weights, b = make((2,), 64, 20, 4, True, 0)
    for args, words in [((x.double(), weights, b, 20), "float32"), ((x, pack(w), b, 20), "384 or 640"),
                        ((x[:, :32], weights, b, 20), "K = 32 * weights.shape[1] = 64"),
                        ((x, weights, b, 33), "n = 33 rows do not fill 2 groups"),
                        ((x, weights, b[:3], 20), "bias must be float32 [n = 20]")]:
        with pytest.raises(SwiftkernError, match=words.replace("[", r"\[").replace("*", r"\*")):
            ops.int8_linear(*args)


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_opcheck(bits):
    x, _, weights, b = make((3,), 64, 9, bits, True, 1)
    torch.library.opcheck(torch.ops.swiftkern.int8_linear, (x, weights, b, 9))


def test_int8_set_follows_a_repacked_weight():
    a, b = gguf_weight(6, 64, Q.Q4_1, 0), gguf_weight(6, 64, Q.Q4_1, 1)
    weights = [a.clone(), None]
    int8 = Int8Set(PackedSet(weights))
    first = int8.slots()[0]
    assert int8.slots()[0] is first and int8.slots()[1] is None  # converted once
    weights[0].copy_(b)
    scale, offset, codes = unpack_int8(int8.slots()[0], 6)
    assert torch.equal((scale.unsqueeze(-1) * codes.float() + offset.unsqueeze(-1)).reshape(6, 64), b)


def _int8_model(monkeypatch):
    """A tiny GGUF-like Llama with its packed set attached by hand; int8 drafts allowed on any
    CPU (without VNNI the portable loop runs them)."""
    monkeypatch.setattr(ops, "int8_linear_fast", lambda: True)
    model = SkipModel(gguf_like(tiny_model("llama")), pack_weights=False)
    model.packed = PackedSet(model._stack_weights + [model.lm_head])
    return model


@needs_cpp
def test_runner_int8_forward_is_near_the_exact_one(monkeypatch):
    model = _int8_model(monkeypatch)
    skip = LayerSet.parse("attn:1|mlp:2", 4)
    tokens = torch.randint(0, 301, (2, 6), generator=torch.Generator().manual_seed(0))
    outs = {}
    for arithmetic in ("exact", "int8"):
        cache = model.new_cache(2, 16)
        outs[arithmetic] = model.forward(tokens, cache, layer_set=skip, arithmetic=arithmetic)
    diff = (outs["int8"] - outs["exact"]).abs().max()
    assert 0 < diff < 0.05 * outs["exact"].abs().max()
    with pytest.raises(SwiftkernError, match="one layer set for all rows"):
        model.forward(tokens, model.new_cache(2, 16), layer_set=[skip, None], arithmetic="int8")
    with pytest.raises(SwiftkernError, match="'exact' or 'int8'"):
        model.forward(tokens, model.new_cache(2, 16), arithmetic="int4")


def test_int8_where_it_cannot_run_is_refused():
    model = SkipModel(tiny_model("llama"), pack_weights=False)  # no packed weights
    with pytest.raises(SwiftkernError, match="int8_available"):
        model.forward(torch.ones((1, 2), dtype=torch.int64), model.new_cache(1, 4), arithmetic="int8")
    with pytest.raises(SwiftkernError, match="draft with 'exact'"):
        Generator(model, mode="self-spec", layer_set="none", draft_arithmetic="int8")
    with pytest.raises(SwiftkernError, match="draft_arithmetic must be one of"):
        Generator(model, mode="self-spec", layer_set="none", draft_arithmetic="fp8")


@needs_cpp
@pytest.mark.parametrize("mode, drafter", [("self-spec", "layer-skip"), ("self-spec", "auto"),
                                           ("deterministic", "self-spec")])
def test_int8_drafts_keep_the_greedy_output(monkeypatch, mode, drafter):
    model = _int8_model(monkeypatch)
    prompts = [[5, 17, 33, 9, 120], [7, 7, 250, 3]]
    want = Generator(model, mode="ar").generate(prompts, max_new_tokens=24, eos_token_id=[]).tokens
    gen = Generator(model, mode=mode, drafter=drafter, layer_set="attn:2|mlp:1", eps=0.0, k_max=4,
                    draft_arithmetic="int8", replay="always" if mode == "deterministic" else "auto")
    out = gen.generate(prompts, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == want
    assert out.stats["draft_arithmetic"] == "int8"


@pytest.mark.slow
@needs_vnni
def test_smollm2_int8_drafts_equal_hf_greedy(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a list."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_greedy(model.hf_model, ids, 48, eos_token_id=[])
    gen = Generator(model, tok, mode="self-spec", drafter="layer-skip", layer_set="none", eps=0.0, k_max=4,
                    draft_arithmetic="int8")
    out = gen.generate([ids], max_new_tokens=48, eos_token_id=[])
    assert out.tokens[0] == want
    assert out.stats["acceptance_rate"] > 0.5  # the int8 draft mostly agrees with the model
