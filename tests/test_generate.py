"""Generator in mode ar against HF generate (tiny random models) and sampling statistics."""

import itertools
import random

import numpy as np
import pytest
import torch

from conftest import expected_probs, hf_greedy, tiny_model
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.cuda_graphs import GraphRunner
from swiftkern.graph_capture import EmulatedGraph
from swiftkern.sampling import SamplingParams, filter_logits, keyed_uniform, sample_from_weights

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_matches_hf_batch_1_and_batched(arch):
    hf = tiny_model(arch)
    gen = Generator(hf)
    refs = [hf_greedy(hf, p, 24, eos_token_id=[]) for p in PROMPTS]
    for p, r in zip(PROMPTS, refs):
        assert gen.generate([p], max_new_tokens=24, eos_token_id=[]).tokens[0] == r
    assert gen.generate(PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens == refs


@pytest.mark.parametrize("kw", [
    dict(mode="ar"),
    dict(mode="self-spec", drafter="lookup"),
    dict(mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:2", eps=0.0),
    dict(mode="deterministic"),
    dict(mode="deterministic", replay="always", window=16),
    dict(mode="ar", cuda_graphs=EmulatedGraph),
], ids=["ar", "lookup", "layer-skip", "det", "det-replay", "ar-graphs"])
def test_a_sliding_window_model_runs_up_to_its_window(kw):
    """Up to the window a sliding-window model attends to every key, as swiftkern does: prompt +
    max_new_tokens = window gives HF greedy's tokens in every mode, though verify passes and
    replay windows pad past it (their outputs discarded) and the graph runner rounds its cache
    up; one token more is refused. (The padding and the rounding were refused before.)"""
    window = 48
    hf = tiny_model("mistral", sliding_window=window, max_position_embeddings=128)
    model = SkipModel.from_hf(hf)
    graphs = kw.pop("cuda_graphs", None)
    gen = Generator(model, cuda_graphs=GraphRunner(model, graphs) if graphs else False, **kw)
    prompt = list(range(3, 13)) * 3  # repetitive: lookup drafts
    new = window - len(prompt)
    assert gen.generate([prompt], max_new_tokens=new, eos_token_id=[]).tokens[0] == \
        hf_greedy(hf, prompt, new, eos_token_id=[])
    with pytest.raises(SwiftkernError, match=f"sliding-window attention \\({window} tokens\\)"):
        gen.generate([prompt], max_new_tokens=new + 1, eos_token_id=[])
    with pytest.raises(SwiftkernError, match="used"):
        model.new_cache(1, 8, used=9)


def test_eos_and_max_new_tokens_are_exact():
    hf = tiny_model("llama")
    gen = Generator(hf)
    free = gen.generate(PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens
    # make a token the first row generates at step 3 the EOS: every row stops right after it
    eos = free[0][3]
    out = gen.generate(PROMPTS, max_new_tokens=30, eos_token_id=eos)
    for row, full in zip(out.tokens, free):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]
    assert out.tokens[0] == hf_greedy(hf, PROMPTS[0], 30, eos_token_id=eos)
    assert [len(t) for t in gen.generate(PROMPTS, max_new_tokens=7, eos_token_id=[]).tokens] == [7] * 4


@pytest.mark.parametrize("mode", ["self-spec", "deterministic"])
def test_the_cache_is_sized_by_the_drafts_a_call_can_make(mode, monkeypatch):
    """A verify pass overshoots a row's tokens by at most min(k_max, max_new_tokens) + 1: a huge
    k_max allocated a cache of k_max positions for a call of 4 tokens (1 GB at k_max 10^6 on a
    tiny model; SmolLM2 at 10^5: ~4.6 GB). The output stays HF's greedy."""
    hf = tiny_model("llama")
    model = SkipModel.from_hf(hf)
    sizes = []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda batch, max_len, used=None: sizes.append(max_len) or
                        new_cache(batch, max_len, used))
    kw = dict(drafter="self-spec", layer_set="mlp:1", replay="always") if mode == "deterministic" else {}
    gen = Generator(model, mode=mode, k_max=100000, **kw)
    out = gen.generate([PROMPTS[0]], max_new_tokens=4, eos_token_id=[])
    assert out.tokens[0] == hf_greedy(hf, PROMPTS[0], 4, eos_token_id=[])
    window = gen.window if mode == "deterministic" else 0
    assert sizes and max(sizes) <= len(PROMPTS[0]) + 4 + max(window, 4 + 1), sizes


@pytest.mark.parametrize("mode", ["ar", "self-spec"])
def test_dynamic_rope_decodes_as_hf(mode):
    """Dynamic NTK scaling rescales the frequencies by the longest position of a forward: the
    invariant set's RoPE table, filled 1024 positions at a time past the model's 512, rotated
    every position with rescaled frequencies (6 of 20 prompts left HF's greedy tokens). Such a
    model decodes with the regular kernels; what cannot hold it (mode deterministic, the
    invariant context) refuses it."""
    hf = tiny_model("llama", seed=3, rope_scaling={"rope_type": "dynamic", "factor": 8.0})
    model = SkipModel.from_hf(hf)
    gen = Generator(model, mode=mode, **({"layer_set": "mlp:1"} if mode == "self-spec" else {}))
    assert not gen.invariant_decode()
    rng = random.Random(0)
    for _ in range(8):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(5, 60))]
        got = gen.generate([prompt], max_new_tokens=40, eos_token_id=[]).tokens[0]
        assert got == hf_greedy(hf, prompt, 40, eos_token_id=[]), prompt
    with pytest.raises(SwiftkernError, match="rope_type 'dynamic'"):
        Generator(model, mode="deterministic")
    with pytest.raises(SwiftkernError, match="rope_type 'dynamic'"):
        with model.batch_invariant():
            pass


