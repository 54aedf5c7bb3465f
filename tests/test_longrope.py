"""LongRoPE's short and long frequencies, chosen per token as HF's batch-1 generate chooses them
(swiftkern/longrope.py): a pass straddling the limit, a prompt past it, a padded batch's
prefill, and the tokens of every mode against HF greedy."""

import random

import pytest
import torch

from conftest import hf_greedy, tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.integrations import compat
from swiftkern.longrope import longrope_limit
from swiftkern.prefill import prefill
from triton_cases import backend as use_backend

LIMIT = 64  # original_max_position_embeddings: the long factors from this position on


def longrope_model(seed: int = 3, arch: str = "llama", attribute: bool = True):
    """A tiny model (head_dim 16: 8 factors) whose short and long factors differ far apart. The
    limit goes in both places a transformers version reads it (5.x: rope_parameters, 4.x: the
    config attribute), or (``attribute=False``) in the rope parameters alone."""
    scaling = dict(rope_type="longrope", factor=4.0, original_max_position_embeddings=LIMIT,
                   short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[1.5 + 0.2 * i for i in range(8)])
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    if attribute:
        extra["original_max_position_embeddings"] = LIMIT
    return tiny_model(arch, seed=seed, rope_scaling=scaling, max_position_embeddings=256, **extra)


def hf_step_logits(hf, prompt, new):
    """float32 [len(new), V]: HF's logits for each token of ``new`` fed one at a time after the
    prompt (what batch-1 greedy generate computes), the last prompt position's first."""
    name = "cache" if compat.transformers_version() >= (5, 24) else "past_key_values"  # the cache's kwarg
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        logits = [out.logits[0, -1]]
        for t in new[:-1]:
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache")
            out = hf(torch.tensor([[t]]), use_cache=True, **{name: cache})
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("attribute", [True, False], ids=["both-places", "rope-parameters-only"])
def test_the_limit_is_where_the_modules_own_choice_switches(attribute):
    """longrope_limit reads what this transformers' module reads: a call whose largest position
    is limit - 1 rotates position 5 as a call of it alone, one reaching the limit does not
    (transformers 5.x reads the rope parameters' 64, 4.x the config attribute, else the model's
    256 positions)."""
    rotary = longrope_model(attribute=attribute).model.rotary_emb
    limit = longrope_limit(rotary)
    if attribute:
        assert limit == LIMIT
    probe = torch.zeros((1, 2, 1))

    def cos_at_5(*more):  # [D]: position 5's cos in a call with ``more`` positions after it
        return rotary(probe[:, : 1 + len(more)], torch.tensor([[5, *more]]))[0][0, 0]

    assert torch.equal(cos_at_5(limit - 1), cos_at_5())
    assert not torch.allclose(cos_at_5(limit), cos_at_5(), atol=1e-3)
    assert longrope_limit(tiny_model().model.rotary_emb) is None


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("prompt_len", [LIMIT - 20, LIMIT - 3, LIMIT, LIMIT + 5])
def test_a_pass_straddling_the_limit_has_hfs_token_by_token_logits(backend, prompt_len):
    """Prefill, then one forward of 6 tokens (a verify pass): every position's logits equal
    HF's one-token-at-a-time ones. Before, a pass from LIMIT - 3 rotated its first three tokens
    with the long factors (HF: short), and nothing else told it."""
    hf = longrope_model()
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(3, 300) for _ in range(prompt_len)]
    new = [rng.randrange(3, 300) for _ in range(6)]
    want = hf_step_logits(hf, prompt, new)  # [7, V]
    model = SkipModel.from_hf(hf)
    with use_backend(backend):
        cache = model.new_cache(1, prompt_len + 8)
        first = prefill(model, cache, [prompt])  # [1, V]
        rest = model.forward(torch.tensor([new]), cache)[0]  # [6, V]
    got = torch.cat([first, rest[:-1]])
    torch.testing.assert_close(got, want[: len(got)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_padded_batchs_prefill_rotates_each_prompt_by_its_own_length(backend):
    """A batch of prompts on both sides of the limit: each row's last logits are its own
    prompt's (a padded forward would rotate the short ones by the longest row)."""
    hf = longrope_model()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (LIMIT - 10, LIMIT + 9, 7, LIMIT)]
    model = SkipModel.from_hf(hf)
    with use_backend(backend):
        cache = model.new_cache(len(prompts), LIMIT + 16)
        got = prefill(model, cache, prompts)  # [4, V]
    assert cache.host_lengths == [len(p) for p in prompts]
    for b, p in enumerate(prompts):
        torch.testing.assert_close(got[b], hf_step_logits(hf, p, [0])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode,options", [("ar", {}), ("self-spec", {"layer_set": "mlp:1"}),
                                          ("self-spec", {"drafter": "lookup"})],
                         ids=["ar", "self-spec", "lookup"])
def test_a_batch_crossing_the_limit_decodes_as_hf_greedy_alone(arch, mode, options):
    """Prompts that start below the limit and decode past it, and one past it from the start,
    in one batch: each row's tokens are HF batch-1 greedy's (whose frequencies follow that
    prompt alone). Before, self-spec left HF's tokens on 1 of 6 such prompts."""
    hf = longrope_model(arch=arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 40) for _ in range(n)] for n in (LIMIT - 30, LIMIT - 4, LIMIT + 3, 12)]
    gen = Generator(SkipModel.from_hf(hf), mode=mode, **options)
    got = gen.generate(prompts, max_new_tokens=60, eos_token_id=[]).tokens
    for p, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, p, 60, eos_token_id=[])
