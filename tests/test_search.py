"""Layer-set search on models: matchness against a slow per-position reference, batched
candidate forwards, on-the-fly search staying token-identical to ar, the stored-set round trip."""

import os
import random

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, LayerSet, SkipModel, SwiftkernError
from swiftkern import layer_set_store
from swiftkern.search import matchness

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200]]
SMALL_SEARCH = dict(window=8, steps_per_window=8, time_fraction=100.0)


def _slow_matchness(sm, context, layer_set, window):
    """Per position j of the window: prefill the full model on the context before the window,
    decode the window's tokens one at a time with the layer set skipped, compare the top-1."""
    n = min(window, len(context) - 1)
    start = len(context) - 1 - n
    hits = 0
    for j in range(n):
        cache = sm.new_cache(1, len(context) + 1)
        if start:
            sm.forward(torch.tensor([context[:start]]), cache)
        logits = None
        for t in context[start:start + j + 1]:
            logits = sm.forward(torch.tensor([[t]]), cache, layer_set=layer_set)[0, -1]
        hits += int(int(logits.argmax()) == context[start + j + 1])
    return hits / n


def test_matchness_equals_a_slow_per_position_reference():
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=5))
    out = Generator(sm).generate(PROMPTS[:2], max_new_tokens=14, eos_token_id=[]).tokens
    contexts = [PROMPTS[0] + out[0], PROMPTS[1] + out[1]]
    cache = sm.new_cache(2, 40)
    for b, ctx in enumerate(contexts):  # the full model's KV of each row, in one cache
        row = sm.new_cache(1, 40)
        sm.forward(torch.tensor([ctx[:-1]]), row)
        cache.k[:, b], cache.v[:, b] = row.k[:, 0], row.v[:, 0]
    cache.host_lengths = [len(c) - 1 for c in contexts]
    cache.lengths = torch.tensor(cache.host_lengths)
    before = cache.k.clone()
    cands = [LayerSet.parse(s, 5) for s in ("attn:1,2|mlp:3", "none", "attn:3|mlp:1-3")]
    for window in (4, 9):
        got = matchness(sm, cache, [0], [contexts[0]], cands, window)
        want = [_slow_matchness(sm, contexts[0], ls, window) for ls in cands]
        assert got == pytest.approx(want, abs=1e-12)
        assert got[1] == 1.0  # skipping nothing reproduces the full model's tokens
    both = matchness(sm, cache, [0, 1], contexts, cands, 6)  # two rows: mean over all positions
    want = [(_slow_matchness(sm, contexts[0], ls, 6) + _slow_matchness(sm, contexts[1], ls, 6)) / 2 for ls in cands]
    assert both == pytest.approx(want, abs=1e-12)
    assert torch.equal(cache.k, before)  # scoring never touches the live cache


def test_one_layer_set_per_row_equals_separate_forwards():
    sm = SkipModel.from_hf(tiny_model("qwen2", num_hidden_layers=4))
    sets = [LayerSet.parse(s, 4) for s in ("attn:1|mlp:2", "none", "attn:1,2|mlp:1-2")]
    tokens = torch.tensor([[5, 6, 7, 8], [9, 3, 4, 1], [2, 2, 7, 7]])
    together = sm.forward(tokens, sm.new_cache(3, 8), layer_set=sets)
    for i, ls in enumerate(sets):
        alone = sm.forward(tokens[i:i + 1], sm.new_cache(1, 8), layer_set=ls)
        torch.testing.assert_close(together[i], alone[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(SwiftkernError, match="2 layer sets for a batch of 3"):
        sm.forward(tokens, sm.new_cache(3, 8), layer_set=sets[:2])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter,skip_ratio", [("auto", "auto"), ("layer-skip", 0.3)])
def test_on_the_fly_search_is_greedy_identical_to_ar(arch, drafter, skip_ratio, tmp_path, monkeypatch, fixed_costs):
    from swiftkern.tuner import OnTheFlyTuner

    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    # what this test checks must not hang on this machine's timings: free draft forwards (no
    # ratio is dropped for speed), the drafter policy's fixed cost model (on a loaded machine
    # noisy verify costs made no ratio pay, even with free drafts) and no time cap (below)
    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: 0.0)
    hf = tiny_model(arch, num_hidden_layers=6)
    ar = Generator(hf).generate(PROMPTS, max_new_tokens=60, eos_token_id=[]).tokens
    gen = Generator(hf, mode="self-spec", drafter=drafter, layer_set="auto", skip_ratio=skip_ratio, eps=0.0,
                    search_options=dict(SMALL_SEARCH, time_fraction=1e9))
    out = gen.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    assert out.tokens == ar
    s = out.stats
    # the first phase scores candidates_per_forward (4) sets; it may already end the search
    assert s["search_phases"] >= 1 and s["candidates_scored"] >= 4, s.get("search_stop")
    if drafter == "layer-skip":
        assert s["drafter_steps"]["layer-skip"] > 0 and s["searched_layer_set"]


def test_bad_auto_configurations_are_refused():
    hf = tiny_model("llama", num_hidden_layers=6)
    with pytest.raises(SwiftkernError, match="needs mode self-spec"):
        Generator(hf, mode="ar", layer_set="auto")
    with pytest.raises(SwiftkernError, match="needs mode self-spec"):
        Generator(hf, mode="self-spec", drafter="lookup", layer_set="auto")
    with pytest.raises(SwiftkernError, match="skip_ratio"):
        Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=1.5)


