"""Prompt-lookup drafting: the n-gram rule, and lossless output through verify/accept."""

import pytest
from hypothesis import given, settings, strategies as st
import torch

from conftest import assert_follows, next_token_marginals, tiny_model
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.drafters import lookup_draft, lookup_match

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [200]]


def test_lookup_rule():
    assert lookup_draft([1, 2, 3, 9, 1, 2], k=3) == [3, 9, 1]  # 2-gram "1 2" wins over 1-gram
    assert lookup_draft([1, 2, 3, 1, 2, 4, 2], k=2) == [4, 2]  # a tie of next tokens: the latest "2"
    assert lookup_draft([1, 5, 1, 5, 1, 7, 1], k=2) == [5, 1]  # "1" was followed by 5 twice, 7 once
    assert lookup_match([1, 5, 1, 5, 1, 7, 1], k=2, vote=False) == (1, [7, 1])  # the latest "1"
    assert lookup_draft([4, 5, 6], k=3) == []  # no earlier occurrence
    assert lookup_draft([7, 8, 9, 7, 8, 9, 7, 8], k=10) == [9, 7, 8]  # stops at the end of context
    assert lookup_draft([1, 1], k=0) == [] and lookup_draft([3], k=4) == []


def test_greedy_lookup_equals_ar():
    hf = tiny_model("llama", num_hidden_layers=5)
    ar = Generator(hf).generate(PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens
    for k_max in (1, 4, 12):
        out = Generator(hf, mode="self-spec", drafter="lookup", k_max=k_max).generate(
            PROMPTS, max_new_tokens=30, eos_token_id=[])
        assert out.tokens == ar
        assert out.stats["draft_steps"] == 0 and out.stats["drafted"] > 0


def test_sampled_lookup_keeps_the_distribution():
    """Every bigram "4 t" and "t 4" appears in the prompt, so lookup always drafts two tokens (q
    one-hot); the second and third generated tokens must follow their exact marginals."""
    hf = tiny_model("llama", num_hidden_layers=3, vocab_size=32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.05)  # spread-out distributions: accepts and rejects
    sm = SkipModel.from_hf(hf)
    prompt, n = [x for t in range(32) for x in (4, t)] + [3, 4], 3000  # "4 t" occurs for every t
    expect = next_token_marginals(sm, prompt, lambda z: z.double().softmax(-1), 3)
    gen = Generator(sm, mode="self-spec", drafter="lookup", k_max=3)
    out = gen.generate([prompt] * n, max_new_tokens=3, do_sample=True, seed=list(range(n)), eos_token_id=[])
    assert out.stats["drafted"] >= 1.5 * n and 0 < out.stats["accepted"] < out.stats["drafted"]
    for j in (1, 2):
        assert_follows([t[j] for t in out.tokens], expect[j])


def test_unknown_drafter_is_refused():
    with pytest.raises(SwiftkernError, match="unknown drafter"):
        Generator(tiny_model("llama"), mode="self-spec", drafter="magic")


def _slow_lookup(context, k, max_ngram, min_ngram, vote=True):
    """Reference: every earlier window equal to the last n tokens, for the longest n that has
    one with a non-empty continuation; (n, the continuation of the latest window among those
    whose next token is the most common next token of all of them; vote=False: of the latest
    window)."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(context):
            continue
        tail = tuple(context[-n:])
        starts = [s for s in range(len(context) - n) if tuple(context[s:s + n]) == tail
                  and s + n < len(context)]
        if starts:
            nexts = [context[s + n] for s in starts]
            top = max(nexts.count(t) for t in nexts) if vote else 0
            s = max(s for s in starts if nexts.count(context[s + n]) >= top)
            return n, context[s + n:s + n + k]
    return 0, []


@settings(max_examples=400, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=60), k=st.integers(0, 8),
       max_ngram=st.integers(1, 10), min_ngram=st.integers(1, 4))
def test_lookup_matches_a_slow_reference(context, k, max_ngram, min_ngram):
    expect = _slow_lookup(context, k, max_ngram, min_ngram) if k > 0 else (0, [])
    assert lookup_match(context, k, max_ngram=max_ngram, min_ngram=min_ngram) == expect
    assert lookup_draft(context, k, max_ngram=max_ngram, min_ngram=min_ngram) == expect[1]
    latest = _slow_lookup(context, k, max_ngram, min_ngram, vote=False) if k > 0 else (0, [])
    assert lookup_match(context, k, max_ngram=max_ngram, min_ngram=min_ngram, vote=False) == latest


def test_lookup_reports_the_match_length():
    assert lookup_match([1, 2, 3, 4, 9, 2, 3, 4], k=2) == (3, [9, 2])  # "2 3 4" matched
    assert lookup_match([5, 1, 2, 3, 4, 6, 1, 2, 3, 4], k=1, max_ngram=3) == (3, [6])  # capped at 3
    assert lookup_match([5, 6, 7], k=2) == (0, [])
