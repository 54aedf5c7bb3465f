"""Pruned draft LM head: logits equal the full head's restricted to the subset; drafting with
it stays lossless (greedy == ar, sampled distribution kept)."""

import pytest
import torch

from conftest import assert_follows, next_token_marginals, tiny_model
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.draft_head import DraftHead

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200]]


def test_subset_grows_without_duplicates_and_maps_back():
    w = torch.randn(50, 8)
    head = DraftHead(w, None, num_frequent=10, context_ids=[3, 40, 41, 40])
    assert head.ids.tolist() == list(range(10)) + [40, 41]
    head.add([41, 7, 49] + list(range(20, 40)))  # 41 and 7 are members already
    assert head.ids.tolist() == list(range(10)) + [40, 41, 49] + list(range(20, 40))
    weight, bias, packed = head.head
    assert packed is None  # a plain tensor head has no packed rows
    assert bias is None and torch.equal(weight, w[head.ids])
    full = head.to_full(torch.arange(len(head), dtype=torch.float32))
    assert full[49] == 12 and full[10] == float("-inf") and full[3] == 3
    with pytest.raises(SwiftkernError, match="outside"):
        head.add([50])


def test_capacity_growth_keeps_rows_and_bias():
    w, b = torch.randn(3000, 4), torch.randn(3000)
    head = DraftHead(w, b, num_frequent=5)
    head.add(range(100, 2900))  # forces a regrow of the row buffer
    weight, bias, packed = head.head
    assert packed is None  # a plain tensor head has no packed rows
    assert torch.equal(weight, w[head.ids]) and torch.equal(bias, b[head.ids])


def test_packed_rows_are_the_packed_heads_rows_of_the_ids(uninitialized_is_poison):
    """With a packed head (uint8 [V, H/32, bytes]) the pruned head's packed rows are that head's
    rows of ``ids``, in the same order as its weight rows, through context ids and a regrow
    (checked against plain indexing; a row left unwritten holds the poison 255)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 64, generator=gen)
    packed = torch.randint(0, 255, (3000, 2, 18), dtype=torch.uint8, generator=gen)  # no 255: poison shows
    head = DraftHead(w, None, num_frequent=5, context_ids=[2999, 7, 4], packed_head=packed)
    head.add(range(100, 2900))  # forces a regrow of the row buffers
    weight, bias, rows = head.head
    assert head.ids.tolist() == [0, 1, 2, 3, 4, 2999, 7] + list(range(100, 2900))
    assert bias is None and torch.equal(weight, w[head.ids]) and torch.equal(rows, packed[head.ids])


def test_pruned_logits_are_the_full_logits_restricted():
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=3))
    head = DraftHead(sm.lm_head, sm.lm_head_bias, num_frequent=40, context_ids=[200, 250, 7])
    tokens = torch.tensor([[5, 6, 7, 250], [9, 200, 3, 1]])
    full = sm.forward(tokens, sm.new_cache(2, 8))  # [2, 4, V]
    pruned = sm.forward(tokens, sm.new_cache(2, 8), head=head.head)  # [2, 4, n]
    torch.testing.assert_close(pruned, full[..., head.ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("draft_vocab", [1, 30, 150])
@pytest.mark.parametrize("drafter", ["layer-skip", "auto"])
def test_greedy_with_a_pruned_head_equals_ar(draft_vocab, drafter):
    hf = tiny_model("llama", num_hidden_layers=6)
    ar = Generator(hf).generate(PROMPTS, max_new_tokens=20, eos_token_id=[]).tokens
    gen = Generator(hf, mode="self-spec", drafter=drafter, layer_set="attn:2|mlp:3", k_max=5, eps=0.0,
                    draft_vocab=draft_vocab)
    out = gen.generate(PROMPTS, max_new_tokens=20, eos_token_id=[])
    assert out.tokens == ar
    if drafter == "layer-skip":
        assert out.stats["drafted"] > 0


def test_sampling_with_a_pruned_head_keeps_the_distribution():
    """The second and third tokens (after two drafts) follow their exact marginals."""
    V = 48
    hf = tiny_model("llama", num_hidden_layers=6, vocab_size=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.6)  # ~20 tokens carry the mass: drafts accepted and rejected
    sm = SkipModel.from_hf(hf)
    prompt, n = [5, 9, 11], 3000
    expect = next_token_marginals(sm, prompt, lambda z: z.double().softmax(-1), 3)
    # the draft sees 17 of 48 tokens: its q is zero elsewhere, the target must still be exact
    gen = Generator(sm, mode="self-spec", drafter="layer-skip", layer_set="attn:1-3|mlp:2", k_max=3, eps=0.0,
                    draft_vocab=17)
    out = gen.generate([prompt] * n, max_new_tokens=3, do_sample=True, seed=list(range(n)), eos_token_id=[])
    s = out.stats
    assert s["drafted"] >= 1.8 * n and 0.2 < s["accepted"] / s["drafted"] < 0.8, s
    for j in (1, 2):
        assert_follows([t[j] for t in out.tokens], expect[j])