def test_stored_layer_set_round_trips_and_is_refused_for_another_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    a = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6, seed=0))
    b = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6, seed=1))  # same shape, other weights
    assert layer_set_store.fingerprint(a) != layer_set_store.fingerprint(b)
    assert layer_set_store.fingerprint(a) == layer_set_store.fingerprint(SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6, seed=0)))
    assert layer_set_store.load(a) is None
    ls = LayerSet.parse("attn:2,3|mlp:1", 6)
    path = layer_set_store.save(a, ls, matchness=0.75, acceptance=0.5, speedup=1.1)
    record = layer_set_store.load(a)
    assert record["layer_set"] == ls and record["matchness"] == 0.75 and record["speedup"] == 1.1
    with pytest.raises(SwiftkernError, match="is for model"):
        layer_set_store.load_record(path, b)
    assert layer_set_store.load(b) is None  # b has no file of its own
    # the on-the-fly search starts from the stored set: it is the first candidate scored
    gen = Generator(a, mode="self-spec", drafter="layer-skip", layer_set="auto", skip_ratio=0.25,
                    search_options=SMALL_SEARCH)
    tuner = gen._tuner(None)
    assert any(s.propose(1)[0] == ls for s in tuner.searches.values())


@pytest.mark.parametrize("layers, ratio, said", [
    (2, "auto", r"needs >= 3 layers .* the model has 2: give a layer set yourself"),
    (1, 0.3, r"needs >= 3 layers .* the model has 1"),
    (3, 0.05, r"skip ratio 0.05 skips no sub-layer of a 3-layer model: raise it above 0.0833"),
])
def test_a_search_with_nothing_to_search_is_refused_when_the_generator_is_made(layers, ratio, said):
    """It was refused at the first generate call, and said nothing of what to do. The bound it
    names is the one: just above it a set of one sub-layer is searched."""
    from swiftkern.search import skip_count

    hf = tiny_model("llama", num_hidden_layers=layers)
    with pytest.raises(SwiftkernError, match=said):
        Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=ratio)
    if layers >= 3:
        assert skip_count(layers, 1 / (4 * layers)) == 0 and skip_count(layers, 1.001 / (4 * layers)) == 1
        gen = Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=1.001 / (4 * layers),
                        search_options=SMALL_SEARCH)
        out = gen.generate([[5, 6, 7]], max_new_tokens=6, eos_token_id=[]).tokens
        assert out == Generator(hf).generate([[5, 6, 7]], max_new_tokens=6, eos_token_id=[]).tokens


def test_a_cache_dir_that_cannot_be_written_is_said_with_the_set(tmp_path, monkeypatch):
    """A NotADirectoryError (or PermissionError) came out of swiftkern search as a traceback
    after the whole search, the set it found lost; a failed write left its .tmp file behind."""
    model = SkipModel.from_hf(tiny_model("llama"))
    ls = LayerSet.parse("attn:1", 4)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(SwiftkernError, match=r"cannot store layer set attn:1\|mlp: in .*a-file.*SWIFTKERN_CACHE_DIR"):
        layer_set_store.save(model, ls)
    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path / "cache"))
    os.makedirs(layer_set_store.path_for(model))  # the file's own name taken by a folder: the replace fails
    with pytest.raises(SwiftkernError, match="cannot store layer set attn:1"):
        layer_set_store.save(model, ls)
    assert os.listdir(layer_set_store.cache_dir()) == [os.path.basename(layer_set_store.path_for(model))]


@pytest.mark.parametrize("content,message", [
    ("[]", "not a swiftkern search record"),
    ('"attn:1"', "not a swiftkern search record"),
    ('{{"fingerprint": "{fp}"}}', "not a swiftkern search record"),
    ('{{"fingerprint": "{fp}", "layer_set": 5}}', "not a swiftkern search record"),
    ('{{"fingerprint": "{fp}", "layer_set": "attn:1", "format": 2}}', "format 2"),
    ('{{"fingerprint": "{fp}", "layer_set": "attn:99"}}', "outside"),
    ("{{", "cannot read it"),
], ids=["list", "string", "no-set", "set-not-a-string", "format", "bad-set", "not-json"])
def test_a_malformed_stored_file_is_refused_naming_it(tmp_path, monkeypatch, content, message):
    """A stored file that is not a record of this swiftkern (hand-edited, another version) is a
    SwiftkernError naming the file, from the store and from a Generator that reads it; a list
    or a record without its set was an AttributeError or KeyError, and another format was read."""
    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    model = SkipModel.from_hf(tiny_model("llama"))
    path = layer_set_store.save(model, LayerSet.parse("attn:1", 4))
    with open(path, "w") as f:
        f.write(content.format(fp=layer_set_store.fingerprint(model)))
    with pytest.raises(SwiftkernError, match=message) as refused:
        layer_set_store.load(model)
    assert path in str(refused.value)
    with pytest.raises(SwiftkernError, match=message):
        Generator(model, mode="self-spec", layer_set="auto", search_options=SMALL_SEARCH).generate(
            [[5, 6, 7]], max_new_tokens=4)


