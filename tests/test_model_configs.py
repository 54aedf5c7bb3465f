"""Drawn model shapes against HF: head dims that are not hidden / heads, GQA groups of 1-3,
one to five layers, tied embeddings, biases in attention and MLP, other RoPE bases, RoPE
scalings (linear, llama3, yarn, longrope with a limit the tokens may cross) and norm eps,
vocabularies of odd sizes. The prefill's logits match HF's forward, and greedy tokens of
ar and self-spec (layer-skip and lookup drafts) equal HF generate's; in bf16 / fp16 self-spec
and deterministic mode equal ar's tokens."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import hf_greedy, tiny_model, top_logit_gaps
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.layer_kernels import invariant_kernels_available


@st.composite
def configs(draw):
    arch = draw(st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]))
    kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([8, 12, 20, 24, 32]))
    cfg = dict(num_hidden_layers=draw(st.integers(1, 5)), num_attention_heads=kv * group, num_key_value_heads=kv,
               hidden_size=kv * group * head_dim, intermediate_size=draw(st.sampled_from([40, 96, 130])),
               vocab_size=draw(st.sampled_from([101, 301, 1000])), rope_theta=draw(st.sampled_from([1e4, 5e5])),
               rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6])), tie_word_embeddings=draw(st.booleans()))
    if arch == "qwen3":  # its head_dim is its own: hidden_size need not be heads x head_dim
        cfg.update(head_dim=head_dim, hidden_size=draw(st.sampled_from([48, 64])))
    if arch == "llama":
        cfg.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    rope = draw(st.sampled_from([None, "linear", "llama3", "yarn", "longrope"]))
    if rope is not None:  # a limit the prompt and its new tokens may cross (longrope: tests/test_longrope.py)
        cfg.update(rope_scaling_for(rope, head_dim, limit=draw(st.integers(4, 24))))
    return arch, cfg, draw(st.integers(0, 2**16))


def rope_scaling_for(rope: str, head_dim: int, limit: int) -> dict:
    """Config fields of a RoPE scaling of type ``rope`` whose original length is ``limit``."""
    scaling = dict(rope_type=rope, factor=4.0, original_max_position_embeddings=limit)
    if rope == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if rope == "longrope":
        half = head_dim // 2
        scaling.update(short_factor=[1.0 + 0.1 * i for i in range(half)], long_factor=[1.5 + 0.2 * i for i in range(half)])
        return dict(rope_scaling=scaling, original_max_position_embeddings=limit)  # 4.x reads the attribute
    if rope == "yarn":  # HF warns where the factor is not max_position_embeddings over the limit
        scaling["factor"] = 512 / limit
    if rope == "linear":
        del scaling["original_max_position_embeddings"]
    return dict(rope_scaling=scaling)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.data())
def test_a_drawn_shape_decodes_as_hf(drawn, data):
    arch, cfg, seed = drawn
    hf = tiny_model(arch, seed=seed, **cfg)
    V = cfg["vocab_size"]
    prompt = data.draw(st.lists(st.integers(3, V - 1), min_size=1, max_size=20), label="prompt")
    model = SkipModel.from_hf(hf)
    with torch.no_grad():
        want_logits = hf(torch.tensor([prompt])).logits[0]
    got_logits = model.forward(torch.tensor([prompt]), model.new_cache(1, len(prompt)))[0]
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    n = data.draw(st.integers(1, 10), label="new tokens")
    want = hf_greedy(hf, prompt, n, eos_token_id=[])
    assert len(want) == n
    for options in (dict(mode="ar"), dict(mode="self-spec", drafter="lookup", k_max=4),
                    dict(mode="self-spec", drafter="layer-skip", layer_set="none", eps=0.0, k_max=3)):
        got = Generator(model, **options).generate([prompt], max_new_tokens=n, eos_token_id=[]).tokens[0]
        assert got == want, (options, cfg)


@pytest.mark.skipif(not invariant_kernels_available("cpu", torch.bfloat16),
                    reason="swiftkern._C is not built with the CPU kernels of the invariant set")
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.sampled_from([torch.bfloat16, torch.float16]), st.data())
def test_a_drawn_shape_in_half_precision_speculates_bit_for_bit(drawn, dtype, data):
    """In bf16 / fp16 HF's own greedy is defined only to rounding, so the reference is ar: self-spec
    (lookup and layer-skipped drafts) and deterministic mode give its tokens, for batches of
    prompts of different lengths, and each of ar's tokens is within 0.5 of the top of HF's own
    logits over the same context. (These shapes have no near ties: that the equality holds at a
    tie too, through the invariant kernels, is tests/test_exact_self_spec.py's.)"""
    arch, cfg, seed = drawn
    hf = tiny_model(arch, seed=seed, **{**cfg, "num_hidden_layers": max(3, cfg["num_hidden_layers"])}).to(dtype)
    V = cfg["vocab_size"]
    prompts = data.draw(st.lists(st.lists(st.integers(3, V - 1), min_size=1, max_size=15), min_size=1, max_size=3),
                        label="prompts")
    n = data.draw(st.integers(1, 10), label="new tokens")
    model = SkipModel.from_hf(hf)
    want = Generator(model).generate(prompts, max_new_tokens=n, eos_token_id=[]).tokens
    for options in (dict(mode="self-spec", drafter="lookup", k_max=4),
                    dict(mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:1", eps=0.0, k_max=3),
                    dict(mode="deterministic")):
        if options["mode"] == "deterministic" and model.longrope_limit is not None:  # no table holds its rotations
            with pytest.raises(SwiftkernError, match="mode deterministic does not support rope_type 'longrope'"):
                Generator(model, **options)
            continue
        assert Generator(model, **options).generate(prompts, max_new_tokens=n, eos_token_id=[]).tokens == want, options
    for prompt, out in zip(prompts, want):
        assert top_logit_gaps(hf, prompt, out).max() <= 0.5
