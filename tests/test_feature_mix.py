"""Every feature at once, drawn at random: a mode and drafter, a batch of prompts of any lengths
(repetitive ones, so lookup drafts), arrivals while others decode, an EOS and a stop token that
the output really meets, per-request deterministic flags, a streamer, any ``max_new_tokens``,
the forwards replayed through CUDA graphs' CPU stand-ins or not, six tiny model layouts, prompt
lookup through the prompts' index or their scan.
Greedy, each request's tokens are HF greedy's for its prompt alone, cut at its first EOS / stop
token; the streamer got exactly those tokens; the stats add up. Seeded sampling in mode
deterministic: each request's tokens and logprobs are those it gets alone, bit for bit."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import hf_greedy, tiny_model, until_stop
from test_streaming import Recorder
from swiftkern import Generator, SkipModel
from swiftkern.cuda_graphs import GraphRunner
from swiftkern.graph_capture import EmulatedGraph, RecordedGraph
from swiftkern.layer_kernels import invariant_kernels_available
from swiftkern.lookup_index import PromptLookup

INVARIANT = invariant_kernels_available("cpu", torch.float32)
SKIP = "attn:1|mlp:2"
CONFIGS = {
    "ar": dict(mode="ar"),
    "self-spec-auto": dict(mode="self-spec", drafter="auto", layer_set=SKIP, k_max=5),
    "self-spec-lookup": dict(mode="self-spec", drafter="lookup", k_max=3),
    "self-spec-layer-skip": dict(mode="self-spec", drafter="layer-skip", layer_set=SKIP, eps=0.3, k_max=6),
    "self-spec-none": dict(mode="self-spec", drafter="none"),
    # the draft is the model: every draft accepted, so EOS and stops land inside long commits
    "self-spec-full-draft": dict(mode="self-spec", drafter="layer-skip", layer_set="none", eps=0.0, k_max=5),
    "det-replay-portable": dict(mode="deterministic", replay="always", window=3, verify_batch=2,
                                verifier_kernels="portable"),
    "det-replay-self-spec": dict(mode="deterministic", replay="always", window=5, verify_batch=3,
                                 drafter="self-spec", layer_set=SKIP, eps=0.0, k_max=4),
}
if INVARIANT:
    CONFIGS.update({
        # the portable config's shapes: a runner shared by both must still keep their graphs apart
        "det-replay-fused": dict(mode="deterministic", replay="always", window=3, verify_batch=2,
                                 verifier_kernels="fused"),
    })
if INVARIANT or torch.cuda.is_available():
    CONFIGS.update({
        # replay auto: no replay on the CPU's C++ set and on CUDA's Triton set (Generator.replay_elided),
        # except the self-spec drafter's on CUDA, which replays
        "det-auto": dict(mode="deterministic", replay="auto"),
        "det-auto-self-spec": dict(mode="deterministic", replay="auto", drafter="self-spec",
                                   layer_set=SKIP, eps=0.0, k_max=4),
    })
DETERMINISTIC = [name for name in CONFIGS if name.startswith("det")]
# a replayed layer-skipped fast path refuses unverified requests (auto replays on a CPU without the C++ set)
ALL_VERIFIED = {"det-replay-self-spec"} | (set() if INVARIANT else {"det-auto-self-spec"})

MODELS = {  # tiny random models of each family and attention layout the runner takes
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "mistral": ("mistral", {}),
    "qwen3": ("qwen3", {}),  # per-head q/k norms, head_dim past hidden_size / heads
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, seed=5)),
    "llama-mha-5-layers": ("llama", dict(num_key_value_heads=4, num_hidden_layers=5, seed=9)),
}


@functools.cache
def tiny(model="llama"):
    arch, overrides = MODELS[model]
    return SkipModel(tiny_model(arch, **{"num_hidden_layers": 4, **overrides}))


def generator(name, graph_type=None, model="llama"):
    """A new Generator each draw: a drafter's state carried over would make a failure flaky (and
    so would timed drafter costs: the greedy test takes the fixed cost model). ``graph_type``: a
    CPU stand-in for CUDA graphs (``graph_capture``), the forwards replayed through a new runner."""
    graphs = False if graph_type is None else GraphRunner(tiny(model), graph_type)
    return Generator(tiny(model), cuda_graphs=graphs, **CONFIGS[name])


def hf_full(prompt, model="llama"):
    """HF greedy's 18 new tokens for ``prompt`` alone, no EOS (cached: HF generate is the slow part)."""
    return _hf_full(tuple(prompt), model)