def test_a_stored_file_of_binary_bytes_is_refused_naming_it(tmp_path, monkeypatch):
    """Bytes that are not UTF-8 came out as a UnicodeDecodeError naming no file, and every
    layer_set="auto" call on the model failed with it until the file was found by hand."""
    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    model = SkipModel.from_hf(tiny_model("llama"))
    path = layer_set_store.save(model, LayerSet.parse("attn:1", 4))
    with open(path, "wb") as f:
        f.write(b"\xff\xfe\x00garbage")
    with pytest.raises(SwiftkernError, match="cannot read it.*delete it") as refused:
        layer_set_store.load(model)
    assert path in str(refused.value)


@pytest.mark.parametrize("L, ratio, bo_every", [(5, 0.2, 25), (6, 0.15, 2), (6, 0.25, 1), (4, 0.25, 1)])
def test_a_small_space_is_scored_once_a_set_until_exhausted(L, ratio, bo_every):
    """Every set of k sub-layers (C(2(L-2), k) of them), each scored once, then "exhausted".
    Random proposals retried 20 times and then proposed a set scored before: 16 scorings of 15
    sets at L 5, 31 of 28 at L 6 (a forward each, wasted)."""
    import math

    from swiftkern.search import LayerSetSearch, SearchConfig

    search = LayerSetSearch(L, SearchConfig(skip_ratio=ratio, bo_every=bo_every, target=2.0, patience=10**4,
                                            max_steps=10**4, pool=16))
    scores = random.Random(0)
    proposed = []
    while not search.done():
        for c in search.propose(2):
            proposed.append(tuple(c.to_bits()))
            search.observe(c, scores.random())
    assert search.done() == "exhausted"
    assert len(proposed) == len(set(proposed)) == math.comb(2 * (L - 2), search.k)
    assert all(sum(bits) == search.k and not bits[0] and not bits[L - 1] and not bits[L] and not bits[-1]
               for bits in proposed)


def test_a_search_over_every_searchable_sub_layer_runs_to_its_one_set(fixed_costs, tmp_path, monkeypatch):
    """At k = 2(L - 2) (a 4-layer model at the auto ladder's 0.45) there is one set and it has no
    neighbours: the first Bayesian-optimization proposal raised IndexError from rng.choice([]),
    in the offline search and in generate(layer_set="auto"). It now stops as exhausted."""
    from swiftkern.search import LayerSetSearch, SearchConfig

    search = LayerSetSearch(4, SearchConfig(skip_ratio=0.45, target=2.0))
    assert search.k == len(search.coords)
    for step in range(60):
        if search.done():
            break
        for c in search.propose(1):
            search.observe(c, 0.1 + 0.001 * step)
    assert search.done() == "exhausted" and search.steps == 1
    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    hf = tiny_model("llama")
    gen = Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=0.45, search_options=SMALL_SEARCH)
    out = gen.generate([[5, 6, 7, 8]], max_new_tokens=60, eos_token_id=[])
    assert out.tokens[0] == Generator(hf).generate([[5, 6, 7, 8]], max_new_tokens=60, eos_token_id=[]).tokens[0]


def test_an_asked_skip_ratio_is_the_only_one_searched(tmp_path, monkeypatch):
    """A stored set of another ratio added its ratio to the search even where skip_ratio was
    given (0.2 asked, a set of 5/12 drafted with); with "auto" it still joins the ladder."""
    from swiftkern.tuner import OnTheFlyTuner

    stored = LayerSet.parse("attn:1-2|mlp:1", 6)  # 3 of 12 sub-layers: no ratio of the auto ladder's
    asked = OnTheFlyTuner(6, None, skip_ratio=0.2, initial=stored)
    assert list(asked.searches) == [0.2]
    auto = OnTheFlyTuner(6, None, skip_ratio="auto", initial=stored)
    assert 3 / 12 in auto.searches


def test_offline_search_stores_a_measured_set(tmp_path, monkeypatch):
    from swiftkern.offline_search import search_layer_set

    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6))
    record = search_layer_set(sm, None, PROMPTS[:2], skip_ratio=0.25, budget_s=2.0, max_new_tokens=12,
                              log=lambda *a: None)
    (row,) = record["table"]
    assert row["scored"] >= 4 and 0.0 <= record["matchness"] <= 1.0 and record["speedup"] > 0
    assert LayerSet.parse(record["layer_set"], 6).num_skipped == 3  # round(0.25 * 12)
    stored = layer_set_store.load(sm)
    assert str(stored["layer_set"]) == record["layer_set"] and stored["speedup"] == record["speedup"]


def test_offline_search_on_a_tiny_budget_scores_one_batch(tmp_path, monkeypatch):
    """The loop looked at the clock before scoring anything: with no set scored its best was
    None, measured as the layer set "None" and refused with a message about layer sets."""
    from swiftkern.offline_search import search_layer_set

    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6))
    record = search_layer_set(sm, None, PROMPTS[:1], skip_ratio=0.25, budget_s=1e-9, max_new_tokens=4,
                              log=lambda *a: None)
    (row,) = record["table"]
    assert row["scored"] >= 1
    assert LayerSet.parse(record["layer_set"], 6).num_skipped == 3