def test_stats_are_consistent():
    out = Generator(tiny_model("llama")).generate(PROMPTS, max_new_tokens=9, eos_token_id=[])
    s = out.stats
    assert s["new_tokens"] == 36 and s["batch"] == 4 and s["steps"] == 8
    assert s["prompt_tokens"] == sum(map(len, PROMPTS)) and s["tokens_per_s"] > 0


def test_sampling_is_seeded_and_batch_independent():
    gen = Generator(tiny_model("llama"))
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.3, top_k=50, top_p=0.9, eos_token_id=[])
    alone = gen.generate([PROMPTS[1]], seed=7, **kw).tokens[0]
    assert gen.generate([PROMPTS[1]], seed=7, **kw).tokens[0] == alone
    batched = gen.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], seed=[1, 7, 3], **kw).tokens
    assert batched[1] == alone
    assert gen.generate([PROMPTS[1]], seed=8, **kw).tokens[0] != alone


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.5, 0, 0.8), (1.0, 20, 0.9)])
def test_first_token_distribution(temperature, top_k, top_p):
    """Chi-square of 4000 seeded first-token draws against the filtered softmax."""
    hf = tiny_model("llama", vocab_size=64)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.05)  # a spread-out distribution over the 64 tokens
    gen = Generator(hf)
    prompt = [5, 9, 11]
    model = SkipModel.from_hf(hf)
    logits = model.forward(torch.tensor([prompt]), model.new_cache(1, 4))[0, -1]
    expect = expected_probs(logits, temperature, top_k, top_p)
    n = 4000
    out = gen.generate([prompt] * n, max_new_tokens=1, do_sample=True, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=list(range(n)), eos_token_id=[])
    counts = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=64).double()
    assert counts[expect == 0].sum() == 0, "a filtered-out token was sampled"
    support = expect > 0
    exp_counts = expect[support] * n
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(support.sum()) - 1
    # p < 1e-4 threshold: dof + 4.5 * sqrt(2 dof) + 10 bounds the chi-square tail for these dofs
    assert chi2 < dof + 4.5 * (2 * dof) ** 0.5 + 10, (chi2, dof)


