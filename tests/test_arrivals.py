"""Requests that arrive while others decode (``generate(arrive_at=...)``: dynamic batching, as in
LLM-42's server setting): each joins the batch at its step as new cache rows, and still gets the
tokens it gets alone; in mode deterministic also the same logprobs, bit for bit, wherever in the
stream of arrivals it comes."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import hf_greedy, tiny_model
from swiftkern import Generator, KVCache, SkipModel, SwiftkernError
from swiftkern.layer_kernels import invariant_kernels_available
from swiftkern.requests import Requests

needs_invariant = pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                                     reason="swiftkern._C is not built with the CPU kernels of the invariant set")
PROMPTS = [[4, 77, 31], list(range(10, 40)), [200, 3, 9, 9], [5, 6, 7, 8, 9, 10], [250, 251]]
ARRIVE = [0, 3, 3, 4, 30]  # the last comes after every other request has finished: an empty batch waits


@pytest.fixture(scope="module")
def tiny():
    return SkipModel(tiny_model("llama"))


def test_add_rows_keeps_the_rows_in_use():
    cache = KVCache(2, 2, 1, 8, 4, torch.float32, "cpu")
    cache.k.normal_()
    cache.set_lengths([3, 5])
    before = cache.k.clone()
    assert cache.add_rows(2) == [2, 3]
    assert cache.batch == 4 and cache.host_lengths == [3, 5, 0, 0] and cache.lengths.tolist() == [3, 5, 0, 0]
    assert torch.equal(cache.k[:, :2], before) and not cache.k[:, 2:].any()
    assert cache.add_rows(1, replace=True) == [0] and cache.batch == 1 and cache.k.shape[1] == 1
    with pytest.raises(SwiftkernError, match="n must be >= 1"):
        cache.add_rows(0)


def test_requests_hand_over_arrivals_in_order():
    cache = KVCache(1, 1, 1, 8, 4, torch.float32, "cpu")  # request 1's row
    req = Requests(4, 5, frozenset(), arrive_at=[2, 0, 2, 1])
    assert req.alive == [1] and req.admit(cache) == ([], [])
    req.step = 1
    assert req.admit(cache) == ([3], [1]) and req.alive == [1, 3] and cache.batch == 2
    req.step = 5
    assert req.admit(cache) == ([0, 2], [2, 3]) and req.alive == [1, 3, 0, 2] and not req.waiting
    assert req.admit(cache) == ([], []) and cache.batch == 4


def test_an_empty_batch_jumps_to_the_next_arrival():
    cache = KVCache(1, 2, 1, 8, 4, torch.float32, "cpu")
    req = Requests(3, 5, frozenset(), arrive_at=[0, 9, 9])
    req.alive = []  # every request alive so far finished at step 2
    req.step = 2
    assert req.admit(cache) == ([1, 2], [0, 1]) and req.step == 9 and cache.batch == 2


class Order:
    def __init__(self):
        self.calls = []

    def __call__(self, request, tokens):
        self.calls.append(request)


SKIP = "attn:1|mlp:2"


MODES = pytest.mark.parametrize("mode", [
    dict(mode="ar"),
    dict(mode="self-spec", drafter="lookup", k_max=4),
    dict(mode="self-spec", drafter="layer-skip", layer_set=SKIP, eps=0.0, k_max=4),
    dict(mode="deterministic", replay="always", window=4, verify_batch=2),
    dict(mode="deterministic", replay="always", window=4, verify_batch=2, drafter="self-spec", layer_set=SKIP,
         eps=0.0, k_max=4),
    pytest.param(dict(mode="deterministic", replay="auto"), marks=needs_invariant),
    pytest.param(dict(mode="deterministic", replay="auto", drafter="self-spec", layer_set=SKIP, eps=0.0,
                      k_max=4), marks=needs_invariant),
], ids=["ar", "self-spec-lookup", "self-spec-layer-skip", "deterministic-replay", "deterministic-replay-self-spec",
        "deterministic-no-replay", "deterministic-no-replay-self-spec"])


@MODES
def test_each_request_gets_its_tokens_alone(tiny, mode):
    gen = Generator(tiny, **mode)
    order = Order()
    out = gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[], arrive_at=ARRIVE, streamer=order)
    for p, tokens in zip(PROMPTS, out.tokens):
        assert tokens == gen.generate([p], max_new_tokens=12, eos_token_id=[]).tokens[0]
    assert out.tokens[0] == hf_greedy(tiny.hf_model, PROMPTS[0], 12)
    # they decoded side by side: request 3 (step 4) streamed before request 1 (step 3) was done,
    # which at most 1 + 4 drafts a step cannot be, and request 4 after everyone else was
    assert order.calls.index(3) < len(order.calls) - 1 - order.calls[::-1].index(1)
    assert order.calls.index(4) > max(i for i, r in enumerate(order.calls) if r != 4)


@MODES
@pytest.mark.parametrize("stop", ["length", "eos"])
def test_arrivals_that_finish_at_their_first_token_leave_the_batch_empty_again(tiny, mode, stop):
    """Each request's first token (from its own prefill) ends it: the batch is empty after every
    arrival, and the loop waits for the next one. Self-spec's loop took that path in no test."""
    gen = Generator(tiny, **mode)
    firsts = [gen.generate([p], max_new_tokens=1, eos_token_id=[]).tokens[0] for p in PROMPTS]
    if stop == "length":
        kw = dict(max_new_tokens=1, eos_token_id=[])
    else:  # every first token is a stop token, with room for more
        kw = dict(max_new_tokens=8, eos_token_id=sorted({t[0] for t in firsts}))
    out = gen.generate(PROMPTS, arrive_at=[0, 2, 2, 5, 9], **kw)
    assert out.tokens == firsts