@pytest.mark.parametrize("context_end", [None, 11])
def test_matchness_with_a_pruned_head_scores_the_drafts_top1(context_end):
    """The draft's top-1 under a pruned head is a token id (the head's row mapped back), compared
    with the targets. The head holds 3 frequent ids and the context's tokens (all of them, or the
    first 11: then the window's last targets are outside it), so its rows are not the token ids."""
    from swiftkern.draft_head import DraftHead

    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=5))
    ctx = PROMPTS[0] + Generator(sm).generate([PROMPTS[0]], max_new_tokens=12, eos_token_id=[]).tokens[0]
    cache = sm.new_cache(1, 40)
    sm.forward(torch.tensor([ctx[:-1]]), cache)
    cands = [LayerSet.parse(s, 5) for s in ("attn:1,2|mlp:3", "none")]
    head = DraftHead(sm.lm_head, None, num_frequent=3, context_ids=ctx[:context_end])
    assert not torch.equal(head.ids, torch.arange(len(head.ids)))
    got = matchness(sm, cache, [0], [ctx], cands, 10, head)
    # reference: full logits restricted to the subset, argmax mapped back to token ids
    scratch = sm.new_cache(2, 40)
    start = len(ctx) - 11
    sm.forward(torch.tensor([ctx[:start]] * 2), scratch)
    logits = sm.forward(torch.tensor([ctx[start:-1]] * 2), scratch, layer_set=cands)[..., head.ids]
    top1 = head.ids[logits.argmax(-1)]
    want = (top1 == torch.tensor(ctx[start + 1:])).double().mean(-1).tolist()
    assert got == pytest.approx(want, abs=1e-12)
    # skipping nothing: the full model's tokens, wherever the head holds them
    held = sum(t in set(head.ids.tolist()) for t in ctx[start + 1:]) / 10
    assert got[1] == pytest.approx(held, abs=1e-12) and held > 0.5


@pytest.mark.parametrize("draft_seconds,enabled", [(10.0, False), (0.0, True)])
def test_layer_skip_is_switched_off_when_no_set_can_pay(draft_seconds, enabled, monkeypatch, fixed_costs):
    from swiftkern.tuner import OnTheFlyTuner

    # a draft forward "measured" at 10 s can never beat a plain step, not even with the target
    # matchness, so the ratio is dropped before any set is scored; a free one always pays
    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: draft_seconds)
    hf = tiny_model("llama", num_hidden_layers=6)
    ar = Generator(hf).generate(PROMPTS[:2], max_new_tokens=40, eos_token_id=[]).tokens
    out = Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=0.3,
                    search_options=dict(SMALL_SEARCH, time_fraction=1e9)).generate(PROMPTS[:2], max_new_tokens=40,
                                                                                   eos_token_id=[])
    assert out.tokens == ar
    assert out.stats["layer_skip_enabled"] is enabled
    if not enabled:
        assert out.stats["search_phases"] == 0 and out.stats["candidates_scored"] == 0
        assert "fast enough to pay" in out.stats["search_stop"] and out.stats["ratio_ceiling"][0.3] < 1
        assert out.stats["drafter_steps"]["layer-skip"] == 0


def test_predicted_draft_cost_is_the_share_of_weight_bytes_read():
    """The tuner's draft cost: verify(1) x (kept sub-layers + head rows) / (all sub-layers + full head)."""
    from swiftkern.drafter_policy import DrafterPolicy
    from swiftkern.draft_head import DraftHead
    from swiftkern.tuner import OnTheFlyTuner

    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6))
    chooser = DrafterPolicy(("layer-skip",), k_max=8)
    chooser.record_verify(1, 0.02)
    tuner = OnTheFlyTuner(sm.num_layers, chooser, skip_ratio=0.3)
    H, V, I = 64, sm.vocab_size, 96
    attn = H * H * 2 + H * (H // 2) * 2  # q, o [64, 64]; k, v [32, 64] (2 of 4 heads)
    mlp = 3 * H * I
    full = 6 * (attn + mlp) + V * H
    assert tuner._draft_cost(sm, LayerSet.parse("none", 6), None) == pytest.approx(0.02)
    skip = LayerSet.parse("attn:3|mlp:1,2", 6)
    want = 0.02 * (full - 2 * mlp - attn) / full
    assert tuner._draft_cost(sm, skip, None) == pytest.approx(want)
    head = DraftHead(sm.lm_head, None, 50, [7, 8, 9])
    want = 0.02 * (full - V * H + len(head) * H) / full
    assert tuner._draft_cost(sm, LayerSet.parse("none", 6), head) == pytest.approx(want)


def test_search_waits_for_its_budget_and_needs_tokens_left(monkeypatch, fixed_costs):
    from swiftkern.tuner import OnTheFlyTuner

    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: 0.0)
    hf = tiny_model("llama", num_hidden_layers=6)
    run = lambda n, **opts: Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=0.3,  # noqa: E731
                                      search_options=dict(SMALL_SEARCH, **opts)).generate(
        PROMPTS[:1], max_new_tokens=n, eos_token_id=[]).stats
    # 20 tokens: after the first window of 8 only 12 are left, fewer than two windows
    s = run(20)
    assert s["search_phases"] == 0 and "too few tokens left" in s["search_stop"]
    # a phase predicted to cost more than the budget earned so far waits; with 60 tokens it never
    # becomes affordable, and the search ends when too few tokens are left
    monkeypatch.setattr(OnTheFlyTuner, "_phase_estimate", lambda self: 1e6)
    s = run(60)
    assert s["search_phases"] == 0 and "too few tokens left" in s["search_stop"]
    monkeypatch.setattr(OnTheFlyTuner, "_phase_estimate", lambda self: 0.0)
    assert run(60)["search_phases"] >= 1