def test_inverse_cdf_draw_and_keyed_uniforms():
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0]])
    assert sample_from_weights(w, torch.tensor([0.0])).item() == 1
    assert sample_from_weights(w, torch.tensor([0.2499])).item() == 1
    assert sample_from_weights(w, torch.tensor([0.25])).item() == 3
    assert sample_from_weights(w, torch.tensor([0.9999])).item() == 3
    us = [keyed_uniform(3, p) for p in range(2000)]
    assert keyed_uniform(3, 17) == us[17] and all(0 <= u < 1 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.03
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    kept = filter_logits(logits, SamplingParams(True, 1.0, 2, 1.0))
    assert torch.isinf(kept[0, :2]).all() and torch.isfinite(kept[0, 2:]).all()


def test_bad_inputs_are_refused():
    gen = Generator(tiny_model("llama"))
    with pytest.raises(SwiftkernError, match="max_new_tokens"):
        gen.generate([[1, 2]], max_new_tokens=0)
    with pytest.raises(SwiftkernError, match="exceeds"):
        gen.generate([[1] * 500], max_new_tokens=20)
    with pytest.raises(SwiftkernError, match="outside"):
        gen.generate([[1, 99999]])
    with pytest.raises(SwiftkernError, match="tokenizer"):
        gen.generate("hello")
    for tiny_temperature in (0.0, 1e-40, 1e-6):  # 1e-40: logits / t overflowed, the last id was drawn
        with pytest.raises(SwiftkernError, match="temperature must be >= 1e-05.*greedily"):
            gen.generate([[1]], do_sample=True, temperature=tiny_temperature)
    with pytest.raises(SwiftkernError, match="top_p"):
        gen.generate([[1]], do_sample=True, top_p=1.5)
    for stop in (5, 3.5, ""):  # a TypeError from list(5), or no stop at all for ""
        with pytest.raises(SwiftkernError, match="stop must be a non-empty string"):
            gen.generate([[1]], stop=stop)
    with pytest.raises(SwiftkernError, match="arrive_at: a list"):
        gen.generate([[1]], arrive_at=0)
    with pytest.raises(SwiftkernError, match="chat applies the tokenizer's chat template to text"):
        gen.generate([[1, 2]], chat=True)  # was ignored: the ids ran without a template
    with pytest.raises(SwiftkernError, match="skip_ratio is the search's"):
        Generator(tiny_model("llama"), mode="self-spec", layer_set="mlp:1", skip_ratio=0.3)
    with pytest.raises(SwiftkernError, match="unknown mode"):
        Generator(tiny_model("llama"), mode="warp")


def test_token_ids_must_be_integers_and_flags_one_per_prompt():
    """A float id is refused rather than truncated (1.5 would have run as token 1); integer ids
    of any kind (numpy, a tensor [T] or [B, T]) give the tokens of the same plain list."""
    gen = Generator(tiny_model("llama"), mode="deterministic")
    want = gen.generate([[5, 7, 9]], max_new_tokens=4).tokens
    for same in (torch.tensor([5, 7, 9]), torch.tensor([[5, 7, 9]], dtype=torch.int32),
                 [np.int64(5), np.int64(7), np.int64(9)], [(5, 7, 9)]):
        assert gen.generate(same, max_new_tokens=4).tokens == want
    for bad, match in (([[1.5, 2]], "integer token ids, got 1.5"), (torch.tensor([[1.0, 2.0]]), "integer token ids"),
                       (torch.ones(1, 2, 3, dtype=torch.int64), r"\[T\] or \[B, T\]"), ([[1, True]], "got True"),
                       ([None], "text or a list of token ids")):
        with pytest.raises(SwiftkernError, match=match):
            gen.generate(bad, max_new_tokens=4)
    with pytest.raises(SwiftkernError, match="1 deterministic flags for 2 prompts"):
        gen.generate([[1, 2], [3, 4]], max_new_tokens=4, deterministic=[True])


class _LetterTokenizer:
    """Token t reads as one letter, chr(97 + t % 26): enough for stop strings."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(t) % 26) for t in ids)


def test_scalar_arguments_of_the_wrong_kind_are_refused():
    """Not truncated (2.5 -> 2), not ignored, and not a TypeError from deep inside."""
    hf = tiny_model("llama")
    gen = Generator(hf)
    for kwargs, match in ((dict(max_new_tokens=4.5), "max_new_tokens must be an integer"),
                          (dict(do_sample=True, seed=1.5), "seed must be an integer"),
                          (dict(do_sample=True, seed=[2, "x"]), "seed must be an integer"),
                          (dict(eos_token_id=2.5), "eos_token_id entry must be an integer"),
                          (dict(eos_token_id=[-1]), r"eos_token_id entry must be in \[0, "),
                          (dict(stop_token_ids=[10**6]), r"stop_token_ids entry must be in \[0, "),
                          (dict(do_sample=True, temperature="hot"), "temperature must be a number"),
                          (dict(do_sample=True, top_k=2.5), "top_k must be an integer"),
                          (dict(stop=[""]), "stop must be a non-empty string"),
                          (dict(do_sample="yes"), "do_sample must be True or False"),
                          (dict(chat=None), "chat must be True or False"),
                          (dict(deterministic="yes"), "deterministic must be True or False"),
                          (dict(do_sample=True, seed=2**64), r"seed must be in \[-9223372036854775808, "),
                          (dict(stop_token_ids="x"), "stop_token_ids entry must be an integer")):
        with pytest.raises(SwiftkernError, match=match):
            gen.generate([[1, 2]], **{"max_new_tokens": 4, **kwargs})
    for kwargs, match in ((dict(mode="self-spec", k_max=2.5), "k_max must be an integer"),
                          (dict(mode="deterministic", window=8.0), "window must be an integer"),
                          (dict(mode="ar", drafter="lookup"), "needs mode self-spec"),
                          (dict(mode="ar", layer_set="attn:1"), "would ignore layer_set"),
                          (dict(mode="deterministic", layer_set="attn:1"), "would ignore layer_set"),
                          (dict(mode="self-spec", layer_set=3), "layer_set must be a LayerSet, its string form"),
                          (dict(mode="self-spec", adaptive_eps="yes"), "adaptive_eps must be True or False")):
        with pytest.raises(SwiftkernError, match=match):
            Generator(hf, **kwargs)


def test_one_stop_id_and_seeds_at_the_ends_of_their_range():
    """stop_token_ids takes one id as eos_token_id does; a seed s < 0 is 2**64 + s (torch's rule)."""
    gen = Generator(tiny_model("llama"))
    free = gen.generate([[5, 6]], max_new_tokens=8, eos_token_id=[]).tokens[0]
    assert gen.generate([[5, 6]], max_new_tokens=8, eos_token_id=[], stop_token_ids=free[3]).tokens[0] == \
        free[:free.index(free[3]) + 1]
    draws = {s: gen.generate([[5, 6]], max_new_tokens=8, do_sample=True, seed=s).tokens[0]
             for s in (-1, 2**64 - 1, -(2**63), 2**63)}
    assert draws[-1] == draws[2**64 - 1] and draws[-(2**63)] == draws[2**63]


def test_a_stop_string_given_alone_is_one_string_not_its_letters():
    hf = tiny_model("llama")
    gen = Generator(hf, _LetterTokenizer())
    free = gen.generate([[1, 2]], max_new_tokens=24, eos_token_id=[]).tokens[0]
    text = _LetterTokenizer().decode(free)
    pair = next(text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2] not in text[:i + 1])
    alone = gen.generate([[1, 2]], max_new_tokens=24, eos_token_id=[], stop=pair).tokens[0]
    listed = gen.generate([[1, 2]], max_new_tokens=24, eos_token_id=[], stop=[pair]).tokens[0]
    assert alone == listed == free[:text.index(pair) + 2]  # ends right after the pair, not at its first letter


@pytest.mark.parametrize("mode", [dict(mode="self-spec", drafter="layer-skip", layer_set="mlp:1", eps=0.0, k_max=4),
                                  dict(mode="deterministic", drafter="self-spec", layer_set="mlp:1", eps=0.0, k_max=4)],
                         ids=["self-spec", "deterministic-self-spec"])
def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(mode, fixed_costs):
    """Speculative steps commit several tokens at once: wherever a stop string ends (at every
    place of the free output that a string first reaches), the output ends right after it, as
    greedy decoding's free output cut there; some of those places are inside a step's commit
    (asserted from the streamed commits). The drafter policy runs on its fixed cost model
    (timings would make how many drafts a step takes vary from run to run)."""
    hf = tiny_model("llama")
    free = Generator(hf, _LetterTokenizer()).generate([[1, 2]], max_new_tokens=24, eos_token_id=[]).tokens[0]
    text = _LetterTokenizer().decode(free)
    gen = Generator(hf, _LetterTokenizer(), **mode)
    commits = []  # tokens made final together, step by step
    spec = gen.generate([[1, 2]], max_new_tokens=24, eos_token_id=[], streamer=lambda r, t: commits.append(len(t)))
    assert spec.tokens[0] == free
    ends = set(itertools.accumulate(commits))  # output lengths at which a step's commit ends
    cuts_inside = 0
    for n in range(2, len(text) + 1):  # the shortest string whose first occurrence ends at n
        stop = next((text[n - k:n] for k in range(1, n + 1) if text[n - k:n] not in text[:n - 1]), None)
        if stop is None:
            continue
        out = gen.generate([[1, 2]], max_new_tokens=24, eos_token_id=[], stop=stop)
        assert out.tokens[0] == free[:n], stop
        cuts_inside += n not in ends
    assert cuts_inside > 0, commits


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 5)])
def test_filter_logits_keeps_what_hf_warpers_keep(temperature, top_k):
    """filter_logits vs transformers' own Temperature -> TopK -> TopP warpers on random rows,
    with top_p set so that a row's cumulative mass sits exactly on the cut (HF removes a token
    whose sorted cumulative probability is <= 1 - top_p), and a row whose top-k cut falls among
    values 1e-4 apart: the same tokens kept, the same values."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    g = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[1, :10] = logits[1, 10]  # ties
    logits[2, :10] = logits[2].max() + 1 + 1e-4 * torch.arange(10)  # near-ties at the top: top-k cuts inside them
    for row in range(logits.shape[0]):
        z = logits[row:row + 1] / temperature
        if top_k:
            z = TopKLogitsWarper(top_k)(None, z)
        cum = z.sort(dim=-1).values.softmax(-1).cumsum(-1)[0]
        edge = float(cum[(cum >= 0.5).nonzero()[0, 0]])  # in [0.5, 1): 1 - (1 - edge) == edge exactly
        for top_p in (1.0 - edge, 0.9, 0.3):
            if not 0 < top_p <= 1:
                continue
            want = TemperatureLogitsWarper(temperature)(None, logits[row:row + 1].clone())
            if top_k:
                want = TopKLogitsWarper(top_k)(None, want)
            want = TopPLogitsWarper(top_p)(None, want)
            got = filter_logits(logits[row:row + 1], SamplingParams(True, temperature, top_k, top_p))
            assert torch.equal(torch.isinf(got), torch.isinf(want)), (row, top_p)
            torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])
