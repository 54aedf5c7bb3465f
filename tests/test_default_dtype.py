"""A caller's ``torch.set_default_dtype`` changes nothing: swiftkern makes each tensor in the
dtype it means. Before, the deterministic replay's prefill logits took the default dtype and
failed under float64 / bf16 / fp16 ("Index put requires the source and destination dtypes
match"), and the GP's length scales were the default dtype's at import."""

import subprocess
import sys

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, gp

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8]]
CONFIGS = [dict(mode="ar"), dict(mode="self-spec", layer_set="attn:1|mlp:2"),
           dict(mode="self-spec", drafter="auto", layer_set="attn:1"), dict(mode="self-spec", layer_set="auto"),
           dict(mode="deterministic"), dict(mode="deterministic", replay="always", window=4),
           dict(mode="deterministic", replay="always", drafter="self-spec", layer_set="attn:1|mlp:2")]
CALLS = [dict(max_new_tokens=20), dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.9, top_k=20, seed=3)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def outputs(model, cfg):
    gen = Generator(model, **cfg)
    return [(out.tokens, out.logprobs) for out in (gen.generate(PROMPTS, **call) for call in CALLS)]


def same(a, b):
    return all(ta == tb and (la is None) == (lb is None) and (la is None or all(torch.equal(x, y) for x, y in zip(la, lb)))
               for (ta, la), (tb, lb) in zip(a, b))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_the_default_dtype_changes_no_token_or_logprob(model, cfg, default):
    want = outputs(model, cfg)
    torch.set_default_dtype(default)
    try:
        got = outputs(model, cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    assert same(got, want)


def test_the_gps_length_scales_do_not_follow_the_default_dtype():
    code = ("import torch; torch.set_default_dtype(torch.float64); from swiftkern import gp; "
            "print(repr(gp.LENGTH_SCALES))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == repr(gp.LENGTH_SCALES)


def test_mixed_drafters_keep_float32_draft_probabilities(monkeypatch):
    """Sampled self-spec where one row drafts by lookup and another by layer skip in one step:
    the one-hot rows and the skipped model's rows share one probability tensor. It took the
    default dtype: under bf16 / fp16 the draft probabilities were rounded and the sampled tokens
    changed silently; under float64 rejection_sample refused them."""
    import swiftkern.speculative as speculative

    mixed = []
    assemble = speculative._assemble

    def spy(choices, lookups, skip, params, vocab, device):
        rows, probs = assemble(choices, lookups, skip, params, vocab, device)
        if probs is not None and any(c.drafter != "layer-skip" and rows[i] for i, c in enumerate(choices)):
            mixed.append(probs.dtype)
        return rows, probs

    monkeypatch.setattr(speculative, "_assemble", spy)
    model = tiny_model("llama", num_hidden_layers=4)
    prompts = [[5, 6, 7, 8] * 3, [11, 40, 3, 9, 22], [5, 6, 7] * 2 + [5, 6], [100, 200, 17]]

    def run():
        gen = Generator(model, mode="self-spec", drafter="auto", layer_set="attn:1|mlp:3", eps=0.0)
        return [gen.generate(prompts, max_new_tokens=40, do_sample=True, temperature=0.7, seed=s).tokens
                for s in range(4)]

    want = run()
    assert mixed, "no step mixed lookup and layer-skip drafts: the case is not exercised"
    for default in (torch.bfloat16, torch.float16, torch.float64):
        mixed.clear()
        torch.set_default_dtype(default)
        try:
            got = run()
        finally:
            torch.set_default_dtype(torch.float32)
        assert mixed and set(mixed) == {torch.float32}
        assert got == want, default