def test_the_first_phase_is_estimated_no_cheaper_than_its_width_allows():
    """Before any phase, its estimate is a pass of candidates_per_forward x window tokens: with
    the timed widths flat (a loaded machine) not the price of the widest timed pass but that
    grown by the prior slope (a phase estimated at 0.046-0.155 s took 0.51-0.86 s on the Xeon);
    after a phase, twice that phase."""
    from types import SimpleNamespace

    from swiftkern.forward_costs import ForwardCosts
    from swiftkern.tuner import OnTheFlyTuner

    costs = ForwardCosts(decay=0.0)
    for t in (1, 2, 4, 8, 16):
        costs.add_verify(t, 0.1)
    tuner = SimpleNamespace(last_phase_s=None, chooser=SimpleNamespace(costs=costs), per_forward=4, window=32)
    estimate = OnTheFlyTuner._phase_estimate(tuner)
    assert estimate == pytest.approx(costs.wide_pass_floor(128)) and estimate > 5 * costs.verify(128)
    tuner.last_phase_s = 0.3
    assert OnTheFlyTuner._phase_estimate(tuner) == pytest.approx(0.6)


@pytest.mark.parametrize("draft_seconds,drafter", [(10.0, "auto"), (0.0, "layer-skip")])
def test_the_search_carries_over_to_the_next_call(draft_seconds, drafter, monkeypatch, fixed_costs):
    """A Generator's tuner serves its later calls (SWIFT: optimize on the first inputs, draft with
    the result on the rest): a verdict that layer skip cannot pay stands and costs the next call
    nothing; a found set drafts from the next call's first steps; reset_search() starts over."""
    from swiftkern.tuner import OnTheFlyTuner

    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: draft_seconds)
    hf = tiny_model("llama", num_hidden_layers=6)
    ar = Generator(hf).generate(PROMPTS[:2], max_new_tokens=40, eos_token_id=[]).tokens
    gen = Generator(hf, mode="self-spec", drafter=drafter, layer_set="auto", skip_ratio=0.3, eps=0.0,
                    search_options=dict(SMALL_SEARCH, time_fraction=1e9))
    first = gen.generate(PROMPTS[:2], max_new_tokens=40, eos_token_id=[])
    second = gen.generate(PROMPTS[:2], max_new_tokens=40, eos_token_id=[])
    assert first.tokens == second.tokens == ar
    s1, s2 = first.stats, second.stats
    assert s2["search_calls"] == 2 and s2["layer_skip_enabled"] is s1["layer_skip_enabled"]
    if draft_seconds:  # no ratio can pay: decided once, never searched again
        assert not s1["layer_skip_enabled"] and s2["search_s"] == 0 and s2["candidates_scored"] == 0
        assert s2["drafter_steps"]["layer-skip"] == 0
    else:  # the found set drafts at once in the second call (the first spent a window finding it)
        assert s1["layer_skip_enabled"] and s2["searched_layer_set"]
        # every step of the second call drafts; the first had plain steps while it searched
        assert s2["drafter_steps"]["none"] == 0 < s1["drafter_steps"]["none"], (s1, s2)
    gen.reset_search()
    assert gen.generate(PROMPTS[:2], max_new_tokens=40, eos_token_id=[]).stats["search_calls"] == 1


def test_the_time_cap_stops_the_search_after_one_phase(monkeypatch, fixed_costs):
    """time_fraction 1e-9: the first phase (predicted free) runs, and then the search has spent
    more than its share of the generating time: it stops for the time budget, cut short for this
    call only (no target can be reached, and free drafts keep every set within reach)."""
    from swiftkern.search import SearchConfig
    from swiftkern.tuner import OnTheFlyTuner

    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: 0.0)
    monkeypatch.setattr(OnTheFlyTuner, "_phase_estimate", lambda self: 0.0)
    hf = tiny_model("llama", num_hidden_layers=6)
    options = dict(SMALL_SEARCH, time_fraction=1e-9, config=SearchConfig(target=2.0))
    gen = Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=0.3, search_options=options)
    s = gen.generate(PROMPTS[:1], max_new_tokens=60, eos_token_id=[]).stats
    assert s["search_phases"] == 1 and s["candidates_scored"] == 4 and s["search_stop"] == "time budget"
    assert gen._tuner_state.cut_short