NEEDLE = [17, 250, 9, 3, 44, 61]


def _needle_with_arrivals(gen, rng, trials, **kw):
    needle = NEEDLE
    alone = gen.generate([needle], **kw)
    for _ in range(trials):
        B = rng.randint(2, 10)
        idx = rng.randrange(B)
        prompts = [[rng.randrange(3, 301) for _ in range(rng.randint(1, 30))] for _ in range(B)]
        prompts[idx] = needle
        arrive = [0] + [rng.randrange(0, 20) for _ in range(B - 1)]
        rng.shuffle(arrive)
        seeds = [rng.randrange(1000) for _ in range(B)]
        seeds[idx] = kw.get("seed", 0)
        out = gen.generate(prompts, arrive_at=arrive, **dict(kw, seed=seeds))
        assert out.tokens[idx] == alone.tokens[0], (B, idx, arrive)
        assert torch.equal(out.logprobs[idx], alone.logprobs[0]), (B, idx, arrive)


@pytest.mark.parametrize("replay,kernels", [("always", "portable"), pytest.param("always", "fused", marks=needs_invariant),
                                            pytest.param("auto", "auto", marks=needs_invariant)])
@pytest.mark.parametrize("sample", [False, True])
def test_needle_joining_a_stream_of_arrivals(tiny, replay, kernels, sample):
    """The needle arrives at a random step among requests arriving at random steps (batches
    that grow and shrink as requests come and finish): its tokens and logprobs are its own."""
    gen = Generator(tiny, mode="deterministic", window=8, verify_batch=4, replay=replay, verifier_kernels=kernels)
    kw = dict(max_new_tokens=20, eos_token_id=[], do_sample=sample, temperature=1.3, seed=11)
    _needle_with_arrivals(gen, random.Random(21 + sample), trials=3, **kw)
    # alone, its tokens are plain ar's (the same seeded draws; a replay made greedy would show)
    assert gen.generate([NEEDLE], **kw).tokens == Generator(tiny, mode="ar").generate([NEEDLE], **kw).tokens


@pytest.mark.parametrize("replay", ["always", pytest.param("auto", marks=needs_invariant)])
def test_needle_joining_a_stream_of_arrivals_with_the_self_spec_drafter(tiny, replay):
    """The same with self-speculation: the replay's fast path (draft, full or lookup, chosen per
    batch), or without replay the speculative loop on the invariant kernels."""
    gen = Generator(tiny, mode="deterministic", window=8, verify_batch=4, replay=replay, drafter="self-spec",
                    layer_set=SKIP, eps=0.0)
    _needle_with_arrivals(gen, random.Random(5), trials=3, max_new_tokens=20, eos_token_id=[], seed=11)