@functools.cache
def _hf_full(prompt: tuple, model: str):
    return hf_greedy(tiny(model).hf_model, list(prompt), 18, eos_token_id=[])


def cut(tokens, max_new, stop_ids):
    """What greedy with these stop ids gives: the first ``max_new`` tokens, up to the first stop."""
    return until_stop(tokens[:max_new], stop_ids)


def draw_flags(data, name, n):
    """Per-request ``deterministic`` flags where the config takes them, else all True."""
    if name not in DETERMINISTIC or name in ALL_VERIFIED:
        return [True] * n
    return data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="flags")


prompt = st.one_of(
    st.lists(st.integers(3, 300), min_size=1, max_size=25),
    st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=4), st.integers(2, 6)).map(lambda p: p[0] * p[1]),
)


@st.composite
def batches(draw):
    prompts = draw(st.lists(prompt, min_size=1, max_size=5))
    arrive = None
    if len(prompts) > 1 and draw(st.booleans()):
        arrive = draw(st.lists(st.integers(0, 12), min_size=len(prompts), max_size=len(prompts)))
        arrive[draw(st.integers(0, len(prompts) - 1))] = 0
    return prompts, arrive


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CONFIGS)), batch=batches(), max_new=st.integers(1, 18),
       eos_at=st.one_of(st.none(), st.integers(0, 17)), stop_at=st.one_of(st.none(), st.integers(0, 17)),
       graph_type=st.sampled_from([None, None, EmulatedGraph, RecordedGraph]), model=st.sampled_from(sorted(MODELS)),
       index_prompts=st.booleans(), data=st.data())
def test_greedy_any_mix_is_hf_greedy_alone(fixed_costs, name, batch, max_new, eos_at, stop_at, graph_type, model,
                                          index_prompts, data):
    prompts, arrive = batch
    gen = generator(name, graph_type, model)
    # an EOS and a stop token taken from what the first prompt's output really holds
    plain = hf_full(prompts[0], model)
    eos = [] if eos_at is None else [plain[eos_at]]
    stop = [] if stop_at is None else [plain[stop_at]]
    flags = draw_flags(data, name, len(prompts))
    streamed = Recorder()
    # index_prompts: prompt lookup matches through lookup_index.ContextIndex for every request, not long ones alone
    with mock.patch.object(PromptLookup, "INDEX_MIN_TOKENS", 1 if index_prompts else PromptLookup.INDEX_MIN_TOKENS):
        out = gen.generate(prompts, max_new_tokens=max_new, eos_token_id=eos, stop_token_ids=stop,
                           deterministic=flags, streamer=streamed, arrive_at=arrive)
    for i, p in enumerate(prompts):
        assert out.tokens[i] == cut(hf_full(p, model), max_new, eos + stop), (name, model, i)
    assert streamed.per_request(len(prompts)) == out.tokens
    assert out.stats["new_tokens"] == sum(map(len, out.tokens))
    assert [r["new_tokens"] for r in out.request_stats] == list(map(len, out.tokens))
    if name in DETERMINISTIC:
        assert len(out.logprobs) == len(prompts)


@pytest.mark.skipif(not DETERMINISTIC, reason="no deterministic config")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(name=st.sampled_from(DETERMINISTIC), batch=batches(), max_new=st.integers(1, 14),
       seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.7, 1.0, 1.6]),
       top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.9]), model=st.sampled_from(sorted(MODELS)),
       data=st.data())