def test_a_search_cut_short_by_one_call_resumes_in_the_next(monkeypatch, fixed_costs):
    """A stop for this call's clock or length is not a verdict: the next call searches on (and a
    phase that is affordable there runs)."""
    from swiftkern.tuner import OnTheFlyTuner

    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: 0.0)
    monkeypatch.setattr(OnTheFlyTuner, "_phase_estimate", lambda self: 1e6)  # never affordable
    hf = tiny_model("llama", num_hidden_layers=6)
    gen = Generator(hf, mode="self-spec", layer_set="auto", skip_ratio=0.3, search_options=SMALL_SEARCH)
    first = gen.generate(PROMPTS[:1], max_new_tokens=40, eos_token_id=[]).stats
    assert first["search_phases"] == 0 and "too few tokens left" in first["search_stop"]
    monkeypatch.setattr(OnTheFlyTuner, "_phase_estimate", lambda self: 0.0)
    second = gen.generate(PROMPTS[:1], max_new_tokens=40, eos_token_id=[]).stats
    assert second["search_calls"] == 2 and second["search_phases"] >= 1 and second["candidates_scored"] >= 4


def _tuner_after_a_search(score, **kw):
    """A 6-layer tuner whose one search (r = 0.3) found a set of this matchness and stopped."""
    from swiftkern.tuner import OnTheFlyTuner

    tuner = OnTheFlyTuner(6, None, skip_ratio=0.3, **kw)
    (search,) = tuner.searches.values()
    found = search.propose(1)[0]
    search.observe(found, score)
    tuner.current, tuner.current_score, tuner.optimizing = found, score, False
    return tuner, search, found


@pytest.mark.parametrize("accepted,restart_at", [(0, 7), (1, None), (4, None)])
def test_restart_when_acceptance_falls_far_below_matchness(accepted, restart_at):
    """Drafts of 4 with `accepted` accepted each step: the decayed acceptance accepted / (accepted +
    misses) is 0, 0.5 or 1 against restart_ratio 0.5 x matchness 0.97 = 0.485; only 0 restarts,
    once the decayed count sum_i 0.9^i reaches 5 (the 7th draft: 4.69 after 6, 5.22 after 7).
    A restart searches on from the found set, its old-window score no longer trusted."""
    tuner, search, found = _tuner_after_a_search(0.97)
    assert search.done() == "target"
    tuner.observe(0, 0)  # no draft: nothing to learn
    for n in range(1, 31):
        tuner.observe(4, accepted)
        assert tuner.restarts == int(restart_at is not None and n >= restart_at), n
    if restart_at is None:
        assert not tuner.optimizing and search.done() == "target"
    else:
        assert tuner.optimizing and search.done() is None
        assert search.best == found and search.best_score < 0.97 and search.steps == 0


def test_a_phase_rescores_the_kept_best_on_the_new_window(monkeypatch):
    """With a synthetic matchness (window A: the found set 0.9, others 0.3; window B: it 0.2,
    others 0.1), the second phase re-scores the kept best on window B first, so its score is
    B's 0.2, not A's stale 0.9; every call scores at most candidates_per_forward sets on the
    tuner's window of the context it was given."""
    import swiftkern.tuner as tuner_module
    from swiftkern.tuner import OnTheFlyTuner

    calls = []

    def fake(model, cache, rows, contexts, cands, window, head):
        calls.append((contexts[0][-1], list(cands), window))
        good, other = (0.9, 0.3) if contexts[0][-1] == 1 else (0.2, 0.1)
        return [good if c == first else other for c in cands]

    monkeypatch.setattr(tuner_module, "matchness", fake)
    tuner = OnTheFlyTuner(6, None, skip_ratio=0.3, window=8, steps_per_window=8, candidates_per_forward=4)
    (search,) = tuner.searches.values()
    first = search.initial
    tuner._optimize(None, None, 0, [5] * 20 + [1], None)
    assert search.best == first and search.best_score == 0.9 and tuner.scored == 4
    tuner._optimize(None, None, 0, [5] * 28 + [2], None)
    assert calls[1][1][0] == first and calls[1][0] == 2  # the re-score leads phase 2, on window B
    assert search.best == first and search.best_score == 0.2 and tuner.scored == 9
    assert all(len(c) <= 4 and w == 8 for _, c, w in calls)
    tuner._pick(None, None)
    assert tuner.current == first and tuner.current_score == 0.2


def _np_rate(a, draft_cost):
    """Tokens per second of the best k in 1..25 at the fixed cost model verify(T) = 1 + 0.15 (T - 1)."""
    return max(sum(a ** i for i in range(k + 1)) / (k * draft_cost + 1 + 0.15 * k) for k in range(1, 26))


def test_the_set_to_draft_with_is_the_fastest_not_the_best_matching(monkeypatch):
    """Two ratios' best sets: A matchness 0.9 with a draft forward of 0.9 x a plain step, B 0.7 at
    0.1. The closed-form rate (expected tokens / step time at the fixed cost model) says B:
    ~1.46 plain steps' worth against A's ~0.93. With B as slow as A no set pays, and not even a
    better-scoring one would: the search gives up and layer skip is switched off."""
    from swiftkern.drafter_policy import DrafterPolicy
    from swiftkern.tuner import OnTheFlyTuner

    a, b = LayerSet.parse("attn:2", 6), LayerSet.parse("attn:1,3|mlp:2,4", 6)
    cost = {a: 0.9, b: 0.1}
    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, model, ls, head: cost[ls])
    tuner = OnTheFlyTuner(6, DrafterPolicy(("layer-skip",), k_max=8, measure=False), skip_ratio="auto")
    tuner.searches[0.1].best, tuner.searches[0.1].best_score = a, 0.9
    tuner.searches[0.3].best, tuner.searches[0.3].best_score = b, 0.7
    tuner._pick(None, None)
    assert _np_rate(0.7, 0.1) > 1 > _np_rate(0.9, 0.9)
    assert tuner.current == b and tuner.current_score == 0.7
    assert tuner.best_rate_vs_plain == pytest.approx(_np_rate(0.7, 0.1)) and not tuner.hopeless
    cost[b] = 0.9
    tuner._pick(None, None)
    assert tuner.current == a and tuner.best_rate_vs_plain == pytest.approx(_np_rate(0.9, 0.9))
    assert tuner.hopeless and _np_rate(1.0, 0.9) < 1  # optimism 0.45: even matchness 1 would not pay
    assert tuner._finish("no set within reach can pay") is None and not tuner.enabled