def test_bad_arrivals_are_refused(tiny):
    gen = Generator(tiny, mode="ar")
    for bad, msg in (([0], "one step >= 0 per prompt"), ([1, 2], "at least one 0"), ([0, -1], "one step >= 0"),
                     ([0, True], "one step >= 0"), ([0, 1.5], "one step >= 0")):
        with pytest.raises(SwiftkernError, match=msg):
            gen.generate(PROMPTS[:2], max_new_tokens=2, arrive_at=bad)


def test_arrivals_of_numpy_ints_are_the_ints(tiny):
    """Steps that are NumPy integers (an arange, a JSON of them) were refused as "one step >= 0"
    although every other integer argument takes them."""
    import numpy

    gen = Generator(tiny, mode="ar")
    want = gen.generate(PROMPTS[:3], max_new_tokens=6, arrive_at=[0, 3, 1]).tokens
    got = gen.generate(PROMPTS[:3], max_new_tokens=6, arrive_at=list(numpy.array([0, 3, 1]))).tokens
    assert got == want


def test_layer_set_search_with_arrivals_is_greedy_identical_to_ar(monkeypatch, fixed_costs):
    """The on-the-fly search reads the batch's first row; rows that come and go (an empty batch
    waiting for the last arrival included) leave its tokens those of ar. Fixed drafter costs: the
    search must not hang on this machine's load."""
    from swiftkern.tuner import OnTheFlyTuner

    monkeypatch.setattr(OnTheFlyTuner, "_draft_cost", lambda self, *a: 0.0)  # no ratio dropped for speed
    hf = tiny_model("llama", num_hidden_layers=6)
    ar = Generator(hf).generate(PROMPTS, max_new_tokens=60, eos_token_id=[]).tokens
    gen = Generator(hf, mode="self-spec", layer_set="auto", eps=0.0,
                    search_options=dict(window=8, steps_per_window=8, time_fraction=1e9))
    out = gen.generate(PROMPTS, max_new_tokens=60, eos_token_id=[], arrive_at=[0, 3, 3, 7, 70])
    assert out.tokens == ar and out.stats["search_phases"] >= 1


def test_cli_refuses_a_bad_arrival_step(tmp_path, capsys):
    from swiftkern.cli import main

    path = tmp_path / "p.jsonl"
    for bad in ("-1", "1.5", "true", '"3"'):
        path.write_text('{"prompt": "a"}\n{"prompt": "b", "arrive_at": %s}\n' % bad)
        assert main(["generate", "--prompt-file", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "p.jsonl:2" in err[0] and "arrive_at" in err[0]


@pytest.mark.slow
def test_cli_arrivals_from_a_prompt_file(smollm2, tmp_path, capsys, monkeypatch):
    """Lines with "arrive_at" join the batch later (more decode steps), with the same tokens."""
    import json

    from swiftkern import cli, loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: smollm2)
    lines = [{"prompt": "The capital of France is"}, {"prompt": "Count to five:", "arrive_at": 6},
             {"prompt": "Name a color:", "arrive_at": 3}]
    runs = []
    for records in (lines, [{"prompt": r["prompt"]} for r in lines]):
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert cli.main(["generate", "--prompt-file", str(path), "--max-new-tokens", "8", "--json"]) == 0
        runs.append([json.loads(line) for line in capsys.readouterr().out.strip().splitlines()])
    staggered, together = runs
    assert [r["tokens"] for r in staggered] == [r["tokens"] for r in together]
    assert staggered[0]["stats"]["steps"] == 7 + 6 and together[0]["stats"]["steps"] == 7


def test_arrivals_among_requests_that_skip_verification(tiny):
    """LLM-42's mix: some requests need determinism, the rest decode at regular cost; with
    arrivals the verified ones keep their bits and the others get plain ar's tokens."""
    gen = Generator(tiny, mode="deterministic", window=8, verify_batch=2, replay="always")
    kw = dict(max_new_tokens=16, eos_token_id=[])
    flags = [True, False, True, False, False]
    out = gen.generate(PROMPTS, deterministic=flags, arrive_at=ARRIVE, **kw)
    for p, tokens, lp, verified in zip(PROMPTS, out.tokens, out.logprobs, flags):
        alone = gen.generate([p], **kw)
        assert tokens == alone.tokens[0]
        if verified:
            assert torch.equal(lp, alone.logprobs[0])