def test_sampled_deterministic_any_mix_is_the_request_alone(name, batch, max_new, seed, temperature, top_k,
                                                           top_p, model, data):
    prompts, arrive = batch
    gen = generator(name, model=model)
    seeds = [seed + i for i in range(len(prompts))]
    needle = data.draw(st.integers(0, len(prompts) - 1), label="needle")
    flags = draw_flags(data, name, len(prompts))
    flags[needle] = True
    kw = dict(max_new_tokens=max_new, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
              eos_token_id=[])
    streamed = Recorder()
    out = gen.generate(prompts, seed=seeds, deterministic=flags, streamer=streamed, arrive_at=arrive, **kw)
    alone = gen.generate([prompts[needle]], seed=seeds[needle], **kw)
    assert out.tokens[needle] == alone.tokens[0], (name, needle)
    assert torch.equal(out.logprobs[needle], alone.logprobs[0]), (name, needle)
    assert streamed.per_request(len(prompts)) == out.tokens
    assert all(len(t) == max_new for t in out.tokens)


def _calls_through_one_runner(model, runner, expected_tokens):
    """60 seeded calls, each by the Generator of a random config, all sharing ``runner``;
    ``expected_tokens(prompt, max_new)`` is what each request must get. Deterministic configs'
    logprobs must equal the same config's without graphs, bit for bit."""
    import random

    rng = random.Random(7)
    graphed = {name: Generator(model, cuda_graphs=runner, **CONFIGS[name]) for name in CONFIGS}
    for call in range(60):
        name = rng.choice(sorted(CONFIGS))
        n = rng.randint(1, 5)
        prompts = [[rng.randrange(3, 301) for _ in range(rng.randint(1, 25))] for _ in range(n)]
        arrive = None
        if n > 1 and rng.random() < 0.5:
            arrive = [rng.randint(0, 12) for _ in range(n)]
            arrive[rng.randrange(n)] = 0
        kw = dict(max_new_tokens=rng.randint(1, 18), eos_token_id=[], arrive_at=arrive)
        out = graphed[name].generate(prompts, **kw)
        for i, p in enumerate(prompts):
            assert out.tokens[i] == expected_tokens(p, kw["max_new_tokens"]), (call, name, i)
        if name in DETERMINISTIC:
            plain = Generator(model, **CONFIGS[name]).generate(prompts, **kw)
            assert all(torch.equal(a, b) for a, b in zip(out.logprobs, plain.logprobs)), (call, name)
    stats = runner.stats()
    assert stats["replays_by_kind"]["verify"] > 0 and stats["captures"] > runner.max_graphs  # evictions


@pytest.mark.parametrize("graph_type", [EmulatedGraph, RecordedGraph], ids=["rerun", "recorded"])
def test_one_graph_runner_shared_by_every_config_across_calls(fixed_costs, graph_type):
    """A graph runner lives across calls and Generators (a server keeps one per model): one runner
    shared by a Generator of every config, 60 calls in a seeded random order with batches that
    shrink, grow and take arrivals, so graphs captured for one config and batch are met by
    another (and evicted past ``max_graphs``). Each call's tokens are HF greedy's alone, and in
    mode deterministic its logprobs those of the same config without graphs, bit for bit."""
    _calls_through_one_runner(tiny(), GraphRunner(tiny(), graph_type, max_graphs=24),
                              lambda prompt, max_new: cut(hf_full(prompt), max_new, []))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_cuda_graph_runner_shared_by_every_config_on_the_gpu(fixed_costs):
    """The same with real CUDA graphs on the GPU: each request's tokens are those `ar` gives it
    alone without graphs on the GPU (the deterministic configs' tokens come from the invariant
    kernels, ``bi_matmul`` for cuBLAS: equal on this model, as the CPU's are)."""
    model = SkipModel(tiny_model("llama", num_hidden_layers=4).to("cuda"))
    alone = Generator(model)
    _calls_through_one_runner(model, GraphRunner(model, max_graphs=24),
                              lambda prompt, max_new: alone.generate([prompt], max_new_tokens=max_new,
                                                                     eos_token_id=[]).tokens[0])