def test_matchness_weights_rows_by_window_length_and_reads_each_rows_own_kv():
    """Rows given out of cache order (rows [1, 0]) and windows of different lengths (window 9: 9
    positions of a 19-token context, all 4 of a 5-token one): the score is the slow reference's
    hits over all 13 positions, not the mean of the two rows' fractions nor hits over 2 x 9 padded
    slots; each row's window runs on its own cache row's KV."""
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=5))
    long_ctx = PROMPTS[0] + Generator(sm).generate([PROMPTS[0]], max_new_tokens=14, eos_token_id=[]).tokens[0]
    short_ctx = PROMPTS[1] + Generator(sm).generate([PROMPTS[1]], max_new_tokens=2, eos_token_id=[]).tokens[0]
    cache = sm.new_cache(2, 40)
    for b, ctx in enumerate((long_ctx, short_ctx)):  # row 0: the long context, row 1: the short one
        row = sm.new_cache(1, 40)
        sm.forward(torch.tensor([ctx[:-1]]), row)
        cache.k[:, b], cache.v[:, b] = row.k[:, 0], row.v[:, 0]
    cache.host_lengths = [len(long_ctx) - 1, len(short_ctx) - 1]
    cache.lengths = torch.tensor(cache.host_lengths)
    cands = [LayerSet.parse(s, 5) for s in ("attn:1,2|mlp:3", "attn:3|mlp:1-3", "attn:1-3|mlp:1-3")]
    got = matchness(sm, cache, [1, 0], [short_ctx, long_ctx], cands, 9)
    hits_short = [4 * _slow_matchness(sm, short_ctx, ls, 9) for ls in cands]
    hits_long = [9 * _slow_matchness(sm, long_ctx, ls, 9) for ls in cands]
    want = [(s + lg) / 13 for s, lg in zip(hits_short, hits_long)]
    assert got == pytest.approx(want, abs=1e-12)
    assert any(abs(w - (s / 4 + lg / 9) / 2) > 0.01 for w, s, lg in zip(want, hits_short, hits_long))


def test_offline_search_keeps_the_best_scored_set_of_each_ratio_and_the_fastest_ratio(tmp_path, monkeypatch):
    """skip_ratio "auto" with the real matchness recorded and a synthetic measured speedup per
    ratio (0.2 fastest): each ratio's row holds the first of its highest-scoring candidates and
    that score, and the record (and the stored file) is the fastest ratio's row."""
    import swiftkern.offline_search as offline

    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    scored = []

    def recording(*args):
        scores = matchness(*args)
        scored.extend(zip(args[4], scores))
        return scores

    speeds = iter((1.1, 1.4, 0.8, 1.2))  # measured once per ratio, in the ladder's order
    monkeypatch.setattr(offline, "matchness", recording)
    monkeypatch.setattr(offline, "measure_speedup", lambda *a: dict(speedup=next(speeds), acceptance_rate=0.5,
                                                                   drafted=8, mean_accepted=1.0))
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=6))
    record = offline.search_layer_set(sm, None, PROMPTS[:2], skip_ratio="auto", budget_s=0.4, max_new_tokens=12,
                                      log=lambda *a: None)
    assert [row["skip_ratio"] for row in record["table"]] == [0.1, 0.2, 0.3, 0.45]
    start = 0
    for row in record["table"]:  # the ratios are searched one after the other
        mine = scored[start:start + row["scored"]]
        start += row["scored"]
        best = max(s for _, s in mine)
        assert row["matchness"] == round(best, 4)
        assert row["layer_set"] == str(next(ls for ls, s in mine if s == best))
    assert start == len(scored)
    assert record["skip_ratio"] == 0.2 and record["speedup"] == 1.4
    assert record["layer_set"] == record["table"][1]["layer_set"]
    assert str(layer_set_store.load(sm)["layer_set"]) == record["layer_set"]


