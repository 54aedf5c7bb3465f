"""lookup_index: the context's index gives ``lookup_match``'s answer over indexed + further tokens,
match for match (hypothesis-drawn contexts over small vocabularies, so that tokens, pairs and
longer n-grams repeat, indexed at once or extended piece by piece, and long prompts made of
repeated chunks); PromptLookup following a growing output (and one that changed under it), its
choice of way and its dropping of finished requests' indexes; and lookup decoding with prompts
long enough to be indexed, greedy and deterministic, against plain decoding."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from swiftkern import Generator
from swiftkern.drafters import lookup_match
from swiftkern.lookup_index import ContextIndex, PromptLookup


@settings(max_examples=600, deadline=None)
@given(vocab=st.sampled_from([1, 2, 3, 5, 20]), data=st.data(), k=st.integers(0, 12),
       max_ngram=st.integers(1, 10), min_ngram=st.integers(1, 4), vote=st.booleans())
def test_index_equals_the_scan(vocab, data, k, max_ngram, min_ngram, vote):
    """Indexed tokens (made at once, or from a start extended by pieces) then tokens not indexed."""
    tokens = st.lists(st.integers(0, vocab - 1), max_size=50)
    indexed = data.draw(tokens, label="indexed")
    pieces = data.draw(st.lists(tokens, max_size=3), label="extended by")
    rest = data.draw(st.lists(st.integers(0, vocab - 1), min_size=0 if indexed or any(pieces) else 1, max_size=30),
                     label="not indexed")
    grown = ContextIndex(indexed)
    for piece in pieces:
        grown.extend(piece)
    whole = indexed + [t for piece in pieces for t in piece]
    want = lookup_match(whole + rest, k, max_ngram, min_ngram, vote)
    assert grown.match(rest, k, max_ngram, min_ngram, vote) == want
    assert ContextIndex(whole).match(rest, k, max_ngram, min_ngram, vote) == want
    followed = range(len(whole) - 1)  # the positions another indexed token follows
    singles, pairs = {}, {}
    for end in followed:
        singles.setdefault(whole[end], []).append(end)
        if end >= 1:
            pairs.setdefault((whole[end - 1], whole[end]), []).append(end)
    assert (grown.singles, grown.pairs) == (singles, pairs)


def _chunked(n: int, seed: int, vocab: int = 300) -> list[int]:
    """n tokens made of chunks copied from earlier (as text repeats itself) and fresh ones."""
    rng = random.Random(seed)
    out = [rng.randrange(vocab) for _ in range(16)]
    while len(out) < n:
        if rng.random() < 0.6:
            j = rng.randrange(len(out) - 2)
            out += out[j:j + rng.randrange(2, 12)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
    return out[:n]


def test_index_equals_the_scan_on_long_prompts():
    for seed in range(3):
        tokens = _chunked(3000, seed)
        index = ContextIndex(tokens[:2500])
        for g in range(1, 500, 7):
            generated = tokens[2500:2500 + g]
            for k in (1, 8):
                assert index.match(generated, k) == lookup_match(tokens[:2500] + generated, k), (seed, g, k)


def test_prompt_lookup_indexes_long_contexts_and_drops_finished_ones():
    short, long_a, long_b = _chunked(50, 0), _chunked(400, 1), _chunked(300, 2)
    done = [False, False, False]
    lookup = PromptLookup([short, long_a, long_b], done)
    for r, prompt in enumerate([short, long_a, long_b]):
        committed = prompt[-5:] + [7]
        assert lookup.match(r, committed, 6) == lookup_match(prompt + committed, 6)
    assert sorted(lookup._indexes) == [1, 2]  # the short one is scanned
    done[1] = True
    lookup._indexes.pop(2)
    lookup.match(2, [1], 4)  # a new index: the finished request's goes
    assert sorted(lookup._indexes) == [2]


def test_prompt_lookup_follows_the_output():
    """A short prompt whose output grows past INDEX_MIN_TOKENS, with tokens pending after it; the
    index extends with each commit, and is made again when the output does not extend it."""
    tokens = _chunked(700, 3)
    prompt, output = tokens[:100], tokens[100:]
    lookup = PromptLookup([prompt])
    for n in range(0, 600, 9):
        committed, pending = output[:n], output[n:n + 3]
        assert lookup.match(0, committed, 8, pending=pending) == lookup_match(prompt + committed + pending, 8), n
    index = lookup._indexes[0]
    assert index.tokens == prompt + output[:594]
    changed = output[:590] + [5, 6, 7, 8]  # not an extension of what it holds
    assert lookup.match(0, changed, 8) == lookup_match(prompt + changed, 8)
    assert lookup._indexes[0] is not index and lookup._indexes[0].tokens == prompt + changed


def _long_prompts(vocab: int) -> list[list[int]]:
    return [[t % vocab for t in _chunked(n, seed)] for seed, n in ((5, 300), (6, 420), (7, 30))]


def test_greedy_lookup_with_indexed_prompts_equals_ar():
    hf = tiny_model("llama", num_hidden_layers=3)
    prompts = _long_prompts(hf.config.vocab_size)
    ar = Generator(hf).generate(prompts, max_new_tokens=24, eos_token_id=[]).tokens
    out = Generator(hf, mode="self-spec", drafter="lookup").generate(prompts, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == ar
    assert out.stats["drafted"] > 0


def test_deterministic_lookup_with_indexed_prompts_keeps_its_bits(monkeypatch):
    """Mode deterministic whose self-spec fast path drafts by prompt lookup over long prompts:
    the tokens and logprobs of the plain fast path, and a prompt alone keeps its bits in the
    batch."""
    import swiftkern.deterministic as deterministic

    policy = deterministic.FastPathPolicy  # fixed costs: which matches it takes must not hang on the load
    monkeypatch.setattr(deterministic, "FastPathPolicy", lambda *a, **k: policy(*a, **k, measure=False))
    hf = tiny_model("llama", num_hidden_layers=3)
    prompts = _long_prompts(hf.config.vocab_size)
    kw = dict(max_new_tokens=20, eos_token_id=[])
    plain = Generator(hf, mode="deterministic", window=6, replay="always").generate(prompts, **kw)
    gen = Generator(hf, mode="deterministic", window=6, drafter="self-spec", layer_set="attn:1,2|mlp:2", eps=0.0,
                    replay="always", verify_batch=2)
    spec = gen.generate(prompts, **kw)
    assert spec.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(spec.logprobs, plain.logprobs))
    assert spec.stats["lookup_tokens"] + spec.stats["lookup_checked"] > 0
    alone = gen.generate(prompts[1:2], **kw)
    assert alone.tokens[0] == spec.tokens[1] and torch.equal(alone.logprobs[0], spec.logprobs[1])