def test_offline_search_splits_its_budget_over_the_ratios(tmp_path, monkeypatch):
    """skip_ratio "auto": each of the four ratios gets a quarter of budget_s (a clock that moves
    1/64 s a scoring forward, whose scores never reach the target: a budget of 12/64 s is three
    forwards a ratio)."""
    import types

    import swiftkern.offline_search as offline

    monkeypatch.setenv("SWIFTKERN_CACHE_DIR", str(tmp_path))
    clock, forwards = [0.0], []

    def timed(*args):
        clock[0] += 1 / 64
        forwards.append(len(args[4]))
        return [0.25] * len(args[4])

    monkeypatch.setattr(offline, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(offline, "matchness", timed)
    monkeypatch.setattr(offline, "measure_speedup", lambda *a: dict(speedup=1.0, acceptance_rate=0.5, drafted=8,
                                                                   mean_accepted=1.0))
    sm = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=8))
    record = offline.search_layer_set(sm, None, PROMPTS[:2], skip_ratio="auto", budget_s=12 / 64, max_new_tokens=12,
                                      save=False, log=lambda *a: None)
    assert [(row["stop"], row["scored"]) for row in record["table"]] == [("budget", 12)] * 4
    assert forwards == [4] * 12


def test_measure_speedup_sums_the_runs_it_interleaves(monkeypatch):
    """measure_speedup against its closed form over canned runs: the speedup is ar's total decode
    time over self-spec's, the acceptance rate accepted over drafted tokens, mean_accepted accepted
    tokens a verify pass; outputs that differ from ar's are a bug, raised, where decoding is
    batch-invariant, and counted where it is not."""
    import types

    import swiftkern.offline_search as offline

    runs = {"ar": iter([(1.0, 0, 0, 0), (3.0, 0, 0, 0), (2.0, 0, 0, 0), (2.0, 0, 0, 0)]),
            "self-spec": iter([(0.5, 6, 10, 3), (1.5, 2, 4, 2), (1.0, 0, 0, 5), (1.0, 4, 6, 2)])}

    class Canned:
        bitwise = True

        def __init__(self, model, tokenizer, mode="ar", **kw):
            self.mode = mode

        def invariant_decode(self):
            return self.bitwise

        def generate(self, prompts, **kw):
            decode_s, accepted, drafted, verifies = next(runs[self.mode])
            stats = dict(decode_s=decode_s, accepted=accepted, drafted=drafted, row_verifies=verifies)
            return types.SimpleNamespace(tokens=[[7, 8]], stats=stats)

    monkeypatch.setattr(offline, "Generator", Canned)
    got = offline.measure_speedup("m", "t", [[1], [2]], "mlp:1", 4, repeats=2)
    assert got == dict(speedup=round(8.0 / 4.0, 4), acceptance_rate=round(12 / 20, 4), drafted=20,
                       mean_accepted=round(12 / 12, 4), differing=0)
    stats = dict(decode_s=1.0, accepted=0, drafted=0, row_verifies=0)
    monkeypatch.setattr(Canned, "generate", lambda self, prompts, **kw: types.SimpleNamespace(
        tokens=[[7, 8] if self.mode == "ar" else [7, 9]], stats=stats))
    with pytest.raises(AssertionError, match="self-spec output differs from ar"):
        offline.measure_speedup("m", "t", [[1]], "mlp:1", 4)
    # where decoding is not batch-invariant (bf16 on a GPU) a near tie may round apart: counted, and
    # the measurement stands (it raised after the whole search, and its result was lost)
    Canned.bitwise = False
    assert offline.measure_speedup("m", "t", [[1], [2]], "mlp:1", 4, repeats=2)["differing"] == 4


@pytest.mark.parametrize("options, msg", [
    ("window=8", "search_options must be a dict"),
    (dict(patience=5), "search_options has no option 'patience'; it takes window"),
    (dict(skip_ratio=0.3), r"give skip_ratio= to the Generator"),
    (dict(window=0), r"search_options\['window'\] must be >= 1"),
    (dict(time_fraction=0.0), r"search_options\['time_fraction'\] must be > 0"),
    (dict(restart_ratio="x"), r"search_options\['restart_ratio'\] must be a number"),
    (dict(config="fast"), "must be a swiftkern.search.SearchConfig"),
    (dict(optimism=[]), r"optimism'\] must be a number or a non-empty list"),  # crashed mid-generation
    (dict(optimism=[0.5, float("nan")]), r"optimism'\] entries must be finite, got nan"),
])
def test_bad_search_options_are_refused_when_the_generator_is_made(options, msg):
    """Not a TypeError from the tuner's constructor at the first generate (as they were)."""
    with pytest.raises(SwiftkernError, match=msg):
        Generator(tiny_model("llama"), mode="self-spec", layer_set="auto", search_options=options)


def test_search_options_without_a_search_are_refused():
    with pytest.raises(SwiftkernError, match="search_options are for the search of layer_set='auto'"):
        Generator(tiny_model("llama"), mode="self-spec", layer_set="mlp:1", search_options=dict(window=8))


def test_a_search_report_says_no_drafts_rather_than_acceptance_zero():
    """A set whose draft never drafted (its confidence stayed below eps) has an acceptance rate of
    0/0: stored as 0.0 (as the Generator's stats), reported as 'no drafts', not 'acceptance 0.00'."""
    from swiftkern.offline_search import acceptance_text

    assert acceptance_text(dict(acceptance_rate=0.0, drafted=0)) == "no drafts"
    assert acceptance_text(dict(acceptance_rate=0.4, drafted=5)) == "acceptance 0.40"
    assert acceptance_text(dict(acceptance_rate=0.0, drafted=5)) == "acceptance 0.00"
